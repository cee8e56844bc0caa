"""One client connection: the reader thread and the server's own DMA requests.

A single reader thread owns the receive side and demultiplexes:

* **requests** from the client are handed to the dispatcher, which answers
  at once (it never waits for anything the client must do first);
* **replies** to our DMA_READ / DMA_WRITE requests wake the engine thread
  waiting for them.  A DMA_READ reply is received straight into its
  destination (VRAM), so the payload is never copied in Python.

Limits that keep QEMU 11.1 happy (lab notes): DMA_READ replies larger than
about one socket buffer arrive cut, so reads go out in 64 KiB pieces, one at
a time; DMA_WRITE pieces stay within the client's max_data_xfer_size.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
from typing import Callable

from . import wire
from .dma import DmaFault, DmaTable
from .regs import Status
from .transport import ConnectionClosed, MessageTimeout, Transport, close_fds

log = logging.getLogger(__name__)

DMA_READ_CHUNK = 64 * 1024
MAX_REQUEST_BODY = wire.SERVER_MAX_DATA_XFER + 4096  # REGION_WRITE of max size + slack
DISCARD_LIMIT = 64 << 20  # larger claimed sizes mean a broken stream: hang up

Handler = Callable[[wire.Header, bytearray, list], tuple[list, list]]


class _Pending:
    """One DMA request in flight; the reader thread finishes it exactly once."""

    __slots__ = ("command", "iova", "into", "_done", "errno", "aborted")

    def __init__(self, command: int, iova: int, into: memoryview | None):
        self.command, self.iova, self.into = command, iova, into
        # a bare lock as a one-shot signal: cheaper than an Event (no Condition)
        self._done = threading.Lock()
        self._done.acquire()
        self.errno = 0
        self.aborted = False

    def finish(self, err: int = 0, aborted: bool = False) -> None:
        self.errno, self.aborted = err, aborted
        self._done.release()

    def wait(self, timeout: float) -> bool:
        return self._done.acquire(timeout=timeout)


class Connection:
    def __init__(self, sock, *, partial_timeout: float = 2.0, dma_timeout: float = 5.0,
                 send_timeout: float = 5.0, name: str = "client"):
        self.transport = Transport(sock, partial_timeout=partial_timeout, send_timeout=send_timeout)
        self.table = DmaTable()
        self.dma_timeout = dma_timeout
        self.name = name
        self.max_write = wire.DEFAULT_MAX_DATA_XFER
        self.max_read = min(DMA_READ_CHUNK, wire.DEFAULT_MAX_DATA_XFER)
        self.internal_errors = 0
        self.messages_in = 0
        self._handler: Handler | None = None
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._dma_closed = False  # set once the reader is gone: no new DMA requests
        self.finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._debug = log.isEnabledFor(logging.DEBUG)

    # ------------------------------------------------------------ lifetime
    def start(self, handler: Handler, on_exit: Callable[[], None] = lambda: None) -> None:
        self._handler = handler
        self._on_exit = on_exit
        self._thread = threading.Thread(target=self._reader, name=f"vfio-user-{self.name}",
                                        daemon=True)
        self._thread.start()

    def set_client_limits(self, max_data_xfer: int) -> None:
        """Size our DMA messages by what the client said it accepts."""
        self.max_write = max_data_xfer
        self.max_read = min(DMA_READ_CHUNK, max_data_xfer)

    def shutdown(self) -> None:
        """Ask the reader to stop (it sees EOF); returns at once."""
        self.transport.shutdown()

    def close(self) -> None:
        """Stop the reader, fail DMA in flight, drop every mapping.  Idempotent."""
        self.transport.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._fail_pending()
        self.table.unmap_all()
        if not self._closed:
            self._closed = True
            self.transport.close()

    def _fail_pending(self) -> None:
        with self._lock:
            self._dma_closed = True
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.finish(errno.ECONNRESET, aborted=True)

    # ------------------------------------------------------------ reader
    def _reader(self) -> None:
        try:
            while True:
                fds: list[int] = []
                try:
                    header = self.transport.recv_header(fds)
                    self.messages_in += 1
                    if self._debug:
                        log.debug("<- %s%s", header.describe(), f" fds={len(fds)}" if fds else "")
                    if header.is_reply:
                        self._on_reply(header, fds)
                    else:
                        self._on_request(header, fds)
                finally:
                    close_fds(fds)  # whatever no handler kept
        except ConnectionClosed as exc:
            log.info("%s disconnected (%s)", self.name, exc)
        except MessageTimeout as exc:
            log.warning("%s: %s; closing the connection", self.name, exc)
        except Exception:
            self.internal_errors += 1
            log.exception("%s: reader failed; closing the connection", self.name)
        finally:
            self._fail_pending()
            self.finished.set()
            self._on_exit()

    def _on_request(self, header: wire.Header, fds: list[int]) -> None:
        body = header.size - wire.HEADER_SIZE
        if body < 0:
            return self._reply_error(header, errno.EINVAL, "size smaller than the header")
        if body > MAX_REQUEST_BODY:
            if body > DISCARD_LIMIT:
                raise ConnectionClosed(f"message claims {header.size} bytes: stream is broken")
            self.transport.discard(body, fds)
            return self._reply_error(header, errno.E2BIG, f"{body}-byte body is too large")
        payload = bytearray(body)
        self.transport.recv_into(memoryview(payload), fds)
        if header.msg_type != wire.TYPE_REQUEST:
            return self._reply_error(header, errno.EINVAL, f"message type {header.msg_type}")
        try:
            parts, out_fds = self._handler(header, payload, fds)
        except wire.ProtocolError as exc:
            return self._reply_error(header, exc.errno, str(exc))
        except Exception:
            self.internal_errors += 1
            log.exception("%s: handler failed on %s", self.name, header.describe())
            return self._reply_error(header, errno.EIO, "internal error")
        if header.no_reply:
            return
        size = sum(len(p) for p in parts)
        self.transport.send([wire.reply_header(header, size), *parts], out_fds)

    def _reply_error(self, header: wire.Header, err: int, why: str) -> None:
        log.debug("%s: %s refused: %s", self.name, header.describe(), why)
        if not header.no_reply:
            self.transport.send([wire.error_header(header, err)])

    def _on_reply(self, header: wire.Header, fds: list[int]) -> None:
        body = max(header.size - wire.HEADER_SIZE, 0)
        with self._lock:
            p = self._pending.pop(header.msg_id, None)
        if p is None or p.command != header.command:
            log.warning("%s: unexpected reply %s", self.name, header.describe())
            self.transport.discard(body, fds)
            if p is not None:
                p.finish(errno.EIO)
            return
        if header.is_error:
            self.transport.discard(body, fds)
            return p.finish(header.error or errno.EIO)
        if p.command == wire.DMA_READ:
            if body != wire.DMA_ACCESS.size + len(p.into):
                self.transport.discard(body, fds)
                return p.finish(errno.EIO)
            # address, count and data in one scatter read, the data straight into VRAM
            meta = bytearray(wire.DMA_ACCESS.size)
            self.transport.recv_scatter([memoryview(meta), p.into], fds)
            if wire.DMA_ACCESS.unpack(meta) != (p.iova, len(p.into)):
                return p.finish(errno.EIO)
        else:
            self.transport.discard(body, fds)
        p.finish()

    # ------------------------------------------------------------ our DMA requests
    def dma_write(self, iova: int, data: memoryview) -> None:
        """One DMA_WRITE message (len(data) <= max_write); waits for the reply."""
        meta = wire.DMA_ACCESS.pack(iova, len(data))
        self._round_trip(wire.DMA_WRITE, iova, None, [meta, data], len(meta) + len(data))

    def dma_read(self, iova: int, into: memoryview) -> None:
        """One DMA_READ message (len(into) <= max_read); the reply lands in ``into``."""
        meta = wire.DMA_ACCESS.pack(iova, len(into))
        self._round_trip(wire.DMA_READ, iova, into, [meta], len(meta))

    def _round_trip(self, command, iova, into, parts, payload_size) -> None:
        p = _Pending(command, iova, into)
        with self._lock:
            if self._dma_closed:
                raise DmaFault(Status.DMA_ABORTED, iova, errno.ECONNRESET, "client gone")
            msg_id = next(self._ids) & 0xFFFF
            while msg_id in self._pending:
                msg_id = next(self._ids) & 0xFFFF
            self._pending[msg_id] = p
        if self._debug:
            log.debug("-> %s id=%d iova=%#x count=%d", wire.COMMAND_NAMES[command], msg_id,
                      iova, len(into) if into is not None else payload_size - 16)
        try:
            self.transport.send([wire.request_header(msg_id, command, payload_size), *parts])
        except (ConnectionClosed, MessageTimeout) as exc:
            with self._lock:
                self._pending.pop(msg_id, None)
            raise DmaFault(Status.DMA_ABORTED, iova, errno.ECONNRESET, str(exc)) from None
        if not p.wait(self.dma_timeout):
            with self._lock:
                self._pending.pop(msg_id, None)
            raise DmaFault(Status.DMA_TIMEOUT, iova, errno.ETIMEDOUT,
                           f"no reply in {self.dma_timeout}s")
        if p.errno:
            status = Status.DMA_ABORTED if p.aborted else Status.DMA_REFUSED
            raise DmaFault(status, iova, p.errno, f"client answered errno {p.errno}")
