"""One client connection: the reader thread and the server's own DMA requests.

A single reader thread owns the receive side and demultiplexes:

* **requests** from the client are handed to the dispatcher, which answers
  at once (it never waits for anything the client must do first);
* **replies** to our DMA_READ / DMA_WRITE requests advance the transfer they
  belong to.  A DMA_READ reply is received straight into its destination
  (VRAM), so the payload is never copied in Python.

Pieces and pipelining (docs/gpu-device.md, "Data paths"): a transfer goes
out in pieces of at most the client's max_data_xfer_size (8 MiB at most),
up to ``DMA_WINDOW`` of them in flight; the reader sends the next piece as
soon as a reply is in (it only sends, never waits), and wakes the engine
thread once, when the whole transfer is done or has failed.  DMA_WRITE data
leaves by page reference (Transport zero_copy): no copy on our side.  The
socket's send buffer is raised to hold a whole window of DMA_WRITE pieces
(``set_client_limits``; past net.core.wmem_max only with CAP_NET_ADMIN), so
the engine queues a window without sleeping for room: what the kernel holds
for us is bounded by the window (at most 4 x 8 MiB of page references, or
of copies if vmsplice is refused), not by the buffer.

QEMU 11.1 sends its replies with one non-blocking write and forgets
whatever did not fit into its socket buffer (~208 KiB by default): a
DMA_READ reply that does not fit arrives cut and the stream is lost.  So
for a client offering at most 1 MiB (QEMU's default) DMA_READ pieces are
64 KiB and the bytes of DMA_READ replies outstanding on the connection --
stale ones of dropped transfers included -- never exceed
``QEMU_READ_BUDGET``.
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

DMA_READ_CHUNK_QEMU = 64 * 1024  # DMA_READ piece for clients offering <= 1 MiB (QEMU 11.1)
# DMA_READ reply bytes outstanding per connection for such clients: two 64 KiB
# replies take ~148 KiB of QEMU's ~208 KiB socket buffer (skb overhead included)
QEMU_READ_BUDGET = 2 * DMA_READ_CHUNK_QEMU
DMA_PIECE_MAX = 8 << 20  # largest DMA message piece even if the client allows more
DMA_WINDOW = 4  # DMA message pieces in flight per transfer
MAX_REQUEST_BODY = wire.SERVER_MAX_DATA_XFER + 4096  # REGION_WRITE of max size + slack
DISCARD_LIMIT = 64 << 20  # larger claimed sizes mean a broken stream: hang up

Handler = Callable[[wire.Header, bytearray, list], tuple[list, list]]


def _never() -> bool:
    return False


class _Transfer:
    """A run of DMA_READ or DMA_WRITE pieces over one buffer, up to ``window`` in flight.

    Pieces are handed out in order (``next_pos``); ``inflight`` maps message id
    -> (pos, n).  ``acked`` is the prefix known complete: everything below the
    lowest piece still in flight.
    """

    __slots__ = ("command", "iova", "buf", "chunk", "window", "need", "stale", "next_pos",
                 "inflight", "acked", "finished", "errno", "outcome", "fault_at", "_done")

    def __init__(self, command: int, iova: int, buf: memoryview, chunk: int, window: int,
                 need: int, stale):
        self.command, self.iova, self.buf, self.chunk = command, iova, buf, chunk
        self.window, self.need, self.stale = window, need, stale
        self.next_pos = 0
        self.inflight: dict[int, tuple[int, int]] = {}
        self.acked = 0
        self.finished = False
        self.errno = 0
        self.outcome = "ok"  # ok | refused | closed | timeout | aborted | unmapped | permission
        self.fault_at = 0  # offset of the piece that failed
        # a bare lock as a one-shot signal: cheaper than an Event (no Condition)
        self._done = threading.Lock()
        self._done.acquire()

    def update_acked(self) -> None:
        self.acked = min((pos for pos, _ in self.inflight.values()), default=self.next_pos)


class Connection:
    def __init__(self, sock, *, partial_timeout: float = 2.0, dma_timeout: float = 5.0,
                 send_timeout: float = 5.0, name: str = "client"):
        self.transport = Transport(sock, partial_timeout=partial_timeout, send_timeout=send_timeout)
        self.table = DmaTable()
        self.dma_timeout = dma_timeout
        self.name = name
        self.max_write = wire.DEFAULT_MAX_DATA_XFER
        self.max_read = DMA_READ_CHUNK_QEMU
        self.read_budget = QEMU_READ_BUDGET  # DMA_READ reply bytes outstanding, at most
        self.window = DMA_WINDOW
        self.send_buffer = 0  # SO_SNDBUF granted after VERSION (set_client_limits)
        self.internal_errors = 0
        self.messages_in = 0
        self._handler: Handler | None = None
        self._pending: dict[int, _Transfer] = {}  # message id -> transfer, stale ones too
        self._reads_out = 0  # bytes of DMA_READ replies still to come (in _pending)
        self._live: set[_Transfer] = set()  # transfers not finished yet
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
        """Size our DMA messages by what the client said it accepts (never more)."""
        self.max_write = min(max_data_xfer, DMA_PIECE_MAX)
        if max_data_xfer <= wire.DEFAULT_MAX_DATA_XFER:
            # QEMU 11.1 cuts DMA_READ replies that do not fit its socket buffer
            # (module doc; docs/gpu-device.md, departures)
            self.max_read = min(max_data_xfer, DMA_READ_CHUNK_QEMU)
            self.read_budget = QEMU_READ_BUDGET
        else:
            self.max_read = min(max_data_xfer, DMA_PIECE_MAX)
            self.read_budget = DMA_WINDOW * self.max_read
        # room for a whole window of DMA_WRITE pieces: the engine queues them without
        # sleeping for buffer space (each such sleep is a wake-up and a hand-off to the
        # client's CPU); it is bounded by the window either way (module doc)
        self.send_buffer = self.transport.set_send_buffer(self.window * self.max_write)

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
            self._reads_out = 0
        for t in set(pending.values()):
            self._finish(t, errno.ECONNRESET, "closed")

    @property
    def closed(self) -> bool:
        return self._dma_closed

    def abort_transfers(self) -> None:
        """Settle every transfer in flight as aborted (the device dropped its work).
        Replies still on their way are read and thrown away."""
        with self._lock:
            transfers = set(self._pending.values()) | self._live
        for t in transfers:
            self._finish(t, 0, "aborted")

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
            log.info("%s disconnected (%s)", self.name, str(exc))
        except MessageTimeout as exc:
            log.warning("%s: %s; closing the connection", self.name, str(exc))
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
            # the stream cannot be framed any more: answer, then hang up
            self._reply_error(header, errno.EINVAL, "size smaller than the header")
            raise ConnectionClosed(f"message size {header.size} < {wire.HEADER_SIZE}: "
                                   f"stream is broken")
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
            close_fds(fds)  # before the error reply: a refused fd never outlives it
            fds.clear()
            self._reply_error(header, exc.errno, str(exc))
            if exc.hang_up:
                raise ConnectionClosed(f"{header.describe()}: {exc}") from None
            return
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
        with self._lock:
            t = self._pending.get(header.msg_id)
            piece = t.inflight.get(header.msg_id) if t is not None else None
        self._take_reply(header, fds, t, piece)
        # the reply is off the socket now: its id is free, its bytes leave the budget
        with self._lock:
            starved = []
            if self._pending.pop(header.msg_id, None) is not None and piece is not None \
                    and t.command == wire.DMA_READ:
                self._reads_out -= piece[1]
                starved = [x for x in self._live if x.command == wire.DMA_READ]
        for x in starved:  # DMA_READ transfers waiting for room in the budget (t too)
            self._pump(x)

    def _take_reply(self, header: wire.Header, fds: list[int], t, piece) -> None:
        body = max(header.size - wire.HEADER_SIZE, 0)
        if t is None or t.command != header.command or piece is None:
            log.warning("%s: unexpected reply %s", self.name, header.describe())
            self.transport.discard(body, fds)
            if t is not None:
                self._finish(t, errno.EIO, "refused")
            return
        pos, n = piece
        if t.finished or t.stale():  # dropped or failed: the reply is read and thrown away
            self.transport.discard(body, fds)
            with self._lock:
                t.inflight.pop(header.msg_id, None)
            return self._finish(t, 0, "aborted")
        if header.is_error:
            self.transport.discard(body, fds)
            t.fault_at = pos
            return self._finish(t, header.error or errno.EIO, "refused")
        at = t.iova + pos
        if t.command == wire.DMA_READ:
            if body != wire.DMA_ACCESS.size + n:
                self.transport.discard(body, fds)
                t.fault_at = pos
                return self._finish(t, errno.EIO, "refused")
            # address, count and data in one scatter read, the data straight into VRAM
            meta = bytearray(wire.DMA_ACCESS.size)
            self.transport.recv_scatter([memoryview(meta), t.buf[pos:pos + n]], fds)
            if wire.DMA_ACCESS.unpack(meta) != (at, n):
                t.fault_at = pos
                return self._finish(t, errno.EIO, "refused")
        else:
            self.transport.discard(body, fds)  # departure 4: the body is not checked
        with self._lock:
            t.inflight.pop(header.msg_id, None)
            t.update_acked()
            complete = t.acked >= len(t.buf)
        if complete:
            return self._finish(t)
        if t.command == wire.DMA_WRITE:  # a DMA_READ is pumped once its budget is back
            self._pump(t)  # sends only: the replies come back to this thread

    # ------------------------------------------------------------ our DMA requests
    def dma_write(self, iova: int, data: memoryview, stale: Callable[[], bool] = _never, *,
                  unchecked: bool = False) -> None:
        """Device -> client memory through DMA_WRITE messages of <= max_write bytes.
        ``unchecked``: no DMA_MAP need cover the range (a device's message window)."""
        self._run(_Transfer(wire.DMA_WRITE, iova, data, self.max_write, self.window,
                            0 if unchecked else wire.DMA_MAP_FLAG_WRITE, stale))

    def dma_read(self, iova: int, into: memoryview, stale: Callable[[], bool] = _never, *,
                 unchecked: bool = False) -> None:
        """Client memory -> ``into`` through DMA_READ messages of <= max_read bytes."""
        self._run(_Transfer(wire.DMA_READ, iova, into, self.max_read, self.window,
                            0 if unchecked else wire.DMA_MAP_FLAG_READ, stale))

    def _run(self, t: _Transfer) -> None:
        """Start a transfer and wait for it; raise DmaFault (``done`` set) on failure."""
        if not len(t.buf):
            return
        with self._lock:
            self._live.add(t)
        self._pump(t)
        last = -1
        while not t._done.acquire(timeout=self.dma_timeout):
            with self._lock:
                if t.finished or t.acked != last:  # finishing right now, or still moving
                    last = t.acked
                    continue
                # pieces still out stay in _pending: their late replies are thrown away
                t.fault_at = t.acked
                t.finished, t.errno, t.outcome = True, errno.ETIMEDOUT, "timeout"
                self._live.discard(t)
            break
        if t.outcome == "ok":
            return
        if t.outcome == "aborted":
            raise DmaAborted()
        kind = {"refused": FaultKind.REFUSED, "timeout": FaultKind.TIMEOUT,
                "closed": FaultKind.CLOSED, "unmapped": FaultKind.UNMAPPED,
                "permission": FaultKind.PERMISSION}[t.outcome]
        # raised without a local name: a frame holding its own exception would keep
        # the VRAM slices it references alive until the cyclic GC runs
        raise DmaFault(kind, t.iova + t.fault_at, t.errno,
                       f"{wire.COMMAND_NAMES[t.command]}: {t.outcome}, errno {t.errno}",
                       min(t.acked, t.fault_at))

    def _pump(self, t: _Transfer) -> None:
        """Keep up to ``window`` pieces of ``t`` in flight."""
        while True:
            with self._lock:
                if (t.finished or len(t.inflight) >= t.window or t.next_pos >= len(t.buf)):
                    return
                if self._dma_closed:
                    closed = True
                else:
                    closed = False
                    pos = t.next_pos
                    n = min(t.chunk, len(t.buf) - pos)
                    if t.command == wire.DMA_READ:
                        if self._reads_out and self._reads_out + n > self.read_budget:
                            return  # the reply that frees the budget pumps again
                        self._reads_out += n
                    msg_id = next(self._ids) & 0xFFFF
                    while msg_id in self._pending:
                        msg_id = next(self._ids) & 0xFFFF
                    t.next_pos = pos + n
                    t.inflight[msg_id] = (pos, n)
                    self._pending[msg_id] = t
            if closed:
                return self._finish(t, errno.ECONNRESET, "closed")
            if not self._send_piece(t, msg_id, pos, n):
                return

    def _send_piece(self, t: _Transfer, msg_id: int, pos: int, n: int) -> bool:
        at = t.iova + pos
        meta = wire.DMA_ACCESS.pack(at, n)
        if t.command == wire.DMA_WRITE:
            parts, size = [meta, t.buf[pos:pos + n]], len(meta) + n
        else:
            parts, size = [meta], len(meta)

        def guard() -> None:
            # under the transport's send lock: a drop or an unmap that happened
            # before this point stops the message; one after it is ordered after it
            if t.stale():
                raise DmaAborted()
            if t.need:   # 0: a message-window transfer, which no DMA_MAP covers
                self.table.check(at, n, t.need)

        if self._debug:
            log.debug("-> %s id=%d iova=%#x count=%d", wire.COMMAND_NAMES[t.command], msg_id, at, n)
        outcome = None
        try:
            # DMA_WRITE data goes by page reference (no copy on our side): the
            # piece is in flight until its reply, and nothing rewrites it before
            self.transport.send([wire.request_header(msg_id, t.command, size), *parts],
                                guard=guard, zero_copy=True)
        except DmaAborted:
            outcome = (0, "aborted")
        except DmaFault as fault:
            outcome = (0, "unmapped" if fault.kind == FaultKind.UNMAPPED else "permission")
            pos = fault.addr - t.iova
        except (ConnectionClosed, MessageTimeout) as exc:
            log.warning("%s: DMA request not sent: %s", self.name, str(exc))
            with self._lock:
                self._dma_closed = True  # poisoned: the engine waits for the disconnect
            outcome = (errno.ECONNRESET, "closed")
        if outcome is None:
            return True
        with self._lock:
            if self._pending.pop(msg_id, None) is not None and t.command == wire.DMA_READ:
                self._reads_out -= n
            t.inflight.pop(msg_id, None)
            t.fault_at = pos
            t.update_acked()
        self._finish(t, *outcome)
        return False

    def _finish(self, t: _Transfer, err: int = 0, outcome: str = "ok") -> None:
        """Settle a transfer exactly once and wake the engine waiting for it."""
        with self._lock:
            self._live.discard(t)
            if t.finished:
                return
            t.finished, t.errno, t.outcome = True, err, outcome
        t._done.release()
