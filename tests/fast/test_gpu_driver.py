"""Item 8: the guest driver checks every completion record against what it submitted,
and submit() checks ring space.

The device here is a *fake* (this checks the driver's own logic, not VFIO): it
reads descriptors from the control buffer the driver DMA-maps, and writes
completion records the way a test wants -- correct, missing, foreign, stale.
"""

import pytest

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.gpu.regs import Op, Status
from vfio_cxl.guest.drivers.gpu import GpuCompletionError, GpuDmaError, GpuDriver, GpuError, Transfer
from vfio_cxl.guest.vfio import uapi
from vfio_cxl.guest.vfio.errors import InterruptError


class FakeVectors:
    def __init__(self, count=regs.MSIX_VECTORS):
        self.fired = {}
        self.eventfds = [None] * count

    def pending(self, vector):
        return self.fired.pop(vector, 0)

    def wait_any(self, timeout):
        fired, self.fired = self.fired, {}
        return fired


class FakeGpu:
    """Registers + a ring executor with selectable completion behaviour."""

    def __init__(self):
        self.regs = {regs.REG_ID: regs.ID_MAGIC, regs.REG_VRAM_SIZE_LO: 16 << 20}
        self.vectors = FakeVectors()
        self.control = None
        self.head = self.completed = 0
        self.mode = "good"
        self.command = 0
        self.irq_mode = "msix"
        self.msi_granted = regs.MSI_VECTORS
        self.config = self  # read16 / write16 below

    # -- the VfioPciDevice surface the driver uses
    def read16(self, offset):
        return self.command

    def write16(self, offset, value):
        self.command = value

    def bar(self, index):
        return self

    def read32(self, offset):
        if offset == regs.REG_STATUS:
            return regs.STATUS_ENABLED
        if offset == regs.REG_COMPLETED:
            return self.completed
        if offset == regs.REG_RING_HEAD:
            return self.head
        return self.regs.get(offset, 0)

    def write32(self, offset, value):
        if offset == regs.REG_INTR_STATUS:  # W1C
            self.regs[offset] = self.regs.get(offset, 0) & ~value
            return
        self.regs[offset] = value
        if offset == regs.REG_CONTROL and value & regs.CONTROL_RESET:
            self.head = self.completed = 0
        if offset == regs.REG_RING_TAIL:
            self._run(value)

    def map_dma(self, buffer, iova):
        if iova == GpuDriver.CONTROL_IOVA:
            self.control = memoryview(buffer)
        return self

    def irq_info(self, index):
        from types import SimpleNamespace
        msix = self.irq_mode == "msix"
        count = {uapi.VFIO_PCI_MSIX_IRQ_INDEX: regs.MSIX_VECTORS if msix else 0,
                 uapi.VFIO_PCI_MSI_IRQ_INDEX: 0 if msix else regs.MSI_VECTORS}[index]
        return SimpleNamespace(index=index, flags=0, count=count)

    def msix(self, count):
        assert self.irq_mode == "msix"
        return self.vectors

    def release_request(self):   # this fake has no release-request channel (Device.release_request: None)
        return None

    def interrupts(self, index, count):
        assert index == uapi.VFIO_PCI_MSI_IRQ_INDEX and self.irq_mode == "msi"
        if count > self.msi_granted:
            raise InterruptError(f"only {self.msi_granted} MSI vectors", "")
        self.vectors = FakeVectors(count)
        return self.vectors

    def _raise(self, vector, bit):
        self.regs[regs.REG_INTR_STATUS] = self.regs.get(regs.REG_INTR_STATUS, 0) | bit
        vector = min(vector, len(self.vectors.eventfds) - 1)  # MSI folding
        self.vectors.fired[vector] = self.vectors.fired.get(vector, 0) + 1

    def close(self):
        if self.control is not None:
            self.control.release()
            self.control = None

    # -- the "device"
    def _run(self, tail):
        entries = GpuDriver.RING_ENTRIES
        compl = entries * regs.DESC_SIZE
        while self.head != tail:
            i = self.head
            src, dst, length, op, flags, _, cookie = regs.DESC.unpack_from(self.control, i * regs.DESC_SIZE)
            seq = self.completed + 1
            record = {"good": (cookie, 0, length, i, seq, 1),
                      # the seq the driver expects (its default cookie is seq << 16 | index)
                      "uncounted": (cookie, 0, length, i, cookie >> 16, 1),
                      "foreign": (cookie ^ 1, 0, length, (i + 1) % entries, seq, 1),
                      "stale": (cookie, 0, length, i, seq + 7, 1)}.get(self.mode)
            if record is not None:
                regs.COMPL.pack_into(self.control, compl + i * regs.COMPL_SIZE, *record)
            if self.mode != "uncounted":  # "uncounted": the record is there, COMPLETED not
                self.completed += 1
            self.head = (i + 1) % entries
            if op == 0xFF:  # the test's way to make the device fail
                self.regs[regs.REG_ERR_STATUS] = Status.BAD_OPCODE
                self.regs[regs.REG_ERR_DESC_INDEX] = i
                self._raise(regs.VEC_ERROR, regs.INTR_ERROR)
                return
            if flags & regs.DESC_FLAG_INTERRUPT:
                self._raise(regs.VEC_DMA_DONE, regs.INTR_DMA_DONE)


