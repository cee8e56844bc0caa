"""VfioPciDevice: the whole open sequence, its teardown order, and rollback on failure.

FAKE KERNEL: ``FakeVfio`` answers the container, group and device ioctls
(reusing ``FakeType1`` from test_vfio_dma and ``FakeSysfs`` from
test_vfio_bind); /dev/vfio is a directory of plain files and the device fd a
real file, so fds, mmaps and eventfds are real and leaks would show in
/proc/self/fd.  The real-kernel version of these tests runs in the VM.
"""

import errno
import mmap
import os

import pytest
from test_vfio_bind import FakeSysfs
from test_vfio_dma import FakeType1

from vfio_cxl.guest.vfio import uapi
from vfio_cxl.guest.vfio.errors import (DeviceBoundElsewhereError, GroupNotViableError, IoctlError,
                                        VfioError)
from vfio_cxl.guest.vfio.pci import VfioPciDevice
from vfio_cxl.guest.vfio.uapi import ffi

GPU = "0000:01:00.0"
GROUP = 7
BAR0_SIZE = 0x4000


class FakeVfio:
    """Stands in for the kernel's VFIO group, container and device ioctls (unit tests only)."""

    def __init__(self, tmp_path, sysfs, device_fd_errno=None):
        self.dev_vfio = tmp_path / "dev-vfio"
        self.dev_vfio.mkdir()
        (self.dev_vfio / "vfio").write_bytes(b"")
        (self.dev_vfio / str(GROUP)).write_bytes(b"")
        self.device_file = tmp_path / "device"
        self.device_file.write_bytes(bytes(BAR0_SIZE))
        self.sysfs = sysfs
        self.type1 = FakeType1()
        self.device_fd_errno = device_fd_errno
        self.events = []
        self.container_fd = None

    def _kind(self, fd):
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))

    def __call__(self, fd, request, arg=None):
        kind = self._kind(fd)
        if kind == "vfio":
            if request == uapi.VFIO_IOMMU_MAP_DMA:
                self.events.append("map")
            if request == uapi.VFIO_IOMMU_UNMAP_DMA:
                self.events.append("unmap")
            if request == uapi.VFIO_SET_IOMMU:
                assert self.container_fd is not None, "SET_IOMMU before a group is attached"
                self.events.append("set_iommu")
            return self.type1(fd, request, arg)
        if kind == str(GROUP):
            return self._group(request, arg)
        assert kind == "device"
        return self._device(request, arg)

    def _group(self, request, arg):
        if request == uapi.VFIO_GROUP_GET_STATUS:
            status = ffi.cast("struct vfio_group_status *", arg)
            assert status.argsz == 8
            # The kernel's rule: viable when every member is on vfio-pci or on no driver.
            viable = all(d in (None, "vfio-pci") for _, d in self.sysfs.group_members(GROUP))
            status.flags = ((uapi.VFIO_GROUP_FLAGS_VIABLE if viable else 0)
                            | (uapi.VFIO_GROUP_FLAGS_CONTAINER_SET if self.container_fd else 0))
            return 0
        if request == uapi.VFIO_GROUP_SET_CONTAINER:
            self.container_fd = ffi.cast("int32_t *", arg)[0]
            assert self._kind(self.container_fd) == "vfio"
            self.events.append("set_container")
            return 0
        if request == uapi.VFIO_GROUP_UNSET_CONTAINER:
            if self.container_fd is None:   # the kernel's vfio_group_ioctl_unset_container
                raise OSError(errno.EINVAL, "no container")
            self.container_fd = None
            self.events.append("unset_container")
            return 0
        if request == uapi.VFIO_GROUP_GET_DEVICE_FD:
            assert arg == GPU.encode()  # the ioctl wrapper turns bytes into a char *
            if self.device_fd_errno:
                raise OSError(self.device_fd_errno, os.strerror(self.device_fd_errno))
            self.events.append("get_device_fd")
            return os.open(self.device_file, os.O_RDWR)
        raise OSError(errno.ENOTTY, "unexpected group ioctl")

    def _device(self, request, arg):
        if request == uapi.VFIO_DEVICE_GET_INFO:
            info = ffi.cast("struct vfio_device_info *", arg)
            info.flags = uapi.VFIO_DEVICE_FLAGS_PCI | uapi.VFIO_DEVICE_FLAGS_RESET
            info.num_regions, info.num_irqs = uapi.VFIO_PCI_NUM_REGIONS, uapi.VFIO_PCI_NUM_IRQS
            return 0
        if request == uapi.VFIO_DEVICE_GET_REGION_INFO:
            info = ffi.cast("struct vfio_region_info *", arg)
            if info.index == 0:
                info.flags = (uapi.VFIO_REGION_INFO_FLAG_READ | uapi.VFIO_REGION_INFO_FLAG_WRITE
                              | uapi.VFIO_REGION_INFO_FLAG_MMAP)
                info.size, info.offset = BAR0_SIZE, 0
            else:
                info.flags, info.size, info.offset = 0, 0, info.index << 40
            return 0
        if request == uapi.VFIO_DEVICE_GET_IRQ_INFO:
            info = ffi.cast("struct vfio_irq_info *", arg)
            info.flags = uapi.VFIO_IRQ_INFO_EVENTFD
            info.count = 4 if info.index == uapi.VFIO_PCI_MSIX_IRQ_INDEX else 0
            return 0
        if request == uapi.VFIO_DEVICE_SET_IRQS:
            irq = ffi.cast("struct vfio_irq_set *", arg)
            self.events.append(f"set_irqs count={irq.count}")
            return 0
        if request == uapi.VFIO_DEVICE_RESET:
            self.events.append("reset")
            return 0
        raise OSError(errno.ENOTTY, "unexpected device ioctl")


