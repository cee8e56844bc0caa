"""An independent vfio-user client written from the protocol specification.

This is the *other side* of the GPU server, for black-box checks: the
conformance suite (tests/conformance/) and the chaos harness
(``scripts/bench chaos``) drive the server only as a subprocess over a real
UNIX socket through this module.  On purpose it imports nothing from the
device package: the layouts below are transcribed from the vfio-user
specification (QEMU's docs/interop/vfio-user.rst) and linux/vfio.h, so a
layout bug in the server cannot hide behind a shared definition.

Where QEMU 11.1, the client the lab actually uses, departs from the spec
table, this module speaks QEMU's form and says so next to the layout:

* DMA_READ / DMA_WRITE requests carry ``u64 address, u64 count`` (the spec
  table) and the data at byte 16 of the payload; QEMU 11.1's reply to a
  DMA_WRITE echoes ``address`` and ``count`` as two u64 (16 bytes), where
  the spec's reply table gives ``count`` 4 bytes.

The client keeps its own "guest memory": every DMA window is a memfd, with
canary bytes around the part exported by DMA_MAP, so a check can tell
whether the server wrote anywhere it was not allowed to.  It answers the
server's DMA_READ / DMA_WRITE requests from those memfds and records every
request, and every rule the server broke while sending it, in ``dma_log``
and ``violations``.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

# ---------------------------------------------------------------- header (spec "Header")
HEADER = struct.Struct("<HHIII")  # message ID, command, message size (incl. header), flags, error
HEADER_SIZE = 16
TYPE_MASK = 0x0F  # flags bits 0-3
TYPE_COMMAND = 0x0
TYPE_REPLY = 0x1
FLAG_NO_REPLY = 0x10  # bit 4
FLAG_ERROR = 0x20  # bit 5

# ---------------------------------------------------------------- commands (spec "Commands")
VERSION = 1
DMA_MAP = 2
DMA_UNMAP = 3
DEVICE_GET_INFO = 4
DEVICE_GET_REGION_INFO = 5
DEVICE_GET_REGION_IO_FDS = 6
DEVICE_GET_IRQ_INFO = 7
DEVICE_SET_IRQS = 8
REGION_READ = 9
REGION_WRITE = 10
DMA_READ = 11
DMA_WRITE = 12
DEVICE_RESET = 13
REGION_WRITE_MULTI = 15
DEVICE_FEATURE = 16
MIG_DATA_READ = 17
MIG_DATA_WRITE = 18
CLIENT_COMMANDS = (VERSION, DMA_MAP, DMA_UNMAP, DEVICE_GET_INFO, DEVICE_GET_REGION_INFO,
                   DEVICE_GET_REGION_IO_FDS, DEVICE_GET_IRQ_INFO, DEVICE_SET_IRQS,
                   REGION_READ, REGION_WRITE, DEVICE_RESET, REGION_WRITE_MULTI,
                   DEVICE_FEATURE, MIG_DATA_READ, MIG_DATA_WRITE)

# ---------------------------------------------------------------- payloads
VERSION_HEAD = struct.Struct("<HH")  # major, minor; then JSON (NUL-terminated)
DMA_MAP_REQ = struct.Struct("<IIQQQ")  # argsz, flags, offset, address, size (32 bytes)
DMA_UNMAP_REQ = struct.Struct("<IIQQ")  # argsz, flags, address, size (24 bytes)
DEVICE_INFO = struct.Struct("<IIII")  # argsz, flags, num_regions, num_irqs
REGION_INFO = struct.Struct("<IIIIQQ")  # argsz, flags, index, cap_offset, size, offset
CAP_HEADER = struct.Struct("<HHI")  # id, version, next
SPARSE_MMAP = struct.Struct("<II")  # nr_areas, reserved; then areas
SPARSE_AREA = struct.Struct("<QQ")  # offset, size
IRQ_INFO = struct.Struct("<IIII")  # argsz, flags, index, count
IRQ_SET = struct.Struct("<IIIII")  # argsz, flags, index, start, count; then data
REGION_RW = struct.Struct("<QII")  # offset, region, count; then data
DMA_RW = struct.Struct("<QQ")  # address, count (u64 both); then data
DMA_WRITE_REPLY_QEMU = struct.Struct("<QQ")  # QEMU 11.1: address, count as u64 (spec: u32 count)

# linux/vfio.h
DMA_MAP_FLAG_READ = 1 << 0
DMA_MAP_FLAG_WRITE = 1 << 1
DMA_UNMAP_FLAG_GET_DIRTY_BITMAP = 1 << 0
DMA_UNMAP_FLAG_ALL = 1 << 1  # QEMU sends it (vfio_user_dma_unmap with unmap_all)
DEVICE_FLAGS_RESET = 1 << 0
DEVICE_FLAGS_PCI = 1 << 1
REGION_INFO_FLAG_READ = 1 << 0
REGION_INFO_FLAG_WRITE = 1 << 1
REGION_INFO_FLAG_MMAP = 1 << 2
REGION_INFO_FLAG_CAPS = 1 << 3
REGION_INFO_CAP_SPARSE_MMAP = 1
IRQ_INFO_EVENTFD = 1 << 0
IRQ_INFO_MASKABLE = 1 << 1
IRQ_INFO_AUTOMASKED = 1 << 2
IRQ_INFO_NORESIZE = 1 << 3
IRQ_SET_DATA_NONE = 1 << 0
IRQ_SET_DATA_BOOL = 1 << 1
IRQ_SET_DATA_EVENTFD = 1 << 2
IRQ_SET_ACTION_MASK = 1 << 3
IRQ_SET_ACTION_UNMASK = 1 << 4
IRQ_SET_ACTION_TRIGGER = 1 << 5

PCI_BAR0_REGION = 0
PCI_BAR2_REGION = 2
PCI_BAR4_REGION = 4
PCI_ROM_REGION = 6
PCI_CONFIG_REGION = 7
PCI_VGA_REGION = 8
PCI_NUM_REGIONS = 9
PCI_INTX_IRQ = 0
PCI_MSI_IRQ = 1
PCI_MSIX_IRQ = 2
PCI_ERR_IRQ = 3
PCI_REQ_IRQ = 4
PCI_NUM_IRQS = 5

# spec defaults ("Version" capabilities)
DEFAULT_MAX_MSG_FDS = 1
DEFAULT_MAX_DATA_XFER = 1 << 20
DEFAULT_MAX_DMA_MAPS = 65535
DEFAULT_PGSIZES = 4096

PAGE = 4096
CANARY = 0xA5
FILL = 0x3C


class PeerClosed(Exception):
    """The server closed the connection (EOF or reset)."""


class PeerTimeout(Exception):
    """Nothing (or not enough) arrived in time."""


@dataclass
class Msg:
    msg_id: int
    command: int
    size: int
    flags: int
    error: int
    payload: bytes
    fds: list[int] = field(default_factory=list)

    @property
    def type(self) -> int:
        return self.flags & TYPE_MASK

    @property
    def is_reply(self) -> bool:
        return self.type == TYPE_REPLY

    @property
    def is_error(self) -> bool:
        return bool(self.flags & FLAG_ERROR)

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

    def __repr__(self) -> str:
        kind = "reply" if self.is_reply else f"type{self.type}"
        err = f" ERROR errno={self.error}" if self.is_error else ""
        return (f"<Msg {kind} cmd={self.command} id={self.msg_id} size={self.size} "
                f"flags={self.flags:#x}{err} fds={len(self.fds)}>")


def header(msg_id: int, command: int, payload_len: int, flags: int = 0, error: int = 0,
           size: int | None = None) -> bytes:
    return HEADER.pack(msg_id & 0xFFFF, command,
                       HEADER_SIZE + payload_len if size is None else size, flags, error)


def version_body(major: int = 0, minor: int = 0, caps: dict | None = None,
                 raw_json: bytes | None = None) -> bytes:
    if raw_json is None:
        raw_json = b"" if caps is None else json.dumps({"capabilities": caps}).encode() + b"\0"
    return VERSION_HEAD.pack(major, minor) + raw_json


def parse_version(payload: bytes) -> tuple[int, int, dict]:
    """(major, minor, capabilities) of a VERSION reply; ValueError if malformed."""
    if len(payload) < VERSION_HEAD.size:
        raise ValueError(f"VERSION reply payload is {len(payload)} bytes, < 4")
    major, minor = VERSION_HEAD.unpack_from(payload)
    text = payload[VERSION_HEAD.size:]
    if not text:
        return major, minor, {}
    if b"\0" not in text:
        raise ValueError("VERSION JSON is not NUL-terminated")
    doc = json.loads(text.split(b"\0", 1)[0].decode("utf-8"))
    if not isinstance(doc, dict):
        raise ValueError("VERSION JSON is not an object")
    caps = doc.get("capabilities", {})
    if not isinstance(caps, dict):
        raise ValueError("VERSION capabilities is not an object")
    return major, minor, caps


def new_eventfd() -> int:
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)


def eventfd_take(fd: int) -> int:
    """The eventfd's counter (0 if never signalled), resetting it."""
    try:
        return int.from_bytes(os.read(fd, 8), "little")
    except BlockingIOError:
        return 0


