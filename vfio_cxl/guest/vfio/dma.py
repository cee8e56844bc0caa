"""DMA mapping helpers both IOMMU backends use: pinning a buffer, explaining a refused MAP_DMA.

``pin_buffer`` takes a cffi buffer handle on the Python object to map.  While
the handle is held the object cannot be resized or closed (an ``mmap`` refuses
to close), so memory the IOMMU still points at is never freed under the
device.  The mapping itself (``iommu.DmaMapping``) lives beside the IOMMU
context that owns it; this module imports neither, so the three form no circle.
"""

from __future__ import annotations

import errno

from .errors import DmaMapError
from .uapi import ffi

ALIGN_FIX = ("allocate the buffer with mmap.mmap(-1, size) (page-aligned) and use a size and an IOVA "
             "that are multiples of the IOMMU page size")

# Why MAP_DMA failed, by errno, and what to do about it.
_MAP_ERRNO_HELP = {
    errno.EEXIST: ("the IOVA range overlaps a mapping the kernel already has",
                   "unmap that mapping first, or choose another IOVA"),
    errno.EINVAL: ("the kernel rejected the request (alignment, IOVA range or flags)",
                   "use page-aligned buffers, IOVAs inside Container.iommu_info().iova_ranges, "
                   "and set the IOMMU type first"),
    errno.ENOMEM: ("pinning the pages failed (locked-memory limit?)",
                   "raise RLIMIT_MEMLOCK (ulimit -l unlimited) or run as root"),
    errno.ENOSPC: ("the container's limit of DMA mappings is reached",
                   "unmap some mappings, or raise vfio_iommu_type1's dma_entry_limit"),
    errno.EFAULT: ("the buffer's address is not valid process memory",
                   "map a live, writable buffer (bytearray or mmap)"),
    errno.EPERM: ("not allowed to map DMA", "run as root"),
}


def map_error(err: int, iova: int, size: int) -> DmaMapError:
    why, fix = _MAP_ERRNO_HELP.get(err, ("VFIO_IOMMU_MAP_DMA failed", "see the kernel log (dmesg)"))
    return DmaMapError(iova, size, why, fix, err)


def pin_buffer(buffer, iova: int, writable: bool):
    """A cffi handle on ``buffer`` (keeps it alive and unresizable), its address and its size."""
    try:
        handle = ffi.from_buffer(buffer, require_writable=writable)
    except (TypeError, BufferError) as error:
        size = _nbytes(buffer)
        raise DmaMapError(iova, size, f"the buffer cannot be mapped ({error})",
                          "pass a writable buffer (bytearray or mmap), or writable=False "
                          "for a buffer the device only reads") from None
    return handle, int(ffi.cast("uintptr_t", handle)), ffi.sizeof(handle)


def _nbytes(buffer) -> int:
    try:
        return memoryview(buffer).nbytes
    except TypeError:
        return 0
