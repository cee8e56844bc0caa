"""vfio-user wire format: header, command numbers, payload layouts.

Facts from the vfio-user protocol specification and linux/vfio.h, checked
against QEMU 11.1's client (docs/gpu-device.md lists its quirks).  Everything is
little-endian (the spec says host order; x86 only here) and packed.
"""

from __future__ import annotations

import errno
import json
import struct
from dataclasses import dataclass

from ... import vfio_abi as abi

# ---------------------------------------------------------------- header
HEADER = struct.Struct("<HHIII")  # msg_id, command, size (incl. header), flags, error
HEADER_SIZE = HEADER.size  # 16

FLAG_TYPE_MASK = 0x0F
TYPE_REQUEST = 0x0
TYPE_REPLY = 0x1
FLAG_NO_REPLY = 0x10
FLAG_ERROR = 0x20

# ---------------------------------------------------------------- commands
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

COMMAND_NAMES = {
    VERSION: "VERSION", DMA_MAP: "DMA_MAP", DMA_UNMAP: "DMA_UNMAP",
    DEVICE_GET_INFO: "DEVICE_GET_INFO", DEVICE_GET_REGION_INFO: "GET_REGION_INFO",
    DEVICE_GET_REGION_IO_FDS: "GET_REGION_IO_FDS", DEVICE_GET_IRQ_INFO: "GET_IRQ_INFO",
    DEVICE_SET_IRQS: "SET_IRQS", REGION_READ: "REGION_READ", REGION_WRITE: "REGION_WRITE",
    DMA_READ: "DMA_READ", DMA_WRITE: "DMA_WRITE", DEVICE_RESET: "DEVICE_RESET",
    REGION_WRITE_MULTI: "REGION_WRITE_MULTI", DEVICE_FEATURE: "DEVICE_FEATURE",
    MIG_DATA_READ: "MIG_DATA_READ", MIG_DATA_WRITE: "MIG_DATA_WRITE",
}

# ---------------------------------------------------------------- payloads
VERSION_HEAD = struct.Struct("<HH")  # major, minor; then JSON capabilities + NUL
DMA_MAP_REQ = struct.Struct("<IIQQQ")  # argsz, flags, offset, addr, size
DMA_UNMAP_REQ = abi.VFIO_IOMMU_TYPE1_DMA_UNMAP_HEAD  # argsz, flags, addr, size
# vfio-user reuses the kernel's VFIO structs and flags: defined once, in vfio_abi
DEVICE_INFO = abi.VFIO_DEVICE_INFO_HEAD  # argsz, flags, num_regions, num_irqs
REGION_INFO = abi.VFIO_REGION_INFO  # argsz, flags, index, cap_offset, size, offset
CAP_HEADER = abi.VFIO_INFO_CAP_HEADER  # id, version, next (offset from start of region info)
SPARSE_MMAP = struct.Struct("<II")  # nr_areas, reserved: the sparse-mmap cap after CAP_HEADER
SPARSE_AREA = abi.VFIO_REGION_SPARSE_MMAP_AREA  # offset, size
IRQ_INFO = abi.VFIO_IRQ_INFO  # argsz, flags, index, count
IRQ_SET = abi.VFIO_IRQ_SET_HEAD  # argsz, flags, index, start, count; then data
REGION_ACCESS = struct.Struct("<QII")  # offset, region, count; then data
DMA_ACCESS = struct.Struct("<QQ")  # address, count; then data (count is u64 since QEMU 10.1+)

DEVICE_FLAGS_RESET = abi.VFIO_DEVICE_FLAGS_RESET
DEVICE_FLAGS_PCI = abi.VFIO_DEVICE_FLAGS_PCI

REGION_INFO_FLAG_READ = abi.VFIO_REGION_INFO_FLAG_READ
REGION_INFO_FLAG_WRITE = abi.VFIO_REGION_INFO_FLAG_WRITE
REGION_INFO_FLAG_MMAP = abi.VFIO_REGION_INFO_FLAG_MMAP
REGION_INFO_FLAG_CAPS = abi.VFIO_REGION_INFO_FLAG_CAPS
REGION_INFO_CAP_SPARSE_MMAP = abi.VFIO_REGION_INFO_CAP_SPARSE_MMAP

IRQ_INFO_EVENTFD = abi.VFIO_IRQ_INFO_EVENTFD
IRQ_INFO_MASKABLE = abi.VFIO_IRQ_INFO_MASKABLE
IRQ_INFO_AUTOMASKED = abi.VFIO_IRQ_INFO_AUTOMASKED
IRQ_INFO_NORESIZE = abi.VFIO_IRQ_INFO_NORESIZE

IRQ_SET_DATA_NONE = abi.VFIO_IRQ_SET_DATA_NONE
IRQ_SET_DATA_BOOL = abi.VFIO_IRQ_SET_DATA_BOOL
IRQ_SET_DATA_EVENTFD = abi.VFIO_IRQ_SET_DATA_EVENTFD
IRQ_SET_ACTION_MASK = abi.VFIO_IRQ_SET_ACTION_MASK
IRQ_SET_ACTION_UNMASK = abi.VFIO_IRQ_SET_ACTION_UNMASK
IRQ_SET_ACTION_TRIGGER = abi.VFIO_IRQ_SET_ACTION_TRIGGER
IRQ_SET_DATA_MASK = IRQ_SET_DATA_NONE | IRQ_SET_DATA_BOOL | IRQ_SET_DATA_EVENTFD
IRQ_SET_ACTION_MASK_ALL = IRQ_SET_ACTION_MASK | IRQ_SET_ACTION_UNMASK | IRQ_SET_ACTION_TRIGGER

