"""Container setup and DMA mapping bookkeeping.

FAKE KERNEL: ``FakeType1`` below stands in for the container ioctls (the host
has no VFIO device to give us); the buffers, their addresses and the cffi
handles that pin them are real.
"""

import errno
import mmap
import os
import struct

import pytest

from vfio_cxl.guest.vfio import uapi
from vfio_cxl.guest.vfio.container import Container
from vfio_cxl.guest.vfio.errors import (ContainerError, DmaMapError, DmaUnmapError,
                                        IommuTypeUnsupportedError)
from vfio_cxl.guest.vfio.uapi import ffi

PAGE = 0x1000
IOVA_END = (1 << 39) - 1


class FakeType1:
    """A stand-in for the kernel's VFIO container with a type1 IOMMU (unit tests only)."""

    def __init__(self, extensions=(uapi.VFIO_TYPE1_IOMMU, uapi.VFIO_TYPE1v2_IOMMU), api_version=0,
                 ranges=((0, 0xFEDFFFFF), (0xFEF00000, IOVA_END)), map_errno=None, unmap_errno=None):
        self.extensions = set(extensions)
        self.api_version = api_version
        self.ranges = ranges
        self.map_errno = map_errno
        self.unmap_errno = unmap_errno
        self.iommu = None
        self.mapped = {}  # iova -> (vaddr, size, flags)
        self.unmapped = []  # iovas, in order

    def __call__(self, fd, request, arg=None):
        if request == uapi.VFIO_GET_API_VERSION:
            return self.api_version
        if request == uapi.VFIO_CHECK_EXTENSION:
            return int(arg in self.extensions)
        if request == uapi.VFIO_SET_IOMMU:
            self.iommu = arg
            return 0
        if request == uapi.VFIO_IOMMU_GET_INFO:
            return self._get_info(arg)
        if request == uapi.VFIO_IOMMU_MAP_DMA:
            request_ = ffi.cast("struct vfio_iommu_type1_dma_map *", arg)
            if self.map_errno:
                raise OSError(self.map_errno, os.strerror(self.map_errno))
            self.mapped[request_.iova] = (request_.vaddr, request_.size, request_.flags)
            return 0
        if request == uapi.VFIO_IOMMU_UNMAP_DMA:
            request_ = ffi.cast("struct vfio_iommu_type1_dma_unmap *", arg)
            if self.unmap_errno:
                raise OSError(self.unmap_errno, os.strerror(self.unmap_errno))
            _, size, _ = self.mapped.pop(request_.iova)
            request_.size = size
            self.unmapped.append(request_.iova)
            return 0
        raise OSError(errno.ENOTTY, "unexpected ioctl")

    def _get_info(self, arg):
        caps = struct.pack("<HHIII", uapi.VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE, 1, 0, len(self.ranges), 0)
        caps += b"".join(struct.pack("<QQ", s, e) for s, e in self.ranges)
        flags = uapi.VFIO_IOMMU_INFO_PGSIZES | uapi.VFIO_IOMMU_INFO_CAPS
        full = struct.pack("<IIQII", 24 + len(caps), flags, 0x40201000, 24, 0) + caps
        info = ffi.cast("struct vfio_iommu_type1_info *", arg)
        if info.argsz < len(full):
            info.argsz, info.flags, info.cap_offset = len(full), flags, 0
        else:
            ffi.memmove(arg, full, len(full))
        return 0


@pytest.fixture
def device_node(tmp_path):
    path = tmp_path / "vfio"
    path.write_bytes(b"")
    return str(path)


def open_fds():
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def container(device_node):
    kernel = FakeType1()
    with Container.open(device_node, ioctl=kernel) as container:
        container.kernel = kernel
        assert container.set_iommu() == uapi.VFIO_TYPE1v2_IOMMU
        yield container


def test_iommu_info_reads_pgsizes_and_iova_ranges(container):
    info = container.iommu_info()
    assert info.page_size == PAGE
    assert info.iova_ranges == [(0, 0xFEDFFFFF), (0xFEF00000, IOVA_END)]
    assert info.contains(0xFEF00000, PAGE)
    assert not info.contains(0xFEE00000, PAGE)  # the MSI window is carved out


def test_map_and_unmap_are_tracked(container):
    first, second = mmap.mmap(-1, 4 * PAGE), mmap.mmap(-1, PAGE)
    with container.map_dma(first, 0x100000) as dma:
        assert container.mappings == (dma,)
        vaddr, size, flags = container.kernel.mapped[0x100000]
        assert vaddr == int(ffi.cast("uintptr_t", ffi.from_buffer(first)))
        assert size == 4 * PAGE
        assert flags == uapi.VFIO_DMA_MAP_FLAG_READ | uapi.VFIO_DMA_MAP_FLAG_WRITE
        assert dma.iova_of(PAGE + 8) == 0x101008
        with pytest.raises(BufferError):
            first.close()  # pinned while the device may reach it
        other = container.map_dma(second, 0x200000, writable=False)
        assert container.kernel.mapped[0x200000][2] == uapi.VFIO_DMA_MAP_FLAG_READ
        assert container.mappings == (dma, other)
    assert container.kernel.unmapped == [0x100000]
    assert container.mappings == (other,)
    assert not dma.active
    dma.close()  # idempotent
    assert container.kernel.unmapped == [0x100000]
    first.close()  # released once unmapped


