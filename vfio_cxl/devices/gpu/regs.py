"""Register map of the vfio-cxl GPU, as Python (docs/gpu-device.md is the contract).

The device model (``vfio_cxl.devices.gpu``) and the guest driver both import
this module, so it imports the standard library only and runs on any
Python >= 3.11 (the guest has 3.13).  docs/gpu-device.md is the contract;
this module writes its numbers down as Python.  If the two disagree, one has
a bug and both are fixed together.

Conventions: all registers are 32 bits, little-endian; 64-bit quantities are
split into ``*_LO`` / ``*_HI`` pairs (an aligned 64-bit access to the pair
works too).  Descriptors and completion records are little-endian structs
in guest memory, addressed by IOVA.
"""

from __future__ import annotations

import hashlib
import struct
from enum import IntEnum

# --------------------------------------------------------------------------
# PCI identity
# --------------------------------------------------------------------------
PCI_VENDOR_ID = 0x0601
PCI_DEVICE_ID = 0x1991
PCI_SUBSYSTEM_VENDOR_ID = 0x0601
PCI_SUBSYSTEM_ID = 0x0001
PCI_REVISION = 0x01
PCI_CLASS_CODE = 0x030200  # base 0x03 display, sub 0x02 "3D controller", prog-if 0

# --------------------------------------------------------------------------
# BARs
# --------------------------------------------------------------------------
BAR_REGS = 0  # 4 KiB, 32-bit, non-prefetchable: the registers below (trapped)
BAR_VRAM = 2  # 64-bit prefetchable VRAM (BAR2+BAR3), mmappable, direct CPU access
BAR_MSIX = 4  # 4 KiB, 32-bit: MSI-X table and PBA

REGS_SIZE = 0x1000
MSIX_BAR_SIZE = 0x1000
MSIX_TABLE_OFFSET = 0x000
MSIX_PBA_OFFSET = 0x800
MSIX_ENTRY_SIZE = 16

MIB = 1 << 20
DEFAULT_VRAM_SIZE = 64 * MIB
MIN_VRAM_SIZE = 1 * MIB
MAX_VRAM_SIZE = 4096 * MIB  # must be a power of two (it is a BAR)

# --------------------------------------------------------------------------
# MSI-X vectors
# --------------------------------------------------------------------------
MSIX_VECTORS = 4
MSI_VECTORS = 4  # with --irq-mode msi: MSI capability (Multiple Message Capable 4), no BAR4
VEC_DMA_DONE = 0  # a descriptor with DESC_FLAG_INTERRUPT completed OK
VEC_ERROR = 1  # the ring halted on an error (ERR_* registers say why)
VEC_SPARE0 = 2  # reserved, never raised
VEC_SPARE1 = 3  # reserved, never raised

# --------------------------------------------------------------------------
# BAR0 registers (offset -> meaning).  RO = read-only, RW = read/write,
# W1C = write 1 to clear.  Writes to RO or unassigned offsets are ignored;
# unassigned offsets read 0.
# --------------------------------------------------------------------------
REG_ID = 0x000  # RO  ID_MAGIC
REG_VERSION = 0x004  # RO  DEVICE_VERSION (major << 16 | minor)
REG_VRAM_SIZE_LO = 0x008  # RO  VRAM size in bytes, low 32 bits
REG_VRAM_SIZE_HI = 0x00C  # RO  VRAM size in bytes, high 32 bits
REG_CAPS = 0x010  # RO  bit n set = op code n supported (CAPS_OPS)
REG_RING_MAX = 0x014  # RO  largest RING_SIZE accepted (RING_SIZE_MAX)
REG_SCRATCH = 0x018  # RW  free for the driver (probe that writes land)

REG_CONTROL = 0x020  # RW  CONTROL_* bits (see the engine states in the spec)
REG_STATUS = 0x024  # RO  STATUS_* bits
REG_INTR_STATUS = 0x028  # W1C INTR_* bits, latched when a vector is raised

REG_RING_BASE_LO = 0x040  # RW  descriptor ring IOVA (DESC_ALIGN-aligned)
REG_RING_BASE_HI = 0x044  # RW
REG_RING_SIZE = 0x048  # RW  entries, power of two in [RING_SIZE_MIN, RING_SIZE_MAX]
REG_RING_HEAD = 0x04C  # RO  next descriptor index the device will execute
REG_RING_TAIL = 0x050  # RW  doorbell: index one past the last ready descriptor
REG_COMPL_BASE_LO = 0x058  # RW  completion area IOVA (COMPL_ALIGN-aligned)
REG_COMPL_BASE_HI = 0x05C  # RW
REG_COMPLETED = 0x060  # RO  descriptors retired OK since reset (wraps at 2**32)