@pytest.fixture
def gpu():
    fake = FakeGpu()
    driver = GpuDriver(fake)
    yield driver, fake
    driver.close()


def nops(n):
    return [Transfer(Op.NOP, 0, 0, 0) for _ in range(n)]


def test_good_completions_pass_and_sequence_across_rounds(gpu):
    driver, fake = gpu
    for _ in range(3):
        done = driver.run(nops(100))
        assert [d["status"] for d in done] == [Status.OK] * 100
    assert fake.command & 0x4, "the driver sets Bus Master Enable"


@pytest.mark.parametrize("mode", ["zero", "foreign", "stale"])
def test_a_record_not_written_for_the_descriptor_is_an_error(gpu, mode):
    driver, fake = gpu
    driver.run(nops(3))  # a good round first: slots now hold old records
    fake.mode = mode
    with pytest.raises(GpuCompletionError, match="not the one for the descriptor"):
        driver.run(nops(3))


def test_reused_slots_never_show_old_records_as_new(gpu):
    driver, fake = gpu
    for _ in range(2):
        driver.run(nops(GpuDriver.RING_ENTRIES - 1))  # every slot used once
    fake.mode = "zero"  # the device writes nothing: the old records are still there
    with pytest.raises(GpuCompletionError):
        driver.run(nops(1))


def test_submit_checks_ring_space(gpu):
    driver, fake = gpu
    fake.mode = "zero"
    driver.submit(nops(200))  # not waited for: 200 slots stay busy
    assert driver.free_slots == GpuDriver.RING_ENTRIES - 1 - 200
    with pytest.raises(GpuError, match="do not fit"):
        driver.submit(nops(100))
    with pytest.raises(GpuError):
        driver.submit([])


@pytest.mark.parametrize("granted", [4, 1], ids=["msi-4-vectors", "msi-folded-1-vector"])
def test_msi_mode(granted):
    """Stretch: with --irq-mode msi the driver uses VFIO's MSI index; with one vector
    granted, INTR_STATUS tells DMA_DONE from ERROR."""
    fake = FakeGpu()
    fake.irq_mode, fake.msi_granted = "msi", granted
    driver = GpuDriver(fake)
    try:
        assert driver.irq_mode == "msi" and len(driver.vectors.eventfds) == granted
        assert [d["status"] for d in driver.run(nops(5))] == [Status.OK] * 5
        with pytest.raises(GpuDmaError) as failed:
            driver.run([Transfer(0xFF, 0, 0, 0)])
        assert failed.value.status == Status.BAD_OPCODE
        assert driver.run(nops(1))[0]["status"] == Status.OK  # reset: usable again
    finally:
        driver.close()


def test_the_fake_offers_nothing_the_real_device_lacks():
    from vfio_cxl.guest.vfio import VfioPciDevice
    for name in ("irq_info", "interrupts", "msix", "release_request", "map_dma", "bar", "config", "close"):
        assert hasattr(VfioPciDevice, name), name


def test_a_matching_record_that_completed_does_not_count_is_an_error(gpu):
    """docs/gpu-device.md, "Dropped descriptor" (spec-driver finding F2): a record
    with the expected index/cookie/seq proves nothing unless COMPLETED counts it."""
    driver, fake = gpu
    fake.mode = "uncounted"
    with pytest.raises(GpuCompletionError, match="COMPLETED counts 0"):
        driver.run(nops(2))
    fake.mode = "good"
    assert [c["seq"] for c in driver.run(nops(2))] == [1, 2]  # reset by the error: usable again


class RecordingMapping:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_a_driver_that_fails_after_mapping_its_control_area_unmaps_it():
    """In a shared container the control area's mapping is the container's: a driver whose set-up
    fails after mapping it (here: the interrupts) unmaps it before the error leaves, or the
    container's owner later fails to unmap it (EINVAL once the last device left its container)
    and that error hides this one."""
    class NoInterrupts(FakeGpu):
        def map_dma(self, buffer, iova):   # holds no view of the buffer (the real one's handle goes on close)
            self.mapping = RecordingMapping()
            return self.mapping

        def msix(self, count):
            raise InterruptError("enabling 4 MSI-X vectors failed (EINVAL)", "")

    fake = NoInterrupts()
    with pytest.raises(InterruptError, match="MSI-X"):
        GpuDriver(fake)
    assert fake.mapping.closed
