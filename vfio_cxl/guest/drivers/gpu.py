"""The GPU's userspace driver: VFIO (vfio_cxl.guest.vfio) + the register map (vfio_cxl.devices.gpu.regs).

    with GpuDriver.open() as gpu:
        with gpu.map(dax_mapping.map, iova=GpuDriver.DATA_IOVA):
            gpu.vram_write(0, b"hello")
            gpu.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=GpuDriver.DATA_IOVA, length=5)])

Set-up: reset the device, allocate the descriptor ring and the completion
area in one page-aligned buffer, DMA-map it, program the ring registers,
enable MSI-X (vector 0 = DMA done, 1 = error) and the ring.  ``run`` writes
descriptors, rings the tail doorbell and waits on the eventfds; a device
error becomes a ``GpuDmaError`` naming the failed descriptor, and the ring is
reset so the driver stays usable.

Every completion record is checked against what was submitted in that slot
(docs/gpu-device.md, "Completion record"): its ``index``, ``cookie`` and
``seq`` (descriptors retired since reset, plus one).  A record that does not
match -- all zero, another slot's, left over from an earlier round -- is a
``GpuCompletionError``, never a success; so is a matching record that
``COMPLETED`` does not count (a record written just before a drop looks
right).  ``reset`` reads a register after the reset write before it zeroes
the ring and the records, so no record of dropped work lands afterwards.
``submit`` refuses more descriptors than the ring has free slots.
"""

from __future__ import annotations

import contextlib

import mmap
from dataclasses import dataclass

from ...devices.gpu import regs
from ...devices.gpu.regs import Op, Status
from ..vfio import DmaMapping, VfioPciDevice, find_pci_devices, uapi
from ..vfio.errors import InterruptError, VfioError
from ..vfio.interrupts import wait_readable

__all__ = ["GpuDriver", "Transfer", "Op", "Status", "GpuError", "GpuRemovedError", "GpuCompletionError",
           "GpuDmaError"]


PCI_COMMAND = 0x04
PCI_COMMAND_MEMORY = 0x2
PCI_COMMAND_MASTER = 0x4


class GpuError(VfioError):
    pass


class GpuRemovedError(GpuError):
    """The kernel asked the driver to release the GPU (hot-removal, surprise or not)."""


class GpuCompletionError(GpuError):
    """A completion record that was not written for the descriptor it should answer."""


class GpuDmaError(GpuError):
    def __init__(self, index: int, cookie: int, status: int, address: int, errno: int):
        self.index, self.cookie, self.status, self.address, self.errno = index, cookie, status, address, errno
        name = Status(status).name if status in Status._value2member_map_ else str(status)
        super().__init__(
            f"GPU descriptor {index} (cookie {cookie:#x}) failed: {name} at {address:#x}"
            + (f" (errno {errno})" if errno else ""),
            "map the IOVA range with VFIO_IOMMU_MAP_DMA before submitting" if status in
            (Status.DMA_UNMAPPED, Status.DMA_REFUSED) else "see docs/gpu-device.md for the status code")


@dataclass(frozen=True)
class Transfer:
    op: Op
    src: int
    dst: int
    length: int
    cookie: int = 0


