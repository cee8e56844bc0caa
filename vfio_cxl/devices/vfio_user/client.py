"""A small vfio-user client that plays QEMU's part, for tests, benchmarks and probes.

It speaks the same wire format QEMU 11.1 does, hands over eventfds and
memfds with SCM_RIGHTS, and answers the server's DMA_READ / DMA_WRITE from
a ``GuestMemory`` of local buffers -- so both the server's direct path
(memfd areas, passed with DMA_MAP) and its message path (plain areas) can
be exercised without a VM.  IOVAs the memory does not back, or that the client
has not DMA-mapped (or has unmapped), are refused with ENODEV, as QEMU does
when the vIOMMU has no translation.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field

from . import wire
from .transport import ConnectionClosed, MessageTimeout, Transport, close_fds


F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)


def wait_eventfd(fd: int, timeout: float) -> int:
    """Wait until the eventfd fires and return its counter (0 on timeout)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(int(timeout * 1000)):
        return 0
    return os.eventfd_read(fd)


def eventfd_count(fd: int) -> int:
    """The eventfd's counter without waiting (0 if it has not fired)."""
    return wait_eventfd(fd, 0)


class Area:
    """A piece of pretend guest memory at an IOVA; ``shared`` ones live in a memfd."""

    def __init__(self, iova: int, size: int, shared: bool, writable: bool = True,
                 sealed: bool = False):
        self.iova, self.size, self.writable = iova, size, writable
        self.mapped = False  # DMA-mapped for the server: only then are DMA messages served
        if shared:
            flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0)
            self.fd = os.memfd_create(f"guest-{iova:#x}", flags)
            os.ftruncate(self.fd, size)
            if sealed:  # like QEMU's memory-backend-memfd (seal=on): it can no longer shrink
                fcntl.fcntl(self.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)
            self.buf = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        else:
            self.fd = None
            self.buf = bytearray(size)
        self.view = memoryview(self.buf)

    @property
    def end(self) -> int:
        return self.iova + self.size

    def close(self) -> None:
        self.view.release()
        if self.fd is not None:
            self.buf.close()
            os.close(self.fd)
            self.fd = None


class GuestMemory:
    """IOVA -> local buffer map the client serves DMA messages from."""

    def __init__(self):
        self.areas: list[Area] = []

    def add(self, iova: int, size: int, *, shared: bool, writable: bool = True,
            sealed: bool = False) -> Area:
        area = Area(iova, size, shared, writable, sealed)
        self.areas.append(area)
        return area

    def view(self, iova: int, length: int, write: bool = False,
             mapped_only: bool = False) -> memoryview | None:
        for a in self.areas:
            if (a.iova <= iova and iova + length <= a.end and (a.writable or not write)
                    and (a.mapped or not mapped_only)):
                return a.view[iova - a.iova:iova - a.iova + length]
        return None

    def unmapped(self, iova: int, size: int) -> None:
        """The client unmapped [iova, iova+size): areas it touches stop serving DMA."""
        for a in self.areas:
            if a.iova < iova + size and iova < a.end:
                a.mapped = False

    def close(self) -> None:
        for a in self.areas:
            a.close()
        self.areas.clear()


@dataclass
class Reply:
    header: wire.Header
    payload: bytes
    fds: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.header.is_error

    @property
    def errno(self) -> int:
        return self.header.error if self.header.is_error else 0


@dataclass
class DmaStats:
    reads: int = 0
    writes: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    max_read: int = 0
    max_write: int = 0
    refused: int = 0
    refusals: list = field(default_factory=list)  # (command, address, count) of each refused


