"""One IOMMU context, two backends: the IOVA bookkeeping both share.

A device's DMA goes through an IOMMU context: the legacy type1 container
(``container.Container``, /dev/vfio/vfio) or an iommufd IO address space
(``iommufd.IommufdContext``, /dev/iommu).  Both do the same job -- map a
buffer of this process at an IOVA, unmap it -- with different ioctls.  What
does not depend on the ioctls lives here, once: alignment, usable IOVA
ranges, overlap with live mappings, pinning the buffer while it is mapped,
and unmapping everything newest first on close.  A backend supplies three
operations (the model is libvfn's ``iommu_ctx`` ops):

* ``_query_info()`` -> ``IommuInfo`` (page size, usable IOVA ranges);
* ``_map_op(vaddr, iova, size, readable, writable)``, raising ``OSError``;
* ``_unmap_op(iova, size)`` -> bytes unmapped, raising ``OSError``.

Drivers and demos see only ``map_dma``/``mappings``/``iommu_info``: they do
not know which backend they run on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .dma import ALIGN_FIX, map_error, pin_buffer
from .errors import DmaMapError, DmaUnmapError, describe_errno
from .uapi import ffi


@dataclass(frozen=True)
class IommuInfo:
    flags: int
    pgsizes: int  # bitmap of the IOMMU page sizes
    iova_ranges: list[tuple[int, int]] = field(default_factory=list)  # (start, end inclusive)
    dma_avail: int | None = None  # mappings still allowed, if the kernel says

    @property
    def page_size(self) -> int:
        """The smallest IOMMU page size: the alignment a mapping needs."""
        return self.pgsizes & -self.pgsizes if self.pgsizes else 4096

    def contains(self, iova: int, size: int) -> bool:
        if not self.iova_ranges:
            return True  # the kernel did not say: let it decide
        last = iova + size - 1
        return any(start <= iova and last <= end for start, end in self.iova_ranges)


class IommuContext:
    """The IOVA bookkeeping above both backends.  Subclasses set ``backend`` and the three ops."""

    backend = "none"
    unmap_fix = "close the IOMMU context: the kernel drops every mapping with it"

    def __init__(self) -> None:
        self._mappings: list[DmaMapping] = []
        self._info: IommuInfo | None = None

    # -- backend operations ------------------------------------------------
    def _query_info(self) -> IommuInfo:
        raise NotImplementedError

    def _map_op(self, vaddr: int, iova: int, size: int, readable: bool, writable: bool) -> None:
        raise NotImplementedError

    def _unmap_op(self, iova: int, size: int) -> int:
        raise NotImplementedError

    def _require_ready(self, action: str) -> None:
        """Raise a VfioError saying why ``action`` cannot happen yet (closed, not attached)."""

    # -- what drivers use --------------------------------------------------
    def iommu_info(self) -> IommuInfo:
        """Page sizes and usable IOVA ranges, as the kernel reports them now."""
        self._require_ready("query the IOMMU")
        self._info = self._query_info()
        return self._info

    @property
    def mappings(self) -> tuple[DmaMapping, ...]:
        """The live mappings, oldest first."""
        return tuple(self._mappings)

    def map_dma(self, buffer, iova: int, *, readable: bool = True, writable: bool = True) -> DmaMapping:
        """Map all of ``buffer`` (an mmap, bytearray, ...) at ``iova`` for the device.

        ``readable``/``writable`` are from the device's side.  Checks alignment,
        IOVA range and overlap first, so a mistake gets a precise message.
        """
        self._require_ready("map DMA")
        info = self._info or self.iommu_info()
        handle, vaddr, size = pin_buffer(buffer, iova, writable)
        try:
            self._check_request(info, vaddr, iova, size)
            try:
                self._map_op(vaddr, iova, size, readable, writable)
            except OSError as error:
                raise map_error(error.errno, iova, size) from None
        except BaseException:
            ffi.release(handle)  # nothing was mapped: let go of the buffer
            raise
        mapping = DmaMapping(self, buffer, handle, vaddr, iova, size, readable, writable)
        self._mappings.append(mapping)
        return mapping

    def _check_request(self, info: IommuInfo, vaddr: int, iova: int, size: int) -> None:
        page = info.page_size
        if size == 0:
            raise DmaMapError(iova, size, "the buffer is empty", "map a non-empty buffer")
        for name, value in (("buffer address", vaddr), ("IOVA", iova), ("size", size)):
            if value % page:
                raise DmaMapError(iova, size, f"the {name} {value:#x} is not a multiple of the "
                                  f"IOMMU page size {page:#x}", ALIGN_FIX)
        if not info.contains(iova, size):
            usable = ", ".join(f"{s:#x}-{e:#x}" for s, e in info.iova_ranges)
            raise DmaMapError(iova, size, f"the range is outside the usable IOVA ranges ({usable})",
                              "choose an IOVA inside one of those ranges")
        for live in self._mappings:
            if live.overlaps(iova, size):
                raise DmaMapError(iova, size, f"it overlaps {live!r}",
                                  "unmap that mapping first, or choose another IOVA")

    def _unmap(self, mapping: DmaMapping) -> None:
        """Called by ``DmaMapping.close()``."""
        try:
            unmapped = self._unmap_op(mapping.iova, mapping.size)
        except OSError as error:
            # Still mapped as far as we know: keep the buffer pinned, report.
            raise DmaUnmapError(f"cannot unmap {mapping!r} ({describe_errno(error.errno)})",
                                self.unmap_fix) from None
        if unmapped != mapping.size:
            raise DmaUnmapError(f"unmapping {mapping!r} removed {unmapped:#x} bytes, not {mapping.size:#x}",
                                "map and unmap the same ranges; the kernel unmaps whole mappings only")
        self._mappings.remove(mapping)
        mapping._release()

    def unmap_all(self) -> None:
        """Unmap every live mapping, newest first; raises the first failure after trying all."""
        first_error = None
        for mapping in reversed(self._mappings[:]):
            try:
                mapping.close()
            except DmaUnmapError as error:
                first_error = first_error or error
        if first_error:
            raise first_error

    def _forget_mappings(self) -> None:
        """The fd is gone, and with it every mapping: the buffers may go."""
        for mapping in self._mappings:
            mapping._release()
        self._mappings.clear()


class DmaMapping:
    """One live MAP_DMA of ``buffer`` at ``iova``; unmapped by ``close()`` or on leaving ``with``."""

    def __init__(self, context: IommuContext, buffer, handle, vaddr: int, iova: int, size: int,
                 readable: bool, writable: bool):
        self.context = context       # the IOMMU context (type1 container or iommufd IOAS) that maps it
        self.buffer = buffer
        self._handle = handle
        self.vaddr = vaddr
        self.iova = iova
        self.size = size
        self.readable = readable
        self.writable = writable
        self.active = True

    def iova_of(self, offset: int) -> int:
        """The device address of byte ``offset`` of the buffer."""
        if not 0 <= offset < self.size:
            raise ValueError(f"offset {offset:#x} is outside this {self.size:#x}-byte mapping")
        return self.iova + offset

    def overlaps(self, iova: int, size: int) -> bool:
        return iova < self.iova + self.size and self.iova < iova + size

    def close(self) -> None:
        """Unmap from the IOMMU (once; later calls do nothing)."""
        if self.active:
            self.context._unmap(self)

    def _release(self) -> None:
        """Let go of the buffer: called once the kernel no longer maps it.  The reference goes
        too: a mapping kept after its unmap must not keep the buffer exported (a view of a BAR
        mmap would keep the mmap, so the device fd and its VFIO group, open)."""
        self.active = False
        if self._handle is not None:
            ffi.release(self._handle)
            self._handle = None
        self.buffer = None

    def __enter__(self) -> "DmaMapping":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "mapped" if self.active else "unmapped"
        return f"<DmaMapping iova={self.iova:#x} size={self.size:#x} {state}>"
