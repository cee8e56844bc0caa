"""The vfio-user server: message dispatch and the listening socket.

``Dispatcher`` turns each client request into a reply (or an error reply)
by asking the device; it never blocks on the client.  ``VfioUserServer``
listens on a UNIX socket and serves one client at a time; when a client
leaves its DMA mappings and eventfds are dropped, the device keeps its
state, and the next client (the device moving to another VM) is accepted.

The device is any object with the ``Device`` surface below: the server
knows nothing about what it does.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import stat
import threading

from . import wire
from typing import Protocol

from .connection import Connection
from .transport import close_fds
from .irq import IrqTable


class Region:
    """One VFIO region as the client sees it."""

    def __init__(self, size: int, flags: int, fd: int | None = None):
        self.size, self.flags, self.fd = size, flags, fd


class Device(Protocol):
    """What the server needs from a device model."""

    regions: dict[int, Region]
    irqs: IrqTable

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def connect(self, conn: Connection) -> None: ...
    def disconnect(self) -> None: ...
    def dma_map(self, iova: int, size: int, flags: int, fd: int | None, offset: int): ...
    def dma_unmap(self, iova: int, size: int, everything: bool) -> int: ...
    def reset(self, *, function_level: bool = False) -> None: ...
    def region_read(self, index: int, offset: int, count: int): ...
    def region_write(self, index: int, offset: int, data) -> None: ...

log = logging.getLogger(__name__)

SPARSE_CAP_SIZE = wire.CAP_HEADER.size + wire.SPARSE_MMAP.size + wire.SPARSE_AREA.size


class Dispatcher:
    """Handlers for client -> server commands, one instance per connection."""

    def __init__(self, device: Device, conn: Connection):
        self.device = device
        self.conn = conn
        self.negotiated = False
        self.client_max_fds = wire.DEFAULT_MAX_MSG_FDS  # fds the client takes per message
        self._handlers = {
            wire.VERSION: self._version,
            wire.DMA_MAP: self._dma_map,
            wire.DMA_UNMAP: self._dma_unmap,
            wire.DEVICE_GET_INFO: self._device_info,
            wire.DEVICE_GET_REGION_INFO: self._region_info,
            wire.DEVICE_GET_IRQ_INFO: self._irq_info,
            wire.DEVICE_SET_IRQS: self._set_irqs,
            wire.REGION_READ: self._region_read,
            wire.REGION_WRITE: self._region_write,
            wire.DEVICE_RESET: self._reset,
        }

    def handle(self, header: wire.Header, payload: bytearray, fds: list[int]):
        """-> (reply payload parts, fds to send).  Raises ProtocolError to refuse.
        Handlers that keep a received fd remove it from ``fds``; the rest get closed."""
        handler = self._handlers.get(header.command)
        if handler is None:
            raise wire.ProtocolError(errno.ENOSYS, f"command {header.command} not supported")
        if not self.negotiated and header.command != wire.VERSION:
            raise wire.ProtocolError(errno.EINVAL, "VERSION must come first")
        if fds and header.command not in (wire.DMA_MAP, wire.DEVICE_SET_IRQS):
            count = len(fds)
            close_fds(fds)  # before the error reply: nothing of them outlives it
            fds.clear()
            raise wire.ProtocolError(errno.EINVAL, f"{count} unexpected fds")
        return handler(payload, fds)

    # ------------------------------------------------------------ session
    def _version(self, payload, fds):
        if self.negotiated:
            raise wire.ProtocolError(errno.EINVAL, "VERSION already negotiated")
        major, minor, caps = wire.parse_version(payload)
        if major != wire.MAJOR_VERSION:
            # the spec: the server "closes the connection if it cannot support the
            # advertised version" (after an error reply, so the client knows why)
            raise wire.ProtocolError(errno.ENOTSUP, f"protocol major {major} unsupported",
                                     hang_up=True)
        max_xfer = caps.get("max_data_xfer_size", wire.DEFAULT_MAX_DATA_XFER)
        if isinstance(max_xfer, bool) or not isinstance(max_xfer, int) or max_xfer < 1:
            raise wire.ProtocolError(errno.EINVAL,
                                     f"max_data_xfer_size {max_xfer!r} is not a positive integer")
        max_fds = caps.get("max_msg_fds", wire.DEFAULT_MAX_MSG_FDS)
        if isinstance(max_fds, bool) or not isinstance(max_fds, int) or max_fds < 0:
            raise wire.ProtocolError(errno.EINVAL,
                                     f"max_msg_fds {max_fds!r} is not a non-negative integer")
        self.conn.set_client_limits(max_xfer)
        self.client_max_fds = max_fds
        self.negotiated = True
        log.info("%s: protocol %d.%d, client max_data_xfer_size %d, max_msg_fds %d",
                 self.conn.name, major, min(minor, wire.MINOR_VERSION), max_xfer, max_fds)
        # The spec: the reply's capabilities are a subset of the proposed ones
        # (QEMU 11.1 proposes both of these).  Keep the reply short: QEMU receives
        # it into a buffer of its request's size.
        ours = {"max_msg_fds": wire.SERVER_MAX_MSG_FDS,
                "max_data_xfer_size": wire.SERVER_MAX_DATA_XFER}
        return [wire.version_payload(wire.MAJOR_VERSION, min(minor, wire.MINOR_VERSION),
                                     {k: v for k, v in ours.items() if k in caps})], []

    def _reset(self, payload, fds):
        self.device.reset(function_level=True)
        return [], []

    # ------------------------------------------------------------ DMA windows
    def _dma_map(self, payload, fds):
        if len(payload) < wire.DMA_MAP_REQ.size:
            raise wire.ProtocolError(errno.EINVAL, "DMA_MAP payload too short")
        if len(fds) > 1:
            raise wire.ProtocolError(errno.EINVAL, f"DMA_MAP with {len(fds)} fds")
        argsz, flags, offset, iova, size = wire.DMA_MAP_REQ.unpack_from(payload)
        fd = fds.pop() if fds else None
        try:
            if argsz < wire.DMA_MAP_REQ.size:
                raise wire.ProtocolError(errno.EINVAL, f"DMA_MAP argsz {argsz} < "
                                         f"{wire.DMA_MAP_REQ.size}")
            if iova % wire.DMA_PAGE_SIZE or size % wire.DMA_PAGE_SIZE:
                raise wire.ProtocolError(
                    errno.EINVAL, f"DMA_MAP {iova:#x}+{size:#x} not aligned to the "
                    f"{wire.DMA_PAGE_SIZE}-byte page size (pgsizes)")
        except wire.ProtocolError:
            if fd is not None:
                close_fds([fd])
            raise
        m = self.device.dma_map(iova, size, flags, fd, offset)
        log.debug("DMA_MAP %r", m)
        return [], []

    def _dma_unmap(self, payload, fds):
        if len(payload) < wire.DMA_UNMAP_REQ.size:
            raise wire.ProtocolError(errno.EINVAL, "DMA_UNMAP payload too short")
        _argsz, flags, iova, size = wire.DMA_UNMAP_REQ.unpack_from(payload)
        if flags & wire.DMA_UNMAP_FLAG_GET_DIRTY_BITMAP:
            raise wire.ProtocolError(errno.ENOTSUP, "dirty page tracking not supported")
        if flags & ~wire.DMA_UNMAP_FLAG_ALL:
            raise wire.ProtocolError(errno.EINVAL, f"DMA_UNMAP flags {flags:#x}")
        everything = bool(flags & wire.DMA_UNMAP_FLAG_ALL)
        if everything and (iova or size):
            raise wire.ProtocolError(errno.EINVAL, "DMA_UNMAP_FLAG_ALL needs address and size 0")
        if not everything and size == 0:
            raise wire.ProtocolError(errno.EINVAL, "DMA_UNMAP of size 0")
        gone = self.device.dma_unmap(iova, size, everything)
        log.debug("DMA_UNMAP %#x+%#x: %s bytes were mapped", iova, size, gone)
        return [bytes(payload[:wire.DMA_UNMAP_REQ.size])], []  # the spec: echo the entry

    # ------------------------------------------------------------ info
    def _device_info(self, payload, fds):
        argsz = self._argsz(payload, wire.DEVICE_INFO.size)
        flags = wire.DEVICE_FLAGS_RESET | wire.DEVICE_FLAGS_PCI
        info = wire.DEVICE_INFO.pack(wire.DEVICE_INFO.size, flags, wire.PCI_NUM_REGIONS,
                                     wire.PCI_NUM_IRQS)
        return [info[:argsz]], []

    def _region_info(self, payload, fds):
        argsz = self._argsz(payload, wire.REGION_INFO.size)
        index = wire.REGION_INFO.unpack_from(payload)[2]
        region = self.device.regions.get(index)
        if region is None:
            raise wire.ProtocolError(errno.EINVAL, f"no region {index}")
        caps = b""
        flags = region.flags
        if self.client_max_fds < 1:  # it cannot take the fd: no mmap offered
            flags &= ~(wire.REGION_INFO_FLAG_MMAP | wire.REGION_INFO_FLAG_CAPS)
        if flags & wire.REGION_INFO_FLAG_CAPS:
            # sparse mmap: the whole BAR is one mappable area of the fd
            caps = (wire.CAP_HEADER.pack(wire.REGION_INFO_CAP_SPARSE_MMAP, 1, 0)
                    + wire.SPARSE_MMAP.pack(1, 0) + wire.SPARSE_AREA.pack(0, region.size))
        full = wire.REGION_INFO.size + len(caps)
        info = wire.REGION_INFO.pack(full, flags, index,
                                     wire.REGION_INFO.size if caps else 0, region.size, 0)
        # argsz tells the client the full size; send only what fits its buffer
        reply = (info + caps)[:argsz]
        out_fds = [region.fd] if flags & wire.REGION_INFO_FLAG_MMAP else []
        return [reply], out_fds

    def _irq_info(self, payload, fds):
        self._argsz(payload, wire.IRQ_INFO.size)
        index = wire.IRQ_INFO.unpack_from(payload)[2]
        count, flags = self.device.irqs.info(index)
        return [wire.IRQ_INFO.pack(wire.IRQ_INFO.size, flags, index, count)], []

    def _set_irqs(self, payload, fds):
        if len(payload) < wire.IRQ_SET.size:
            raise wire.ProtocolError(errno.EINVAL, "SET_IRQS payload too short")
        argsz, flags, index, start, count = wire.IRQ_SET.unpack_from(payload)
        if argsz != len(payload):
            # the spec: argsz "is the size of the VFIO IRQ set request payload,
            # including any data field" (QEMU 11.1 sends exactly that)
            close_fds(fds)
            fds.clear()
            raise wire.ProtocolError(errno.EINVAL, f"SET_IRQS argsz {argsz} but the payload "
                                     f"has {len(payload)} bytes")
        taken = list(fds)
        fds.clear()  # set_irqs owns them now: kept or closed
        self.device.irqs.set_irqs(flags, index, start, count,
                                  bytes(payload[wire.IRQ_SET.size:]), taken)
        return [], []

    @staticmethod
    def _argsz(payload, minimum: int) -> int:
        if len(payload) < minimum:
            raise wire.ProtocolError(errno.EINVAL, f"payload {len(payload)} < {minimum} bytes")
        argsz = int.from_bytes(payload[:4], "little")
        if argsz < minimum:
            raise wire.ProtocolError(errno.EINVAL, f"argsz {argsz} < {minimum}")
        return argsz

    # ------------------------------------------------------------ region access
    def _access(self, payload, exact: bool):
        if len(payload) < wire.REGION_ACCESS.size or (exact and len(payload) != wire.REGION_ACCESS.size):
            raise wire.ProtocolError(errno.EINVAL, "bad region access payload size")
        offset, index, count = wire.REGION_ACCESS.unpack_from(payload)
        if count > wire.SERVER_MAX_DATA_XFER:
            raise wire.ProtocolError(errno.E2BIG, f"count {count} > max_data_xfer_size")
        region = self.device.regions.get(index)
        if region is None or not region.flags & wire.REGION_INFO_FLAG_READ:
            raise wire.ProtocolError(errno.EINVAL, f"no accessible region {index}")
        if offset + count > region.size:
            raise wire.ProtocolError(
                errno.EINVAL, f"region {index} access {offset:#x}+{count} beyond {region.size:#x}")
        return offset, index, count

    def _region_read(self, payload, fds):
        offset, index, count = self._access(payload, exact=True)
        data = self.device.region_read(index, offset, count)
        return [wire.REGION_ACCESS.pack(offset, index, count), data], []

    def _region_write(self, payload, fds):
        offset, index, count = self._access(payload, exact=False)
        if len(payload) - wire.REGION_ACCESS.size != count:
            raise wire.ProtocolError(errno.EINVAL, "REGION_WRITE count disagrees with size")
        data = memoryview(payload)[wire.REGION_ACCESS.size:]
        self.device.region_write(index, offset, data)
        return [wire.REGION_ACCESS.pack(offset, index, count)], []


class VfioUserServer:
    """Listen on ``socket_path`` and serve one client at a time until stop()."""

    def __init__(self, socket_path: str, device: Device, *, partial_timeout: float = 2.0,
                 dma_timeout: float = 5.0, send_timeout: float = 5.0):
        self.socket_path = os.fspath(socket_path)
        self.device = device
        self.partial_timeout = partial_timeout
        self.dma_timeout = dma_timeout
        self.send_timeout = send_timeout
        self.connections_served = 0
        self.internal_errors = 0
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop = threading.Event()
        self._conn: Connection | None = None
        self._conn_lock = threading.Lock()

    # ------------------------------------------------------------ setup
    def listen(self) -> None:
        path = self.socket_path
        self._remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)
            sock.listen(4)
        except OSError:
            sock.close()
            raise
        self._listener = sock

    @staticmethod
    def _remove_stale_socket(path: str) -> None:
        """A leftover socket nobody answers on is ours to replace; anything else is not."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
            return
        except OSError:
            return  # let bind() report it
        finally:
            probe.close()
        raise FileExistsError(f"another server is listening on {path}")

    # ------------------------------------------------------------ main loop
    def serve_forever(self) -> None:
        """Accept and serve clients until stop(); call listen() first."""
        assert self._listener is not None, "listen() first"
        self.device.start()
        try:
            while not self._stop.is_set():
                sock = self._accept()
                if sock is not None:
                    self._serve(sock)
        finally:
            self.device.stop()

    def _wait(self, *fds: int) -> list[int]:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = [fd for fd, _ in poller.poll()]
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        return ready

    def _accept(self) -> socket.socket | None:
        ready = self._wait(self._listener.fileno(), self._wake_r)
        if self._stop.is_set() or self._listener.fileno() not in ready:
            return None
        try:
            sock, _ = self._listener.accept()
        except OSError as exc:
            log.warning("accept failed: %s", exc)
            return None
        sock.set_inheritable(False)
        return sock

    def _serve(self, sock: socket.socket) -> None:
        self.connections_served += 1
        conn = Connection(sock, partial_timeout=self.partial_timeout,
                          dma_timeout=self.dma_timeout, send_timeout=self.send_timeout,
                          name=f"client{self.connections_served}")
        log.info("%s connected", conn.name)
        dispatcher = Dispatcher(self.device, conn)
        with self._conn_lock:
            self._conn = conn
        self.device.connect(conn)
        conn.start(dispatcher.handle, on_exit=self._poke)
        try:
            while not self._stop.is_set() and not conn.finished.is_set():
                self._wait(self._wake_r)
        finally:
            conn.shutdown()
            self.device.disconnect()  # the device has stopped touching the client's memory
            conn.close()
            self.device.irqs.close_all()  # the client's eventfds die with it
            self.internal_errors += conn.internal_errors
            with self._conn_lock:
                self._conn = None  # last: "no connection" means fully cleaned up
            log.info("%s gone; waiting for the next client", conn.name)

    @property
    def wakeup_fd(self) -> int:
        """The write end of the pipe every wait of serve_forever includes (non-blocking): a
        byte there makes it look at stop() again.  For ``signal.set_wakeup_fd``."""
        return self._wake_w

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    # ------------------------------------------------------------ shutdown
    def stop(self) -> None:
        """Make serve_forever return soon; safe from signal handlers and other threads."""
        self._stop.set()
        conn = self._conn  # no lock: a signal handler may interrupt a holder of it
        if conn is not None:
            conn.shutdown()
        self._poke()

    def close(self) -> None:
        """Release the socket (and its file) and the wake pipe."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1