DMA_MAP_FLAG_READ = abi.VFIO_DMA_MAP_FLAG_READ
DMA_MAP_FLAG_WRITE = abi.VFIO_DMA_MAP_FLAG_WRITE
DMA_UNMAP_FLAG_GET_DIRTY_BITMAP = abi.VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP
DMA_UNMAP_FLAG_ALL = abi.VFIO_DMA_UNMAP_FLAG_ALL

# PCI region and IRQ indexes (enum vfio_pci_region_index / irq_index)
PCI_BAR0_REGION = abi.VFIO_PCI_BAR0_REGION_INDEX
PCI_ROM_REGION = abi.VFIO_PCI_ROM_REGION_INDEX
PCI_CONFIG_REGION = abi.VFIO_PCI_CONFIG_REGION_INDEX
PCI_VGA_REGION = abi.VFIO_PCI_VGA_REGION_INDEX
PCI_NUM_REGIONS = abi.VFIO_PCI_NUM_REGIONS

PCI_INTX_IRQ = abi.VFIO_PCI_INTX_IRQ_INDEX
PCI_MSI_IRQ = abi.VFIO_PCI_MSI_IRQ_INDEX
PCI_MSIX_IRQ = abi.VFIO_PCI_MSIX_IRQ_INDEX
PCI_ERR_IRQ = abi.VFIO_PCI_ERR_IRQ_INDEX
PCI_REQ_IRQ = abi.VFIO_PCI_REQ_IRQ_INDEX
PCI_NUM_IRQS = abi.VFIO_PCI_NUM_IRQS

# ---------------------------------------------------------------- limits
MAJOR_VERSION = 0
MINOR_VERSION = 0
DEFAULT_MAX_DATA_XFER = 1 << 20  # spec default when a peer does not say
SERVER_MAX_MSG_FDS = 8  # what we advertise; QEMU accepted it
DEFAULT_MAX_MSG_FDS = 1  # spec default when a peer does not say
SERVER_MAX_DATA_XFER = 1 << 20
DMA_PAGE_SIZE = 4096  # the spec's default pgsizes (we do not offer others)


class ProtocolError(Exception):
    """A request the server refuses; becomes an error reply carrying ``errno``."""

    def __init__(self, err: int, why: str, *, hang_up: bool = False):
        self.errno = err
        self.hang_up = hang_up  # the error reply is the last message: then close
        super().__init__(f"{errno.errorcode.get(err, err)}: {why}")


@dataclass(slots=True)
class Header:
    msg_id: int
    command: int
    size: int
    flags: int
    error: int = 0

    @classmethod
    def unpack(cls, raw) -> "Header":
        return cls(*HEADER.unpack(raw))

    def pack(self) -> bytes:
        return HEADER.pack(self.msg_id, self.command, self.size, self.flags, self.error)

    @property
    def msg_type(self) -> int:
        return self.flags & FLAG_TYPE_MASK

    @property
    def is_reply(self) -> bool:
        return self.msg_type == TYPE_REPLY

    @property
    def no_reply(self) -> bool:
        return bool(self.flags & FLAG_NO_REPLY)

    @property
    def is_error(self) -> bool:
        return bool(self.flags & FLAG_ERROR)

    def describe(self) -> str:
        name = COMMAND_NAMES.get(self.command, f"cmd{self.command}")
        return f"{name} id={self.msg_id} size={self.size} flags={self.flags:#x} err={self.error}"


def reply_header(request: Header, payload_size: int) -> bytes:
    return HEADER.pack(request.msg_id, request.command, HEADER_SIZE + payload_size,
                       TYPE_REPLY, 0)


def error_header(request: Header, err: int) -> bytes:
    return HEADER.pack(request.msg_id, request.command, HEADER_SIZE,
                       TYPE_REPLY | FLAG_ERROR, err)


def request_header(msg_id: int, command: int, payload_size: int, flags: int = 0) -> bytes:
    return HEADER.pack(msg_id & 0xFFFF, command, HEADER_SIZE + payload_size,
                       TYPE_REQUEST | (flags & ~FLAG_TYPE_MASK), 0)


def version_payload(major: int, minor: int, capabilities: dict) -> bytes:
    """VERSION body: major, minor, then JSON {"capabilities": ...} and a NUL (QEMU checks it)."""
    text = json.dumps({"capabilities": capabilities}, separators=(",", ":"))
    return VERSION_HEAD.pack(major, minor) + text.encode() + b"\0"


def parse_version(payload) -> tuple[int, int, dict]:
    """(major, minor, capabilities) of a VERSION body; ProtocolError if malformed."""
    if len(payload) < VERSION_HEAD.size:
        raise ProtocolError(errno.EINVAL, "VERSION payload shorter than 4 bytes")
    major, minor = VERSION_HEAD.unpack_from(payload)
    text = bytes(payload[VERSION_HEAD.size:]).split(b"\0", 1)[0]
    caps: dict = {}
    if text.strip():
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(errno.EINVAL, f"VERSION JSON unreadable: {exc}") from None
        if not isinstance(doc, dict):
            raise ProtocolError(errno.EINVAL, "VERSION JSON is not an object")
        caps = doc.get("capabilities", {})
        if not isinstance(caps, dict):
            raise ProtocolError(errno.EINVAL, "VERSION capabilities is not an object")
    return major, minor, caps
