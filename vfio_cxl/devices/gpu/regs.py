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
VEC_FAULT = 2  # interface 1.1: a compute op stopped on a replayable fault (docs/gpu-device.md)
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
DEVICE_VERSION = 0x00010007  # 1.7: 1.0 plus far memory and compute (1.1), the message window and NVME_IO (1.2), an NVME_IO SQ in a peer's memory (1.3), 1.1's error values, copy engine and fault seq pinned down (1.4), unmapped DMA reported to the client's vIOMMU (1.5), fault batches, UVM counters and GEMV (1.6), FAR_SIZE bounded (1.7); a 1.0 driver works unchanged

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
INTR_FAULT = 1 << 2  # interface 1.1: VEC_FAULT was raised

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
    # interface 1.1: far memory and compute (docs/gpu-device.md, "Far memory and compute")
    COMPUTE = 6  # src = IOVA of a KERNEL_PARAMS block, length = KERNEL_PARAMS.size; dst must be 0
    FLUSH = 7  # drain the DS backlog into the far window; src, dst, length must be 0
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
    DMA_ABORTED = 8  # client gone with work queued (ECONNRESET) or device failure (EIO); MIG_STATUS: no BME, or dropped
    RING_FETCH = 9  # descriptor fetch failed (ERR_ADDR = IOVA)
    COMPLETION_WRITE = 10  # the completion record could not be written (ERR_ADDR = IOVA)
    BAD_TAIL = 11  # doorbell value >= RING_SIZE (ERR_ADDR = value written)
    BAD_RING_CONFIG = 12  # ENABLE with bad RING_SIZE / unaligned bases (ERR_ADDR = RING_BASE)
    DMA_IO_ERROR = 13  # memory behind a mapping not accessible, e.g. truncated file (EFAULT)
    QUEUE_TIMEOUT = 16  # NVME_IO: no completion within the queue block's timeout (ERR_ADDR = request's VRAM offset)
    BAD_QUEUE = 17  # NVME_IO: bad queue block, request or completion entry (ERR_ADDR = its VRAM offset)
    # interface 1.1 (far memory and compute)
    BAD_KERNEL = 24  # bad COMPUTE/FLUSH descriptor or kernel parameter (ERR_ADDR = the bad value), bad index data (= its position)
    FAR_RANGE = 25  # no far window, or an operand outside it / VRAM (ERR_ADDR = device address)
    FAULT_TIMEOUT = 26  # a replayable fault was not replayed within UVM_FAULT_TIMEOUT_MS (ERR_ADDR = address)
    FAULT_CANCELLED = 27  # the driver cancelled the faulting op (UVM_CONTROL.CANCEL)
    BAD_MODE = 28  # MEM_MODE combines UVM with SR/DS, or a bad SR/DS parameter (ERR_ADDR = that register's value)


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
#   u16 flags         1.3: NVME_QUEUE_SQ_PEER; other bits 0 (1.2: reserved, 0)
#   u32 timeout_ms    longest wait for a completion (0: NVME_DEFAULT_TIMEOUT_MS)
#   u32 reserved, u64 reserved
NVME_QUEUE = struct.Struct("<QQQQHHIHHBBHIIQ")
NVME_QUEUE_SIZE = NVME_QUEUE.size  # 64
NVME_QUEUE_SQ_PEER = 1 << 0  # 1.3: sq_offset is the SQ's IOVA (e.g. an NVMe CMB), written by DMA, not a VRAM offset
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
                    timeout_ms: int = 0, flags: int = 0) -> bytes:
    return NVME_QUEUE.pack(sq_offset, cq_offset, sq_doorbell, cq_doorbell, entries, depth, nsid, sq_tail, cq_head,
                           phase, lba_shift, flags, timeout_ms, 0, 0)


def pack_nvme_request(opcode: int, slba: int, length: int, data_iova: int) -> bytes:
    return NVME_REQUEST.pack(opcode, 0, NVME_REQ_PENDING, length, slba, data_iova, 0, 0)