REG_ERR_STATUS = 0x080  # RO  Status of the error that halted the ring (0 = none)
REG_ERR_DESC_INDEX = 0x084  # RO  ring index of the failing descriptor
REG_ERR_ADDR_LO = 0x088  # RO  failing IOVA / VRAM offset / tail value
REG_ERR_ADDR_HI = 0x08C  # RO
REG_ERR_ERRNO = 0x090  # RO  errno from the client's DMA error reply, else 0

REG_P2P_CONTROL = 0x0A0  # RW  P2P_* bits (peer fast path, docs/gpu-device.md "P2P")
REG_P2P_PEER_KIB = 0x0A4  # RO  KiB moved by the peer fast path since connect (wraps)
REG_P2P_PROOFS = 0x0A8  # RO  peer mappings proven since connect (wraps)

# Interface 1.2 (docs/gpu-device.md "Peer MMIO and GPU-initiated NVMe I/O"): 0x200-0x27F
REG_MSGWIN_BASE_LO = 0x200  # RW  message window: IOVAs reached by DMA_READ/DMA_WRITE messages
REG_MSGWIN_BASE_HI = 0x204  # RW
REG_MSGWIN_SIZE_LO = 0x208  # RW  bytes; 0 = no window
REG_MSGWIN_SIZE_HI = 0x20C  # RW
REG_MSGWIN_WRITES = 0x210  # RO  DMA_WRITE messages sent into the window since connect (wraps)
REG_MSGWIN_READS = 0x214  # RO  DMA_READ messages sent into the window since connect (wraps)

ID_MAGIC = 0x31555047  # b"GPU1" read as a little-endian u32
DEVICE_VERSION = 0x00010002  # 1.2 (1.0 plus the message window and NVME_IO; a 1.0 driver works)

# REG_CONTROL bits
CONTROL_ENABLE = 1 << 0  # run the ring (IDLE -> RUNNING); ring registers writable only in IDLE
CONTROL_RESET = 1 << 1  # write 1: reset the device (-> IDLE, no vector); reads back 0

# REG_P2P_CONTROL bits
P2P_FAST_DISABLE = 1 << 0  # 1: never use the peer fast path (all peer DMA as messages)

# REG_STATUS bits
STATUS_ENABLED = 1 << 0  # state RUNNING
STATUS_BUSY = 1 << 1  # executing a descriptor right now
STATUS_HALTED = 1 << 2  # state HALTED: stopped on an error until reset

# REG_INTR_STATUS bits
INTR_DMA_DONE = 1 << 0
INTR_ERROR = 1 << 1

RING_SIZE_MIN = 2
RING_SIZE_MAX = 65536

# --------------------------------------------------------------------------
# Descriptors (in guest memory, RING_BASE + index * DESC_SIZE)
# --------------------------------------------------------------------------
#   u64 src     VRAM offset / source IOVA / fill pattern / PRNG seed (see Op)
#   u64 dst     destination IOVA or VRAM offset
#   u32 length  bytes
#   u8  op      Op
#   u8  flags   DESC_FLAG_*; undefined bits must be 0
#   u16 reserved (0)
#   u64 cookie  copied verbatim into the completion record
DESC = struct.Struct("<QQIBBHQ")
DESC_SIZE = DESC.size  # 32
DESC_ALIGN = DESC_SIZE

DESC_FLAG_INTERRUPT = 1 << 0  # raise VEC_DMA_DONE when this descriptor completes OK
DESC_FLAGS_VALID = DESC_FLAG_INTERRUPT


class Op(IntEnum):
    NOP = 0  # nothing moves; completes with bytes_done 0
    VRAM_TO_HOST = 1  # src = VRAM offset, dst = IOVA
    HOST_TO_VRAM = 2  # src = IOVA, dst = VRAM offset
    FILL_PATTERN = 3  # src = u64 pattern (its 8 LE bytes repeated), dst = VRAM offset
    FILL_PRNG = 4  # src = u64 seed (prng_bytes stream from 0), dst = VRAM offset
    HOST_TO_HOST = 5  # src = IOVA, dst = IOVA: a copy in host memory through the device (no VRAM)
    NVME_IO = 16  # src = VRAM offset of an NVMe queue block, dst = VRAM offset of requests, length = count


CAPS_OPS = sum(1 << op for op in Op)
HOST_COPY_CHUNK = 1 * MIB  # HOST_TO_HOST moves its bytes front to back in pieces of this size

# --------------------------------------------------------------------------
# Completion records (in guest memory, COMPL_BASE + index * COMPL_SIZE)
# --------------------------------------------------------------------------
#   u64 cookie       from the descriptor
#   u32 status       Status
#   u32 bytes_done   bytes moved before completion or failure
#   u32 index        ring index of the descriptor
#   u32 seq          COMPLETED after this descriptor retired (never 0);
#                    on failure COMPLETED + 1 (the descriptor did not retire)
#   u64 duration_ns  time the device spent executing the descriptor
COMPL = struct.Struct("<QIIIIQ")
COMPL_SIZE = COMPL.size  # 32
COMPL_ALIGN = COMPL_SIZE


