"""Peer-to-peer on iommufd: a BAR as a VFIO dma-buf, mapped with IOMMU_IOAS_MAP_FILE; and
the route between two GPUs read from the PCI hierarchy.

FAKE KERNEL: ``FakeKernel`` stands in for /dev/iommu and a VFIO device cdev (the
host has neither); it checks the request structs our code builds and answers
as the 7.3 source does (drivers/vfio/pci/vfio_pci_dmabuf.c, iommufd/ioas.c).
The real kernel runs in tests/vm/test_p2p.py (the lab-kernel case).
"""

import errno
import os

import pytest

from vfio_cxl.guest.p2p import route
from vfio_cxl.guest.vfio import uapi_iommufd as u
from vfio_cxl.guest.vfio.errors import DmaMapError
from vfio_cxl.guest.vfio.iommufd import DmaBufError, IommufdContext, export_dma_buf

ffi = u.ffi
PAGE = 0x1000
DMABUF_FD = 99


class FakeKernel:
    def __init__(self, dmabuf_errno=None, map_file_errno=None):
        self.dmabuf_errno, self.map_file_errno = dmabuf_errno, map_file_errno
        self.exported = []
        self.mapped = {}

    def __call__(self, fd, request, arg=None):
        if request == u.IOMMU_IOAS_ALLOC:
            ffi.cast("struct iommu_ioas_alloc *", arg).out_ioas_id = 5
        elif request == u.IOMMU_IOAS_IOVA_RANGES:
            req = ffi.cast("struct iommu_ioas_iova_ranges *", arg)
            out = ffi.cast("struct iommu_iova_range *", req.allowed_iovas)
            out[0].start, out[0].last = 0, (1 << 48) - 1
            req.num_iovas, req.out_iova_alignment = 1, PAGE
        elif request == u.VFIO_DEVICE_FEATURE:
            head = ffi.cast("struct vfio_device_feature *", arg)
            assert head.flags == u.VFIO_DEVICE_FEATURE_GET | u.VFIO_DEVICE_FEATURE_DMA_BUF
            body = ffi.cast("struct vfio_device_feature_dma_buf *", head.data)
            assert head.argsz == (ffi.sizeof("struct vfio_device_feature")
                                  + ffi.sizeof("struct vfio_device_feature_dma_buf")
                                  + body.nr_ranges * ffi.sizeof("struct vfio_region_dma_range"))
            assert body.flags == 0 and body.open_flags & os.O_RDWR and body.nr_ranges == 1
            if self.dmabuf_errno:
                raise OSError(self.dmabuf_errno, os.strerror(self.dmabuf_errno))
            self.exported.append((fd, body.region_index, body.dma_ranges[0].offset, body.dma_ranges[0].length))
            return DMABUF_FD
        elif request == u.IOMMU_IOAS_MAP_FILE:
            req = ffi.cast("struct iommu_ioas_map_file *", arg)
            assert req.size == ffi.sizeof("struct iommu_ioas_map_file") and req.ioas_id == 5
            if self.map_file_errno:
                raise OSError(self.map_file_errno, os.strerror(self.map_file_errno))
            self.mapped[req.iova] = (req.fd, req.start, req.length, req.flags)
        elif request == u.IOMMU_IOAS_UNMAP:
            req = ffi.cast("struct iommu_ioas_unmap *", arg)
            req.length = self.mapped.pop(req.iova)[2]
        elif request == u.IOMMU_DESTROY:
            pass
        else:
            raise OSError(errno.ENOTTY, "unexpected")
        return 0


@pytest.fixture
def node(tmp_path):
    path = tmp_path / "iommu"
    path.write_bytes(b"")
    return str(path)


def test_a_bar_exported_as_a_dma_buf_maps_with_map_file_and_unmaps(node):
    kernel = FakeKernel()
    fd = export_dma_buf(42, "0000:03:00.0", 2, 0, 64 << 20, ioctl=kernel)
    assert fd == DMABUF_FD and kernel.exported == [(42, 2, 0, 64 << 20)]
    with IommufdContext.open(node, ioctl=kernel) as ctx:
        mapping = ctx.map_file(fd, 0, 64 << 20, 0x10_0000_0000)
        assert kernel.mapped[0x10_0000_0000] == (
            DMABUF_FD, 0, 64 << 20,
            u.IOMMU_IOAS_MAP_FIXED_IOVA | u.IOMMU_IOAS_MAP_READABLE | u.IOMMU_IOAS_MAP_WRITEABLE)
        assert ctx.mappings == (mapping,)
        with pytest.raises(DmaMapError, match="overlaps"):     # the shared bookkeeping holds
            ctx.map_file(fd, 0, PAGE, 0x10_0000_0000 + PAGE)
    assert kernel.mapped == {} and not mapping.active


def test_a_kernel_without_vfio_dmabuf_is_named():
    with pytest.raises(DmaBufError) as caught:
        export_dma_buf(42, "0000:03:00.0", 2, 0, PAGE, ioctl=FakeKernel(dmabuf_errno=errno.ENOTTY))
    assert caught.value.errno == errno.ENOTTY
    assert "CONFIG_VFIO_PCI_DMABUF" in caught.value.what and "type1" in caught.value.fix


def test_map_file_refused_leaves_nothing_mapped(node):
    kernel = FakeKernel(map_file_errno=errno.EOPNOTSUPP)
    with IommufdContext.open(node, ioctl=kernel) as ctx:
        with pytest.raises(DmaMapError, match="IOMMU_IOAS_MAP_FILE: this iommufd cannot import") as caught:
            ctx.map_file(DMABUF_FD, 0, PAGE, 0x10_0000_0000)
        assert caught.value.errno == errno.EOPNOTSUPP and ctx.mappings == ()


def test_route_behind_a_switch_and_through_the_root_complex(tmp_path):
    """A fake sysfs: /sys/bus/pci/devices/BDF are symlinks into the device tree, as in the guest."""
    root = tmp_path / "devices" / "pci0000:00"
    tree = {"a": "0000:00:02.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",   # switch dp0
            "b": "0000:00:02.0/0000:01:00.0/0000:02:01.0/0000:04:00.0",   # switch dp1
            "c": "0000:00:01.0/0000:05:00.0"}                              # own root port
    links = tmp_path / "bus"
    links.mkdir()
    for name, path in tree.items():
        (root / path).mkdir(parents=True)
        (links / name).symlink_to(root / path)
    ab = route("a", "b", str(links))
    assert ab["kind"] == "switch" and ab["via"] == "0000:01:00.0"
    ac = route("a", "c", str(links))
    assert ac["kind"] == "root complex" and ac["via"] == "pci0000:00"