# ---------------------------------------------------------------- client memory
class Window:
    """One client memory area: a memfd of ``PAGE + size + PAGE`` bytes whose
    middle part is exported with DMA_MAP at ``iova`` (file offset ``PAGE``);
    the pages around it are canaries the server must never touch."""

    _serial = 0

    def __init__(self, iova: int, size: int, *, direct: bool, name: str = "win",
                 flags: int = DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, guard: int = PAGE,
                 sealed: bool = True):
        """``sealed``: F_SEAL_SHRINK on the memfd (as QEMU's memfd backend does), so
        nobody can truncate it; unsealed ones can be truncated behind the server."""
        self.iova, self.size, self.direct, self.flags, self.guard = iova, size, direct, flags, guard
        self.sealed = sealed
        Window._serial += 1
        self.name = f"vfio-user-spec-{name}-{iova:x}-{os.getpid()}-{Window._serial}"
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.file_size = guard + size + guard
        os.ftruncate(self.fd, self.file_size)
        if sealed:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        self.mm = mmap.mmap(self.fd, self.file_size, flags=mmap.MAP_SHARED)
        self.mm[:guard] = bytes([CANARY]) * guard
        self.mm[guard + size:] = bytes([CANARY]) * guard
        self.mapped = False
        self.truncated = False

    @property
    def end(self) -> int:
        return self.iova + self.size

    def contains(self, iova: int, count: int) -> bool:
        return self.iova <= iova and iova + count <= self.end

    def read(self, iova: int, count: int) -> bytes:
        off = self.guard + iova - self.iova
        return bytes(self.mm[off:off + count])

    def write(self, iova: int, data) -> None:
        off = self.guard + iova - self.iova
        self.mm[off:off + len(data)] = data

    def body(self) -> bytes:
        return bytes(self.mm[self.guard:self.guard + self.size])

    def canaries_intact(self) -> bool:
        if self.truncated:
            return True
        c = bytes([CANARY]) * self.guard
        return self.mm[:self.guard] == c and self.mm[self.guard + self.size:] == c

    def close(self) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