class Status(IntEnum):
    OK = 0
    BAD_OPCODE = 1  # op not in Op
    BAD_FLAGS = 2  # undefined flag or reserved bits set
    VRAM_RANGE = 3  # VRAM offset + length beyond VRAM (ERR_ADDR = VRAM offset)
    DMA_UNMAPPED = 4  # IOVA range not (fully) covered by DMA_MAP (ERR_ADDR = first uncovered IOVA)
    DMA_PERMISSION = 5  # mapping lacks read (or write) permission (ERR_ADDR = IOVA)
    DMA_REFUSED = 6  # the client answered a DMA message with an error (ERR_ERRNO = its errno)
    DMA_TIMEOUT = 7  # the client did not answer a DMA message in time (ERR_ERRNO = ETIMEDOUT)
    DMA_ABORTED = 8  # client gone with work queued (ECONNRESET) or device failure (EIO)
    RING_FETCH = 9  # descriptor fetch failed (ERR_ADDR = IOVA)
    COMPLETION_WRITE = 10  # the completion record could not be written (ERR_ADDR = IOVA)
    BAD_TAIL = 11  # doorbell value >= RING_SIZE (ERR_ADDR = value written)
    BAD_RING_CONFIG = 12  # ENABLE with bad RING_SIZE / unaligned bases (ERR_ADDR = RING_BASE)
    DMA_IO_ERROR = 13  # memory behind a mapping not accessible, e.g. truncated file (EFAULT)
    QUEUE_TIMEOUT = 16  # NVME_IO: no completion within the queue block's timeout (ERR_ADDR = request's VRAM offset)
    BAD_QUEUE = 17  # NVME_IO: bad queue block, request or completion entry (ERR_ADDR = its VRAM offset)


# --------------------------------------------------------------------------
# NVME_IO (interface 1.2): an NVMe queue pair in VRAM, driven by the device
# --------------------------------------------------------------------------
#   Queue block (64 bytes at VRAM offset src; the device writes sq_tail, cq_head, phase back):
#   u64 sq_offset     VRAM offset of the submission queue (entries x 64 bytes)
#   u64 cq_offset     VRAM offset of the completion queue (entries x 16 bytes)
#   u64 sq_doorbell   IOVA of the SQ tail doorbell (inside the message window)
#   u64 cq_doorbell   IOVA of the CQ head doorbell
#   u16 entries       queue size the NVMe queue was created with, 2..NVME_MAX_ENTRIES
#   u16 depth         commands in flight at most, 1..min(NVME_MAX_DEPTH, entries - 1)
#   u32 nsid
#   u16 sq_tail, u16 cq_head, u8 phase (1 for a new queue): where the queue stands
#   u8  lba_shift     log2 of the namespace's block size, 9..12
#   u16 reserved
#   u32 timeout_ms    longest wait for a completion (0: NVME_DEFAULT_TIMEOUT_MS)
#   u32 reserved, u64 reserved
NVME_QUEUE = struct.Struct("<QQQQHHIHHBBHIIQ")
NVME_QUEUE_SIZE = NVME_QUEUE.size  # 64
#   Request (32 bytes each at VRAM offset dst):
#   u8  opcode        NVMe I/O opcode: 1 Write, 2 Read
#   u8  flags (0)
#   u16 status        out: NVMe status (SCT << 8 | SC), 0 = success; NVME_REQ_PENDING until completed
#   u32 length        bytes, a whole number of blocks
#   u64 slba          starting block
#   u64 data_iova     the data buffer as the NVMe controller reaches it (e.g. VRAM through its IOMMU)
#   u32 result        out: completion dword 0
#   u32 latency_us    out: doorbell to completion seen
NVME_REQUEST = struct.Struct("<BBHIQQII")
NVME_REQUEST_SIZE = NVME_REQUEST.size  # 32
NVME_MAX_ENTRIES = 4096
NVME_MAX_DEPTH = 64
NVME_MAX_REQUESTS = 65535  # the request index is the command identifier
NVME_DEFAULT_TIMEOUT_MS = 10000
NVME_REQ_PENDING = 0xFFFF


def pack_nvme_queue(sq_offset: int, cq_offset: int, sq_doorbell: int, cq_doorbell: int, entries: int,
                    depth: int, nsid: int, lba_shift: int, *, sq_tail: int = 0, cq_head: int = 0, phase: int = 1,
                    timeout_ms: int = 0) -> bytes:
    return NVME_QUEUE.pack(sq_offset, cq_offset, sq_doorbell, cq_doorbell, entries, depth, nsid, sq_tail, cq_head,
                           phase, lba_shift, 0, timeout_ms, 0, 0)


