"""One client connection: the reader thread and the server's own DMA requests.

A single reader thread owns the receive side and demultiplexes:

* **requests** from the client are handed to the dispatcher, which answers
  at once (it never waits for anything the client must do first);
* **replies** to our DMA_READ / DMA_WRITE requests advance the transfer they
  belong to.  A DMA_READ reply is received straight into its destination
  (VRAM), so the payload is never copied in Python.

Limits that keep QEMU 11.1 happy (lab notes): DMA_READ replies larger than
about one socket buffer arrive cut, so reads go out in 64 KiB pieces;
DMA_WRITE pieces stay within the client's max_data_xfer_size.  Exactly one
request is in flight per transfer: the reader sends the next piece as soon
as the previous reply is in (it only sends, never waits), and wakes the
engine thread once, when the whole transfer is done or has failed.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
from typing import Callable

from . import wire
from .dma import DmaAborted, DmaFault, DmaTable, FaultKind
from .transport import ConnectionClosed, MessageTimeout, Transport, close_fds

log = logging.getLogger(__name__)

DMA_READ_CHUNK = 64 * 1024
MAX_REQUEST_BODY = wire.SERVER_MAX_DATA_XFER + 4096  # REGION_WRITE of max size + slack
DISCARD_LIMIT = 64 << 20  # larger claimed sizes mean a broken stream: hang up

Handler = Callable[[wire.Header, bytearray, list], tuple[list, list]]


def _never() -> None:
    pass


class _Transfer:
    """A run of DMA_READ or DMA_WRITE pieces over one buffer, one piece in flight."""

    __slots__ = ("command", "iova", "buf", "chunk", "pos", "inflight", "msg_id", "abort",
                 "finished", "errno", "outcome", "_done")

    def __init__(self, command: int, iova: int, buf: memoryview, chunk: int, abort):
        self.command, self.iova, self.buf, self.chunk = command, iova, buf, chunk
        self.abort = abort
        self.pos = 0  # bytes completed; only the thread handling the reply moves it
        self.inflight = 0
        self.msg_id = -1
        self.finished = False
        self.errno = 0
        self.outcome = "ok"  # ok | refused | closed | timeout | aborted
        # a bare lock as a one-shot signal: cheaper than an Event (no Condition)
        self._done = threading.Lock()
        self._done.acquire()


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
        self._pending: dict[int, _Transfer] = {}
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
        for t in pending.values():
            self._finish(t, errno.ECONNRESET, "closed")

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
        if self._debug:
            log.debug("-> reply %s size=%d%s", wire.COMMAND_NAMES.get(header.command),
                      wire.HEADER_SIZE + size, f" fds={len(out_fds)}" if out_fds else "")
        self.transport.send([wire.reply_header(header, size), *parts], out_fds)

    def _reply_error(self, header: wire.Header, err: int, why: str) -> None:
        log.debug("-> error %s for %s: %s", errno.errorcode.get(err, err), header.describe(), why)
        if not header.no_reply:
            self.transport.send([wire.error_header(header, err)])

    def _on_reply(self, header: wire.Header, fds: list[int]) -> None:
        body = max(header.size - wire.HEADER_SIZE, 0)
        with self._lock:
            t = self._pending.pop(header.msg_id, None)
        if t is None or t.command != header.command:
            log.warning("%s: unexpected reply %s", self.name, header.describe())
            self.transport.discard(body, fds)
            if t is not None:
                self._finish(t, errno.EIO, "refused")
            return
        if header.is_error:
            self.transport.discard(body, fds)
            return self._finish(t, header.error or errno.EIO, "refused")
        n, at = t.inflight, t.iova + t.pos
        if t.command == wire.DMA_READ:
            if body != wire.DMA_ACCESS.size + n:
                self.transport.discard(body, fds)
                return self._finish(t, errno.EIO, "refused")
            # address, count and data in one scatter read, the data straight into VRAM
            meta = bytearray(wire.DMA_ACCESS.size)
            self.transport.recv_scatter([memoryview(meta), t.buf[t.pos:t.pos + n]], fds)
            if wire.DMA_ACCESS.unpack(meta) != (at, n):
                return self._finish(t, errno.EIO, "refused")
        else:
            self.transport.discard(body, fds)
        t.pos += n
        if t.pos >= len(t.buf):
            return self._finish(t)
        if t.abort():
            return self._finish(t, 0, "aborted")
        self._send_next(t)  # sends only: the reply will come back to this thread

    # ------------------------------------------------------------ our DMA requests
    def dma_write(self, iova: int, data: memoryview, abort: Callable[[], bool] = _never) -> None:
        """Device -> client memory through DMA_WRITE messages of <= max_write bytes."""
        self._run(_Transfer(wire.DMA_WRITE, iova, data, self.max_write, abort))

    def dma_read(self, iova: int, into: memoryview, abort: Callable[[], bool] = _never) -> None:
        """Client memory -> ``into`` through DMA_READ messages of <= max_read bytes."""
        self._run(_Transfer(wire.DMA_READ, iova, into, self.max_read, abort))

    def _run(self, t: _Transfer) -> None:
        """Start a transfer and wait for it; raise DmaFault (``progress`` set) on failure."""
        if not len(t.buf):
            return
        self._send_next(t)
        last = 0
        while not t._done.acquire(timeout=self.dma_timeout):
            with self._lock:
                if t.finished or t.pos != last:  # finishing right now, or still moving
                    last = t.pos
                    continue
                self._pending.pop(t.msg_id, None)
                t.finished, t.errno, t.outcome = True, errno.ETIMEDOUT, "timeout"
            break
        if t.outcome == "ok":
            return
        if t.outcome == "aborted":
            raise DmaAborted()
        status = {"refused": FaultKind.REFUSED, "timeout": FaultKind.TIMEOUT,
                  "closed": FaultKind.CLOSED}[t.outcome]
        # raised without a local name: a frame holding its own exception would keep
        # the VRAM slices it references alive until the cyclic GC runs
        raise DmaFault(status, t.iova + t.pos, t.errno,
                       f"{wire.COMMAND_NAMES[t.command]}: {t.outcome}, errno {t.errno}", t.pos)

    def _send_next(self, t: _Transfer) -> None:
        n = min(t.chunk, len(t.buf) - t.pos)
        at = t.iova + t.pos
        with self._lock:
            if t.finished:
                return
            if self._dma_closed:
                closed = True
            else:
                closed = False
                msg_id = next(self._ids) & 0xFFFF
                while msg_id in self._pending:
                    msg_id = next(self._ids) & 0xFFFF
                t.msg_id, t.inflight = msg_id, n
                self._pending[msg_id] = t
        if closed:
            return self._finish(t, errno.ECONNRESET, "closed")
        meta = wire.DMA_ACCESS.pack(at, n)
        if t.command == wire.DMA_WRITE:
            parts, size = [meta, t.buf[t.pos:t.pos + n]], len(meta) + n
        else:
            parts, size = [meta], len(meta)
        if self._debug:
            log.debug("-> %s id=%d iova=%#x count=%d", wire.COMMAND_NAMES[t.command], msg_id, at, n)
        try:
            self.transport.send([wire.request_header(msg_id, t.command, size), *parts])
        except (ConnectionClosed, MessageTimeout) as exc:
            log.warning("%s: DMA request not sent: %s", self.name, exc)
            with self._lock:
                self._pending.pop(msg_id, None)
            self._finish(t, errno.ECONNRESET, "closed")

    def _finish(self, t: _Transfer, err: int = 0, outcome: str = "ok") -> None:
        """Settle a transfer exactly once and wake the engine waiting for it."""
        with self._lock:
            if t.finished:
                return
            t.finished, t.errno, t.outcome = True, err, outcome
        t._done.release()