class GpuDriver:
    RING_ENTRIES = 256
    CONTROL_IOVA = 0x0010_0000      # ring + completion area
    BOUNCE_IOVA = 0x1000_0000       # guest RAM buffers (route A)
    DATA_IOVA = 0x4000_0000         # CXL devdax (route B)

    def __init__(self, device: VfioPciDevice, control_iova: int | None = None):
        self.device = device
        if control_iova is not None:   # two GPUs in one container need two control areas
            self.CONTROL_IOVA = control_iova
        # A userspace driver enables bus mastering itself (vfio-pci leaves it
        # off): without it QEMU drops the device's MSI-X writes.
        command = device.config.read16(PCI_COMMAND)
        device.config.write16(PCI_COMMAND, command | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER)
        self.bar0 = device.bar(regs.BAR_REGS)
        self.vram = device.bar(regs.BAR_VRAM)
        self.vram_size = self.bar0.read32(regs.REG_VRAM_SIZE_LO) | self.bar0.read32(regs.REG_VRAM_SIZE_HI) << 32
        ring_bytes = self.RING_ENTRIES * regs.DESC_SIZE
        self._control = mmap.mmap(-1, 2 * ring_bytes)
        self._control_view = memoryview(self._control)
        self._control_dma = device.map_dma(self._control, self.CONTROL_IOVA)
        self._ring = self._control_view[:ring_bytes]
        self._completions = self._control_view[ring_bytes:]
        try:
            self.vectors, self.irq_mode = self._enable_interrupts(device)
            self.request = device.release_request()
            self._tail = 0
            self._retired = 0          # descriptors the device retired since reset (mirrors COMPLETED)
            self._inflight: dict[int, tuple[int, int]] = {}   # ring index -> (cookie, expected seq)
            self.reset()
        except BaseException:
            # In a shared container (peer-to-peer) the control area's mapping is the container's,
            # not the device's: unmap it here, or it outlives this device and the owner's later
            # unmap fails (EINVAL once the last device left), hiding this error
            self._ring.release()
            self._completions.release()
            self._control_dma.close()
            self._control_view.release()
            self._control.close()
            raise

    @staticmethod
    def _enable_interrupts(device):
        """MSI-X (4 vectors), or MSI when the GPU runs with --irq-mode msi: 4 vectors if
        the platform grants them, else 1 (the device then folds both onto vector 0)."""
        if device.irq_info(uapi.VFIO_PCI_MSIX_IRQ_INDEX).count >= regs.MSIX_VECTORS:
            return device.msix(regs.MSIX_VECTORS), "msix"
        try:
            return device.interrupts(uapi.VFIO_PCI_MSI_IRQ_INDEX, regs.MSI_VECTORS), "msi"
        except InterruptError:  # no multi-message MSI here
            return device.interrupts(uapi.VFIO_PCI_MSI_IRQ_INDEX, 1), "msi"

    def release_requested(self) -> bool:
        return self.request is not None and self.request.pending(0) > 0

    def _fired(self, timeout: float) -> dict:
        """{vector: count} that fired; with one folded MSI vector, INTR_STATUS says which.
        A release request from the kernel while waiting raises GpuRemovedError."""
        if self.request is not None:
            wait_readable((*self.vectors.eventfds, *self.request.eventfds), timeout)
            if self.release_requested():
                raise GpuRemovedError(
                    "the host is removing this GPU (vfio-pci release request): the driver stopped",
                    "the GPU left this VM (vfio-cxl fm status on the host); close it and use another")
            timeout = 0
        fired = self.vectors.wait_any(timeout)
        if len(self.vectors.eventfds) > regs.VEC_ERROR:
            return fired
        status = self.bar0.read32(regs.REG_INTR_STATUS)
        self.bar0.write32(regs.REG_INTR_STATUS, status)   # W1C what we handle
        return {v: 1 for v, bit in ((regs.VEC_DMA_DONE, regs.INTR_DMA_DONE),
                                    (regs.VEC_ERROR, regs.INTR_ERROR)) if status & bit}

    @classmethod
    def open(cls, bdf: str | None = None, *, container=None, ioas=None, backend: str | None = None,
             control_iova: int | None = None) -> "GpuDriver":
        """``container`` (type1) or ``ioas`` (an iommufd context): join a shared IOMMU
        context (peer-to-peer DMA); then give each GPU its own ``control_iova``.  ``backend``
        (as VfioPciDevice.open takes it; default auto) for a context of its own."""
        if bdf is None:
            found = find_pci_devices(regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID)
            if not found:
                raise GpuError(f"no GPU [{regs.PCI_VENDOR_ID:04x}:{regs.PCI_DEVICE_ID:04x}] in this VM",
                               "boot a topology with gpu = true (vfio-cxl vm up single)")
            bdf = found[0]
        device = VfioPciDevice.open(bdf, container=container, ioas=ioas, backend=backend)
        try:
            if device.bar(regs.BAR_REGS).read32(regs.REG_ID) != regs.ID_MAGIC:
                raise GpuError(f"{bdf} does not answer with the GPU's ID register", "is it the vfio-cxl GPU?")
            return cls(device, control_iova)
        except BaseException:
            device.close()
            raise

    # -- set-up ---------------------------------------------------------------
    def reset(self) -> None:
        """Device reset, then program the ring and enable it (also after an error)."""
        self.bar0.write32(regs.REG_CONTROL, regs.CONTROL_RESET)
        # BAR writes are posted: this read returns only once the reset took effect,
        # so no record of the dropped work can land on the zeroes below
        # (docs/gpu-device.md, "Dropped descriptor")
        self.bar0.read32(regs.REG_STATUS)
        ring_bytes = self.RING_ENTRIES * regs.DESC_SIZE
        compl = self.CONTROL_IOVA + ring_bytes
        self._control_view[:] = bytes(len(self._control_view))
        for reg, value in ((regs.REG_RING_BASE_LO, self.CONTROL_IOVA & 0xFFFFFFFF),
                           (regs.REG_RING_BASE_HI, self.CONTROL_IOVA >> 32),
                           (regs.REG_RING_SIZE, self.RING_ENTRIES),
                           (regs.REG_COMPL_BASE_LO, compl & 0xFFFFFFFF),
                           (regs.REG_COMPL_BASE_HI, compl >> 32),
                           (regs.REG_CONTROL, regs.CONTROL_ENABLE)):
            self.bar0.write32(reg, value)
        if not self.bar0.read32(regs.REG_STATUS) & regs.STATUS_ENABLED:
            raise GpuError("the GPU refused the ring configuration",
                           f"ERR_STATUS={self.bar0.read32(regs.REG_ERR_STATUS)}")
        self._tail = 0
        self._retired = 0
        self._inflight.clear()
        for vector in range(min(len(self.vectors.eventfds), regs.VEC_ERROR + 1)):
            self.vectors.pending(vector)   # drain stale events

    def map(self, buffer, iova: int) -> DmaMapping:
        """DMA-map ``buffer`` (an mmap: devdax, anonymous, ...) at ``iova`` for the GPU."""
        return self.device.map_dma(buffer, iova)

    # -- VRAM ----------------------------------------------------------------
    def vram_write(self, offset: int, data: bytes) -> None:
        self.vram.write(offset, data)

    def vram_read(self, offset: int, length: int) -> bytes:
        return self.vram.read(offset, length)

    # -- transfers -------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Descriptors that can be submitted now (the ring keeps one slot empty)."""
        return self.RING_ENTRIES - 1 - len(self._inflight)

    def submit(self, transfers: list[Transfer]) -> list[int]:
        """Queue transfers (interrupt on the last) and ring the doorbell; returns ring indices."""
        if not transfers:
            raise GpuError("nothing to submit", "pass at least one Transfer")
        if len(transfers) > self.free_slots:
            raise GpuError(f"{len(transfers)} transfers do not fit: {self.free_slots} of the "
                           f"{self.RING_ENTRIES}-entry ring are free",
                           "wait for the outstanding transfers, or submit fewer at a time")
        indices = []
        seq = self._retired + len(self._inflight)
        for i, t in enumerate(transfers):
            index = self._tail
            flags = regs.DESC_FLAG_INTERRUPT if i == len(transfers) - 1 else 0
            cookie = t.cookie or ((seq + i + 1) << 16 | index)
            start = index * regs.DESC_SIZE
            self._completions[index * regs.COMPL_SIZE:(index + 1) * regs.COMPL_SIZE] = bytes(regs.COMPL_SIZE)
            self._ring[start:start + regs.DESC_SIZE] = regs.pack_descriptor(
                t.op, t.src, t.dst, t.length, flags, cookie)
            self._inflight[index] = (cookie, (seq + i + 1) & 0xFFFFFFFF)
            indices.append(index)
            self._tail = (index + 1) % self.RING_ENTRIES
        self.bar0.write32(regs.REG_RING_TAIL, self._tail)   # the doorbell
        return indices

    def completion(self, index: int) -> dict:
        start = index * regs.COMPL_SIZE
        return regs.unpack_completion(self._completions[start:start + regs.COMPL_SIZE])

    def _check(self, index: int) -> dict:
        """The completion of ``index``, verified against what was submitted there."""
        cookie, seq = self._inflight[index]
        rec = self.completion(index)
        if (rec["index"], rec["cookie"], rec["seq"]) != (index, cookie, seq):
            raise GpuCompletionError(
                f"completion record of ring slot {index} is not the one for the descriptor "
                f"submitted there: got index {rec['index']} cookie {rec['cookie']:#x} seq "
                f"{rec['seq']}, expected index {index} cookie {cookie:#x} seq {seq}",
                "the device wrote no (or a stale) completion: reset the GPU and resubmit")
        return rec

    def wait(self, indices: list[int], timeout: float = 10) -> list[dict]:
        """Wait for the MSI-X of the last transfer (or the error vector); returns completions."""
        return self.finish(indices, self._fired(timeout))

    def pending_vectors(self, timeout: float) -> dict:
        """{vector: count} fired within ``timeout`` (InterruptTimeout if none): for a caller that
        serves other vectors (VEC_FAULT, interface 1.1) while its descriptors run."""
        return self._fired(timeout)

    def abandon(self) -> None:
        """The device dropped the submitted work (it was reset): reset the ring, forget it."""
        self.reset()

    def finish(self, indices: list[int], fired: dict) -> list[dict]:
        """Completions of ``indices`` once ``fired`` (from ``pending_vectors``) holds the
        done or error vector."""
        if fired.get(regs.VEC_ERROR):
            self._raise_device_error()
        if not fired.get(regs.VEC_DMA_DONE):
            raise GpuError("no completion MSI-X from the GPU in time", "is the GPU server alive?")
        try:
            done = [self._check(i) for i in indices]
            # a matching record proves completion only if COMPLETED counts it
            # (docs/gpu-device.md, "Completion record")
            retired = (self.bar0.read32(regs.REG_COMPLETED) - self._retired) & 0xFFFFFFFF
            if retired < len(indices):
                raise GpuCompletionError(
                    f"records for {len(indices)} descriptors but COMPLETED counts {retired} "
                    f"retired since the last wait", "reset the GPU and resubmit")
        except GpuCompletionError:
            self.reset()
            raise
        bad = [c for c in done if c["status"] != Status.OK]
        if bad:
            self.reset()
            raise GpuDmaError(bad[0]["index"], bad[0]["cookie"], bad[0]["status"], 0, 0)
        for i in indices:
            del self._inflight[i]
        self._retired = (self._retired + len(indices)) & 0xFFFFFFFF
        return done

    def run(self, transfers: list[Transfer], timeout: float = 10) -> list[dict]:
        return self.wait(self.submit(transfers), timeout)

    def _raise_device_error(self) -> None:
        index = self.bar0.read32(regs.REG_ERR_DESC_INDEX)
        cookie = self._inflight.get(index, (0, 0))[0]   # what we submitted there, not what memory says
        error = GpuDmaError(index, cookie, self.bar0.read32(regs.REG_ERR_STATUS),
                            self.bar0.read32(regs.REG_ERR_ADDR_LO) | self.bar0.read32(regs.REG_ERR_ADDR_HI) << 32,
                            self.bar0.read32(regs.REG_ERR_ERRNO))
        self.reset()   # the ring halts on an error until reset
        raise error

    # -- teardown ----------------------------------------------------------------
    def close(self) -> None:
        """Reset the GPU and let everything go: each step runs even if one before it failed (the
        first failure is raised after), and a second close does nothing -- the device is
        forgotten first, so a close that failed half way never touches a closed BAR again."""
        device, self.device = self.device, None
        if device is None:
            return
        with contextlib.ExitStack() as steps:   # run last-in first: the reset, then the rest in order
            steps.callback(self._control.close)
            steps.callback(device.close)
            steps.callback(self._control_view.release)
            steps.callback(self._control_dma.close)
            steps.callback(self._completions.release)
            steps.callback(self._ring.release)
            self.bar0.write32(regs.REG_CONTROL, regs.CONTROL_RESET)

    def __enter__(self) -> "GpuDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

