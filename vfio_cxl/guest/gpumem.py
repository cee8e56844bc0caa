"""In the guest: GPU memory expanded over CXL (docs/gpu-memory.md).

    with GpuMemory.open() as mem:
        result = mem.run("stream", mode="cxl+sr", latency="cxl-80ns", working_set=8 << 20)

The data set lives in a CXL devdax region that the driver maps for the GPU (VFIO
MAP_DMA at FAR_IOVA) and announces in the far-window registers.  ``run`` lays the
kernel's operands out in the far window, fills the inputs (bulk data by the GPU:
FILL_PRNG into VRAM, VRAM_TO_HOST into the window; indices and graphs by the CPU),
starts one COMPUTE descriptor, and checks the result against its own computation
(plain Python: the guest has no numpy).

Mode ``uvm`` is the baseline: VRAM is a cache managed here, as NVIDIA's UVM driver
does it.  A kernel that touches a page not in the device's page table stops with
replayable faults (records in the fault buffer, MSI-X vector VEC_FAULT): one for each
non-resident page the warps in flight touch (``FAULT_AHEAD_LINES``).  ``UvmBatchPager``
reads them in batches, coalesces them per 2 MiB VA block, services each block once
(the faulted pages plus what the density prefetcher adds), evicts whole blocks LRU
(writing back the pages the device marked dirty) and replays once per batch; pages
move through the copy engine (the MIG_* registers: not the ring, where the compute op
waits).  Mode ``uvm-naive`` is the simplest driver: the GPU stops on each fault alone
and ``UvmPager`` migrates that one page (LRU over pages).

A pager is pluggable: ``GpuMemory.run(..., pager=MyPager)`` (or ``launch(layout,
pager)``) takes any object with ``service()`` and ``write_back()``, built as
``MyPager(gpu, faults, page_shift, vram_base, vram_cache)``; docs/guest-library.md,
"Your own pager", is its contract.  ``migrate`` is the copy engine for such a pager.
"""

from __future__ import annotations

import math
import mmap
import operator
import os
import time
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from ..devices.gpu import regs
from ..devices.gpu.regs import Kernel, Op
from . import cxl
from .dax import DaxMapping
from .drivers.gpu import GpuDriver, GpuError, Transfer
from .vfio.errors import InterruptTimeout

__all__ = ["GpuMemory", "UvmPager", "UvmBatchPager", "FaultBatch", "prefetch_region", "migrate", "Layout", "layout", "Verifier", "LruCache", "simulate_faults",
           "GpuMemError", "FAR_IOVA", "AUX_IOVA"]

FAR_IOVA = 0x1_0000_0000  # the CXL devdax region, as the GPU sees it
AUX_IOVA = 0x0800_0000  # one page: kernel parameters and the fault buffer
FAULT_OFFSET = 2048  # fault buffer inside the aux page
FAULT_ENTRIES = 64
FAR = regs.FAR_DEVADDR
UNITS = {"4K": 12, "64K": 16, "2M": 21}
MIGRATION_TIMEOUT = 5.0  # s: a migration is one copy in the device; never this long
PROGRESS_TICK = 1.0  # s without a vector: check the device is still running the op
MASK60 = (1 << 60) - 1
MASK64 = (1 << 64) - 1
DRIVER_COUNTERS = ("faults_coalesced", "evicted_blocks")  # counted by the pager, 0 without one
GEMV_TOKENS = 4  # gemv: tokens decoded per run (W read once per token)

# NVIDIA's open UVM driver (open-gpu-kernel-modules, kernel-open/nvidia-uvm), its defaults:
BATCH_COUNT = 256  # uvm_gpu_replayable_faults.c: uvm_perf_fault_batch_count
PREFETCH_THRESHOLD = 51  # uvm_perf_prefetch.c: uvm_perf_prefetch_threshold, percent
VA_BLOCK_SHIFT = 21  # uvm_va_block_types.h: UVM_VA_BLOCK_SIZE, 2 MiB
THRASH_BATCHES = 16  # batches in a row that re-evict the blocks just brought in: give up
# The GPU's warps in flight when one faults (mode uvm; uvm-naive: 0, one fault per stop):
# 28 SMs x 2048 resident threads (the GTX 1080 Ti configuration GPGPU-Sim ships, on which
# UVMSmart builds), one 8-byte access each = 458,752 bytes = 7168 lines of the stream.
FAULT_AHEAD_LINES = 28 * 2048 * 8 // 64


class GpuMemError(GpuError):
    pass


# --------------------------------------------------------------------------
# The eviction policy: LRU over migration units (pure, tested on its own)
# --------------------------------------------------------------------------
class LruCache:
    """VRAM slots for far pages; the least recently *migrated or faulted* page goes first.

    The driver sees faults, not hits (as UVM's driver does): recency is what the
    faults tell it."""

    def __init__(self, slots: int):
        if slots < 1:
            raise GpuMemError("the VRAM cache holds no migration unit",
                              "give --vram-cache at least one migration unit (--unit)")
        self.free = list(range(slots - 1, -1, -1))
        self.pages: OrderedDict[int, int] = OrderedDict()  # page -> slot, least recent first

    def __contains__(self, page: int) -> bool:
        return page in self.pages

    def __len__(self) -> int:
        return len(self.pages)

    def place(self, page: int) -> tuple[int, int | None, int | None]:
        """A slot for ``page`` -> (slot, evicted page or None, its slot)."""
        if page in self.pages:
            self.pages.move_to_end(page)
            return self.pages[page], None, None
        victim = vslot = None
        if self.free:
            slot = self.free.pop()
        else:
            victim, vslot = self.pages.popitem(last=False)
            slot = vslot
        self.pages[page] = slot
        return slot, victim, vslot


