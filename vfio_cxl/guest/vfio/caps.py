"""VFIO INFO ioctls and the capability chains they return.

An INFO struct starts with ``argsz``; when the kernel has capabilities to
report that do not fit, it sets the CAPS flag and raises ``argsz`` to the size
it needs, and the caller asks again with a buffer that large.  Capabilities
form a chain of ``vfio_info_cap_header``s whose ``next`` fields are offsets
from the start of the INFO buffer (0 ends the chain).

Everything here works on plain bytes, so it is tested without a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import VfioError
from .syscalls import IoctlFn
from .uapi import ffi

_HEADER = "struct vfio_info_cap_header"
_MALFORMED_FIX = "this is a kernel or device-model bug: report it with the INFO buffer"


@dataclass(frozen=True)
class Capability:
    id: int
    version: int
    offset: int  # of its header, from the start of the INFO buffer


def query_info(ioctl: IoctlFn, fd: int, request: int, ctype: str, **fields: int) -> bytes:
    """Run an INFO ioctl, growing the buffer once if the kernel asks for more; returns the buffer."""
    size = ffi.sizeof(ctype)
    for _ in range(2):
        buf = ffi.new("char[]", size)
        info = ffi.cast(ctype + " *", buf)
        info.argsz = size
        for name, value in fields.items():
            setattr(info, name, value)
        ioctl(fd, request, info)
        if info.argsz <= size:
            return ffi.buffer(buf)[:]
        size = info.argsz
    raise VfioError(f"{ctype}: the kernel keeps asking for a larger buffer ({size} bytes)", _MALFORMED_FIX)


def read_struct(info: bytes, ctype: str, offset: int = 0) -> dict[str, int]:
    """The integer fields of ``ctype`` found at ``offset`` in ``info`` (bounds-checked)."""
    ptr = _at(info, ctype, offset)
    return {name: getattr(ptr, name) for name, field in ffi.typeof(ctype).fields
            if field.type.kind == "primitive"}


def capability_chain(info: bytes, first: int) -> list[Capability]:
    """Every capability in the chain that starts at offset ``first`` (0: no chain)."""
    chain: list[Capability] = []
    seen: set[int] = set()
    offset = first
    while offset:
        if offset in seen:
            raise VfioError(f"capability chain loops back to offset {offset}", _MALFORMED_FIX)
        seen.add(offset)
        header = _at(info, _HEADER, offset)
        chain.append(Capability(header.id, header.version, offset))
        offset = header.next
    return chain


def find_capability(info: bytes, first: int, cap_id: int) -> Capability | None:
    return next((cap for cap in capability_chain(info, first) if cap.id == cap_id), None)


def sparse_mmap_areas(info: bytes, cap: Capability) -> list[tuple[int, int]]:
    """(offset, size) of each mmap-able area of a region (VFIO_REGION_INFO_CAP_SPARSE_MMAP)."""
    head = _at(info, "struct vfio_region_info_cap_sparse_mmap", cap.offset)
    areas = _array(info, cap.offset, "struct vfio_region_info_cap_sparse_mmap", "areas",
                   "struct vfio_region_sparse_mmap_area", head.nr_areas)
    return [(area.offset, area.size) for area in areas]


def region_type(info: bytes, cap: Capability) -> tuple[int, int]:
    """(type, subtype) of a device-specific region (VFIO_REGION_INFO_CAP_TYPE)."""
    cap_type = _at(info, "struct vfio_region_info_cap_type", cap.offset)
    return cap_type.type, cap_type.subtype


def iova_ranges(info: bytes, cap: Capability) -> list[tuple[int, int]]:
    """(start, end) -- end inclusive -- of each usable IOVA range (VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE)."""
    head = _at(info, "struct vfio_iommu_type1_info_cap_iova_range", cap.offset)
    ranges = _array(info, cap.offset, "struct vfio_iommu_type1_info_cap_iova_range", "iova_ranges",
                    "struct vfio_iova_range", head.nr_iovas)
    return [(r.start, r.end) for r in ranges]


def dma_avail(info: bytes, cap: Capability) -> int:
    """How many more DMA mappings the container allows (VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL)."""
    return _at(info, "struct vfio_iommu_type1_info_dma_avail", cap.offset).avail


def _at(info: bytes, ctype: str, offset: int):
    """A pointer to ``ctype`` at ``offset`` inside ``info``, refusing to reach past its end."""
    end = offset + ffi.sizeof(ctype)
    if offset < 0 or end > len(info):
        raise VfioError(f"{ctype} at offset {offset} runs past the {len(info)}-byte INFO buffer",
                        _MALFORMED_FIX)
    # An owned copy: the returned struct never points into the caller's buffer.
    struct = ffi.new(ctype + " *")
    ffi.memmove(struct, bytes(info[offset:end]), end - offset)
    return struct


def _array(info: bytes, cap_offset: int, head_type: str, field: str, item_type: str, count: int):
    start = cap_offset + ffi.offsetof(head_type, field)
    item = ffi.sizeof(item_type)
    if start + count * item > len(info):
        raise VfioError(f"{head_type} claims {count} entries, more than the {len(info)}-byte "
                        "INFO buffer holds", _MALFORMED_FIX)
    return [_at(info, item_type, start + i * item) for i in range(count)]

