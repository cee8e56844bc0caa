"""INFO buffers and capability chains, decoded from bytes built here by hand.

The buffers are packed with ``struct`` from the kernel's documented layout,
independently of the cffi declarations they are decoded with.  The one
"kernel" in this file is a fake ioctl for the argsz-growing handshake.
"""

import struct

import pytest

from vfio_cxl.guest.vfio import caps, uapi
from vfio_cxl.guest.vfio.errors import VfioError
from vfio_cxl.guest.vfio.region import RegionInfo
from vfio_cxl.guest.vfio.uapi import ffi


def cap_header(cap_id, version, next_offset):
    return struct.pack("<HHI", cap_id, version, next_offset)


def region_info_buffer(index, flags, size, offset, caps_blob=b"", cap_offset=0):
    head = struct.pack("<IIIIQQ", 32 + len(caps_blob), flags, index, cap_offset, size, offset)
    return head + caps_blob


def sparse_cap(areas, next_offset=0):
    blob = cap_header(uapi.VFIO_REGION_INFO_CAP_SPARSE_MMAP, 1, next_offset)
    blob += struct.pack("<II", len(areas), 0)
    return blob + b"".join(struct.pack("<QQ", off, size) for off, size in areas)


def test_chain_of_three_capabilities_in_order():
    # region info (32 bytes), then sparse mmap at 32, type at 80, msix-mappable at 96
    sparse = sparse_cap([(0, 0x1000), (0x3000, 0x1000)], next_offset=80)
    cap_type = cap_header(uapi.VFIO_REGION_INFO_CAP_TYPE, 1, 96) + struct.pack("<II", 0x80000000 | 0x8086, 3)
    msix = cap_header(uapi.VFIO_REGION_INFO_CAP_MSIX_MAPPABLE, 1, 0)
    flags = (uapi.VFIO_REGION_INFO_FLAG_READ | uapi.VFIO_REGION_INFO_FLAG_MMAP
             | uapi.VFIO_REGION_INFO_FLAG_CAPS)
    buf = region_info_buffer(2, flags, 0x4000, 2 << 40, sparse + cap_type + msix, cap_offset=32)
    assert len(sparse) == 48

    chain = caps.capability_chain(buf, 32)
    assert [(c.id, c.offset) for c in chain] == [(1, 32), (2, 80), (3, 96)]
    assert caps.sparse_mmap_areas(buf, chain[0]) == [(0, 0x1000), (0x3000, 0x1000)]
    assert caps.region_type(buf, chain[1]) == (0x80008086, 3)

    info = RegionInfo.from_buffer(buf)
    assert (info.index, info.size, info.offset) == (2, 0x4000, 2 << 40)
    assert info.sparse_areas == ((0, 0x1000), (0x3000, 0x1000))
    assert info.type == (0x80008086, 3)
    assert info.msix_mappable
    assert info.readable and not info.writable and info.mmappable
    assert info.mmap_areas() == [(0, 0x1000), (0x3000, 0x1000)]


def test_region_without_caps_flag_ignores_cap_offset():
    buf = region_info_buffer(0, uapi.VFIO_REGION_INFO_FLAG_READ | uapi.VFIO_REGION_INFO_FLAG_MMAP,
                             0x2000, 0, cap_offset=32)
    info = RegionInfo.from_buffer(buf)
    assert info.sparse_areas is None
    assert info.mmap_areas() == [(0, 0x2000)]  # whole region when no sparse cap


def test_sparse_cap_with_no_areas_means_nothing_mmappable():
    flags = uapi.VFIO_REGION_INFO_FLAG_MMAP | uapi.VFIO_REGION_INFO_FLAG_CAPS
    info = RegionInfo.from_buffer(region_info_buffer(0, flags, 0x2000, 0, sparse_cap([]), cap_offset=32))
    assert info.sparse_areas == ()
    assert info.mmap_areas() == []


def test_iova_ranges_and_dma_avail():
    head = struct.pack("<IIQII", 0, 3, 0x1000, 24, 0)
    ranges = cap_header(uapi.VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE, 1, 72) + struct.pack("<II", 2, 0)
    ranges += struct.pack("<QQ", 0, 0xFEDFFFFF) + struct.pack("<QQ", 0xFEF00000, (1 << 39) - 1)
    avail = cap_header(uapi.VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL, 1, 0) + struct.pack("<I", 65535)
    buf = head + ranges + avail
    chain = caps.capability_chain(buf, 24)
    assert caps.iova_ranges(buf, chain[0]) == [(0, 0xFEDFFFFF), (0xFEF00000, (1 << 39) - 1)]
    assert caps.dma_avail(buf, chain[1]) == 65535
    assert caps.find_capability(buf, 24, 3) == chain[1]
    assert caps.find_capability(buf, 24, 2) is None


def test_chain_that_loops_is_refused():
    buf = bytes(32) + cap_header(1, 1, 40) + cap_header(2, 1, 32)
    with pytest.raises(VfioError, match="loops back to offset 32"):
        caps.capability_chain(buf, 32)


def test_capability_past_the_buffer_is_refused():
    buf = bytes(32) + cap_header(1, 1, 200)
    with pytest.raises(VfioError, match="runs past"):
        caps.capability_chain(buf, 32)


def test_array_longer_than_the_buffer_is_refused():
    buf = bytes(32) + sparse_cap([(0, 0x1000)])
    buf = buf[:-16] + struct.pack("<QQ", 0, 0x1000)  # same size, but claim 5 areas
    buf = buf[:40] + struct.pack("<I", 5) + buf[44:]
    cap = caps.capability_chain(buf, 32)[0]
    with pytest.raises(VfioError, match="claims 5 entries"):
        caps.sparse_mmap_areas(buf, cap)


def test_query_info_grows_the_buffer_when_the_kernel_asks():
    # Fake kernel: first call (small argsz) only reports the size it needs.
    full = region_info_buffer(7, uapi.VFIO_REGION_INFO_FLAG_CAPS, 0x100, 7 << 40,
                              sparse_cap([(0, 0x100)]), cap_offset=32)
    seen_argsz = []

    def fake_ioctl(fd, request, arg):
        assert request == uapi.VFIO_DEVICE_GET_REGION_INFO
        info = ffi.cast("struct vfio_region_info *", arg)
        assert info.index == 7
        seen_argsz.append(info.argsz)
        if info.argsz < len(full):
            info.flags = uapi.VFIO_REGION_INFO_FLAG_CAPS
            info.argsz = len(full)
            info.cap_offset = 0
        else:
            ffi.memmove(arg, full, len(full))
        return 0

    buf = caps.query_info(fake_ioctl, 3, uapi.VFIO_DEVICE_GET_REGION_INFO, "struct vfio_region_info", index=7)
    assert seen_argsz == [32, len(full)]
    assert buf == full
    assert RegionInfo.from_buffer(buf).sparse_areas == ((0, 0x100),)
