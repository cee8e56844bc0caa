"""Region access paths: mmap inside sparse areas, pread/pwrite elsewhere.

FAKE KERNEL: a regular file stands in for the device fd (a region at a
non-zero offset of it), and the RegionInfo is built by hand.  mmap, pread
and pwrite on that file are real, so both paths really move bytes.
"""

import mmap
import os
import struct

import pytest

from vfio_cxl.guest.vfio import uapi
from vfio_cxl.guest.vfio.errors import RegionError
from vfio_cxl.guest.vfio.region import Region, RegionInfo

PAGE = mmap.PAGESIZE
REGION_OFFSET = 4 * PAGE  # where the region starts in the "device fd"
RW_MMAP = uapi.VFIO_REGION_INFO_FLAG_READ | uapi.VFIO_REGION_INFO_FLAG_WRITE | uapi.VFIO_REGION_INFO_FLAG_MMAP


@pytest.fixture
def device_file(tmp_path):
    path = tmp_path / "device"
    with open(path, "wb") as f:
        f.write(bytes(REGION_OFFSET))
        f.write(bytes(range(256)) * (4 * PAGE // 256))  # the region's contents
    fd = os.open(path, os.O_RDWR)
    yield fd
    os.close(fd)


def file_bytes(fd, offset, length):
    return os.pread(fd, length, REGION_OFFSET + offset)


def make_region(fd, flags=RW_MMAP, sparse=((PAGE, PAGE),)):
    info = RegionInfo(index=0, flags=flags, size=4 * PAGE, offset=REGION_OFFSET, sparse_areas=sparse)
    return Region(fd, info)


def test_sparse_area_is_mmapped_and_the_rest_is_not(device_file):
    with make_region(device_file) as bar:
        assert bar.name == "BAR0"
        assert bar.is_mapped(PAGE, PAGE)
        assert not bar.is_mapped(0, 4)  # before the area (e.g. the MSI-X table)
        assert not bar.is_mapped(2 * PAGE - 2, 4)  # straddles its end
        assert not bar.is_mapped(3 * PAGE)


@pytest.mark.parametrize("offset", [0x10, PAGE + 0x10], ids=["pread-path", "mmap-path"])
def test_typed_reads_and_writes_reach_the_device(device_file, offset):
    with make_region(device_file) as bar:
        assert bar.read32(offset) == struct.unpack("<I", bytes([0x10, 0x11, 0x12, 0x13]))[0]
        assert bar.read8(offset + 1) == 0x11
        assert bar.read16(offset + 2) == 0x1312
        bar.write32(offset, 0xDEADBEEF)
        bar.write64(offset + 8, 0x0123456789ABCDEF)
        bar.write16(offset + 4, 0xCAFE)
        bar.write8(offset + 6, 0x5A)
        assert file_bytes(device_file, offset, 16) == (
            struct.pack("<IHB", 0xDEADBEEF, 0xCAFE, 0x5A) + bytes([0x17]) + struct.pack("<Q", 0x0123456789ABCDEF))
        assert bar.read64(offset + 8) == 0x0123456789ABCDEF
        assert bar.read32(offset) == 0xDEADBEEF


def test_bulk_read_write_and_view(device_file):
    with make_region(device_file) as bar:
        bar.write(PAGE + 100, b"hello")
        bar.write(3 * PAGE, b"world")  # outside the area: pwrite
        assert file_bytes(device_file, PAGE + 100, 5) == b"hello"
        assert bar.read(3 * PAGE, 5) == b"world"
        view = bar.view(PAGE, 16)
        view[0:2] = b"hi"
        view.release()
        assert file_bytes(device_file, PAGE, 2) == b"hi"
        with pytest.raises(RegionError, match="not mmap-able"):
            bar.view(0, 16)


def test_without_sparse_cap_the_whole_region_is_mapped(device_file):
    with make_region(device_file, sparse=None) as bar:
        assert bar.is_mapped(0, 4 * PAGE)


def test_without_mmap_flag_everything_goes_through_pread(device_file):
    flags = uapi.VFIO_REGION_INFO_FLAG_READ | uapi.VFIO_REGION_INFO_FLAG_WRITE
    with make_region(device_file, flags=flags) as bar:
        assert not bar.is_mapped(PAGE, 4)
        bar.write32(PAGE, 7)
        assert bar.read32(PAGE) == 7


@pytest.mark.parametrize("call, message", [
    (lambda r: r.read32(4 * PAGE), "outside BAR0"),
    (lambda r: r.read32(4 * PAGE - 2), "outside BAR0"),
    (lambda r: r.read32(-4), "outside BAR0"),
    (lambda r: r.read32(2), "32-bit access to BAR0 at 0x2 is not aligned"),
    (lambda r: r.write64(PAGE + 4, 0), "64-bit access"),
    (lambda r: r.write8(0, 256), "does not fit in 8 bits"),
])
def test_bad_accesses_are_refused(device_file, call, message):
    with make_region(device_file) as bar:
        with pytest.raises((RegionError, ValueError), match=message):
            call(bar)


def test_read_only_region_refuses_writes(device_file):
    with make_region(device_file, flags=uapi.VFIO_REGION_INFO_FLAG_READ, sparse=None) as rom:
        assert rom.read8(0) == 0
        with pytest.raises(RegionError, match="not writable"):
            rom.write32(0, 1)


def test_close_unmaps_and_further_access_is_refused(device_file):
    bar = make_region(device_file)
    bar.read32(PAGE)
    mapping = bar._areas[0].map
    bar.close()
    bar.close()  # idempotent
    assert mapping.closed
    with pytest.raises(RegionError, match="closed"):
        bar.read32(PAGE)