# --------------------------------------------------------------------------
# Interface 1.1: far memory, compute, memory modes, UVM fault path, counters
# (BAR0 0x100-0x1FF; docs/gpu-device.md "Far memory and compute", docs/gpu-memory.md)
# --------------------------------------------------------------------------
FARMEM_FIRST, FARMEM_LAST = 0x100, 0x1FF
REG_FAR_BASE_LO = 0x100  # RW* far window IOVA (4 KiB aligned); * writable only while no op runs
REG_FAR_BASE_HI = 0x104  # RW*
REG_FAR_SIZE_LO = 0x108  # RW* far window bytes (multiple of 4 KiB); 0 = no far window
REG_FAR_SIZE_HI = 0x10C  # RW*
REG_MEM_MODE = 0x110  # RW  MODE_* bits; 0 = cxl (direct far access at line granularity)
REG_LATENCY_PROFILE = 0x114  # RW  index into LATENCY_PROFILES
REG_SR_DEGREE = 0x118  # RW  speculative reads per trained access (1..SR_MAX_DEGREE)
REG_SR_DISTANCE = 0x11C  # RW  strides ahead (degree + distance <= SR_BUFFER_LINES)
REG_DS_BACKLOG_LINES = 0x120  # RW  DS backlog bound, lines (1..DS_MAX_BACKLOG_LINES)
REG_DS_STAGE_BASE = 0x124  # RW  VRAM offset of the DS staging area (64-byte aligned)
REG_UVM_PAGE_SHIFT = 0x128  # RW  page (= migration unit) size: 12, 16 or 21; a write clears the page table
REG_UVM_FAULT_TIMEOUT_MS = 0x12C  # RW  a fault not replayed in time fails the op (FAULT_TIMEOUT)
REG_FAULT_BASE_LO = 0x130  # RW  fault buffer IOVA (16-byte records, FAULT_RECORD)
REG_FAULT_BASE_HI = 0x134  # RW
REG_FAULT_ENTRIES = 0x138  # RW  fault buffer records, power of two in [2, 4096]
REG_FAULT_PUT = 0x13C  # RO  index of the next record the device writes
REG_FAULT_GET = 0x140  # RW  index of the next record the driver reads
REG_UVM_CONTROL = 0x144  # W   UVM_REPLAY / UVM_CANCEL | seq << 8 (of the newest record handled); reads 0
REG_UVM_STATUS = 0x148  # RO  UVM_FAULT_PENDING while a compute op waits for a replay
REG_PT_INDEX = 0x14C  # RW  far page number the PT_ENTRY register shows
REG_PT_ENTRY = 0x150  # RW  PTE_* of that page: VRAM offset | DIRTY | VALID
REG_MIG_SRC_LO = 0x154  # RW  migration source: device address (FAR_DEVADDR + offset, or VRAM offset)
REG_MIG_SRC_HI = 0x158  # RW
REG_MIG_DST_LO = 0x15C  # RW  migration destination: device address (one side VRAM, the other far)
REG_MIG_DST_HI = 0x160  # RW
REG_MIG_LENGTH = 0x164  # RW  bytes, a nonzero multiple of 64 (else a GO fails at once: FAR_RANGE)
REG_MIG_CONTROL = 0x168  # W   MIG_GO | tag << 8 starts the copy engine (a tag unlike the last one); reads 0
REG_MIG_STATUS = 0x16C  # RO  MIG_BUSY (set by an accepted GO at once) / MIG_DONE / MIG_ERROR, bits 8-15 the Status of an error
REG_DS_PENDING_LINES = 0x170  # RO  lines staged by DS and not yet in the far window
REG_UVM_FAULT_AHEAD = 0x174  # RW  1.6: lines of the access stream resolved per stop (the warps in flight); 0 = one fault per stop
REG_COUNTER_CONTROL = 0x178  # W   COUNTERS_CLEAR; reads 0
REG_CAPS2 = 0x17C  # RO  CAPS2_* feature bits
REG_COUNTERS = 0x180  # RO  16 u64 counters (COUNTERS), _LO at 0x180 + 8 * i, _HI at + 4
# interface 1.6: 0x280-0x28F, more u64 counters (COUNTERS2), _LO at 0x280 + 8 * i, _HI at + 4
FARMEM2_FIRST, FARMEM2_LAST = 0x280, 0x28F
REG_COUNTERS2 = 0x280