@pytest.fixture
def sysfs(tmp_path):
    fake = FakeSysfs(tmp_path / "sys")
    fake.add_device(GPU, driver="nvme", group=GROUP)
    return fake


def open_fds():
    return set(os.listdir("/proc/self/fd"))


def open_gpu(kernel, sysfs, **kwargs):
    return VfioPciDevice.open(GPU, sysfs=sysfs, dev_vfio=str(kernel.dev_vfio), ioctl=kernel, **kwargs)


def test_open_use_close_in_order_and_nothing_left_behind(tmp_path, sysfs):
    kernel = FakeVfio(tmp_path, sysfs)
    before = open_fds()
    buffer = mmap.mmap(-1, 0x2000)
    with open_gpu(kernel, sysfs) as gpu:
        assert sysfs.driver(GPU) == "vfio-pci"
        assert kernel.events == ["set_container", "set_iommu", "get_device_fd"]
        assert kernel.type1.iommu == uapi.VFIO_TYPE1v2_IOMMU
        assert gpu.info.is_pci and gpu.info.resettable

        gpu.bar(0).write32(0x40, 0xC0FFEE)
        assert kernel.device_file.read_bytes()[0x40:0x44] == (0xC0FFEE).to_bytes(4, "little")
        assert gpu.bar(0).is_mapped(0x40, 4)
        dma = gpu.map_dma(buffer, iova=0x100000)
        assert dma.iova_of(0x10) == 0x100010
        vectors = gpu.msix(2)
        assert len(vectors.eventfds) == 2
        gpu.reset()
    # device (interrupts off) -> DMA unmapped -> group out of the container
    assert kernel.events[-4:] == ["reset", "set_irqs count=0", "unmap", "unset_container"]
    assert open_fds() == before
    assert sysfs.driver(GPU) == "nvme"
    buffer.close()  # not pinned any more
    with pytest.raises(VfioError, match="closed"):
        gpu.bar(0)
    gpu.close()  # idempotent


def test_a_device_hot_unplugged_while_open_closes_without_error(tmp_path, sysfs):
    """A hot-unplug: vfio-pci asks the holder to let go, and once its device fd is closed the kernel
    removes the device and detaches the group's container itself -- so the group's own
    UNSET_CONTAINER then fails with EINVAL.  Closing still ends cleanly, every fd released."""
    kernel = FakeVfio(tmp_path, sysfs)
    before = open_fds()
    gpu = open_gpu(kernel, sysfs)
    kernel.container_fd = None          # what the kernel does once the removal went through
    gpu.close()
    assert open_fds() == before and "unset_container" not in kernel.events


def test_group_not_viable_lists_its_devices_and_rolls_back(tmp_path, sysfs):
    sysfs.add_device("0000:01:00.1", driver="e1000e", group=GROUP)
    kernel = FakeVfio(tmp_path, sysfs)
    before = open_fds()
    with pytest.raises(GroupNotViableError) as raised:
        open_gpu(kernel, sysfs)
    message = str(raised.value)
    assert f"IOMMU group {GROUP} is not viable" in message
    assert "0000:01:00.0 (vfio-pci)" in message and "0000:01:00.1 (e1000e)" in message
    assert open_fds() == before
    assert sysfs.driver(GPU) == "nvme"
    assert kernel.events == []


def test_failure_getting_the_device_fd_undoes_every_step(tmp_path, sysfs):
    kernel = FakeVfio(tmp_path, sysfs, device_fd_errno=errno.ENODEV)
    before = open_fds()
    with pytest.raises(IoctlError, match="VFIO_GROUP_GET_DEVICE_FD.0000:01:00.0. failed .ENODEV"):
        open_gpu(kernel, sysfs)
    assert kernel.events == ["set_container", "set_iommu", "unset_container"]
    assert open_fds() == before
    assert sysfs.driver(GPU) == "nvme"


def test_bind_false_refuses_a_device_on_another_driver(tmp_path, sysfs):
    kernel = FakeVfio(tmp_path, sysfs)
    before = open_fds()
    with pytest.raises(DeviceBoundElsewhereError, match="bound to nvme"):
        open_gpu(kernel, sysfs, bind=False)
    assert open_fds() == before and kernel.events == []


def test_bind_false_uses_a_device_already_on_vfio_pci_and_leaves_it_there(tmp_path):
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.add_device(GPU, driver="vfio-pci", group=GROUP)
    kernel = FakeVfio(tmp_path, sysfs)
    with open_gpu(kernel, sysfs, bind=False) as gpu:
        assert gpu.binding is None
    assert sysfs.driver(GPU) == "vfio-pci" and sysfs.writes == []


def test_device_level_mistakes_get_clear_errors(tmp_path, sysfs):
    kernel = FakeVfio(tmp_path, sysfs)
    with open_gpu(kernel, sysfs) as gpu:
        with pytest.raises(VfioError, match="BAR1 of 0000:01:00.0 is not implemented .size 0."):
            gpu.bar(1)
        with pytest.raises(VfioError, match="has no region 9 .it has 9."):
            gpu.region(9)
        assert gpu.bar(0) is gpu.bar(0)  # one Region (one mapping) per index
        first = gpu.msix(1)
        with pytest.raises(VfioError, match="MSI-X is already enabled with 1 vectors"):
            gpu.msix(2)
        first.close()
        with gpu.msix(4) as vectors:  # fine again once the first is closed
            assert vectors.count == 4
        with pytest.raises(VfioError, match="cannot enable 5 MSI-X vectors: the device offers 4"):
            gpu.device.interrupts(uapi.VFIO_PCI_MSIX_IRQ_INDEX, 5)
