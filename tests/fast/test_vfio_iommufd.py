"""The iommufd backend: IOAS set-up, IOVA ranges, map/unmap, teardown order, backend choice.

FAKE KERNEL: ``FakeIommufd`` stands in for /dev/iommu and a VFIO device
cdev (the host has neither a VFIO device nor, usually, IOMMUFD); the
buffers, their addresses and the cffi handles that pin them are real.  The
real thing runs in the VM tests on the lab kernel.
"""

import errno
import mmap
import os

import pytest

from vfio_cxl.guest.vfio import uapi_iommufd as u
from vfio_cxl.guest.vfio.errors import DmaMapError, IoctlError
from vfio_cxl.guest.vfio.iommufd import IommufdContext, IommufdError, cdev_name, open_device_cdev
from vfio_cxl.guest.vfio.pci import choose_backend
from vfio_cxl.guest.vfio.bind import Sysfs

PAGE = 0x1000
MSI_WINDOW = (0xFEE00000, 0xFEEFFFFF)
ffi = u.ffi


class FakeIommufd:
    """/dev/iommu with one IOAS, and device cdevs (unit tests only)."""

    def __init__(self, ranges=((0, MSI_WINDOW[0] - 1), (MSI_WINDOW[1] + 1, (1 << 48) - 1))):
        self.ranges = ranges
        self.calls = []
        self.mapped = {}       # iova -> (user_va, length, flags)
        self.bound = set()
        self.attached = {}
        self.destroyed = []

    def __call__(self, fd, request, arg=None):
        name = next(k for k, v in u.CONSTANTS.items() if v == request and k != "IOMMUFD_TYPE")
        self.calls.append(name)
        if request == u.IOMMU_IOAS_ALLOC:
            ffi.cast("struct iommu_ioas_alloc *", arg).out_ioas_id = 7
        elif request == u.IOMMU_IOAS_IOVA_RANGES:
            req = ffi.cast("struct iommu_ioas_iova_ranges *", arg)
            assert req.ioas_id == 7
            if req.num_iovas < len(self.ranges):
                req.num_iovas = len(self.ranges)
                raise OSError(errno.EMSGSIZE, "too small")
            out = ffi.cast("struct iommu_iova_range *", req.allowed_iovas)
            for i, (start, last) in enumerate(self.ranges):
                out[i].start, out[i].last = start, last
            req.num_iovas = len(self.ranges)
            req.out_iova_alignment = PAGE
        elif request == u.IOMMU_IOAS_MAP:
            req = ffi.cast("struct iommu_ioas_map *", arg)
            if req.iova in self.mapped:
                raise OSError(errno.EEXIST, "exists")
            self.mapped[req.iova] = (req.user_va, req.length, req.flags)
        elif request == u.IOMMU_IOAS_UNMAP:
            req = ffi.cast("struct iommu_ioas_unmap *", arg)
            _, length, _ = self.mapped.pop(req.iova)
            req.length = length
        elif request == u.IOMMU_DESTROY:
            if self.attached:
                raise OSError(errno.EBUSY, "busy")
            self.destroyed.append(ffi.cast("struct iommu_destroy *", arg).id)
        elif request == u.VFIO_DEVICE_BIND_IOMMUFD:
            req = ffi.cast("struct vfio_device_bind_iommufd *", arg)
            self.bound.add(fd)
            req.out_devid = 3
        elif request == u.VFIO_DEVICE_ATTACH_IOMMUFD_PT:
            req = ffi.cast("struct vfio_device_attach_iommufd_pt *", arg)
            if fd not in self.bound:
                raise OSError(errno.EINVAL, "not bound")
            self.attached[fd] = req.pt_id
        else:
            raise OSError(errno.ENOTTY, "unexpected")
        return 0


@pytest.fixture
def node(tmp_path):
    path = tmp_path / "iommu"
    path.write_bytes(b"")
    return str(path)


