"""The DMA table under a vIOMMU that maps page by page.

QEMU 11.1 sends one DMA_MAP (with the guest-RAM memfd attached) per 4 KiB
IOMMU entry: a 1 GiB map under iommufd's type1 (v1) compat is 262144 of them.
One mmap or one kept fd per mapping would run the server into vm.max_map_count
(65530) or RLIMIT_NOFILE; the table keeps one open file per client file.
These tests drive DmaTable directly with real memfds and real fds (no fakes).
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

import pytest

from vfio_cxl.devices.vfio_user import wire
from vfio_cxl.devices.vfio_user.dma import DmaPort, DmaTable

PAGE = wire.DMA_PAGE_SIZE
RW = wire.DMA_MAP_FLAG_READ | wire.DMA_MAP_FLAG_WRITE
PAGES = 70_000  # more than vm.max_map_count (65530) and the spec's 65535 max_dma_maps


def _sealed_memfd(size: int) -> int:
    fd = os.memfd_create("guest-ram", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mmaps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_page_by_page_maps_share_one_mmap_and_close_every_fd():
    ram = _sealed_memfd(PAGES * PAGE)
    table, fds0, maps0 = DmaTable(), _open_fds(), _mmaps()
    try:
        # QEMU's order: ascending IOVAs, each page its own DMA_MAP with its own fd
        iova0 = 1 << 32
        for n in range(PAGES):
            table.map(iova0 + n * PAGE, PAGE, RW, os.dup(ram), n * PAGE)
        assert len(table) == PAGES
        assert table.open_files == 1, "one client file, one open file object"
        # CPython's mmap keeps a dup of the fd it maps: one per open file, not per mapping
        assert _open_fds() == fds0 + 1, "every fd that came with a DMA_MAP was closed"
        assert _mmaps() - maps0 < 100, "one mmap for the whole file, not one per mapping"

        # the mappings reach the file at their own offsets
        port = DmaPort(table, None)
        port.write(iova0 + 12345 * PAGE + 7, b"page-12345")
        assert os.pread(ram, 10, 12345 * PAGE + 7) == b"page-12345"

        # an unmap of one page in the middle, then one range covering the rest
        assert table.unmap(iova0 + 5 * PAGE, PAGE) == PAGE
        with pytest.raises(wire.ProtocolError) as cut:
            table.unmap(iova0 + 4 * PAGE + PAGE // 2, PAGE)
        assert cut.value.errno == errno.EINVAL
        t0 = time.process_time()
        assert table.unmap(iova0, PAGES * PAGE) == (PAGES - 1) * PAGE
        assert len(table) == 0 and table.open_files == 0
        assert not any("memfd:guest-ram" in line for line in open("/proc/self/maps")), \
            "the last unmap released the file's mmap"
        # the same IOVA can be mapped again (nothing stale left behind)
        table.map(iova0, PAGE, RW, os.dup(ram), 0)
        assert table.open_files == 1
        assert time.process_time() - t0 < 10, "one bulk unmap must not scan per mapping"
    finally:
        table.unmap_all()
        os.close(ram)
    assert table.open_files == 0 and _open_fds() == fds0 - 1  # and ram closed


def test_refused_maps_close_their_fd_and_keep_the_shared_file():
    ram = _sealed_memfd(4 * PAGE)
    table, fds0 = DmaTable(), _open_fds()
    try:
        table.map(0, PAGE, RW, os.dup(ram), 0)
        for iova, size, off, want in ((0, PAGE, 0, errno.EEXIST),          # same range
                                      (PAGE, 4 * PAGE, PAGE, errno.EINVAL)):  # past the file
            with pytest.raises(wire.ProtocolError) as err:
                table.map(iova, size, RW, os.dup(ram), off)
            assert err.value.errno == want
        assert _open_fds() == fds0 + 1 and table.open_files == 1 and len(table) == 1
        # a read-only mapping of the same file gets a read-only mmap of its own
        table.map(PAGE, PAGE, wire.DMA_MAP_FLAG_READ, os.dup(ram), PAGE)
        assert table.open_files == 2
        table.unmap(0, PAGE)
        assert table.open_files == 1, "the writable file closed with its last mapping"
    finally:
        table.unmap_all()
        os.close(ram)
    assert table.open_files == 0 and _open_fds() == fds0 - 1  # and ram closed


def test_unsealed_files_share_one_fd_too():
    """memory-backend-file (CXL memory) cannot be sealed: read through one kept fd."""
    fd = os.memfd_create("cxl-backend")  # no sealing: the pread/pwrite path
    os.ftruncate(fd, 64 * PAGE)
    table, fds0 = DmaTable(), _open_fds()
    try:
        for n in range(64):
            table.map(n * PAGE, PAGE, RW, os.dup(fd), n * PAGE)
        assert _open_fds() == fds0 + 1 and table.open_files == 1
        DmaPort(table, None).write(3 * PAGE, b"cxl")
        assert os.pread(fd, 3, 3 * PAGE) == b"cxl"
    finally:
        table.unmap_all()
        os.close(fd)
    assert _open_fds() == fds0 - 1  # fd closed too