def pack_nvme_request(opcode: int, slba: int, length: int, data_iova: int) -> bytes:
    return NVME_REQUEST.pack(opcode, 0, NVME_REQ_PENDING, length, slba, data_iova, 0, 0)


# --------------------------------------------------------------------------
# Reset values (offset -> value).  VRAM_SIZE depends on the configured VRAM.
# --------------------------------------------------------------------------
def reset_values(vram_size: int = DEFAULT_VRAM_SIZE) -> dict[int, int]:
    """Every defined register's value after reset."""
    values = {
        REG_ID: ID_MAGIC,
        REG_VERSION: DEVICE_VERSION,
        REG_VRAM_SIZE_LO: vram_size & 0xFFFFFFFF,
        REG_VRAM_SIZE_HI: vram_size >> 32,
        REG_CAPS: CAPS_OPS,
        REG_RING_MAX: RING_SIZE_MAX,
    }
    for reg in (
        REG_SCRATCH, REG_CONTROL, REG_STATUS, REG_INTR_STATUS,
        REG_RING_BASE_LO, REG_RING_BASE_HI, REG_RING_SIZE, REG_RING_HEAD,
        REG_RING_TAIL, REG_COMPL_BASE_LO, REG_COMPL_BASE_HI, REG_COMPLETED,
        REG_ERR_STATUS, REG_ERR_DESC_INDEX, REG_ERR_ADDR_LO, REG_ERR_ADDR_HI,
        REG_ERR_ERRNO, REG_P2P_CONTROL, REG_P2P_PEER_KIB, REG_P2P_PROOFS,
        REG_MSGWIN_BASE_LO, REG_MSGWIN_BASE_HI, REG_MSGWIN_SIZE_LO, REG_MSGWIN_SIZE_HI,
        REG_MSGWIN_WRITES, REG_MSGWIN_READS,
    ):
        values[reg] = 0
    return values


# --------------------------------------------------------------------------
# Data generators the device uses and the driver verifies with
# --------------------------------------------------------------------------
PRNG_BLOCK = 1 * MIB


def prng_bytes(seed: int, length: int, offset: int = 0) -> bytes:
    """Bytes ``offset .. offset+length`` of the FILL_PRNG stream for ``seed``.

    The stream is 1 MiB blocks; block k is
    ``shake_128(seed.to_bytes(8, "little") + k.to_bytes(8, "little")).digest(PRNG_BLOCK)``.
    Blocks make any sub-range cheap to regenerate (a verifier need not start
    at 0) and keep memory bounded; SHAKE is C code in hashlib, ~200-350 MB/s.
    """
    if length <= 0:
        return b""
    key = (seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    out = []
    pos, end = offset, offset + length
    while pos < end:
        block, start = divmod(pos, PRNG_BLOCK)
        stop = min(PRNG_BLOCK, start + (end - pos))
        # SHAKE output is a prefix stream: digest(stop) needs no more work than required.
        digest = hashlib.shake_128(key + block.to_bytes(8, "little")).digest(stop)
        out.append(digest[start:] if start else digest)
        pos += stop - start
    return out[0] if len(out) == 1 else b"".join(out)


def prng_mismatch(data, seed: int, offset: int = 0) -> int:
    """Index of the first byte of ``data`` that differs from the stream, or -1."""
    view = memoryview(data).cast("B")
    pos = 0
    while pos < len(view):
        n = min(PRNG_BLOCK - (offset + pos) % PRNG_BLOCK, len(view) - pos)
        want = prng_bytes(seed, n, offset + pos)
        if view[pos:pos + n] != want:
            got = bytes(view[pos:pos + n])
            return pos + next(i for i in range(n) if got[i] != want[i])
        pos += n
    return -1


def pattern_bytes(pattern: int, length: int) -> bytes:
    """What FILL_PATTERN writes: the pattern's 8 little-endian bytes repeated."""
    unit = (pattern & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    return (unit * (length // 8 + 1))[:length]


def pack_descriptor(op: int, src: int, dst: int, length: int,
                    flags: int = 0, cookie: int = 0) -> bytes:
    """One ring entry, ready to store at RING_BASE + index * DESC_SIZE."""
    return DESC.pack(src, dst, length, op, flags, 0, cookie)


def unpack_completion(raw) -> dict:
    """A completion record as a dict (status as Status when it is known)."""
    cookie, status, bytes_done, index, seq, duration_ns = COMPL.unpack(raw)
    try:
        status = Status(status)
    except ValueError:
        pass
    return {"cookie": cookie, "status": status, "bytes_done": bytes_done,
            "index": index, "seq": seq, "duration_ns": duration_ns}