@dataclass
class DmaRequest:
    command: int
    address: int
    count: int
    data_len: int
    flags: int
    refused: bool = False


# ---------------------------------------------------------------- the client
class Peer:
    """A raw vfio-user client on one connection to ``path``.

    ``request`` sends a command and returns its reply, answering any
    DMA_READ / DMA_WRITE the server sends meanwhile (the spec: "unrelated
    messages sent from the server to the client can appear in between a
    client to server request/reply").
    """

    def __init__(self, path: str | None, timeout: float = 5.0, connect_timeout: float = 10.0,
                 sock: socket.socket | None = None):
        """Connect to ``path`` (or use ``sock``, an already connected socket)."""
        self.path = path
        self.timeout = timeout
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.settimeout(connect_timeout)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
                raise
        self.sock = sock
        self.sock.setblocking(False)
        self._buf = bytearray()
        self._fds: list[int] = []
        self._next_id = 1
        self.windows: dict[int, Window] = {}  # iova -> window (exported or not)
        self.max_data_xfer = DEFAULT_MAX_DATA_XFER  # what this client told the server
        self.server_caps: dict = {}
        self.dma_log: list[DmaRequest] = []
        self.violations: list[str] = []
        self.unsolicited: list[Msg] = []
        self.refuse_dma = False  # answer every DMA request with an error reply (ENODEV)
        self.dma_forbidden: str | None = None  # if set: any DMA request now breaks a rule (why)
        self.read_chunk: int | None = None  # if set: receive at most this many bytes per recv
        self.sent = 0
        self.closed = False

    # ------------------------------------------------------------ ids
    def next_id(self) -> int:
        i = self._next_id
        self._next_id = (self._next_id + 1) & 0xFFFF
        return i

    # ------------------------------------------------------------ send
    def send_bytes(self, data: bytes, fds=(), pieces: list[int] | None = None) -> None:
        """Send raw bytes (fds with the first byte); ``pieces``: sizes of separate
        sends (short writes); the rest goes in one send."""
        view = memoryview(data)
        first = True
        deadline = time.monotonic() + self.timeout
        sizes = list(pieces or [])
        while view:
            n = sizes.pop(0) if sizes else len(view)
            n = max(1, min(n, len(view)))
            chunk = view[:n]
            while chunk:
                self._wait(select.POLLOUT, deadline, "send")
                try:
                    if first and fds:
                        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                        sent = self.sock.sendmsg([chunk], anc)
                    else:
                        sent = self.sock.send(chunk)
                except BlockingIOError:
                    continue
                except (BrokenPipeError, ConnectionResetError) as exc:
                    raise PeerClosed(f"send: {exc}") from None
                first = False
                chunk = chunk[sent:]
                view = view[sent:]
        self.sent += 1

    def send(self, command: int, payload: bytes = b"", *, flags: int = 0, fds=(),
             msg_id: int | None = None, size: int | None = None, error: int = 0,
             pieces: list[int] | None = None) -> int:
        msg_id = self.next_id() if msg_id is None else msg_id
        self.send_bytes(header(msg_id, command, len(payload), flags, error, size) + payload,
                        fds, pieces)
        return msg_id

    # ------------------------------------------------------------ receive
    def _wait(self, events: int, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        p = select.poll()
        p.register(self.sock, events)
        if left <= 0 or not p.poll(left * 1000):
            raise PeerTimeout(f"{what}: nothing arrived in time")

    def _fill(self, need: int, idle: float) -> None:
        """Buffer ``need`` bytes; PeerTimeout if nothing arrives for ``idle`` seconds."""
        deadline = time.monotonic() + idle
        while len(self._buf) < need:
            self._wait(select.POLLIN, deadline, f"waiting for {need - len(self._buf)} bytes")
            want = max(need - len(self._buf), 65536)
            if self.read_chunk:
                want = min(want, self.read_chunk)
            try:
                data, anc, msg_flags, _ = self.sock.recvmsg(
                    want, socket.CMSG_SPACE(64 * 4))
            except BlockingIOError:
                continue
            except ConnectionResetError:
                raise PeerClosed("connection reset by the server") from None
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(raw[:len(raw) - len(raw) % 4])
                    self._fds.extend(fds)
            if msg_flags & socket.MSG_CTRUNC:
                self.violations.append("server sent more fds than fit (MSG_CTRUNC)")
            if not data:
                raise PeerClosed("the server closed the connection")
            self._buf += data
            deadline = time.monotonic() + idle

    def recv(self, timeout: float | None = None) -> Msg:
        """Exactly one message from the server; ``timeout``: longest silence."""
        idle = self.timeout if timeout is None else timeout
        self._fill(HEADER_SIZE, idle)
        msg_id, command, size, flags, err = HEADER.unpack_from(self._buf)
        if size < HEADER_SIZE:
            raise ValueError(f"server sent a header with size {size} < 16")
        self._fill(size, idle)
        payload = bytes(self._buf[HEADER_SIZE:size])
        del self._buf[:size]
        fds, self._fds = self._fds, []
        return Msg(msg_id, command, size, flags, err, payload, fds)

    def next_reply(self, timeout: float | None = None) -> Msg:
        """The next reply, serving server requests that arrive before it; ``timeout``:
        the longest silence."""
        idle = self.timeout if timeout is None else timeout
        while True:
            msg = self.recv(idle)
            if msg.type == TYPE_COMMAND and msg.command in (DMA_READ, DMA_WRITE):
                self.serve_dma(msg)
                continue
            if msg.is_reply:
                return msg
            self.unsolicited.append(msg)
            self.violations.append(f"unexpected message from the server: {msg!r}")

    def request(self, command: int, payload: bytes = b"", *, fds=(), flags: int = 0,
                timeout: float | None = None, **kw) -> Msg:
        msg_id = self.send(command, payload, fds=fds, flags=flags, **kw)
        reply = self.next_reply(timeout)
        if reply.msg_id != msg_id or reply.command != command:
            self.violations.append(f"reply {reply!r} does not match request id={msg_id} "
                                   f"cmd={command}")
        return reply

    def pump(self, until, timeout: float | None = None, poll_fds=()) -> None:
        """Serve server requests until ``until()`` is true; PeerTimeout if it never is."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(f"condition not met within {timeout or self.timeout} s")
            if len(self._buf) < HEADER_SIZE:
                p = select.poll()
                p.register(self.sock, select.POLLIN)
                for fd in poll_fds:
                    p.register(fd, select.POLLIN)
                ready = p.poll(min(left, 0.05) * 1000)
                if not any(fd == self.sock.fileno() for fd, _ in ready):
                    continue
            msg = self.recv(max(1.0, deadline - time.monotonic()))  # finish a started message
            if msg.type == TYPE_COMMAND and msg.command in (DMA_READ, DMA_WRITE):
                self.serve_dma(msg)
            else:
                self.unsolicited.append(msg)
                self.violations.append(f"unexpected message from the server: {msg!r}")

    # ------------------------------------------------------------ DMA service
    def window_for(self, address: int, count: int) -> Window | None:
        for w in self.windows.values():
            if w.mapped and w.contains(address, max(count, 1)):
                return w
        return None

    def serve_dma(self, msg: Msg) -> None:
        """Answer one DMA_READ / DMA_WRITE like QEMU 11.1 does, checking the rules."""
        msg.close_fds()
        if len(msg.payload) < DMA_RW.size:
            self.violations.append(f"{msg!r}: payload shorter than address+count")
            self._reply_error(msg, errno.EINVAL)
            return
        address, count = DMA_RW.unpack_from(msg.payload)
        data = msg.payload[DMA_RW.size:]
        req = DmaRequest(msg.command, address, count, len(data), msg.flags)
        self.dma_log.append(req)
        name = "DMA_READ" if msg.command == DMA_READ else "DMA_WRITE"
        if self.dma_forbidden:
            self.violations.append(f"{name} {address:#x}+{count:#x} {self.dma_forbidden}")
        if count > self.max_data_xfer:
            self.violations.append(f"{name} count {count} > the client's max_data_xfer_size "
                                   f"{self.max_data_xfer}")
        if msg.command == DMA_READ and data:
            self.violations.append(f"DMA_READ request carries {len(data)} data bytes")
        if msg.command == DMA_WRITE and len(data) != count:
            self.violations.append(f"DMA_WRITE count {count} but {len(data)} data bytes")
        window = self.window_for(address, count)
        if window is None:
            self.violations.append(f"{name} {address:#x}+{count:#x} outside every live "
                                   f"DMA_MAP window")
        if window is not None and window.truncated:
            req.refused = True  # its memory is gone on this side too
            self._reply_error(msg, errno.EFAULT)
            return
        if window is None or self.refuse_dma or (msg.command == DMA_WRITE and len(data) != count):
            req.refused = True
            self._reply_error(msg, errno.ENODEV if window is None or self.refuse_dma
                              else errno.EINVAL)
            return
        if msg.command == DMA_WRITE:
            if not window.flags & DMA_MAP_FLAG_WRITE:
                self.violations.append(f"DMA_WRITE to read-only window {window.iova:#x}")
            window.write(address, data)
            body = DMA_WRITE_REPLY_QEMU.pack(address, count)
        else:
            if not window.flags & DMA_MAP_FLAG_READ:
                self.violations.append(f"DMA_READ from write-only window {window.iova:#x}")
            body = DMA_RW.pack(address, count) + window.read(address, count)
        if msg.flags & FLAG_NO_REPLY:
            return
        self.send_bytes(header(msg.msg_id, msg.command, len(body), TYPE_REPLY) + body)

    def _reply_error(self, msg: Msg, err: int) -> None:
        if msg.flags & FLAG_NO_REPLY:
            return
        self.send_bytes(header(msg.msg_id, msg.command, 0, TYPE_REPLY | FLAG_ERROR, err))

    # ------------------------------------------------------------ commands
    def handshake(self, caps: dict | None = None, major: int = 0, minor: int = 0) -> Msg:
        """VERSION; remembers the limits this client announced and the server's caps."""
        if caps is None:
            caps = {"max_msg_fds": 8, "max_data_xfer_size": DEFAULT_MAX_DATA_XFER}
        reply = self.request(VERSION, version_body(major, minor, caps))
        if "max_data_xfer_size" in caps:
            self.max_data_xfer = caps["max_data_xfer_size"]
        if reply.is_reply and not reply.is_error:
            self.server_caps = parse_version(reply.payload)[2]
        return reply

    def dma_map(self, window: Window, *, with_fd: bool | None = None, flags: int | None = None,
                argsz: int = DMA_MAP_REQ.size, no_reply: bool = False) -> Msg | None:
        with_fd = window.direct if with_fd is None else with_fd
        flags = window.flags if flags is None else flags
        body = DMA_MAP_REQ.pack(argsz, flags, window.guard if with_fd else 0, window.iova,
                                window.size)
        previous = self.windows.get(window.iova)
        # a map over a live window (which the server must refuse with EEXIST) does
        # not hide that window: DMA to it may arrive while the request is in flight
        shadowed = previous is not None and previous.mapped
        if not shadowed:
            self.windows[window.iova] = window
        window.mapped = True  # exported from now on (the server may use it once it has it)
        fds = [window.fd] if with_fd else []
        if no_reply:
            self.windows[window.iova] = window
            self.send(DMA_MAP, body, fds=fds, flags=FLAG_NO_REPLY)
            return None
        reply = self.request(DMA_MAP, body, fds=fds)
        if reply.is_error:
            window.mapped = False
            if previous is not None:
                # refused (e.g. EEXIST over a live window): the window that was
                # there stays the one DMA requests to this address are served from
                self.windows[window.iova] = previous
        else:
            self.windows[window.iova] = window
        return reply

    def dma_unmap(self, iova: int, size: int, flags: int = 0, argsz: int = DMA_UNMAP_REQ.size,
                  keep_exported: bool = False) -> Msg:
        body = DMA_UNMAP_REQ.pack(argsz, flags, iova, size)
        reply = self.request(DMA_UNMAP, body)
        if not reply.is_error and not keep_exported:
            end = iova + size
            for w in self.windows.values():
                if flags & DMA_UNMAP_FLAG_ALL or (iova <= w.iova and w.end <= end):
                    w.mapped = False
        return reply

    def region_read(self, region: int, offset: int, count: int) -> Msg:
        return self.request(REGION_READ, REGION_RW.pack(offset, region, count))

    def region_write(self, region: int, offset: int, data: bytes, *, no_reply: bool = False):
        body = REGION_RW.pack(offset, region, len(data)) + data
        if no_reply:
            self.send(REGION_WRITE, body, flags=FLAG_NO_REPLY)
            return None
        return self.request(REGION_WRITE, body)

    def read32(self, offset: int, region: int = PCI_BAR0_REGION) -> int:
        reply = self.region_read(region, offset, 4)
        if reply.is_error or len(reply.payload) != REGION_RW.size + 4:
            raise AssertionError(f"REGION_READ {region}:{offset:#x} failed: {reply!r}")
        return int.from_bytes(reply.payload[REGION_RW.size:], "little")

    def write32(self, offset: int, value: int, region: int = PCI_BAR0_REGION,
                posted: bool = False) -> None:
        reply = self.region_write(region, offset, (value & 0xFFFFFFFF).to_bytes(4, "little"),
                                  no_reply=posted)
        if reply is not None and reply.is_error:
            raise AssertionError(f"REGION_WRITE {region}:{offset:#x} failed: {reply!r}")

    def set_irqs(self, index: int, start: int, count: int, flags: int, data: bytes = b"",
                 fds=(), argsz: int | None = None) -> Msg:
        argsz = IRQ_SET.size + len(data) if argsz is None else argsz
        return self.request(DEVICE_SET_IRQS,
                            IRQ_SET.pack(argsz, flags, index, start, count) + data, fds=fds)

    def close(self, keep_windows: bool = False) -> None:
        """Disconnect; the windows' memfds are closed too unless ``keep_windows``."""
        if self.closed:
            return
        self.closed = True
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        self.sock.close()
        if not keep_windows:
            for w in self.windows.values():
                w.close()
            self.windows.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- the server process
class ServerProcess:
    """``vfio-cxl gpu serve --socket PATH --vram-mib N`` as a child process.

    Started through the CLI only (``python -m vfio_cxl gpu serve``): it prints
    ``READY <path>`` once listening; SIGTERM stops it.
    """

    def __init__(self, socket_path: str, vram_mib: int = 16, extra=(), ready_timeout=30.0):
        self.socket_path = socket_path
        self.argv = [sys.executable, "-m", "vfio_cxl", "gpu", "serve", "--socket", socket_path,
                     "--vram-mib", str(vram_mib), *extra]
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self._stderr = None
        self.starts = 0

    def start(self) -> "ServerProcess":
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL)
        self.starts += 1
        line = b""
        deadline = time.monotonic() + self.ready_timeout
        fd = self.proc.stdout.fileno()
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.stop()
                raise RuntimeError(f"server printed no READY line within {self.ready_timeout} s")
            chunk = os.read(fd, 256)
            if not chunk:
                code = self.proc.wait()
                raise RuntimeError(f"server exited with status {code} before READY: "
                                   f"{self.stderr_tail()}")
            line += chunk
        if line.decode().strip() != f"READY {self.socket_path}":
            self.stop()
            raise RuntimeError(f"server said {line!r}, expected READY {self.socket_path}")
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_status(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stderr_tail(self, limit: int = 3000) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace")
        return text[-limit:]

    def maps(self) -> str:
        with open(f"/proc/{self.pid}/maps") as f:
            return f.read()

    def fd_targets(self) -> list[str]:
        out = []
        base = f"/proc/{self.pid}/fd"
        for name in os.listdir(base):
            try:
                out.append(os.readlink(f"{base}/{name}"))
            except OSError:
                pass
        return out

    def holds(self, memfd_name: str) -> bool:
        """Whether the server still has the memfd named so open or mapped."""
        needle = f"/memfd:{memfd_name}"
        names = {needle, needle + " (deleted)"}
        return (any(t in names for t in self.fd_targets())
                or any(line.rstrip().endswith(tuple(names)) for line in self.maps().splitlines()))

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        code = self.proc.returncode
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        return code