FAR_DEVADDR = 1 << 40  # device address of far window offset 0; below it: VRAM offsets
LINE_SIZE = 64
FAR_ALIGN = 4096
FAR_SIZE_MAX = 16 << 30  # 1.7: a write that would make FAR_SIZE larger is ignored (the page table is per page)

MODE_SR = 1 << 0  # speculative reads
MODE_DS = 1 << 1  # deterministic store
MODE_UVM = 1 << 2  # far pages reached only through the page table (replayable faults); alone
MODES = {"cxl": 0, "cxl+sr": MODE_SR, "cxl+ds": MODE_DS, "cxl+sr+ds": MODE_SR | MODE_DS,
         "uvm": MODE_UVM, "uvm-naive": MODE_UVM}  # the two uvm modes differ in the guest's pager
LATENCY_PROFILES = ("cxl-80ns", "cxl-250ns", "ssd")  # LATENCY_PROFILE register values 0, 1, 2

SR_BUFFER_LINES = 1024  # the SR buffer: 64 KiB
SR_MAX_DEGREE = 64
DS_MAX_BACKLOG_LINES = 1 << 16
UVM_PAGE_SHIFTS = (12, 16, 21)  # 4 KiB, 64 KiB, 2 MiB

UVM_REPLAY = 1 << 0  # the driver serviced the faults: the op retries the access
UVM_CANCEL = 1 << 1  # the op fails with FAULT_CANCELLED
UVM_FAULT_PENDING = 1 << 0
UVM_FAULT_OVERFLOW = 1 << 1  # 1.6: the pending stop had more faults than free records (they fault again)
PTE_VALID = 1 << 0
PTE_DIRTY = 1 << 1  # set by the device when a kernel writes the resident page
PTE_ADDR_MASK = 0xFFFFF000  # VRAM offset of the page (page-size aligned)
MIG_GO = 1 << 0
# Commands carry a tag (MIG_CONTROL) or the fault's seq (UVM_CONTROL) in bits 8-31, so a
# command delivered twice does nothing the second time: under TCG, QEMU 11.1 delivers a
# store through the mmapped BAR0 to the device twice (10 stores, 19 arrivals measured).
CMD_TAG_SHIFT = 8
CMD_TAG_MASK = 0xFFFFFF
MIG_BUSY, MIG_DONE, MIG_ERROR = 1 << 0, 1 << 1, 1 << 2
COUNTERS_CLEAR = 1 << 0
CAPS2_FAR = 1 << 0
CAPS2_SR = 1 << 1
CAPS2_DS = 1 << 2
CAPS2_UVM = 1 << 3
CAPS2 = CAPS2_FAR | CAPS2_SR | CAPS2_DS | CAPS2_UVM

# fault record (FAULT_BASE + 16 * index): u64 device address, u32 flags (FAULT_WRITE), u32 seq (from 1 since
# the last reset: only a reset restarts it; never 0)
FAULT_RECORD = struct.Struct("<QII")
FAULT_WRITE = 1 << 0

# the counters, in register order (index i at REG_COUNTERS + 8 * i)
COUNTERS = (
    "far_lines_read", "far_lines_written", "vram_lines",
    "sr_issued", "sr_hits", "sr_late", "sr_wasted", "sr_throttled",
    "ds_staged", "ds_stalls", "ds_backlog_hwm",
    "faults", "migrations", "evictions", "bytes_migrated",
    "modelled_ns",  # the model's time for the counts above (docs/gpu-memory.md)
)
# interface 1.6 (index i at REG_COUNTERS2 + 8 * i); modelled_ns counts them too
COUNTERS2 = (
    "fault_batches",  # stops on a replayable fault: each one fault interrupt and one replay
    "prefetched_bytes",  # far -> VRAM migration bytes, during a stop, of pages it has no record for
)