def test_close_unmaps_everything_newest_first(device_node):
    kernel = FakeType1()
    buffers = [mmap.mmap(-1, PAGE) for _ in range(3)]
    before = open_fds()
    container = Container.open(device_node, ioctl=kernel)
    container.set_iommu()
    for n, buf in enumerate(buffers):
        container.map_dma(buf, 0x10000 * (n + 1))
    container.close()
    container.close()  # idempotent
    assert kernel.unmapped == [0x30000, 0x20000, 0x10000]
    assert kernel.mapped == {}
    assert open_fds() == before
    for buf in buffers:
        buf.close()  # none still pinned


@pytest.mark.parametrize("buffer_size, iova, message", [
    (PAGE, 0x100800, "IOVA 0x100800 is not a multiple of the IOMMU page size 0x1000"),
    (PAGE + 4, 0x100000, "size 0x1004 is not a multiple"),
    (PAGE, 0xFEE00000, "outside the usable IOVA ranges"),
    (PAGE, IOVA_END + 1, "outside the usable IOVA ranges"),
])
def test_bad_requests_are_refused_before_the_kernel(container, buffer_size, iova, message):
    buf = memoryview(mmap.mmap(-1, 2 * PAGE))[:buffer_size]  # page-aligned start
    with pytest.raises(DmaMapError, match=message) as raised:
        container.map_dma(buf, iova)
    assert raised.value.iova == iova
    assert container.kernel.mapped == {}
    assert container.mappings == ()


def test_unaligned_buffer_address_is_refused(container):
    backing = mmap.mmap(-1, 2 * PAGE)
    window = memoryview(backing)[8:8 + PAGE]
    with pytest.raises(DmaMapError, match="buffer address 0x[0-9a-f]+ is not a multiple"):
        container.map_dma(window, 0x100000)
    window.release()
    backing.close()  # the failed map let go of it


def test_overlap_with_a_live_mapping_is_refused(container):
    keep = container.map_dma(mmap.mmap(-1, 2 * PAGE), 0x100000)
    with pytest.raises(DmaMapError, match="overlaps <DmaMapping iova=0x100000"):
        container.map_dma(mmap.mmap(-1, PAGE), 0x101000)
    assert container.mappings == (keep,)


def test_read_only_buffer_needs_writable_false(container):
    with pytest.raises(DmaMapError, match="writable=False"):
        container.map_dma(bytes(PAGE), 0x100000)


def test_kernel_refusal_names_errno_iova_size_and_releases_the_buffer(device_node):
    kernel = FakeType1(map_errno=errno.ENOMEM)
    with Container.open(device_node, ioctl=kernel) as container:
        container.set_iommu()
        buf = mmap.mmap(-1, 2 * PAGE)
        with pytest.raises(DmaMapError) as raised:
            container.map_dma(buf, 0x100000)
        error = raised.value
        assert (error.errno, error.iova, error.size) == (errno.ENOMEM, 0x100000, 2 * PAGE)
        assert "ENOMEM" in str(error) and "0x100000" in str(error) and "0x2000" in str(error)
        assert "RLIMIT_MEMLOCK" in error.fix
        assert container.mappings == ()
        buf.close()  # not left pinned


def test_failed_unmap_keeps_the_buffer_pinned_until_the_container_closes(device_node):
    kernel = FakeType1()
    buf = mmap.mmap(-1, PAGE)
    container = Container.open(device_node, ioctl=kernel)
    container.set_iommu()
    dma = container.map_dma(buf, 0x100000)
    kernel.unmap_errno = errno.EINVAL
    with pytest.raises(DmaUnmapError, match="EINVAL"):
        dma.close()
    assert dma.active and container.mappings == (dma,)
    with pytest.raises(BufferError):
        buf.close()
    with pytest.raises(DmaUnmapError):
        container.close()  # still reports it, but closes anyway
    assert container.fd == -1
    buf.close()


def test_mapping_needs_an_iommu_type_first(device_node):
    with Container.open(device_node, ioctl=FakeType1()) as container:
        with pytest.raises(ContainerError, match="before an IOMMU type is set"):
            container.map_dma(mmap.mmap(-1, PAGE), 0)


def test_type1_is_used_when_type1v2_is_missing(device_node):
    kernel = FakeType1(extensions={uapi.VFIO_TYPE1_IOMMU})
    with Container.open(device_node, ioctl=kernel) as container:
        assert container.set_iommu() == uapi.VFIO_TYPE1_IOMMU
        assert kernel.iommu == uapi.VFIO_TYPE1_IOMMU


def test_no_type1_at_all_says_turn_the_iommu_on(device_node):
    kernel = FakeType1(extensions={uapi.VFIO_NOIOMMU_IOMMU})
    with Container.open(device_node, ioctl=kernel) as container:
        with pytest.raises(IommuTypeUnsupportedError, match="only no-IOMMU") as raised:
            container.set_iommu()
        assert "intel_iommu=on" in raised.value.fix


def test_wrong_api_version_closes_the_fd(device_node):
    before = open_fds()
    with pytest.raises(ContainerError, match="API version 1"):
        Container.open(device_node, ioctl=FakeType1(api_version=1))
    assert open_fds() == before


def test_missing_container_node_says_load_vfio(tmp_path):
    with pytest.raises(ContainerError, match="does not exist") as raised:
        Container.open(str(tmp_path / "nope"), ioctl=FakeType1())
    assert "modprobe vfio-pci" in raised.value.fix