@pytest.fixture
def ctx(node):
    kernel = FakeIommufd()
    with IommufdContext.open(node, ioctl=kernel) as ctx:
        ctx.kernel = kernel
        dev = os.open(node, os.O_RDWR)
        ctx.bind(dev, "0000:01:00.0")
        ctx.attach(dev, "0000:01:00.0")
        kernel.attached.clear()    # the "device fd" is closed before the IOAS goes
        os.close(dev)
        yield ctx


def test_open_allocates_an_ioas_and_close_destroys_it(node):
    kernel = FakeIommufd()
    ctx = IommufdContext.open(node, ioctl=kernel)
    assert ctx.ioas_id == 7 and kernel.calls == ["IOMMU_IOAS_ALLOC"]
    ctx.close()
    ctx.close()
    assert kernel.destroyed == [7] and ctx.fd == -1


def test_ranges_come_from_the_ioas_after_attach_with_a_bigger_buffer_when_needed(ctx):
    ctx.kernel.ranges = tuple((i << 32, (i << 32) + 0xFFFF) for i in range(12))   # > the first guess of 8
    info = ctx.iommu_info()
    assert info.iova_ranges == list(ctx.kernel.ranges) and info.page_size == PAGE
    assert ctx.kernel.calls.count("IOMMU_IOAS_IOVA_RANGES") == 2


def test_map_is_fixed_iova_with_the_devices_permissions_and_unmaps_on_close(ctx):
    buf = mmap.mmap(-1, 4 * PAGE)
    mapping = ctx.map_dma(buf, 0x4000_0000, writable=False)
    user_va, length, flags = ctx.kernel.mapped[0x4000_0000]
    assert length == 4 * PAGE and user_va == mapping.vaddr
    assert flags == u.IOMMU_IOAS_MAP_FIXED_IOVA | u.IOMMU_IOAS_MAP_READABLE
    with pytest.raises(BufferError):
        buf.close()                        # pinned while mapped
    mapping.close()
    assert ctx.kernel.mapped == {} and ctx.mappings == ()
    buf.close()


def test_the_msi_window_reported_by_the_ioas_is_refused_before_the_kernel_sees_it(ctx):
    with pytest.raises(DmaMapError, match="outside the usable IOVA ranges"):
        ctx.map_dma(mmap.mmap(-1, PAGE), MSI_WINDOW[0])
    assert "IOMMU_IOAS_MAP" not in ctx.kernel.calls


def test_overlap_and_alignment_are_the_shared_bookkeeping(ctx):
    ctx.map_dma(mmap.mmap(-1, 2 * PAGE), 0x10_0000)
    with pytest.raises(DmaMapError, match="overlaps"):
        ctx.map_dma(mmap.mmap(-1, PAGE), 0x10_1000)
    with pytest.raises(DmaMapError, match="not a multiple"):
        ctx.map_dma(mmap.mmap(-1, PAGE), 0x10_0800 + 0x100_0000)


def test_close_unmaps_newest_first_then_destroys(node):
    kernel = FakeIommufd()
    ctx = IommufdContext.open(node, ioctl=kernel)
    for i in range(3):
        ctx.map_dma(mmap.mmap(-1, PAGE), (i + 1) << 20)
    ctx.close()
    assert kernel.calls[-4:] == ["IOMMU_IOAS_UNMAP"] * 3 + ["IOMMU_DESTROY"]
    assert kernel.mapped == {}


def test_attach_before_bind_names_the_fix(node):
    kernel = FakeIommufd()
    with IommufdContext.open(node, ioctl=kernel) as ctx:
        with pytest.raises(IoctlError, match="ATTACH_IOMMUFD_PT") as err:
            ctx.attach(99, "0000:01:00.0")
        assert "bind" in err.value.fix