def simulate_faults(pages, slots: int) -> int:
    """Faults an LRU cache of ``slots`` takes on a stream of page touches (for tests and docs)."""
    cache, faults = LruCache(slots), 0
    for p in pages:
        if p not in cache:
            faults += 1
        cache.place(p)
    return faults


# --------------------------------------------------------------------------
# Kernels: operand layout, inputs, verification
# --------------------------------------------------------------------------
@dataclass
class Layout:
    kernel: Kernel
    n: int
    a: int = 0  # far offsets
    b: int = 0
    idx: int = 0
    aux: int = 0
    arg: int = 0
    size: int = 0  # bytes of far window used (the working set)


def _align(x: int, a: int = 4096) -> int:
    return -(-x // a) * a


def _pow2_below(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def layout(kernel: str, working_set: int) -> Layout:
    """Operands of ``kernel`` for a working set of about ``working_set`` bytes."""
    if kernel not in regs.KERNELS:
        raise GpuMemError(f"unknown kernel {kernel!r}", f"one of {', '.join(regs.KERNELS)}")
    k = regs.KERNELS[kernel]
    ws = working_set
    if ws < 4096:
        raise GpuMemError(f"working set {ws} bytes is too small", "give at least 4K")
    if k is Kernel.STREAM:
        lay = Layout(k, ws // 8, a=0)
    elif k in (Kernel.COPY, Kernel.STENCIL):
        n = ws // 16
        lay = Layout(k, n, a=0, b=_align(8 * n))
    elif k is Kernel.GATHER:
        m = _pow2_below(ws // 16)  # half the set: the table
        n = max(1, (ws - 8 * m) // 12)
        lay = Layout(k, n, a=0, idx=_align(8 * m), aux=m)
        lay.b = _align(lay.idx + 4 * n)
    elif k is Kernel.SCATTER:
        m = _pow2_below(ws // 16)
        n = max(1, (ws - 8 * m) // 4)
        lay = Layout(k, n, a=0, idx=_align(8 * m), aux=m)
    elif k is Kernel.GEMV:  # W (n x n), x, y back to back; n a multiple of 8: whole lines each
        n = max(8, (math.isqrt(ws // 8 + 1) - 1) // 8 * 8)   # 8 (n + 1)**2 >= 8 n**2 + 16 n
        lay = Layout(k, n, a=0, idx=8 * n * n, b=8 * n * n + 8 * n, arg=GEMV_TOKENS)
    else:  # BFS: degree 8, 44 bytes per vertex
        n = _pow2_below(ws // 44)
        lay = Layout(k, n, a=0, aux=8 * n, arg=0)
        lay.idx = _align(8 * (n + 1))
        lay.b = _align(lay.idx + 4 * 8 * n)
    ends = {Kernel.STREAM: lay.a + 8 * lay.n, Kernel.COPY: lay.b + 8 * lay.n,
            Kernel.STENCIL: lay.b + 8 * lay.n, Kernel.GATHER: lay.b + 8 * lay.n,
            Kernel.SCATTER: lay.idx + 4 * lay.n, Kernel.BFS: lay.b + 4 * lay.n,
            Kernel.GEMV: lay.b + 8 * lay.n}
    lay.size = _align(ends[k])
    return lay


def _masked(data: bytes, unit: bytes) -> bytes:
    """``data`` AND the repeated ``unit`` (C speed through big integers)."""
    mask = int.from_bytes(unit * (len(data) // len(unit)), "little")
    return (int.from_bytes(data, "little") & mask).to_bytes(len(data), "little")


class Verifier:
    """What a kernel's result must be, computed here from the inputs."""

    def __init__(self, lay: Layout, dax: DaxMapping):
        self.lay, self.dax = lay, dax
        self.before = None
        self._gemv_y = None  # gemv: y from the inputs, computed once (runs reuse their inputs)

    def capture(self) -> None:
        lay = self.lay
        self._gemv_y = None
        if lay.kernel is Kernel.SCATTER:  # scatter updates its table in place
            self.before = self.dax.read(lay.a, 8 * lay.aux)

    def check(self, result: int) -> tuple[bool, str]:
        lay, view = self.lay, self.dax.view
        k, n = lay.kernel, lay.n
        if k is Kernel.STREAM:
            want = sum(view[lay.a:lay.a + 8 * n].cast("Q")) & 0xFFFFFFFFFFFFFFFF
            return result == want, f"sum {result:#x}, expected {want:#x}"
        if k is Kernel.COPY:
            return view[lay.a:lay.a + 8 * n] == view[lay.b:lay.b + 8 * n], "b == a"
        if k is Kernel.STENCIL:
            x = int.from_bytes(view[lay.a:lay.a + 8 * n], "little")
            bits = (1 << (64 * n)) - 1
            want = (x + (x << 64) + (x >> 64)) & bits  # inputs < 2**60: no carry between elements
            return int.from_bytes(view[lay.b:lay.b + 8 * n], "little") == want, "3-point stencil"
        if k is Kernel.GATHER:
            table = view[lay.a:lay.a + 8 * lay.aux].cast("Q")
            ix = view[lay.idx:lay.idx + 4 * n].cast("I")
            want = array("Q", [table[i] for i in ix])
            return view[lay.b:lay.b + 8 * n] == memoryview(want).cast("B"), "b[i] == a[idx[i]]"
        if k is Kernel.GEMV:
            return self._check_gemv(result)
        if k is Kernel.SCATTER:
            want = array("Q")
            want.frombytes(self.before)
            for i in view[lay.idx:lay.idx + 4 * n].cast("I"):
                want[i] += 1
            return view[lay.a:lay.a + 8 * lay.aux] == memoryview(want).cast("B"), "a[idx[i]] += 1"
        # BFS
        col = view[lay.idx:lay.idx + 4 * lay.aux].cast("I")
        level = [0xFFFFFFFF] * n
        level[lay.arg] = 0
        frontier, depth = [lay.arg], 0
        while frontier:
            depth += 1
            nxt = []
            for v in frontier:
                for u in col[8 * v:8 * v + 8]:
                    if level[u] == 0xFFFFFFFF:
                        level[u] = depth
                        nxt.append(u)
            frontier = nxt
        got = view[lay.b:lay.b + 4 * n].cast("I")
        reached = sum(1 for x in level if x != 0xFFFFFFFF)
        return got.tolist() == level and result == reached, f"levels, {reached} reached"


    def _check_gemv(self, result: int) -> tuple[bool, str]:
        """y after ``arg`` tokens of y = W x (mod 2**64), row by row in plain Python."""
        lay, view = self.lay, self.dax.view
        n = lay.n
        if self._gemv_y is None:
            w = view[lay.a:lay.a + 8 * n * n].cast("Q")
            x = list(view[lay.idx:lay.idx + 8 * n].cast("Q"))
            for _ in range(lay.arg):
                x = [sum(map(operator.mul, w[i * n:(i + 1) * n], x)) & MASK64 for i in range(n)]
            self._gemv_y = x
        y = self._gemv_y
        got = view[lay.b:lay.b + 8 * n].cast("Q").tolist()
        want = sum(y) & MASK64
        return got == y and result == want, f"y = W x over {lay.arg} tokens, sum {result:#x}, expected {want:#x}"


# --------------------------------------------------------------------------
# The copy engine, and the UVM pager: the replayable-fault path
# --------------------------------------------------------------------------
_last_tag: "weakref.WeakKeyDictionary[GpuDriver, int]" = weakref.WeakKeyDictionary()


def _next_tag(gpu: GpuDriver) -> int:
    """A MIG_CONTROL tag unlike the last one written to this GPU: the device ignores a GO that
    repeats the tag of the last GO it accepted (and forgets it only at a reset), so the tags go
    on from one pager to the next on the same GPU."""
    tag = _last_tag.get(gpu, 0) % regs.CMD_TAG_MASK + 1     # 1 .. 2**24 - 1
    _last_tag[gpu] = tag
    return tag


def migrate(gpu: GpuDriver, src: int, dst: int, length: int) -> None:
    """Copy ``length`` bytes between VRAM and the far window with the GPU's copy engine and
    wait until it is done (docs/gpu-device.md, "The copy engine").  ``src`` and ``dst`` are
    device addresses: a VRAM offset, or ``regs.FAR_DEVADDR`` + a far window offset; one of
    each.  GpuMemError if the device reports an error or stays busy."""
    b = gpu.bar0
    for reg, value in ((regs.REG_MIG_SRC_LO, src & 0xFFFFFFFF), (regs.REG_MIG_SRC_HI, src >> 32),
                       (regs.REG_MIG_DST_LO, dst & 0xFFFFFFFF), (regs.REG_MIG_DST_HI, dst >> 32),
                       (regs.REG_MIG_LENGTH, length),
                       (regs.REG_MIG_CONTROL, regs.MIG_GO | _next_tag(gpu) << regs.CMD_TAG_SHIFT)):
        b.write32(reg, value)
    deadline = time.monotonic() + MIGRATION_TIMEOUT
    # polled: one copy in the device, a register read per look (no vector is spent on it); the
    # first read already answers for this GO (BUSY, or its outcome)
    while (status := b.read32(regs.REG_MIG_STATUS)) & regs.MIG_BUSY:
        if time.monotonic() > deadline:
            raise GpuMemError(f"migration {src:#x} -> {dst:#x} still busy after {MIGRATION_TIMEOUT} s",
                              "is the GPU server alive?")
    if status != regs.MIG_DONE:
        code = status >> 8 & 0xFF
        raise GpuMemError(f"migration {src:#x} -> {dst:#x} failed: "
                          f"{regs.Status(code).name if code in regs.Status._value2member_map_ else code}",
                          "see docs/gpu-device.md, MIG_STATUS")


class UvmPager:
    """The library's pager: LRU over ``vram_cache // page`` VRAM slots from ``vram_base`` (the
    pager protocol and how to write another: docs/guest-library.md, "Your own pager")."""

    def __init__(self, gpu: GpuDriver, faults: memoryview, page_shift: int, vram_base: int,
                 vram_cache: int):
        self.gpu, self.bar0, self.faults = gpu, gpu.bar0, faults
        self.page = 1 << page_shift
        self.vram_base = vram_base
        self.cache = LruCache(vram_cache // self.page)
        self.served = 0
        self.spurious = 0  # faults on pages the cache already holds
        self.trace: list[int] = []
        self.entries = len(faults) // regs.FAULT_RECORD.size
        self.check = bool(os.environ.get("VFIO_CXL_GPUMEM_CHECK"))
        self.bar0.write32(regs.REG_UVM_PAGE_SHIFT, page_shift)  # also clears the page table
        # records before this pager (an earlier run's) are not ours: start at the device's PUT
        self.get = self.bar0.read32(regs.REG_FAULT_PUT)
        self.bar0.write32(regs.REG_FAULT_GET, self.get)

    def migrate(self, src: int, dst: int) -> None:
        """One page through the copy engine."""
        migrate(self.gpu, src, dst, self.page)

    def _pte(self, page: int) -> int:
        self.bar0.write32(regs.REG_PT_INDEX, page)
        return self.bar0.read32(regs.REG_PT_ENTRY)

    def service(self) -> int:
        """Handle every fault record the device wrote, then replay; returns records handled."""
        put = self.bar0.read32(regs.REG_FAULT_PUT)
        handled, seq = 0, None
        while self.get != put:
            addr, _flags, seq = regs.FAULT_RECORD.unpack_from(self.faults, 16 * self.get)
            page = (addr - FAR) // self.page
            if page not in self.cache:
                slot, victim, vslot = self.cache.place(page)
                if victim is not None:
                    dirty = self._pte(victim) & regs.PTE_DIRTY
                    self.bar0.write32(regs.REG_PT_ENTRY, 0)  # unmap first: no access may hit it now
                    if dirty:
                        self.migrate(self.vram_base + vslot * self.page, FAR + victim * self.page)
                vram = self.vram_base + slot * self.page
                self.migrate(FAR + page * self.page, vram)
                self.bar0.write32(regs.REG_PT_INDEX, page)
                self.bar0.write32(regs.REG_PT_ENTRY, vram | regs.PTE_VALID)
                if self.check:
                    got = self._pte(page)
                    if got != vram | regs.PTE_VALID:
                        raise GpuMemError(f"PTE of page {page} reads {got:#x} after writing "
                                          f"{vram | regs.PTE_VALID:#x}", "a device bug")
            else:
                self.spurious += 1
            self.trace.append(page)
            self.get = (self.get + 1) % self.entries
            handled += 1
        self.served += handled
        self.bar0.write32(regs.REG_FAULT_GET, self.get)
        if seq is not None:  # replay names the newest fault handled (a repeat does nothing)
            self.bar0.write32(regs.REG_UVM_CONTROL,
                              regs.UVM_REPLAY | (seq & regs.CMD_TAG_MASK) << regs.CMD_TAG_SHIFT)
        return handled

    def write_back(self) -> int:
        """Every dirty resident page back to the far window (the CPU wants the results)."""
        pages = 0
        for page, slot in self.cache.pages.items():
            if self._pte(page) & regs.PTE_DIRTY:
                self.migrate(self.vram_base + slot * self.page, FAR + page * self.page)
                self.bar0.write32(regs.REG_PT_ENTRY, (self.vram_base + slot * self.page) | regs.PTE_VALID)
                pages += 1
        return pages


class FaultRecord(NamedTuple):
    page: int  # far page number (units of the migration unit)
    write: bool
    seq: int


@dataclass
class FaultBatch:
    """Records read from the fault buffer together (at most BATCH_COUNT): serviced once, replayed once."""
    number: int  # the pager's count of batches read, from 1
    records: list
    overflow: bool = False  # the device's stop had more faults than free records
    replayed: bool = False


def prefetch_region(units: int, resident: set, faulted: set, threshold: int = PREFETCH_THRESHOLD) -> set:
    """The units of one VA block the density prefetcher adds to ``faulted`` (not resident).

    As uvm_perf_prefetch.c does it: a binary tree over the block's ``units`` (a power of
    two) counts the units resident or faulted; for each faulted unit, walking up from its
    leaf, the largest subtree whose count exceeds ``threshold`` percent of its size is
    migrated whole."""
    if units & (units - 1):
        raise GpuMemError(f"a VA block of {units} units", "a power of two (2 MiB / the migration unit)")
    outside = [u for u in faulted if not 0 <= u < units]
    if outside:
        raise GpuMemError(f"faulted unit {outside[0]} is not in a VA block of {units} units",
                          "units are numbered from the block's start")
    occupied = resident | faulted
    out: set = set()
    for u in faulted:
        best, size = None, 1
        while size <= units:
            lo = u // size * size
            if sum(1 for v in range(lo, lo + size) if v in occupied) * 100 > size * threshold:
                best = (lo, size)
            size *= 2
        if best is not None:
            out.update(range(best[0], best[0] + best[1]))
    return out - resident - faulted


class UvmBatchPager:
    """Mode uvm, as NVIDIA's UVM driver services replayable faults: batches of up to
    BATCH_COUNT records, coalesced per 2 MiB VA block, each block serviced once (faulted
    units + the density prefetcher's), blocks evicted LRU, one replay per batch."""

    def __init__(self, gpu: GpuDriver, faults: memoryview, page_shift: int, vram_base: int,
                 vram_cache: int):
        self.gpu, self.bar0, self.faults = gpu, gpu.bar0, faults
        self.shift, self.page = page_shift, 1 << page_shift
        self.block_units = 1 << (VA_BLOCK_SHIFT - page_shift)
        self.vram_base = vram_base
        block = 1 << VA_BLOCK_SHIFT
        if vram_cache < block:
            raise GpuMemError(f"mode uvm caches 2 MiB VA blocks; the VRAM cache is {vram_cache} bytes",
                              "give --vram-cache at least 2M, or use mode uvm-naive")
        far_size = self.bar0.read32(regs.REG_FAR_SIZE_LO) | self.bar0.read32(regs.REG_FAR_SIZE_HI) << 32
        if far_size % block:
            raise GpuMemError(f"the far window ({far_size} bytes) ends inside a 2 MiB VA block",
                              "map a far window of a whole number of 2 MiB blocks")
        self.window_units = far_size >> page_shift
        self.blocks = LruCache(vram_cache >> VA_BLOCK_SHIFT)  # VA block -> VRAM block slot
        self.resident: dict[int, set] = {}  # VA block -> its resident units
        self.entries = len(faults) // regs.FAULT_RECORD.size
        self.batches_read = self.served = self.spurious = self.overflows = 0
        self.faults_coalesced = self.evicted_blocks = 0
        self.trace: list[int] = []
        self._serviced_in: dict[int, int] = {}  # VA block -> the last batch that serviced it
        self._thrash = 0  # batches in a row that evicted a block one of the last few serviced
        self.bar0.write32(regs.REG_UVM_PAGE_SHIFT, page_shift)  # also clears the page table
        self.get = self.bar0.read32(regs.REG_FAULT_PUT)
        self.bar0.write32(regs.REG_FAULT_GET, self.get)

    # -- the pager protocol (docs/guest-library.md, "Your own pager")
    def service(self) -> int:
        """Every record in the buffer, batch by batch; returns the records handled."""
        handled = 0
        while (batch := self.read_batch()).records:
            self.service_batch(batch)
            self.replay(batch)
            handled += len(batch.records)
        return handled

    def write_back(self) -> int:
        """Every dirty resident unit back to the far window; returns the units written."""
        written = 0
        for block, slot in self.blocks.pages.items():
            dirty = [u for u in sorted(self.resident[block]) if self._pte(block, u) & regs.PTE_DIRTY]
            self._copy_out(block, slot, dirty)
            for u in dirty:
                self._map(block, slot, u)  # clean again
            written += len(dirty)
        return written

    def counters(self) -> dict:
        """What only the driver knows (the device counts fault_batches and prefetched_bytes)."""
        return {"faults_coalesced": self.faults_coalesced, "evicted_blocks": self.evicted_blocks}

    # -- batches
    def read_batch(self) -> FaultBatch:
        """Up to BATCH_COUNT records from FAULT_GET on (FAULT_GET advanced past them)."""
        put = self.bar0.read32(regs.REG_FAULT_PUT)
        overflow = bool(self.bar0.read32(regs.REG_UVM_STATUS) & regs.UVM_FAULT_OVERFLOW)
        records = []
        while self.get != put and len(records) < BATCH_COUNT:
            addr, flags, seq = regs.FAULT_RECORD.unpack_from(self.faults, regs.FAULT_RECORD.size * self.get)
            records.append(FaultRecord((addr - FAR) >> self.shift, bool(flags & regs.FAULT_WRITE), seq))
            self.get = (self.get + 1) % self.entries
        if not records:
            return FaultBatch(self.batches_read, [])
        self.bar0.write32(regs.REG_FAULT_GET, self.get)
        self.batches_read += 1
        self.overflows += overflow
        return FaultBatch(self.batches_read, records, overflow)

    def replay(self, batch: FaultBatch) -> None:
        """REPLAY naming the batch's newest record (the device acts if that is its newest)."""
        if batch.number != self.batches_read or not batch.records:
            raise GpuMemError(f"replay for fault batch {batch.number}, which this pager did not read last "
                              f"(last read: {self.batches_read})", "replay the batch just serviced")
        if batch.replayed:
            raise GpuMemError(f"fault batch {batch.number} was replayed already", "one replay per batch")
        batch.replayed = True
        seq = batch.records[-1].seq
        self.bar0.write32(regs.REG_UVM_CONTROL, regs.UVM_REPLAY | (seq & regs.CMD_TAG_MASK) << regs.CMD_TAG_SHIFT)

    def service_batch(self, batch: FaultBatch) -> None:
        """Coalesce per VA block, then service each block once, in first-fault order; blocks
        beyond what the cache holds wait (their faults come again after the replay)."""
        by_block: dict[int, set] = {}
        for r in batch.records:
            by_block.setdefault(r.page // self.block_units, set()).add(r.page % self.block_units)
            self.trace.append(r.page)
        self.served += len(batch.records)
        self.faults_coalesced += len(batch.records) - len(by_block)
        slots = len(self.blocks.free) + len(self.blocks.pages)
        victims = []
        for block in list(by_block)[:slots]:
            victims += self.service_block(block, by_block[block])
            self._serviced_in[block] = batch.number
        self._check_thrash(batch.number, victims, slots)

    def _check_thrash(self, number: int, victims: list, slots: int) -> None:
        """GpuMemError when the cache thrashes: batch after batch evicts a block one of the last
        ``slots`` batches brought in (the accesses in flight need more VA blocks than the
        cache holds; NVIDIA's driver would pin or throttle, uvm_perf_thrashing.c: not here)."""
        recent = any(number - self._serviced_in.get(v, -slots - 1) <= slots for v in victims)
        self._thrash = self._thrash + 1 if recent else 0
        if self._thrash >= THRASH_BATCHES:
            raise GpuMemError(f"the VRAM cache ({slots} VA blocks of 2 MiB) thrashes: {self._thrash} batches "
                              f"in a row evicted a block one of the last {slots} batches brought in",
                              "give a larger --vram-cache (a block per operand the kernel touches at "
                              "once), or use mode uvm-naive")

    def service_block(self, block: int, faulted: set) -> list:
        """Make ``faulted`` units of ``block`` (and the prefetcher's) resident; returns the
        blocks evicted for it."""
        slot, victim, vslot = self.blocks.place(block)
        if victim is not None:
            self._evict(victim, vslot)
        resident = self.resident.setdefault(block, set())
        if faulted <= resident:
            self.spurious += 1
            return [victim] if victim is not None else []
        units = sorted((faulted - resident) | prefetch_region(self.block_units, resident, faulted))
        self._check_window(block, units)
        for lo, n in _runs(units):
            migrate(self.gpu, FAR + (block * self.block_units + lo) * self.page,
                    self.vram_base + (slot * self.block_units + lo) * self.page, n * self.page)
        for u in units:
            self._map(block, slot, u)
        resident.update(units)
        return [victim] if victim is not None else []

    # -- helpers
    def _check_window(self, block: int, units: list) -> None:
        last = block * self.block_units + units[-1]
        if last >= self.window_units:
            raise GpuMemError(f"prefetch of unit {last} is beyond the far window ({self.window_units} units "
                              f"of {self.page} bytes)", "a VA block lies wholly inside the window")

    def _evict(self, block: int, slot: int) -> None:
        """Unmap every unit of ``block`` (before any copy: no access may hit it now), then
        write back the dirty ones."""
        dirty = []
        for u in sorted(self.resident.pop(block)):
            if self._pte(block, u) & regs.PTE_DIRTY:
                dirty.append(u)
            self.bar0.write32(regs.REG_PT_ENTRY, 0)
        self._copy_out(block, slot, dirty)
        self.evicted_blocks += 1

    def _copy_out(self, block: int, slot: int, units: list) -> None:
        for lo, n in _runs(units):
            migrate(self.gpu, self.vram_base + (slot * self.block_units + lo) * self.page,
                    FAR + (block * self.block_units + lo) * self.page, n * self.page)

    def _pte(self, block: int, unit: int) -> int:
        self.bar0.write32(regs.REG_PT_INDEX, block * self.block_units + unit)
        return self.bar0.read32(regs.REG_PT_ENTRY)

    def _map(self, block: int, slot: int, unit: int) -> None:
        self.bar0.write32(regs.REG_PT_INDEX, block * self.block_units + unit)
        self.bar0.write32(regs.REG_PT_ENTRY,
                          (self.vram_base + (slot * self.block_units + unit) * self.page) | regs.PTE_VALID)


def _runs(units: list):
    """(first, count) of each run of consecutive numbers in sorted ``units``."""
    start = prev = None
    for u in units:
        if prev is not None and u == prev + 1:
            prev = u
            continue
        if start is not None:
            yield start, prev - start + 1
        start = prev = u
    if start is not None:
        yield start, prev - start + 1


# --------------------------------------------------------------------------
# The library
# --------------------------------------------------------------------------
def _pager_counters(pager) -> dict:
    """What the pager counts (``counters()``, optional in the pager protocol), else nothing."""
    return dict(pager.counters()) if hasattr(pager, "counters") else {}


class GpuMemory:
    def __init__(self, gpu: GpuDriver, dax: DaxMapping, far_size: int | None = None):
        """``far_size``: bytes of the devdax region to map for the GPU (default: all of it).
        Mapping costs time with a vIOMMU (QEMU sends the device one DMA_MAP per 4 KiB
        page), so a run maps what its working set needs, rounded up to 2 MiB."""
        self.gpu, self.dax, self.bar0 = gpu, dax, gpu.bar0
        if far_size is not None and far_size > dax.size:
            raise GpuMemError(f"the working set needs {far_size} bytes of far memory, "
                              f"{dax.dax.name} has {dax.size}",
                              f"give --working-set at most {dax.size}")
        if self.bar0.read32(regs.REG_VERSION) < 0x00010001 or not (
                self.bar0.read32(regs.REG_CAPS2) & regs.CAPS2_FAR):
            raise GpuMemError("this GPU has no far memory (interface 1.1)",
                              "update the GPU server (vfio-cxl gpu serve)")
        if len(gpu.vectors.eventfds) <= regs.VEC_FAULT:
            raise GpuMemError("uvm needs the fault vector: the GPU has fewer than 3 MSI-X vectors here",
                              "run the GPU with --irq-mode msix")
        self.far_size = dax.size if far_size is None else min(dax.size, _align(far_size, 2 << 20))
        self._aux = mmap.mmap(-1, 4096)
        self._aux_view = memoryview(self._aux)
        self._fault_view = self._aux_view[FAULT_OFFSET:FAULT_OFFSET + FAULT_ENTRIES * regs.FAULT_RECORD.size]
        self._far_view = dax.view[:self.far_size]
        self._mappings = []
        try:
            self._mappings.append(gpu.map(self._aux, AUX_IOVA))
            self._mappings.append(gpu.map(self._far_view, FAR_IOVA))
        except BaseException:
            self.close()
            raise
        self.program()

    @classmethod
    def open(cls, bdf: str | None = None, far_size: int | None = None) -> "GpuMemory":
        dax = DaxMapping(cxl.ensure_ram_devdax())
        try:
            gpu = GpuDriver.open(bdf)
        except BaseException:
            dax.close()
            raise
        try:
            return cls(gpu, dax, far_size)
        except BaseException:
            gpu.close()
            dax.close()
            raise

    def program(self) -> None:
        """The far window and fault buffer registers (again after any reset)."""
        fault_iova = AUX_IOVA + FAULT_OFFSET
        for reg, value in ((regs.REG_FAR_BASE_LO, FAR_IOVA & 0xFFFFFFFF), (regs.REG_FAR_BASE_HI, FAR_IOVA >> 32),
                           (regs.REG_FAR_SIZE_LO, self.far_size & 0xFFFFFFFF),
                           (regs.REG_FAR_SIZE_HI, self.far_size >> 32),
                           (regs.REG_FAULT_BASE_LO, fault_iova & 0xFFFFFFFF),
                           (regs.REG_FAULT_BASE_HI, fault_iova >> 32),
                           (regs.REG_FAULT_ENTRIES, FAULT_ENTRIES)):
            self.bar0.write32(reg, value)

    # -- inputs ---------------------------------------------------------------
    def _gpu_fill(self, off: int, size: int, seed: int) -> None:
        """PRNG bytes into the far window: FILL_PRNG into VRAM, VRAM_TO_HOST out, in VRAM-sized steps."""
        step = min(self.gpu.vram_size // 2, 32 << 20)
        done = 0
        while done < size:
            n = min(step, size - done)
            self.gpu.run([Transfer(Op.FILL_PRNG, src=seed + done, dst=0, length=n),
                          Transfer(Op.VRAM_TO_HOST, src=0, dst=FAR_IOVA + off + done, length=n)],
                         timeout=60)
            done += n

    def _mask60(self, off: int, size: int) -> None:
        self.dax.write(off, _masked(self.dax.read(off, size), b"\xff" * 7 + b"\x0f"))

    def prepare(self, lay: Layout, seed: int = 1) -> Verifier:
        k = lay.kernel
        if lay.size > self.far_size:
            raise GpuMemError(f"the working set needs {lay.size} bytes of far memory, the window "
                              f"({self.dax.dax.name}) has {self.far_size}",
                              f"give --working-set at most {self.far_size}")
        if k in (Kernel.STREAM, Kernel.COPY, Kernel.STENCIL):
            self._gpu_fill(lay.a, 8 * lay.n, seed)
            if k is Kernel.STENCIL:
                self._mask60(lay.a, 8 * lay.n)
        elif k is Kernel.GEMV:
            self._gpu_fill(lay.a, 8 * lay.n * lay.n, seed)
            self._gpu_fill(lay.idx, 8 * lay.n, seed + (1 << 40))
        elif k in (Kernel.GATHER, Kernel.SCATTER):
            self._gpu_fill(lay.a, 8 * lay.aux, seed)
            self._mask60(lay.a, 8 * lay.aux)
            self.dax.write(lay.idx, _masked(os.urandom(4 * lay.n), (lay.aux - 1).to_bytes(4, "little")))
        else:
            row = array("Q", range(0, 8 * lay.n + 1, 8))
            self.dax.write(lay.a, row.tobytes())
            col = bytearray(_masked(os.urandom(4 * lay.aux), (lay.n - 1).to_bytes(4, "little")))
            cv = memoryview(col).cast("I")
            for v in range(lay.n):  # a ring edge each: every vertex is reachable
                cv[8 * v] = (v + 1) % lay.n
            cv.release()
            self.dax.write(lay.idx, bytes(col))
        self.clear_output(lay)
        ver = Verifier(lay, self.dax)
        ver.capture()
        return ver

    def clear_output(self, lay: Layout) -> None:
        """Zero the output operand: a stale result cannot pass the check."""
        k = lay.kernel
        if k is not Kernel.STREAM and k is not Kernel.SCATTER:
            self.dax.write(lay.b, bytes(4 * lay.n if k is Kernel.BFS else 8 * lay.n))

    # -- running ----------------------------------------------------------------
    def configure(self, mode: str, latency: str) -> None:
        if mode not in regs.MODES:
            raise GpuMemError(f"unknown mode {mode!r}", f"one of {', '.join(regs.MODES)}")
        if latency not in regs.LATENCY_PROFILES:
            raise GpuMemError(f"unknown latency profile {latency!r}",
                              f"one of {', '.join(regs.LATENCY_PROFILES)}")
        self.bar0.write32(regs.REG_MEM_MODE, regs.MODES[mode])
        self.bar0.write32(regs.REG_LATENCY_PROFILE, regs.LATENCY_PROFILES.index(latency))

    def counters(self) -> dict:
        out = {}
        for name in regs.COUNTERS + regs.COUNTERS2:
            reg = regs.counter_reg(name)
            out[name] = self.bar0.read32(reg) | self.bar0.read32(reg + 4) << 32
        return out

    @property
    def fault_buffer(self) -> memoryview:
        """The fault buffer the device writes its fault records into (``len // 16`` records of
        ``regs.FAULT_RECORD``; record ``i`` at ``16 * i``): what a pager reads."""
        return self._fault_view

    def launch(self, lay: Layout, pager=None, timeout: float = 600) -> int:
        """One COMPUTE descriptor; services faults while it runs (``pager.service()`` each time
        the fault vector fires); returns its result."""
        self._aux_view[:regs.KERNEL_PARAMS.size] = regs.pack_kernel(
            lay.kernel, lay.n, FAR + lay.a, FAR + lay.b, FAR + lay.idx, lay.aux, lay.arg)
        indices = self.gpu.submit([Transfer(Op.COMPUTE, src=AUX_IOVA, dst=0, length=regs.KERNEL_PARAMS.size)])
        deadline = time.monotonic() + timeout
        while True:
            try:
                fired = self.gpu.pending_vectors(PROGRESS_TICK)
            except InterruptTimeout:
                fired = {}
            if fired.get(regs.VEC_FAULT) and pager is not None:
                try:
                    pager.service()
                except GpuMemError:
                    self._check_running()
                    self._drop_op()
                    raise
            if fired.get(regs.VEC_ERROR) or fired.get(regs.VEC_DMA_DONE):
                self.gpu.finish(indices, fired)
                break
            if not fired:
                self._check_running()
                if time.monotonic() > deadline:
                    raise GpuMemError(f"the kernel did not finish within {timeout:.0f} s",
                                      "use a smaller --working-set")
        return int.from_bytes(self._aux_view[regs.KERNEL_RESULT_OFFSET:regs.KERNEL_PARAMS.size], "little")

    def _drop_op(self) -> None:
        """The pager gave up on the op: reset the GPU (which drops it) and program the window again."""
        self.gpu.abandon()
        self.program()

    def _check_running(self) -> None:
        """GpuMemError if the device dropped the op (a reset: its ring is no longer enabled)."""
        if not self.bar0.read32(regs.REG_STATUS) & regs.STATUS_ENABLED:
            self.gpu.abandon()
            raise GpuMemError("the GPU was reset while the kernel ran (its ring is no longer enabled)",
                              "nothing is left pending; run again")

    def flush(self) -> int:
        (done,) = self.gpu.run([Transfer(Op.FLUSH, src=0, dst=0, length=0)])
        return done["bytes_done"]

    def run(self, kernel: str, mode: str = "cxl", latency: str = "cxl-80ns",
            working_set: int = 8 << 20, vram_cache: int | None = None, unit: str = "64K",
            warm: bool = False, seed: int = 1, prepared: tuple | None = None, pager=None) -> dict:
        """Run one kernel; the result dict carries the counters, the modelled and the wall time.

        ``pager`` (modes uvm, uvm-naive): the pager's class, or any callable that builds one as
        ``pager(gpu, faults, page_shift, vram_base, vram_cache)`` (docs/guest-library.md,
        "Your own pager"); default ``UvmBatchPager`` in mode uvm, ``UvmPager`` in uvm-naive.
        A pager with ``counters()`` adds what it returns to the run's counters."""
        lay = layout(kernel, working_set)
        self.configure(mode, latency)
        if unit not in UNITS:
            raise GpuMemError(f"unknown migration unit {unit!r}", f"one of {', '.join(UNITS)}")
        shift = UNITS[unit]
        cache = vram_cache if vram_cache is not None else self.gpu.vram_size // 2
        uvm = bool(regs.MODES[mode] & regs.MODE_UVM)
        if uvm:
            if cache < (1 << shift):
                raise GpuMemError(f"--vram-cache {cache} is smaller than one migration unit ({unit})",
                                  f"give at least {1 << shift} bytes")
            stage = self.bar0.read32(regs.REG_DS_STAGE_BASE)
            if cache > stage:
                raise GpuMemError(f"--vram-cache {cache} does not fit the GPU's VRAM below the DS "
                                  f"staging area ({stage} bytes)", f"give at most {stage}")
        t0 = time.perf_counter()
        if prepared:
            lay, verifier = prepared
            self.clear_output(lay)
        else:
            verifier = self.prepare(lay, seed)
        setup_s = time.perf_counter() - t0
        if uvm:
            # what every pager starts from: pages of 1 << shift, an empty page table, and no
            # fault record before this one's (FAULT_GET = FAULT_PUT); in mode uvm the GPU
            # reports the faults of all its warps in flight per stop, in uvm-naive one
            self.bar0.write32(regs.REG_UVM_FAULT_AHEAD, FAULT_AHEAD_LINES if mode == "uvm" else 0)
            self.bar0.write32(regs.REG_UVM_PAGE_SHIFT, shift)
            self.bar0.write32(regs.REG_FAULT_GET, self.bar0.read32(regs.REG_FAULT_PUT))
            pager = pager or (UvmBatchPager if mode == "uvm" else UvmPager)
            pager = pager(self.gpu, self._fault_view, shift, 0, cache)
        else:
            pager = None
        if warm:  # one run to bring the pages in; the measured run starts warm
            self.launch(lay, pager)
            if kernel == "scatter":  # it updates in place: the measured run starts from here
                if pager is not None:
                    pager.write_back()
                if self.bar0.read32(regs.REG_DS_PENDING_LINES):
                    self.flush()
                verifier.capture()
        self.bar0.write32(regs.REG_COUNTER_CONTROL, regs.COUNTERS_CLEAR)
        before = _pager_counters(pager)
        t1 = time.perf_counter()
        result = self.launch(lay, pager)
        wall_s = time.perf_counter() - t1
        counters = self.counters()
        counters.update(dict.fromkeys(DRIVER_COUNTERS, 0))
        counters.update({k: v - before[k] for k, v in _pager_counters(pager).items()})
        staged = self.bar0.read32(regs.REG_DS_PENDING_LINES)
        flushed = self.flush() if staged else 0
        if pager is not None:
            pager.write_back()
        t2 = time.perf_counter()
        ok, what = verifier.check(result)
        verify_s = time.perf_counter() - t2
        return {"kernel": kernel, "mode": mode, "latency": latency, "working_set": lay.size,
                "vram": cache if uvm else self.gpu.vram_size, "unit": unit if uvm else None,
                "warm": warm, "n": lay.n, "result": result, "verified": ok, "check": what,
                "modelled_ns": counters["modelled_ns"], "wall_s": wall_s, "setup_s": setup_s,
                "verify_s": verify_s, "counters": counters, "ds_flushed_bytes": flushed,
                "pager": ({"served": getattr(pager, "served", None), "spurious": getattr(pager, "spurious", None),
                           "trace": list(getattr(pager, "trace", ()))[:200]} if pager is not None else None),
                "vfio_backend": self.gpu.device.backend}

    def close(self) -> None:
        if self.gpu is not None and self.gpu.device is not None and self._mappings:
            for reg in (regs.REG_FAR_SIZE_LO, regs.REG_FAR_SIZE_HI, regs.REG_MEM_MODE):
                self.bar0.write32(reg, 0)   # the device forgets the window before it is unmapped
        for m in reversed(self._mappings):
            m.close()
        self._mappings = []
        self._far_view.release()
        self._fault_view.release()   # a pager may still hold it: it stops working, nothing leaks
        self._aux_view.release()
        self._aux.close()

    def __enter__(self) -> "GpuMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.gpu.close()
        self.dax.close()
