"""The VFIO container (/dev/vfio/vfio): one IOMMU context and its DMA mappings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import caps, syscalls, uapi
from .dma import ALIGN_FIX, DmaMapping, map_error, pin_buffer
from .errors import (INTEL_IOMMU_HINT, ContainerError, DmaMapError, DmaUnmapError,
                     IommuTypeUnsupportedError, IoctlError, describe_errno)
from .uapi import ffi

CONTAINER_PATH = "/dev/vfio/vfio"
# Preferred first: type1v2 is the modern type1 (stricter unmap semantics).
IOMMU_TYPES = {uapi.VFIO_TYPE1v2_IOMMU: "type1v2", uapi.VFIO_TYPE1_IOMMU: "type1"}


@dataclass(frozen=True)
class IommuInfo:
    flags: int
    pgsizes: int  # bitmap of the IOMMU page sizes
    iova_ranges: list[tuple[int, int]] = field(default_factory=list)  # (start, end inclusive)
    dma_avail: int | None = None  # mappings still allowed, if the kernel says

    @property
    def page_size(self) -> int:
        """The smallest IOMMU page size: the alignment MAP_DMA needs."""
        return self.pgsizes & -self.pgsizes if self.pgsizes else 4096

    def contains(self, iova: int, size: int) -> bool:
        if not self.iova_ranges:
            return True  # the kernel did not say: let it decide
        last = iova + size - 1
        return any(start <= iova and last <= end for start, end in self.iova_ranges)


class Container:
    """An open container fd.  ``close()`` unmaps every live mapping, then closes the fd."""

    def __init__(self, fd: int, *, ioctl: syscalls.IoctlFn = syscalls.ioctl, path: str = CONTAINER_PATH):
        self.fd = fd
        self.path = path
        self.iommu_type: int | None = None
        self._ioctl = ioctl
        self._mappings: list[DmaMapping] = []
        self._info: IommuInfo | None = None

    @classmethod
    def open(cls, path: str = CONTAINER_PATH, *, ioctl: syscalls.IoctlFn = syscalls.ioctl) -> "Container":
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ContainerError(f"{path} does not exist",
                                 "load VFIO: modprobe vfio-pci (the guest kernel needs CONFIG_VFIO_CONTAINER)"
                                 ) from None
        except PermissionError:
            raise ContainerError(f"no permission to open {path}", "run as root") from None
        container = cls(fd, ioctl=ioctl, path=path)
        try:
            container.check_api_version()
        except BaseException:
            container.close()
            raise
        return container

    # -- container ioctls -------------------------------------------------

    def api_version(self) -> int:
        return self._call("VFIO_GET_API_VERSION", uapi.VFIO_GET_API_VERSION)

    def check_api_version(self) -> None:
        version = self.api_version()
        if version != uapi.VFIO_API_VERSION:
            raise ContainerError(f"{self.path} speaks VFIO API version {version}, "
                                 f"this code knows version {uapi.VFIO_API_VERSION}",
                                 "use a kernel whose VFIO API matches include/uapi/linux/vfio.h")

    def check_extension(self, extension: int) -> bool:
        return self._call("VFIO_CHECK_EXTENSION", uapi.VFIO_CHECK_EXTENSION, extension) > 0

    def set_iommu(self, types: tuple[int, ...] = tuple(IOMMU_TYPES)) -> int:
        """Select the first supported IOMMU type of ``types``; needs a group attached first."""
        for iommu_type in types:
            if self.check_extension(iommu_type):
                self._call("VFIO_SET_IOMMU", uapi.VFIO_SET_IOMMU, iommu_type,
                           fix="attach a group to this container first (Group.set_container)")
                self.iommu_type = iommu_type
                return iommu_type
        wanted = ", ".join(IOMMU_TYPES.get(t, str(t)) for t in types)
        noiommu = self.check_extension(uapi.VFIO_NOIOMMU_IOMMU)
        raise IommuTypeUnsupportedError(
            f"the VFIO container supports none of the IOMMU types {wanted}"
            + (" (only no-IOMMU mode is offered)" if noiommu else ""),
            f"{INTEL_IOMMU_HINT}; the guest kernel needs CONFIG_VFIO_IOMMU_TYPE1")

    def iommu_info(self) -> IommuInfo:
        """Page sizes and usable IOVA ranges (VFIO_IOMMU_GET_INFO); needs the IOMMU type set."""
        self._require_iommu("query the IOMMU")
        ctype = "struct vfio_iommu_type1_info"
        try:
            buf = caps.query_info(self._ioctl, self.fd, uapi.VFIO_IOMMU_GET_INFO, ctype)
        except OSError as error:
            raise IoctlError("VFIO_IOMMU_GET_INFO", error.errno) from None
        head = caps.read_struct(buf, ctype)
        ranges: list[tuple[int, int]] = []
        avail = None
        if head["flags"] & uapi.VFIO_IOMMU_INFO_CAPS:
            for cap in caps.capability_chain(buf, head["cap_offset"]):
                if cap.id == uapi.VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE:
                    ranges = caps.iova_ranges(buf, cap)
                elif cap.id == uapi.VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL:
                    avail = caps.dma_avail(buf, cap)
        pgsizes = head["iova_pgsizes"] if head["flags"] & uapi.VFIO_IOMMU_INFO_PGSIZES else 0
        self._info = IommuInfo(head["flags"], pgsizes, ranges, avail)
        return self._info

    # -- DMA --------------------------------------------------------------

    @property
    def mappings(self) -> tuple[DmaMapping, ...]:
        """The live mappings, oldest first."""
        return tuple(self._mappings)

    def map_dma(self, buffer, iova: int, *, readable: bool = True, writable: bool = True) -> DmaMapping:
        """Map all of ``buffer`` (an mmap, bytearray, ...) at ``iova`` for the device.

        ``readable``/``writable`` are from the device's side.  Checks alignment,
        IOVA range and overlap first, so a mistake gets a precise message.
        """
        self._require_iommu("map DMA")
        info = self._info or self.iommu_info()
        handle, vaddr, size = pin_buffer(buffer, iova, writable)
        try:
            self._check_request(info, vaddr, iova, size)
            request = ffi.new("struct vfio_iommu_type1_dma_map *")
            request.argsz = ffi.sizeof(request[0])
            request.flags = ((uapi.VFIO_DMA_MAP_FLAG_READ if readable else 0)
                             | (uapi.VFIO_DMA_MAP_FLAG_WRITE if writable else 0))
            request.vaddr, request.iova, request.size = vaddr, iova, size
            try:
                self._ioctl(self.fd, uapi.VFIO_IOMMU_MAP_DMA, request)
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
        request = ffi.new("struct vfio_iommu_type1_dma_unmap *")
        request.argsz = ffi.sizeof(request[0])
        request.iova, request.size = mapping.iova, mapping.size
        try:
            self._ioctl(self.fd, uapi.VFIO_IOMMU_UNMAP_DMA, request)
        except OSError as error:
            # Still mapped as far as we know: keep the buffer pinned, report.
            raise DmaUnmapError(f"cannot unmap {mapping!r} ({describe_errno(error.errno)})",
                                "close the container: the kernel drops every mapping with it") from None
        if request.size != mapping.size:
            raise DmaUnmapError(f"unmapping {mapping!r} removed {request.size:#x} bytes, not {mapping.size:#x}",
                                "map and unmap the same ranges; type1 unmaps whole mappings only")
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

    # -- lifetime ---------------------------------------------------------

    def close(self) -> None:
        """Unmap everything, close the fd.  Safe to call again."""
        if self.fd < 0:
            return
        try:
            if self.iommu_type is not None:
                self.unmap_all()
        finally:
            os.close(self.fd)
            self.fd = -1
            # Whatever the kernel may still map, it holds its own page pins: our buffers may go.
            for mapping in self._mappings:
                mapping._release()
            self._mappings.clear()

    def __enter__(self) -> "Container":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require_iommu(self, action: str) -> None:
        if self.fd < 0:
            raise ContainerError(f"cannot {action}: the container is closed", "open a new one")
        if self.iommu_type is None:
            raise ContainerError(f"cannot {action} before an IOMMU type is set",
                                 "attach a group (Group.set_container), then call Container.set_iommu()")

    def _call(self, name: str, request: int, arg=None, fix: str = "") -> int:
        try:
            return self._ioctl(self.fd, request, arg)
        except OSError as error:
            raise IoctlError(name, error.errno, fix) from None
