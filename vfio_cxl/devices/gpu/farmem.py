"""Far memory for the GPU (interface 1.1): the far window, the memory modes, the UVM
page table and fault path, the migration copy engine, the DS backlog, the counters.

docs/gpu-device.md ("Far memory and compute") is the contract, docs/gpu-memory.md
the model.  The engine owns this object: register writes arrive from
``Engine._step`` (``lock`` held), reads from ``Engine.reg_value`` (``lock`` held);
``execute`` runs COMPUTE and FLUSH on the engine thread; the copy engine is a
thread of its own, so a migration never queues behind a compute op that waits for
its fault to be serviced, and no message handler ever waits for memory.

Data moves for real: operands are read from the far window through the DMA port
(the direct path when the window's DMA_MAP came with an fd: the CXL memory
backend file), computed with numpy, and written back; time on the CXL link is
modelled (model.py) from the events counted here.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

import numpy as np

from ..vfio_user import wire
from ..vfio_user.dma import DmaAborted, DmaFault, FaultKind
from . import compute, model, regs
from .regs import Status

log = logging.getLogger(__name__)

UVM_WALK_WINDOW = 4096  # page touches checked against the page table per look
DEFAULT_TIMEOUT_MS = 5000


def _mig_error(status: Status) -> int:
    """MIG_STATUS of a migration that failed with ``status`` (its code in bits 8-15)."""
    return regs.MIG_ERROR | int(status) << 8


# RW registers kept as one value: a partial write is merged with what the register reads
# (docs/gpu-device.md, "BAR0 registers").  The 64-bit pairs (_set32) and MEM_MODE merge on their
# own; the command registers (UVM_CONTROL, MIG_CONTROL, COUNTER_CONTROL) read 0 and take what
# was written.
_MERGED = frozenset((regs.REG_LATENCY_PROFILE, regs.REG_SR_DEGREE, regs.REG_SR_DISTANCE,
                     regs.REG_DS_BACKLOG_LINES, regs.REG_DS_STAGE_BASE, regs.REG_UVM_PAGE_SHIFT,
                     regs.REG_UVM_FAULT_TIMEOUT_MS, regs.REG_FAULT_ENTRIES, regs.REG_FAULT_GET,
                     regs.REG_PT_INDEX, regs.REG_PT_ENTRY, regs.REG_MIG_LENGTH,
                     regs.REG_UVM_FAULT_AHEAD))
COUNTER_NAMES = regs.COUNTERS[:-1] + regs.COUNTERS2  # what the device counts (modelled_ns: computed)


class OpFailed(Exception):
    def __init__(self, status: Status, addr: int = 0, err: int = 0):
        self.status, self.addr, self.err = status, addr, err
        super().__init__(f"{Status(status).name} at {addr:#x}")


def _set32(old: int, shift: int, value: int, mask: int) -> int:
    part = (((old >> shift) & 0xFFFFFFFF) & ~mask) | (value & mask)
    return (old & ~(0xFFFFFFFF << shift)) | (part << shift)


class FarMemory:
    def __init__(self, engine, fault_status: dict):
        self.engine = engine
        self.fault_status = fault_status  # FaultKind -> Status, the engine's mapping
        self.vram = engine.vram
        self.vram_size = engine.vram_size
        self.ds_lock = threading.Lock()  # the DS backlog: engine thread and copy engine
        self._copy_thread: threading.Thread | None = None
        self.reset()

    # ================================================================ state (engine.lock held)
    def reset(self) -> None:
        """Every 1.1 register to its reset value; the page table empty, the DS backlog
        dropped (staged lines never reach the far window), the counters zero."""
        self.far_base = self.far_size = 0
        self.mode = 0
        self.profile = 0
        self.sr_degree, self.sr_distance = 8, 128
        self.ds_backlog = 4096
        self.ds_stage = max(0, self.vram_size - self.ds_backlog * regs.LINE_SIZE)
        self.page_shift = 16
        self.fault_timeout_ms = DEFAULT_TIMEOUT_MS
        self.fault_base = self.fault_entries = self.fault_put = self.fault_get = 0
        self.fault_seq = 0
        self.fault_ahead = 0
        self.fault_pending = False
        self.fault_overflow = False
        self.stop_pages = frozenset()  # pages the pending stop has records for
        self.replay = self.cancel = False
        self.pt_index = 0
        self.pt = np.full(0, -1, dtype=np.int64)
        self.dirty = np.zeros(0, dtype=bool)
        self.mig_src = self.mig_dst = self.mig_len = 0
        self.mig_status = 0
        self.mig_tag = None  # tag of the last GO accepted
        self.mig_job = None
        self.busy = False  # a COMPUTE/FLUSH op is executing
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self.ds_pending = None  # (far offsets of staged lines: int64 array) or None
        self._resize_pt()

    def _resize_pt(self) -> None:
        pages = -(-self.far_size >> self.page_shift) if self.far_size else 0
        self.pt = np.full(pages, -1, dtype=np.int64)
        self.dirty = np.zeros(pages, dtype=bool)

    @property
    def model(self) -> model.Model:
        return model.Model().with_profile(regs.LATENCY_PROFILES[self.profile])

    def modelled_ns(self) -> int:
        return int(model.modelled_ns(self.counters, self.model)["total_ns"])

    def reg_write(self, reg: int, value: int, mask: int) -> None:
        v = value & mask
        if reg in _MERGED and mask != 0xFFFFFFFF:  # a partial write only touches the bytes written
            v = (self.reg_value(reg) & ~mask | v) & 0xFFFFFFFF
        if reg in (regs.REG_FAR_BASE_LO, regs.REG_FAR_BASE_HI, regs.REG_FAR_SIZE_LO,
                   regs.REG_FAR_SIZE_HI):
            if self.busy or self.mig_status & regs.MIG_BUSY:
                return  # the window does not move under a running op
            shift = 32 if reg in (regs.REG_FAR_BASE_HI, regs.REG_FAR_SIZE_HI) else 0
            if reg in (regs.REG_FAR_BASE_LO, regs.REG_FAR_BASE_HI):
                self.far_base = _set32(self.far_base, shift, value, mask)
            else:
                size = _set32(self.far_size, shift, value, mask)
                if size > regs.FAR_SIZE_MAX:
                    return  # 1.7: ignored (a page table entry per page of a 2^64-byte window)
                self.far_size = size
                self._resize_pt()
        elif reg == regs.REG_MEM_MODE:
            self.mode = (self.mode & ~mask | v) & (regs.MODE_SR | regs.MODE_DS | regs.MODE_UVM)
        elif reg == regs.REG_LATENCY_PROFILE:
            if v < len(regs.LATENCY_PROFILES):
                self.profile = v
        elif reg == regs.REG_SR_DEGREE:
            self.sr_degree = v
        elif reg == regs.REG_SR_DISTANCE:
            self.sr_distance = v
        elif reg == regs.REG_DS_BACKLOG_LINES:
            self.ds_backlog = v
        elif reg == regs.REG_DS_STAGE_BASE:
            self.ds_stage = v
        elif reg == regs.REG_UVM_PAGE_SHIFT:
            if v in regs.UVM_PAGE_SHIFTS and not self.busy:
                self.page_shift = v
                self._resize_pt()
        elif reg == regs.REG_UVM_FAULT_TIMEOUT_MS:
            self.fault_timeout_ms = v
        elif reg in (regs.REG_FAULT_BASE_LO, regs.REG_FAULT_BASE_HI):
            self.fault_base = _set32(self.fault_base, 32 if reg == regs.REG_FAULT_BASE_HI else 0,
                                     value, mask)
        elif reg == regs.REG_FAULT_ENTRIES:
            self.fault_entries = v
            self.fault_put = self.fault_get = 0
        elif reg == regs.REG_FAULT_GET:
            self.fault_get = v % self.fault_entries if self.fault_entries else 0
        elif reg == regs.REG_UVM_CONTROL:
            # only for the fault pending now: a late or repeated command does nothing
            if self.fault_pending and (v >> regs.CMD_TAG_SHIFT) == self.fault_seq & regs.CMD_TAG_MASK:
                if v & regs.UVM_CANCEL:
                    self.cancel = True
                elif v & regs.UVM_REPLAY:
                    self.replay = True
        elif reg == regs.REG_PT_INDEX:
            self.pt_index = v
        elif reg == regs.REG_PT_ENTRY:
            i = self.pt_index
            if i < len(self.pt):
                was_valid = self.pt[i] >= 0
                page = 1 << self.page_shift
                off = v & regs.PTE_ADDR_MASK
                if v & regs.PTE_VALID and off % page == 0 and off + page <= self.vram_size:
                    self.pt[i] = off
                    self.dirty[i] = bool(v & regs.PTE_DIRTY)
                else:
                    self.pt[i] = -1
                    self.dirty[i] = False
                    if was_valid:
                        self.counters["evictions"] += 1
        elif reg in (regs.REG_MIG_SRC_LO, regs.REG_MIG_SRC_HI):
            self.mig_src = _set32(self.mig_src, 32 if reg == regs.REG_MIG_SRC_HI else 0, value, mask)
        elif reg in (regs.REG_MIG_DST_LO, regs.REG_MIG_DST_HI):
            self.mig_dst = _set32(self.mig_dst, 32 if reg == regs.REG_MIG_DST_HI else 0, value, mask)
        elif reg == regs.REG_MIG_LENGTH:
            self.mig_len = v
        elif reg == regs.REG_MIG_CONTROL:
            tag = v >> regs.CMD_TAG_SHIFT
            if v & regs.MIG_GO and not self.mig_status & regs.MIG_BUSY and tag != self.mig_tag:
                self.mig_tag = tag
                self._start_migration()
        elif reg == regs.REG_COUNTER_CONTROL:
            if v & regs.COUNTERS_CLEAR:
                self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        elif reg == regs.REG_UVM_FAULT_AHEAD:
            self.fault_ahead = v

    def _counter_value(self, reg: int) -> int:
        """The counter half at ``reg`` (0x180-0x1FF: COUNTERS, 0x280-0x28F: COUNTERS2)."""
        base, names = ((regs.REG_COUNTERS2, regs.COUNTERS2) if reg >= regs.FARMEM2_FIRST
                       else (regs.REG_COUNTERS, regs.COUNTERS))
        i, hi = divmod(reg - base, 8)
        name = names[i]
        value = self.modelled_ns() if name == "modelled_ns" else self.counters[name]
        return (value >> 32 if hi >= 4 else value) & 0xFFFFFFFF

    def reg_value(self, reg: int) -> int:
        if reg >= regs.REG_COUNTERS:
            return self._counter_value(reg)
        pte = 0
        if reg == regs.REG_PT_ENTRY and self.pt_index < len(self.pt) and self.pt[self.pt_index] >= 0:
            pte = (int(self.pt[self.pt_index]) | regs.PTE_VALID
                   | (regs.PTE_DIRTY if self.dirty[self.pt_index] else 0))
        values = {
            regs.REG_FAR_BASE_LO: self.far_base & 0xFFFFFFFF,
            regs.REG_FAR_BASE_HI: self.far_base >> 32,
            regs.REG_FAR_SIZE_LO: self.far_size & 0xFFFFFFFF,
            regs.REG_FAR_SIZE_HI: self.far_size >> 32,
            regs.REG_MEM_MODE: self.mode,
            regs.REG_LATENCY_PROFILE: self.profile,
            regs.REG_SR_DEGREE: self.sr_degree,
            regs.REG_SR_DISTANCE: self.sr_distance,
            regs.REG_DS_BACKLOG_LINES: self.ds_backlog,
            regs.REG_DS_STAGE_BASE: self.ds_stage,
            regs.REG_UVM_PAGE_SHIFT: self.page_shift,
            regs.REG_UVM_FAULT_TIMEOUT_MS: self.fault_timeout_ms,
            regs.REG_FAULT_BASE_LO: self.fault_base & 0xFFFFFFFF,
            regs.REG_FAULT_BASE_HI: self.fault_base >> 32,
            regs.REG_FAULT_ENTRIES: self.fault_entries,
            regs.REG_FAULT_PUT: self.fault_put,
            regs.REG_FAULT_GET: self.fault_get,
            regs.REG_UVM_STATUS: ((regs.UVM_FAULT_PENDING if self.fault_pending else 0)
                                  | (regs.UVM_FAULT_OVERFLOW if self.fault_overflow else 0)),
            regs.REG_UVM_FAULT_AHEAD: self.fault_ahead,
            regs.REG_PT_INDEX: self.pt_index,
            regs.REG_PT_ENTRY: pte,
            regs.REG_MIG_SRC_LO: self.mig_src & 0xFFFFFFFF,
            regs.REG_MIG_SRC_HI: self.mig_src >> 32,
            regs.REG_MIG_DST_LO: self.mig_dst & 0xFFFFFFFF,
            regs.REG_MIG_DST_HI: self.mig_dst >> 32,
            regs.REG_MIG_LENGTH: self.mig_len,
            regs.REG_MIG_STATUS: self.mig_status,
            regs.REG_DS_PENDING_LINES: len(self.ds_pending) if self.ds_pending is not None else 0,
            regs.REG_CAPS2: regs.CAPS2,
        }
        return values.get(reg, 0)

    # ================================================================ address space
    def far_range(self, addr: int, size: int) -> bool:
        off = addr - regs.FAR_DEVADDR
        return addr >= regs.FAR_DEVADDR and off + size <= self.far_size

    def vram_range(self, addr: int, size: int) -> bool:
        return 0 <= addr and addr + size <= self.vram_size

    # ================================================================ copy engine
    def start(self) -> None:
        self._copy_thread = threading.Thread(target=self._copy_loop, name="gpu-copy-engine",
                                             daemon=True)
        self._copy_thread.start()

    def join(self) -> None:
        if self._copy_thread is not None:
            self._copy_thread.join(timeout=10)
            self._copy_thread = None

    def _start_migration(self) -> None:
        """MIG_GO (engine.lock held): check, then hand the copy to the copy engine.  MIG_STATUS
        changes here, before the device answers the next message: BUSY, or ERROR at once."""
        src, dst, length = self.mig_src, self.mig_dst, self.mig_len
        far_to_vram = self.far_range(src, length) and self.vram_range(dst, length)
        vram_to_far = self.vram_range(src, length) and self.far_range(dst, length)
        if length == 0 or length % regs.LINE_SIZE or not (far_to_vram or vram_to_far):
            self.mig_status = _mig_error(Status.FAR_RANGE)
            return
        if not self.engine.bus_master:  # no DMA without Bus Master Enable
            self.mig_status = _mig_error(Status.DMA_ABORTED)
            return
        self.mig_status = regs.MIG_BUSY
        prefetched = self._prefetched_bytes(src, length) if far_to_vram else 0
        self.mig_job = (self.engine.epoch, self.engine.port, src, dst, length, far_to_vram, prefetched)

    def _prefetched_bytes(self, src: int, length: int) -> int:
        """Bytes of far [src, src + length) in pages the pending stop has no record for (none
        when no stop is pending: a migration outside a stop is not a prefetch)."""
        if not self.fault_pending:
            return 0
        shift = self.page_shift
        first, end = src - regs.FAR_DEVADDR, src - regs.FAR_DEVADDR + length
        out = 0
        for page in range(first >> shift, ((end - 1) >> shift) + 1):
            if page not in self.stop_pages:
                out += min(end, (page + 1) << shift) - max(first, page << shift)
        return out

    def drop_migration(self) -> None:
        """The device dropped its work (engine.lock held, the epoch already bumped): a migration
        in flight ends now, in ERROR (DMA_ABORTED), never to be finished by the copy engine."""
        self.mig_job = None
        if self.mig_status & regs.MIG_BUSY:
            self.mig_status = _mig_error(Status.DMA_ABORTED)

    def _copy_loop(self) -> None:
        eng = self.engine
        while True:
            with eng.lock:
                while not eng.stopping and self.mig_job is None:
                    eng.lock.wait()
                if eng.stopping:
                    return
                job, self.mig_job = self.mig_job, None
                far_base = self.far_base
            epoch, port, src, dst, length, far_to_vram, prefetched = job

            def stale() -> bool:
                return eng.epoch != epoch

            status = 0
            try:
                if port is None:
                    raise OpFailed(Status.DMA_ABORTED, 0, errno.ENOTCONN)
                self.flush(port, stale)  # the far bytes first, if DS left some staged
                if far_to_vram:
                    window = self.vram[dst:dst + length]
                    try:
                        port.read(far_base + src - regs.FAR_DEVADDR, window, stale)
                    finally:
                        window.release()
                else:
                    window = self.vram[src:src + length]
                    try:
                        port.write(far_base + dst - regs.FAR_DEVADDR, window, stale)
                    finally:
                        window.release()
            except DmaAborted:
                continue
            except OpFailed as failed:
                status = failed.status
            except DmaFault as fault:
                if fault.kind == FaultKind.CLOSED:
                    continue
                status = self.fault_status[fault.kind]
            except Exception:  # a bug must not kill the copy engine
                log.exception("copy engine failure")
                status = Status.DMA_ABORTED
            with eng.lock:
                if eng.epoch != epoch:
                    continue  # dropped: drop_migration (or a reset) has set MIG_STATUS
                if status:
                    self.mig_status = _mig_error(status)
                else:
                    self.mig_status = regs.MIG_DONE
                    self.counters["bytes_migrated"] += length
                    if far_to_vram:
                        self.counters["migrations"] += 1
                        self.counters["prefetched_bytes"] += prefetched
                eng.lock.notify_all()

    # ================================================================ memory access (engine thread)
    def _vram_copy(self, dst, src, stale) -> None:
        with self.engine.gate:
            if stale():
                raise DmaAborted()
            dst[:] = src

    def _load(self, cfg, port, stale, addr: int, size: int) -> np.ndarray:
        buf = np.empty(size, dtype=np.uint8)
        if self.vram_range(addr, size):
            self._vram_copy(buf, np.frombuffer(self.vram[addr:addr + size], np.uint8), stale)
            return buf
        off = addr - regs.FAR_DEVADDR
        for pos, n, vram_off in self._pieces(cfg, off, size):
            if vram_off is None:
                port.read(cfg["far_base"] + off + pos, memoryview(buf[pos:pos + n]), stale)
            else:
                self._vram_copy(buf[pos:pos + n],
                                np.frombuffer(self.vram[vram_off:vram_off + n], np.uint8), stale)
        return buf

    def _store(self, cfg, port, stale, addr: int, data: np.ndarray, skip=None) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8)
        if self.vram_range(addr, len(raw)):
            self._vram_copy(np.frombuffer(self.vram, np.uint8)[addr:addr + len(raw)], raw, stale)
            return
        off = addr - regs.FAR_DEVADDR
        for pos, n, vram_off in self._pieces(cfg, off, len(raw), skip):
            if vram_off is None:
                port.write(cfg["far_base"] + off + pos, memoryview(raw[pos:pos + n]), stale)
            else:
                self._vram_copy(np.frombuffer(self.vram, np.uint8)[vram_off:vram_off + n],
                                raw[pos:pos + n], stale)

    def _pieces(self, cfg, off: int, size: int, skip=None):
        """(position, bytes, VRAM offset or None for the far window) covering far
        [off, off+size): with a page table, resident pages come from VRAM; ``skip``
        (sorted far line numbers) are left out (DS keeps them staged)."""
        pt = cfg["pt"]
        if pt is None and skip is None:
            yield 0, size, None
            return
        if pt is None:  # DS: everything but the staged lines
            first, last = off // regs.LINE_SIZE, (off + size - 1) // regs.LINE_SIZE
            s = skip[(skip >= first) & (skip <= last)]
            pos = 0
            for line in s.tolist():
                start = line * regs.LINE_SIZE - off
                if start > pos:
                    yield pos, start - pos, None
                pos = max(pos, start + regs.LINE_SIZE)
            if pos < size:
                yield pos, size - pos, None
            return
        shift = cfg["page_shift"]
        pos = 0
        while pos < size:
            page = (off + pos) >> shift
            in_page = min(size - pos, ((page + 1) << shift) - (off + pos))
            base = int(pt[page])
            if base >= 0:
                yield pos, in_page, base + (off + pos) - (page << shift)
                pos += in_page
                continue
            n = in_page  # coalesce a run of far pages
            while pos + n < size and pt[(off + pos + n) >> shift] < 0:
                n += min(size - pos - n, 1 << shift)
            yield pos, n, None
            pos += n

    # ================================================================ DS backlog
    def flush(self, port, stale) -> int:
        """Write the staged DS lines to the far window; returns the lines written."""
        with self.ds_lock:
            pending = self.ds_pending
            if pending is None or not len(pending):
                return 0
            with self.engine.lock:
                far_base, stage = self.far_base, self.ds_stage
            staged = np.frombuffer(self.vram, np.uint8)
            # runs of consecutive lines go out as one write each
            breaks = np.flatnonzero(np.diff(pending) != 1) + 1
            slot = 0
            for run in np.split(pending, breaks):
                n = len(run) * regs.LINE_SIZE
                src = stage + slot * regs.LINE_SIZE
                port.write(far_base + int(run[0]) * regs.LINE_SIZE,
                           memoryview(staged[src:src + n]), stale)
                slot += len(run)
            with self.engine.lock:
                self.ds_pending = None
            return len(pending)

    # ================================================================ ops (engine thread)
    def execute(self, op: int, src: int, dst: int, length: int, port, stale):
        """COMPUTE / FLUSH -> (status, bytes_done, fault_addr, errno)."""
        with self.engine.lock:
            self.busy = True
        try:
            if op == regs.Op.FLUSH:
                if src or dst or length:   # ERR_ADDR: the first of them that is not 0
                    raise OpFailed(Status.BAD_KERNEL, next(v for v in (src, dst, length) if v))
                return Status.OK, self.flush(port, stale) * regs.LINE_SIZE, 0, 0
            return self._compute(src, dst, length, port, stale)
        except OpFailed as failed:
            return failed.status, 0, failed.addr, failed.err
        except DmaFault as fault:
            if fault.kind == FaultKind.CLOSED:  # client gone: the DISCONNECT input decides
                raise DmaAborted() from None
            return self.fault_status[fault.kind], 0, fault.addr, fault.errno
        except compute.KernelError as bad:
            log.info("kernel refused: %s", bad)
            return Status.BAD_KERNEL, 0, bad.detail, 0
        finally:
            with self.engine.lock:
                self.busy = False
                self.fault_pending = False

    def _config(self) -> dict:
        with self.engine.lock:
            return {"far_base": self.far_base, "far_size": self.far_size, "mode": self.mode,
                    "model": self.model, "sr": (self.sr_degree, self.sr_distance),
                    "ds": (self.ds_backlog, self.ds_stage), "page_shift": self.page_shift,
                    "fault_ahead": self.fault_ahead,
                    "pt": self.pt.copy() if self.mode & regs.MODE_UVM else None}

    def _compute(self, src, dst, length, port, stale):
        if dst:   # ERR_ADDR: the bad value (dst first, then length)
            raise OpFailed(Status.BAD_KERNEL, dst)
        if length != regs.KERNEL_PARAMS.size:
            raise OpFailed(Status.BAD_KERNEL, length)
        raw = bytearray(regs.KERNEL_PARAMS.size)
        port.read(src, memoryview(raw), stale)
        kernel, reserved, n, a, b, idx, aux, arg, _ = regs.KERNEL_PARAMS.unpack(raw)
        if reserved:
            raise OpFailed(Status.BAD_KERNEL, reserved)
        cfg = self._config()
        mode = cfg["mode"]
        if mode & regs.MODE_UVM and mode & (regs.MODE_SR | regs.MODE_DS):
            raise OpFailed(Status.BAD_MODE, mode)
        degree, distance = cfg["sr"]   # BAD_MODE's ERR_ADDR: the register value that is bad
        if mode & regs.MODE_SR:
            if not 1 <= degree <= regs.SR_MAX_DEGREE:
                raise OpFailed(Status.BAD_MODE, degree)
            if distance < 1 or degree + distance > regs.SR_BUFFER_LINES:
                raise OpFailed(Status.BAD_MODE, distance)
        backlog, stage = cfg["ds"]
        if mode & regs.MODE_DS:
            if not 1 <= backlog <= regs.DS_MAX_BACKLOG_LINES:
                raise OpFailed(Status.BAD_MODE, backlog)
            if stage % regs.LINE_SIZE or stage + backlog * regs.LINE_SIZE > self.vram_size:
                raise OpFailed(Status.BAD_MODE, stage)
        ops = compute.operands(kernel, n, a, b, idx, aux, arg)
        touches_far = False
        for o in ops:
            if self.far_range(o.addr, o.size) and cfg["far_size"]:
                touches_far = True
                need = wire.DMA_MAP_FLAG_READ | (wire.DMA_MAP_FLAG_WRITE if o.writes else 0)
                # like an IOMMU: the whole operand is checked before anything moves
                port.table.check(cfg["far_base"] + o.addr - regs.FAR_DEVADDR, o.size, need)
            elif not self.vram_range(o.addr, o.size):
                raise OpFailed(Status.FAR_RANGE, o.addr)
        if touches_far:
            self.flush(port, stale)  # staged lines are newer than the far window
        # ---- the kernel: values and access stream
        run = compute.run(kernel, n, a, b, idx, aux, arg,
                          lambda addr, size: self._load(cfg, port, stale, addr, size))
        lines, writes, pcs = run.lines, run.is_write, run.pcs
        far = lines >= (regs.FAR_DEVADDR // regs.LINE_SIZE)
        c = dict.fromkeys(regs.COUNTERS[:-1], 0)
        c["vram_lines"] = int((~far).sum())
        skip = None
        if mode & regs.MODE_UVM:
            self._uvm_walk(cfg, port, stale, lines[far], writes[far])
            c["vram_lines"] += int(far.sum())
            cfg["pt"] = self._config()["pt"]  # where the pages are now
        else:
            rd, wr = far & ~writes, far & writes
            reads = int(rd.sum())
            if mode & regs.MODE_SR:
                sr = model.speculative_reads(lines[rd], pcs[rd], degree, distance, cfg["model"])
                c.update(sr_issued=sr.issued, sr_hits=sr.hits, sr_late=sr.late,
                         sr_wasted=sr.wasted, sr_throttled=sr.throttled)
                reads -= sr.hits
            c["far_lines_read"] = reads
            c["far_lines_written"] = int(wr.sum())
            if mode & regs.MODE_DS:
                ds = model.deterministic_store(writes[far], backlog, cfg["model"])
                c.update(ds_staged=ds.staged, ds_stalls=ds.stalls, ds_backlog_hwm=ds.hwm)
                c["vram_lines"] += ds.staged
                wlines = lines[wr] - regs.FAR_DEVADDR // regs.LINE_SIZE
                # the last `pending` lines written (latest write of each) stay staged
                _, last_at = np.unique(wlines[::-1], return_index=True)
                order = np.sort(len(wlines) - 1 - last_at)
                skip = np.sort(wlines[order[len(order) - min(ds.pending, backlog):]])
        # ---- the bytes
        for addr, data in run.outputs:
            self._store(cfg, port, stale, addr, data, skip)
        if skip is not None and len(skip):
            self._stage(cfg, port, run.outputs, skip, stale)
        with self.engine.lock:
            if stale():
                raise DmaAborted()
            for k, v in c.items():
                if k == "ds_backlog_hwm":
                    self.counters[k] = max(self.counters[k], v)
                else:
                    self.counters[k] += v
            if skip is not None and len(skip):
                self.ds_pending = skip
        port.write(src + regs.KERNEL_RESULT_OFFSET,
                   memoryview((run.result & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")), stale)
        return Status.OK, min(n, 0xFFFFFFFF), 0, 0

    def _stage(self, cfg, port, outputs, skip, stale) -> None:
        """Copy the new bytes of the lines DS keeps back into the staging area (slot order =
        ``skip`` order, which ``flush`` follows)."""
        _, stage = cfg["ds"]
        vram = np.frombuffer(self.vram, np.uint8)
        line0 = regs.FAR_DEVADDR // regs.LINE_SIZE
        staged = np.zeros(len(skip) * regs.LINE_SIZE, dtype=np.uint8)
        for addr, data in outputs:
            raw = np.ascontiguousarray(data).view(np.uint8)
            start_line = (addr // regs.LINE_SIZE) - line0
            end_line = (addr + len(raw) - 1) // regs.LINE_SIZE - line0
            sel = np.flatnonzero((skip >= start_line) & (skip <= end_line))
            for i in sel.tolist():
                line_off = (int(skip[i]) + line0) * regs.LINE_SIZE - addr
                lo, hi = max(0, line_off), min(len(raw), line_off + regs.LINE_SIZE)
                slot = staged[i * regs.LINE_SIZE:(i + 1) * regs.LINE_SIZE]
                if lo > line_off or hi < line_off + regs.LINE_SIZE:  # the output covers it in part:
                    port.read(cfg["far_base"] + int(skip[i]) * regs.LINE_SIZE,  # the rest as it is
                              memoryview(slot), stale)
                slot[lo - line_off:hi - line_off] = raw[lo:hi]
        self._vram_copy(vram[stage:stage + len(staged)], staged, stale)

    # ================================================================ UVM
    def _uvm_walk(self, cfg, port, stale, far_lines: np.ndarray, far_writes: np.ndarray) -> None:
        """Every page of the stream resident, in stream order: a page not in the page table
        stops the op with replayable faults until the driver replays.  A stop reports the
        touches of non-resident pages within ``UVM_FAULT_AHEAD`` lines of the stream from
        the first (the accesses of the warps in flight; 0: that one touch alone)."""
        shift = cfg["page_shift"] - 6
        pages = (far_lines - regs.FAR_DEVADDR // regs.LINE_SIZE) >> shift
        if not len(pages):
            return
        keep = np.ones(len(pages), dtype=bool)
        keep[1:] = pages[1:] != pages[:-1]
        # a run of accesses to one page is one touch; written if any access of the run writes
        run_id = np.cumsum(keep) - 1
        touches = pages[keep]
        starts = np.flatnonzero(keep)  # the stream position (line) where each touch begins
        touch_write = np.zeros(len(touches), dtype=bool)
        touch_write[run_id[far_writes]] = True
        i, n = 0, len(touches)
        while i < n:
            with self.engine.lock:
                seg = touches[i:i + UVM_WALK_WINDOW]
                valid = self.pt[seg] >= 0
                upto = len(seg) if valid.all() else int(np.argmin(valid))
                # the device sets DIRTY when it writes a resident page (an eviction writes it back)
                self.dirty[seg[:upto][touch_write[i:i + upto]]] = True
            i += upto
            if upto < len(seg):
                end = max(i + 1, int(np.searchsorted(starts, starts[i] + cfg["fault_ahead"])))
                self._stop(cfg, stale, port, touches[i:end], touch_write[i:end])

    def _stop(self, cfg, stale, port, pages: np.ndarray, writes: np.ndarray) -> None:
        """One stop on replayable faults: a record for each touch of a non-resident page among
        ``pages`` (the first is one), as many as the fault buffer has free records for (the
        rest set UVM_STATUS.OVERFLOW and fault again after the replay); then wait for it."""
        eng = self.engine
        shift = cfg["page_shift"]
        with eng.lock:
            entries, base, put = self.fault_entries, self.fault_base, self.fault_put
            free = (self.fault_get - put - 1) % entries if entries else 0
            if not free:  # nowhere to report it
                raise OpFailed(Status.FAULT_TIMEOUT, regs.FAR_DEVADDR + (int(pages[0]) << shift))
            missing = np.flatnonzero(self.pt[pages] < 0)
            take = missing[:free]
            self.fault_overflow = len(missing) > free
            records = []
            for k in take.tolist():
                self.fault_seq = (self.fault_seq + 1) & 0xFFFFFFFF or 1
                records.append(regs.FAULT_RECORD.pack(regs.FAR_DEVADDR + (int(pages[k]) << shift),
                                                      regs.FAULT_WRITE if writes[k] else 0, self.fault_seq))
            self.replay = self.cancel = False
            timeout = self.fault_timeout_ms / 1000
        for j, record in enumerate(records):
            port.write(base + (put + j) % entries * regs.FAULT_RECORD.size, memoryview(record), stale)
        first = regs.FAR_DEVADDR + (int(pages[0]) << shift)
        deadline = time.monotonic() + timeout
        with eng.lock:
            if stale():
                raise DmaAborted()
            self.fault_put = (put + len(records)) % entries
            self.stop_pages = frozenset(pages[take].tolist())
            self.fault_pending = True
            self.counters["faults"] += len(records)
            self.counters["fault_batches"] += 1
            eng.raise_fault()
            while not (self.replay or self.cancel or stale() or eng.stopping):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                eng.lock.wait(left)
            self.fault_pending = False
            self.stop_pages = frozenset()
            if stale() or eng.stopping:
                raise DmaAborted()
            if self.cancel:
                raise OpFailed(Status.FAULT_CANCELLED, first)
            if not self.replay:
                log.warning("fault at %#x not replayed within %.1f s", first, timeout)
                raise OpFailed(Status.FAULT_TIMEOUT, first, errno.ETIMEDOUT)
            self.replay = False