def test_missing_dev_iommu_points_at_the_lab_kernel(tmp_path):
    with pytest.raises(IommufdError) as err:
        IommufdContext.open(str(tmp_path / "nope"), ioctl=FakeIommufd())
    assert "CONFIG_IOMMUFD" in err.value.fix and "--kernel lab" in err.value.fix


def fake_sysfs(tmp_path, cdev: bool):
    dev = tmp_path / "sys/bus/pci/devices/0000:01:00.0"
    dev.mkdir(parents=True)
    if cdev:
        (dev / "vfio-dev" / "vfio0").mkdir(parents=True)
    return Sysfs(tmp_path / "sys")


@pytest.mark.parametrize("cdev,iommu,wanted,expected", [
    (True, True, None, "iommufd"), (False, True, None, "type1"), (True, False, None, "type1"),
    (True, True, "type1", "type1"), (False, False, "iommufd", "iommufd")])
def test_backend_choice(tmp_path, monkeypatch, cdev, iommu, wanted, expected):
    monkeypatch.delenv("VFIO_CXL_VFIO_BACKEND", raising=False)
    sysfs = fake_sysfs(tmp_path, cdev)
    dev_iommu = tmp_path / "iommu"
    if iommu:
        dev_iommu.write_bytes(b"")
    assert choose_backend("0000:01:00.0", wanted, sysfs=sysfs, iommufd_path=str(dev_iommu)) == expected


def test_backend_from_the_environment_and_a_bad_name(tmp_path, monkeypatch):
    sysfs = fake_sysfs(tmp_path, cdev=True)
    monkeypatch.setenv("VFIO_CXL_VFIO_BACKEND", "type1")
    assert choose_backend("0000:01:00.0", sysfs=sysfs, iommufd_path=str(tmp_path / "x")) == "type1"
    monkeypatch.setenv("VFIO_CXL_VFIO_BACKEND", "iommu")
    with pytest.raises(Exception, match="unknown VFIO backend 'iommu'"):
        choose_backend("0000:01:00.0", sysfs=sysfs)


def test_cdev_found_through_sysfs_and_its_absence_explained(tmp_path):
    sysfs = fake_sysfs(tmp_path, cdev=True)
    assert cdev_name("0000:01:00.0", sysfs.root) == "vfio0"
    with pytest.raises(IommufdError, match="no VFIO device cdev"):
        open_device_cdev("0000:02:00.0", sysfs_root=sysfs.root)


@pytest.mark.parametrize("iommu,expected", [(True, "iommufd"), (False, "type1")])
def test_gpu_ls_says_which_backend_the_stack_takes(tmp_path, monkeypatch, iommu, expected):
    """`vfio-cxl gpu ls` (guest): the backend a bound GPU gets, beside the device nodes (fake sysfs)."""
    from vfio_cxl.guest.cmd.cli import describe

    monkeypatch.delenv("VFIO_CXL_VFIO_BACKEND", raising=False)
    sysfs = fake_sysfs(tmp_path, cdev=True)
    dev = sysfs.device_dir("0000:01:00.0")
    (sysfs.root / "bus/pci/drivers/vfio-pci").mkdir(parents=True)
    (dev / "driver").symlink_to(sysfs.root / "bus/pci/drivers/vfio-pci")
    (sysfs.root / "kernel/iommu_groups/7").mkdir(parents=True)
    (dev / "iommu_group").symlink_to(sysfs.root / "kernel/iommu_groups/7")
    dev_iommu = tmp_path / "iommu"
    if iommu:
        dev_iommu.write_bytes(b"")
    found = describe("0000:01:00.0", sysfs, iommufd_path=str(dev_iommu))
    assert found["vfio_backend"] == expected and found["iommu_group"] == 7
    assert found["vfio_paths"] == ["/dev/vfio/devices/vfio0", "/dev/vfio/7"]
    monkeypatch.setenv("VFIO_CXL_VFIO_BACKEND", "type1")
    assert describe("0000:01:00.0", sysfs, iommufd_path=str(dev_iommu))["vfio_backend"] == "type1"
