"""The GPU device model: regions, BAR0 registers and the descriptor-ring engine.

Message handlers (the connection's reader thread) only touch registers under
``self.lock`` and return at once; all DMA happens on the engine thread,
which a doorbell write wakes.  That split is what keeps QEMU alive: a
handler that waited for a DMA round trip would deadlock QEMU's vCPU (it
holds the global lock while waiting for our reply, and its DMA service needs
that lock).

A reset (CONTROL.RESET, VFIO_USER_DEVICE_RESET, or a PCIe FLR) bumps
``generation``; the engine checks it between chunks and abandons the
descriptor it was working on without writing anything more.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import struct
import threading
import time

from ..vfio_user import wire
from ..vfio_user.dma import DmaAborted, DmaFault, DmaPort, FaultKind
from ..vfio_user.irq import IrqTable, irq_types
from ..vfio_user.pci_config import BAR_MEM_64, BAR_PREFETCH, Bar, MsixLayout, PciConfig, PciIdentity
from ..vfio_user.server import Region
from . import regs
from .regs import Op, Status

log = logging.getLogger(__name__)

FETCH_BATCH = 64  # descriptors fetched per ring read
_U32 = struct.Struct("<I")


# how a protocol-level DMA fault shows in the GPU's status codes
FAULT_STATUS = {
    FaultKind.UNMAPPED: Status.DMA_UNMAPPED,
    FaultKind.PERMISSION: Status.DMA_PERMISSION,
    FaultKind.REFUSED: Status.DMA_REFUSED,
    FaultKind.TIMEOUT: Status.DMA_TIMEOUT,
    FaultKind.CLOSED: Status.DMA_ABORTED,
    FaultKind.IO: Status.DMA_REFUSED,
}


def pci_config(vendor_id: int, device_id: int, vram_size: int) -> PciConfig:
    identity = PciIdentity(vendor_id, device_id, regs.PCI_SUBSYSTEM_VENDOR_ID,
                           regs.PCI_SUBSYSTEM_ID, regs.PCI_REVISION, regs.PCI_CLASS_CODE)
    bars = [Bar(regs.BAR_REGS, regs.REGS_SIZE, 0),
            Bar(regs.BAR_VRAM, vram_size, BAR_MEM_64 | BAR_PREFETCH),
            Bar(regs.BAR_MSIX, regs.MSIX_BAR_SIZE, 0)]
    msix = MsixLayout(regs.MSIX_VECTORS, regs.BAR_MSIX, regs.MSIX_TABLE_OFFSET,
                      regs.MSIX_PBA_OFFSET)
    return PciConfig(identity, bars, msix)


class GpuDevice:
    def __init__(self, vram_size: int = regs.DEFAULT_VRAM_SIZE,
                 vendor_id: int = regs.PCI_VENDOR_ID, device_id: int = regs.PCI_DEVICE_ID):
        if vram_size & (vram_size - 1) or not regs.MIN_VRAM_SIZE <= vram_size <= regs.MAX_VRAM_SIZE:
            raise ValueError(f"VRAM size {vram_size} must be a power of two in "
                             f"[{regs.MIN_VRAM_SIZE}, {regs.MAX_VRAM_SIZE}]")
        self.vram_size = vram_size
        # VRAM lives in a memfd so QEMU can mmap it: guest CPU access never reaches us.
        self.vram_fd = os.memfd_create("vfio-cxl-gpu-vram", os.MFD_CLOEXEC)
        os.ftruncate(self.vram_fd, vram_size)
        self._vram_mm = mmap.mmap(self.vram_fd, vram_size, flags=mmap.MAP_SHARED)
        self.vram = memoryview(self._vram_mm)

        self.config = pci_config(vendor_id, device_id, vram_size)
        self.irqs = IrqTable(irq_types(msix_vectors=regs.MSIX_VECTORS))
        self._msix_reset = bytearray(regs.MSIX_VECTORS * regs.MSIX_ENTRY_SIZE)
        for v in range(regs.MSIX_VECTORS):  # vector control: masked at reset
            self._msix_reset[v * regs.MSIX_ENTRY_SIZE + 12] = 1
        self.msix_table = bytearray(self._msix_reset)

        rw = wire.REGION_INFO_FLAG_READ | wire.REGION_INFO_FLAG_WRITE
        self.regions = {i: Region(0, 0) for i in range(wire.PCI_NUM_REGIONS)}
        self.regions[regs.BAR_REGS] = Region(regs.REGS_SIZE, rw)
        self.regions[regs.BAR_VRAM] = Region(
            vram_size, rw | wire.REGION_INFO_FLAG_MMAP | wire.REGION_INFO_FLAG_CAPS, self.vram_fd)
        self.regions[regs.BAR_MSIX] = Region(regs.MSIX_BAR_SIZE, rw)
        self.regions[wire.PCI_CONFIG_REGION] = Region(len(self.config.data), rw)

        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._port: DmaPort | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.resets = 0
        self._load_reset_values()

    # ================================================================ lifetime
    def start(self) -> None:
        self._thread = threading.Thread(target=self._engine_loop, name="gpu-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self.generation += 1
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def close(self) -> None:
        self.stop()
        self.irqs.close_all()
        self.vram.release()
        try:
            self._vram_mm.close()
        except BufferError:  # a VRAM slice kept alive by a reference cycle (a traceback)
            gc.collect()
            self._vram_mm.close()
        os.close(self.vram_fd)

    def attach(self, port: DmaPort | None) -> None:
        """Connect the bus-master port of a (new) client, or None when it leaves."""
        with self._wake:
            self._port = port
            self._wake.notify_all()

    # ================================================================ reset
    def _load_reset_values(self) -> None:
        self.generation = getattr(self, "generation", 0) + 1
        self.scratch = 0
        self.enabled = False
        self.halted = False
        self.busy = False
        self.intr_status = 0
        self.ring_base = self.ring_size = self.head = self.tail = 0
        self.compl_base = self.completed = 0
        self.err_status = self.err_index = self.err_addr = self.err_errno = 0

    def reset(self, *, function_level: bool = False) -> None:
        """Every register to its reset value; the engine drops what it was doing.

        ``function_level`` (VFIO_USER_DEVICE_RESET, PCIe FLR) also resets config
        space and the MSI-X table.  VRAM contents survive, as on real GPUs.
        """
        with self._wake:
            self._load_reset_values()
            if function_level:
                self.config.reset()
                self.msix_table[:] = self._msix_reset
            self.resets += 1
            self._wake.notify_all()
        log.info("device reset (%s)", "function level" if function_level else "CONTROL.RESET")

    # ================================================================ regions
    def region_read(self, index: int, offset: int, count: int):
        if index == regs.BAR_REGS:
            return self._bar0_read(offset, count)
        if index == regs.BAR_VRAM:
            return self.vram[offset:offset + count]
        if index == regs.BAR_MSIX:
            return self._msix_read(offset, count)
        if index == wire.PCI_CONFIG_REGION:
            with self.lock:
                return self.config.read(offset, count)
        raise AssertionError(f"region {index} has no data")

    def region_write(self, index: int, offset: int, data) -> None:
        if index == regs.BAR_REGS:
            self._bar0_write(offset, bytes(data))
        elif index == regs.BAR_VRAM:
            self.vram[offset:offset + len(data)] = data
        elif index == regs.BAR_MSIX:
            self._msix_write(offset, bytes(data))
        elif index == wire.PCI_CONFIG_REGION:
            with self.lock:
                flr = self.config.write(offset, data)
            if flr:
                self.reset(function_level=True)

    def _msix_read(self, offset: int, count: int) -> bytes:
        # PBA (and everything past the table) reads 0: masking is the client's job.
        table = bytes(self.msix_table) + bytes(regs.MSIX_BAR_SIZE - len(self.msix_table))
        return table[offset:offset + count]

    def _msix_write(self, offset: int, data: bytes) -> None:
        end = min(offset + len(data), len(self.msix_table))
        if offset < end:
            self.msix_table[offset:end] = data[:end - offset]

    # ================================================================ BAR0
    def _bar0_read(self, offset: int, count: int) -> bytes:
        first, last = offset & ~3, (offset + count + 3) & ~3
        with self.lock:
            raw = b"".join(_U32.pack(self._reg_read(r)) for r in range(first, last, 4))
        return raw[offset - first:offset - first + count]

    def _bar0_write(self, offset: int, data: bytes) -> None:
        # Split into 32-bit registers with a byte mask, so a partial write of a
        # W1C or doorbell register touches only the bytes actually written.
        first = offset & ~3
        padded = bytes(offset - first) + data
        padded += bytes(-len(padded) % 4)
        with self._wake:
            for i in range(0, len(padded), 4):
                lo, hi = max(offset - first - i, 0), min(offset - first + len(data) - i, 4)
                mask = sum(0xFF << (8 * b) for b in range(lo, hi))
                if mask:
                    self._reg_write(first + i, _U32.unpack_from(padded, i)[0], mask)

    def _reg_read(self, reg: int) -> int:
        if reg == regs.REG_STATUS:
            return ((regs.STATUS_ENABLED if self.enabled else 0)
                    | (regs.STATUS_BUSY if self.busy else 0)
                    | (regs.STATUS_HALTED if self.halted else 0))
        if reg == regs.REG_CONTROL:
            return regs.CONTROL_ENABLE if self.enabled else 0
        values = {
            regs.REG_ID: regs.ID_MAGIC,
            regs.REG_VERSION: regs.DEVICE_VERSION,
            regs.REG_VRAM_SIZE_LO: self.vram_size & 0xFFFFFFFF,
            regs.REG_VRAM_SIZE_HI: self.vram_size >> 32,
            regs.REG_CAPS: regs.CAPS_OPS,
            regs.REG_RING_MAX: regs.RING_SIZE_MAX,
            regs.REG_SCRATCH: self.scratch,
            regs.REG_INTR_STATUS: self.intr_status,
            regs.REG_RING_BASE_LO: self.ring_base & 0xFFFFFFFF,
            regs.REG_RING_BASE_HI: self.ring_base >> 32,
            regs.REG_RING_SIZE: self.ring_size,
            regs.REG_RING_HEAD: self.head,
            regs.REG_RING_TAIL: self.tail,
            regs.REG_COMPL_BASE_LO: self.compl_base & 0xFFFFFFFF,
            regs.REG_COMPL_BASE_HI: self.compl_base >> 32,
            regs.REG_COMPLETED: self.completed,
            regs.REG_ERR_STATUS: self.err_status,
            regs.REG_ERR_DESC_INDEX: self.err_index,
            regs.REG_ERR_ADDR_LO: self.err_addr & 0xFFFFFFFF,
            regs.REG_ERR_ADDR_HI: (self.err_addr >> 32) & 0xFFFFFFFF,
            regs.REG_ERR_ERRNO: self.err_errno,
        }
        return values.get(reg, 0)

    def _reg_write(self, reg: int, value: int, mask: int) -> None:
        """Caller holds the lock.  ``mask`` selects the bytes that were written."""
        def merge(old: int) -> int:
            return (old & ~mask) | (value & mask)

        if reg == regs.REG_SCRATCH:
            self.scratch = merge(self.scratch)
        elif reg == regs.REG_CONTROL:
            bits = value & mask
            if bits & regs.CONTROL_RESET:
                self._load_reset_values()
                self.resets += 1
                self._wake.notify_all()
                log.info("device reset (CONTROL.RESET)")
            elif mask & 0xFF:
                self._set_enable(bool(bits & regs.CONTROL_ENABLE))
        elif reg == regs.REG_INTR_STATUS:
            self.intr_status &= ~(value & mask)
        elif reg == regs.REG_RING_TAIL:
            self._doorbell(merge(self.tail))
        elif reg in _RING_CONFIG_REGS:
            if self.enabled:
                return  # locked while the ring runs
            attr, shift = _RING_CONFIG_REGS[reg]
            old = getattr(self, attr)
            part = merge((old >> shift) & 0xFFFFFFFF)
            setattr(self, attr, (old & ~(0xFFFFFFFF << shift)) | (part << shift))
        # everything else is read-only: ignored

    def _set_enable(self, on: bool) -> None:
        if not on:
            self.enabled = False  # the engine finishes its current descriptor, then idles
            return
        if self.enabled or self.halted:
            return
        size = self.ring_size
        ok = (regs.RING_SIZE_MIN <= size <= regs.RING_SIZE_MAX and not size & (size - 1)
              and self.ring_base % regs.DESC_ALIGN == 0
              and self.compl_base % regs.COMPL_ALIGN == 0
              and self.ring_base + size * regs.DESC_SIZE <= 1 << 64
              and self.compl_base + size * regs.COMPL_SIZE <= 1 << 64
              and self.head < size and self.tail < size)
        if not ok:
            self._halt(Status.BAD_RING_CONFIG, self.head, self.ring_base, 0)
            return
        self.enabled = True
        self._wake.notify_all()

    def _doorbell(self, tail: int) -> None:
        if tail >= self.ring_size:
            self._halt(Status.BAD_TAIL, self.head, tail, 0)
            return
        self.tail = tail
        self._wake.notify_all()

    def _halt(self, status: Status, index: int, addr: int, err: int) -> None:
        """Latch the first error, stop the ring, raise the error vector.  Lock held."""
        if not self.halted:
            self.halted = True
            self.err_status, self.err_index = int(status), index
            self.err_addr, self.err_errno = addr & 0xFFFFFFFFFFFFFFFF, err & 0xFFFFFFFF
            log.warning("ring halted: %s at index %d addr %#x errno %d",
                        status.name, index, addr, err)
        self.intr_status |= regs.INTR_ERROR
        self.irqs.raise_msix(regs.VEC_ERROR)

    # ================================================================ engine
    def kick(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _runnable(self) -> bool:
        return (self.enabled and not self.halted and self.head != self.tail
                and self._port is not None)

    def _engine_loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._runnable():
                    self._wake.wait()
                if self._stopping:
                    return
                job = (self.generation, self._port, self.ring_base, self.ring_size,
                       self.compl_base, self.head, self.tail)
                self.busy = True
            try:
                self._run_batch(*job)
            except Exception:  # a bug here must not silently kill the device
                log.exception("engine failure")
                with self._wake:
                    if self.generation == job[0]:
                        self._halt(Status.DMA_ABORTED, self.head, 0, 0)
            finally:
                with self._wake:
                    self.busy = False

    def _run_batch(self, gen, port, ring_base, size, compl_base, head, tail) -> None:
        def abort() -> None:
            if self.generation != gen:
                raise DmaAborted()

        count = min((tail - head) % size, size - head, FETCH_BATCH)
        ring = bytearray(count * regs.DESC_SIZE)
        try:
            port.read(ring_base + head * regs.DESC_SIZE, memoryview(ring), abort)
        except DmaAborted:
            return
        except DmaFault as fault:
            with self._wake:
                if self.generation == gen:
                    self._halt(Status.RING_FETCH, head, fault.addr, fault.errno)
            return

        for i in range(count):
            index = head + i
            with self._wake:
                if self.generation != gen or not self.enabled:
                    return
            desc = regs.DESC.unpack_from(ring, i * regs.DESC_SIZE)
            started = time.monotonic_ns()
            try:
                status, done, addr, err = self._execute(desc, port, abort)
            except DmaAborted:
                return
            if not self._complete(gen, port, compl_base, index, size, desc, status, done,
                                  addr, err, time.monotonic_ns() - started, abort):
                return

    def _execute(self, desc, port: DmaPort, abort):
        """Run one descriptor -> (status, bytes_done, fault_addr, errno)."""
        src, dst, length, op, flags, reserved, _cookie = desc
        if flags & ~regs.DESC_FLAGS_VALID or reserved:
            return Status.BAD_FLAGS, 0, 0, 0
        if op == Op.NOP:
            return Status.OK, 0, 0, 0
        if op not in (Op.VRAM_TO_HOST, Op.HOST_TO_VRAM, Op.FILL_PATTERN, Op.FILL_PRNG):
            return Status.BAD_OPCODE, 0, 0, 0
        vram_off = src if op == Op.VRAM_TO_HOST else dst
        if vram_off + length > self.vram_size:
            return Status.VRAM_RANGE, 0, vram_off, 0
        window = self.vram[vram_off:vram_off + length]
        try:
            if op == Op.VRAM_TO_HOST:
                port.write(dst, window, abort)
            elif op == Op.HOST_TO_VRAM:
                port.read(src, window, abort)
            elif op == Op.FILL_PATTERN:
                _fill_pattern(window, src)
            else:
                _fill_prng(window, src, abort)
        except DmaFault as fault:
            return FAULT_STATUS[fault.kind], fault.done, fault.addr, fault.errno
        finally:
            window.release()
        return Status.OK, length, 0, 0

    def _complete(self, gen, port, compl_base, index, size, desc, status, done,
                  addr, err, duration, abort) -> bool:
        """Write the completion record, retire or halt, raise the vector.
        Returns False when the ring must stop."""
        cookie, flags = desc[6], desc[4]
        with self._wake:
            if self.generation != gen:
                return False
            seq = (self.completed + 1) & 0xFFFFFFFF
        record = regs.COMPL.pack(cookie, int(status), done, index, seq, duration)
        try:
            port.write(compl_base + index * regs.COMPL_SIZE, record, abort)
        except DmaAborted:
            return False
        except DmaFault as fault:
            with self._wake:
                if self.generation == gen:
                    self._halt(Status.COMPLETION_WRITE if status == Status.OK else status,
                               index, fault.addr if status == Status.OK else addr,
                               fault.errno if status == Status.OK else err)
            return False
        with self._wake:
            if self.generation != gen:
                return False
            if status != Status.OK:
                self._halt(status, index, addr, err)
                return False
            self.head = (index + 1) % size
            self.completed = seq
            if self.head == self.tail:
                self.busy = False  # drained: BUSY must not outlive the last completion
            if flags & regs.DESC_FLAG_INTERRUPT:
                self.intr_status |= regs.INTR_DMA_DONE
                self.irqs.raise_msix(regs.VEC_DMA_DONE)
        return True


_RING_CONFIG_REGS = {
    regs.REG_RING_BASE_LO: ("ring_base", 0),
    regs.REG_RING_BASE_HI: ("ring_base", 32),
    regs.REG_RING_SIZE: ("ring_size", 0),
    regs.REG_COMPL_BASE_LO: ("compl_base", 0),
    regs.REG_COMPL_BASE_HI: ("compl_base", 32),
}


def _fill_pattern(window: memoryview, pattern: int) -> None:
    n = len(window)
    if n == 0:
        return
    unit = regs.pattern_bytes(pattern, min(n, 1 << 16))
    window[:len(unit)] = unit
    filled = len(unit)
    while filled < n:  # doubling copies inside VRAM: no big temporary
        step = min(filled, n - filled)
        window[filled:filled + step] = window[:step]
        filled += step


def _fill_prng(window: memoryview, seed: int, abort) -> None:
    pos = 0
    while pos < len(window):
        abort()
        n = min(regs.PRNG_BLOCK - pos % regs.PRNG_BLOCK, len(window) - pos)
        window[pos:pos + n] = regs.prng_bytes(seed, n, pos)
        pos += n