class VfioUserClient:
    def __init__(self, path: str, memory: GuestMemory | None = None, *, timeout: float = 5.0):
        self.memory = memory if memory is not None else GuestMemory()
        self.timeout = timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(os.fspath(path))
        except OSError:
            sock.close()
            raise
        self.transport = Transport(sock, partial_timeout=timeout, send_timeout=timeout)
        self.stats = DmaStats()
        self.server_caps: dict = {}
        # called on the reader thread with each DMA request's header before it is
        # served; tests use it to hold a request (the reader waits meanwhile)
        self.before_dma = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, list] = {}  # id -> [Event, Reply | None]
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="vfio-user-client",
                                        daemon=True)
        self._reader.start()

    # ------------------------------------------------------------ plumbing
    def request(self, command: int, payload=b"", fds=(), *, no_reply: bool = False,
                timeout: float | None = None) -> Reply | None:
        """Send one request; wait for and return its reply (None if no_reply)."""
        msg_id = next(self._ids) & 0xFFFF
        slot = [threading.Event(), None]
        if not no_reply:
            with self._lock:
                self._waiting[msg_id] = slot
        header = wire.request_header(msg_id, command, len(payload),
                                     wire.FLAG_NO_REPLY if no_reply else 0)
        self.transport.send([header, payload], list(fds))
        if no_reply:
            return None
        wait = self.timeout if timeout is None else timeout
        if not slot[0].wait(wait):
            with self._lock:
                self._waiting.pop(msg_id, None)
            raise TimeoutError(f"no reply to {wire.COMMAND_NAMES.get(command, command)} "
                               f"(id {msg_id}) within {wait}s")
        if slot[1] is None:
            raise ConnectionError("server closed the connection before replying")
        return slot[1]

    def send_raw(self, data: bytes, fds=()) -> None:
        """Put arbitrary bytes on the wire (bad-input and fuzz tests)."""
        self.transport.send([data], list(fds))

    def _read_loop(self) -> None:
        try:
            while True:
                fds: list[int] = []
                header = self.transport.recv_header(fds)
                body = max(header.size - wire.HEADER_SIZE, 0)
                if header.is_reply:
                    payload = bytearray(body)
                    self.transport.recv_into(memoryview(payload), fds)
                    with self._lock:
                        slot = self._waiting.pop(header.msg_id, None)
                    if slot is None:
                        close_fds(fds)
                        continue
                    slot[1] = Reply(header, bytes(payload), fds)
                    slot[0].set()
                else:
                    if self.before_dma is not None:
                        self.before_dma(header)
                    self._serve_dma(header, body, fds)
        except (ConnectionClosed, MessageTimeout, OSError):
            pass
        finally:
            self.closed.set()
            with self._lock:
                waiting, self._waiting = self._waiting, {}
            for slot in waiting.values():
                slot[0].set()

    def _serve_dma(self, header: wire.Header, body: int, fds: list[int]) -> None:
        """Answer the server's DMA_READ / DMA_WRITE like QEMU would."""
        close_fds(fds)
        meta = bytearray(wire.DMA_ACCESS.size)
        if header.command not in (wire.DMA_READ, wire.DMA_WRITE) or body < len(meta):
            self.transport.discard(body, [])
            return self._answer_error(header, errno.EINVAL)
        self.transport.recv_into(memoryview(meta), [])
        addr, count = wire.DMA_ACCESS.unpack(meta)
        if header.command == wire.DMA_WRITE:
            view = (self.memory.view(addr, count, write=True, mapped_only=True)
                    if body == 16 + count else None)
            if view is None:
                self.transport.discard(body - 16, [])
                return self._answer_error(header, errno.ENODEV, addr, count)
            self.transport.recv_into(view, [])
            self.stats.writes += 1
            self.stats.write_bytes += count
            self.stats.max_write = max(self.stats.max_write, count)
            reply = [wire.reply_header(header, 16), meta]
        else:
            self.transport.discard(body - 16, [])
            view = self.memory.view(addr, count, mapped_only=True)
            if view is None:
                return self._answer_error(header, errno.ENODEV, addr, count)
            self.stats.reads += 1
            self.stats.read_bytes += count
            self.stats.max_read = max(self.stats.max_read, count)
            reply = [wire.reply_header(header, 16 + count), meta, view]
        if not header.no_reply:
            self.transport.send(reply)

    def _answer_error(self, header: wire.Header, err: int, addr: int = 0, count: int = 0) -> None:
        self.stats.refused += 1
        self.stats.refusals.append((header.command, addr, count))
        if not header.no_reply:
            self.transport.send([wire.error_header(header, err)])

    def close(self) -> None:
        self.transport.shutdown()  # wake the reader before the fd goes away
        self._reader.join(timeout=5)
        self.transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ commands
    def negotiate(self, max_data_xfer_size: int = 1 << 20, max_msg_fds: int = 16,
                  minor: int = 0) -> dict:
        caps = {"max_msg_fds": max_msg_fds, "max_data_xfer_size": max_data_xfer_size,
                "pgsizes": 4096, "max_dma_maps": 65535, "write_multiple": False}
        reply = self.request(wire.VERSION, wire.version_payload(0, minor, caps))
        if not reply.ok:
            raise OSError(reply.errno, "VERSION refused")
        _, _, self.server_caps = wire.parse_version(reply.payload)
        return self.server_caps

    def device_info(self) -> tuple[int, int, int, int]:
        reply = self._ok(self.request(wire.DEVICE_GET_INFO, wire.DEVICE_INFO.pack(16, 0, 0, 0)))
        return wire.DEVICE_INFO.unpack(reply.payload)

    def region_info(self, index: int, argsz: int = 256) -> tuple[dict, bytes, list[int]]:
        """(fields, raw payload, fds).  The caller closes the fds."""
        payload = wire.REGION_INFO.pack(argsz, 0, index, 0, 0, 0)
        reply = self._ok(self.request(wire.DEVICE_GET_REGION_INFO, payload))
        names = ("argsz", "flags", "index", "cap_offset", "size", "offset")
        return dict(zip(names, wire.REGION_INFO.unpack_from(reply.payload))), reply.payload, reply.fds

    def irq_info(self, index: int) -> tuple[int, int, int, int]:
        reply = self._ok(self.request(wire.DEVICE_GET_IRQ_INFO, wire.IRQ_INFO.pack(16, 0, index, 0)))
        return wire.IRQ_INFO.unpack(reply.payload)

    def set_irqs(self, index: int, start: int, count: int, flags: int,
                 fds=(), data: bytes = b"") -> Reply:
        payload = wire.IRQ_SET.pack(wire.IRQ_SET.size + len(data), flags, index, start, count)
        return self.request(wire.DEVICE_SET_IRQS, payload + data, fds)

    def attach_msix(self, count: int) -> list[int]:
        """New eventfds for MSI-X vectors 0..count-1; the caller closes them."""
        efds = [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in range(count)]
        self._ok(self.set_irqs(wire.PCI_MSIX_IRQ, 0, count,
                               wire.IRQ_SET_DATA_EVENTFD | wire.IRQ_SET_ACTION_TRIGGER, efds))
        return efds

    def region_read(self, index: int, offset: int, count: int) -> Reply:
        return self.request(wire.REGION_READ, wire.REGION_ACCESS.pack(offset, index, count))

    def region_write(self, index: int, offset: int, data, *, posted: bool = False) -> Reply | None:
        payload = wire.REGION_ACCESS.pack(offset, index, len(data)) + bytes(data)
        return self.request(wire.REGION_WRITE, payload, no_reply=posted)

    def read(self, index: int, offset: int, count: int) -> bytes:
        return self._ok(self.region_read(index, offset, count)).payload[16:]

    def write(self, index: int, offset: int, data, *, posted: bool = False) -> None:
        reply = self.region_write(index, offset, data, posted=posted)
        if reply is not None:
            self._ok(reply)

    def config_read(self, offset: int, count: int) -> bytes:
        return self.read(wire.PCI_CONFIG_REGION, offset, count)

    def config_write(self, offset: int, data) -> None:
        self.write(wire.PCI_CONFIG_REGION, offset, data)

    def set_bus_master(self, on: bool = True) -> None:
        """PCI command register: memory space + Bus Master Enable (a device does no DMA without)."""
        command = int.from_bytes(self.config_read(0x04, 2), "little")
        command = (command | 0x6) if on else (command & ~0x4)
        self.config_write(0x04, command.to_bytes(2, "little"))

    def reg_read(self, offset: int) -> int:
        return int.from_bytes(self.read(0, offset, 4), "little")

    def reg_write(self, offset: int, value: int, *, posted: bool = False) -> None:
        self.write(0, offset, value.to_bytes(4, "little"), posted=posted)

    def dma_map(self, iova: int, size: int, *, fd: int | None = None, offset: int = 0,
                flags: int = wire.DMA_MAP_FLAG_READ | wire.DMA_MAP_FLAG_WRITE) -> Reply:
        payload = wire.DMA_MAP_REQ.pack(32, flags, offset, iova, size)
        return self.request(wire.DMA_MAP, payload, [fd] if fd is not None else [])

    def map_area(self, area: Area, *, direct: bool = True) -> None:
        """DMA_MAP a memory area: with its memfd (direct path) or without (message path)."""
        flags = wire.DMA_MAP_FLAG_READ | (wire.DMA_MAP_FLAG_WRITE if area.writable else 0)
        self._ok(self.dma_map(area.iova, area.size, fd=area.fd if direct else None, flags=flags))
        area.mapped = True

    def dma_unmap(self, iova: int, size: int, flags: int = 0) -> Reply:
        # like QEMU's vIOMMU: once unmapped, DMA messages for it are refused
        if flags & wire.DMA_UNMAP_FLAG_ALL:
            self.memory.unmapped(0, 1 << 64)
        else:
            self.memory.unmapped(iova, size)
        return self.request(wire.DMA_UNMAP, wire.DMA_UNMAP_REQ.pack(24, flags, iova, size))

    def reset(self) -> None:
        self._ok(self.request(wire.DEVICE_RESET))

    @staticmethod
    def _ok(reply: Reply) -> Reply:
        if not reply.ok:
            close_fds(reply.fds)
            raise OSError(reply.errno, f"{wire.COMMAND_NAMES.get(reply.header.command)} failed: "
                          f"{os.strerror(reply.errno) if reply.errno else 'error'}")
        return reply


def connect_when_ready(path: str, memory: GuestMemory | None = None, *,
                       timeout: float = 5.0) -> VfioUserClient:
    """Connect, retrying while the server is still coming up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return VfioUserClient(path, memory, timeout=timeout)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