def counter_reg(name: str) -> int:
    """The _LO register of counter ``name`` (COUNTERS or COUNTERS2)."""
    if name in COUNTERS2:
        return REG_COUNTERS2 + 8 * COUNTERS2.index(name)
    return REG_COUNTERS + 8 * COUNTERS.index(name)


class Kernel(IntEnum):
    """KERNEL_PARAMS.kernel.  Operands are device addresses; elements u64, indices u32."""
    STREAM = 1  # result = sum of n u64 at a (mod 2**64)
    COPY = 2  # b[i] = a[i], i < n
    STENCIL = 3  # b[i] = a[i-1] + a[i] + a[i+1] (mod 2**64; a[-1] = a[n] = 0)
    GATHER = 4  # b[i] = a[idx[i]], i < n; every idx < aux (the table's length)
    SCATTER = 5  # a[idx[i]] += 1, i < n (duplicates add up); every idx < aux
    BFS = 6  # CSR graph: a = row_ptr (u64, n + 1), idx = column (u32, aux edges), b = level (u32, n);
    #          arg = source vertex; level = hops from it, 0xFFFFFFFF unreached; result = vertices reached
    GEMV = 7  # 1.6: LLM decoding: a = W (u64, n x n, row-major), idx = x (u64, n), b = y (u64, n);
    #          arg = tokens (>= 1): token t computes y = W x_t, x_0 = x, x_(t+1) = y; result = sum of the last y


KERNELS = {k.name.lower(): k for k in Kernel}
# u32 kernel, u32 reserved (0), u64 n, a, b, idx, aux, arg, u64 result (written back by the device)
KERNEL_PARAMS = struct.Struct("<IIQQQQQQQ")
KERNEL_RESULT_OFFSET = KERNEL_PARAMS.size - 8


def pack_kernel(kernel: int, n: int, a: int = 0, b: int = 0, idx: int = 0, aux: int = 0,
                arg: int = 0) -> bytes:
    return KERNEL_PARAMS.pack(kernel, 0, n, a, b, idx, aux, arg, 0)


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
    # interface 1.1 (far memory and compute)
    values.update(dict.fromkeys(
        (REG_FAR_BASE_LO, REG_FAR_BASE_HI, REG_FAR_SIZE_LO, REG_FAR_SIZE_HI, REG_MEM_MODE,
         REG_LATENCY_PROFILE, REG_FAULT_BASE_LO, REG_FAULT_BASE_HI, REG_FAULT_ENTRIES,
         REG_FAULT_PUT, REG_FAULT_GET, REG_UVM_CONTROL, REG_UVM_STATUS, REG_PT_INDEX,
         REG_PT_ENTRY, REG_MIG_SRC_LO, REG_MIG_SRC_HI, REG_MIG_DST_LO, REG_MIG_DST_HI,
         REG_MIG_LENGTH, REG_MIG_CONTROL, REG_MIG_STATUS, REG_DS_PENDING_LINES,
         REG_COUNTER_CONTROL, REG_COUNTERS, REG_UVM_FAULT_AHEAD, REG_COUNTERS2), 0))
    values.update({
        REG_SR_DEGREE: 8, REG_SR_DISTANCE: 128, REG_DS_BACKLOG_LINES: 4096,
        REG_DS_STAGE_BASE: max(0, vram_size - 4096 * LINE_SIZE), REG_UVM_PAGE_SHIFT: 16,
        REG_UVM_FAULT_TIMEOUT_MS: 5000, REG_CAPS2: CAPS2,
    })
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
    import hashlib   # here: the guest's commands import this map, and most never call this

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
