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
does it.  A kernel that touches a page not in the device's page table stops with a
replayable fault (a record in the fault buffer, MSI-X vector VEC_FAULT); ``UvmPager``
reads the records, evicts the least recently migrated page when the cache is full
(writing it back if the device marked it dirty), migrates the faulting page into
VRAM through the copy engine (the MIG_* registers: not the ring, where the compute
op waits), maps it in the page table and replays.

A pager is pluggable: ``GpuMemory.run(..., pager=MyPager)`` (or ``launch(layout,
pager)``) takes any object with ``service()`` and ``write_back()``, built as
``MyPager(gpu, faults, page_shift, vram_base, vram_cache)``; docs/guest-library.md,
"Your own pager", is its contract.  ``migrate`` is the copy engine for such a pager.
"""

from __future__ import annotations

import mmap
import os
import time
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ..devices.gpu import regs
from ..devices.gpu.regs import Kernel, Op
from . import cxl
from .dax import DaxMapping
from .drivers.gpu import GpuDriver, GpuError, Transfer
from .vfio.errors import InterruptTimeout

__all__ = ["GpuMemory", "UvmPager", "migrate", "Layout", "layout", "Verifier", "LruCache", "simulate_faults",
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
    else:  # BFS: degree 8, 44 bytes per vertex
        n = _pow2_below(ws // 44)
        lay = Layout(k, n, a=0, aux=8 * n, arg=0)
        lay.idx = _align(8 * (n + 1))
        lay.b = _align(lay.idx + 4 * 8 * n)
    ends = {Kernel.STREAM: lay.a + 8 * lay.n, Kernel.COPY: lay.b + 8 * lay.n,
            Kernel.STENCIL: lay.b + 8 * lay.n, Kernel.GATHER: lay.b + 8 * lay.n,
            Kernel.SCATTER: lay.idx + 4 * lay.n, Kernel.BFS: lay.b + 4 * lay.n}
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

    def capture(self) -> None:
        lay = self.lay
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


# --------------------------------------------------------------------------
# The library
# --------------------------------------------------------------------------
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
        for i, name in enumerate(regs.COUNTERS):
            lo = self.bar0.read32(regs.REG_COUNTERS + 8 * i)
            out[name] = lo | self.bar0.read32(regs.REG_COUNTERS + 8 * i + 4) << 32
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
            warm: bool = False, seed: int = 1, prepared: tuple | None = None, pager=UvmPager) -> dict:
        """Run one kernel; the result dict carries the counters, the modelled and the wall time.

        ``pager`` (mode uvm): the pager's class, or any callable that builds one as
        ``pager(gpu, faults, page_shift, vram_base, vram_cache)`` (docs/guest-library.md,
        "Your own pager")."""
        lay = layout(kernel, working_set)
        self.configure(mode, latency)
        if unit not in UNITS:
            raise GpuMemError(f"unknown migration unit {unit!r}", f"one of {', '.join(UNITS)}")
        shift = UNITS[unit]
        cache = vram_cache if vram_cache is not None else self.gpu.vram_size // 2
        if mode == "uvm":
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
        if mode == "uvm":
            # what every pager starts from: pages of 1 << shift, an empty page table, and no
            # fault record before this one's (FAULT_GET = FAULT_PUT)
            self.bar0.write32(regs.REG_UVM_PAGE_SHIFT, shift)
            self.bar0.write32(regs.REG_FAULT_GET, self.bar0.read32(regs.REG_FAULT_PUT))
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
        t1 = time.perf_counter()
        result = self.launch(lay, pager)
        wall_s = time.perf_counter() - t1
        counters = self.counters()
        staged = self.bar0.read32(regs.REG_DS_PENDING_LINES)
        flushed = self.flush() if staged else 0
        if pager is not None:
            pager.write_back()
        t2 = time.perf_counter()
        ok, what = verifier.check(result)
        verify_s = time.perf_counter() - t2
        return {"kernel": kernel, "mode": mode, "latency": latency, "working_set": lay.size,
                "vram": cache if mode == "uvm" else self.gpu.vram_size, "unit": unit if mode == "uvm" else None,
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
