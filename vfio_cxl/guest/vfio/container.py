"""The VFIO container (/dev/vfio/vfio): the type1 backend of an IOMMU context.

The IOVA bookkeeping (alignment, ranges, overlap, pinning) is the shared
``iommu.IommuContext``; this module has only the type1 ioctls.
"""

from __future__ import annotations

import os
from . import caps, syscalls, uapi
from .errors import INTEL_IOMMU_HINT, ContainerError, IommuTypeUnsupportedError, IoctlError
from .iommu import IommuContext, IommuInfo
from .uapi import ffi

CONTAINER_PATH = "/dev/vfio/vfio"
# Preferred first: type1v2 is the modern type1 (stricter unmap semantics).
IOMMU_TYPES = {uapi.VFIO_TYPE1v2_IOMMU: "type1v2", uapi.VFIO_TYPE1_IOMMU: "type1"}


class Container(IommuContext):
    """An open container fd.  ``close()`` unmaps every live mapping, then closes the fd."""

    backend = "type1"
    unmap_fix = "close the container: the kernel drops every mapping with it"

    def __init__(self, fd: int, *, ioctl: syscalls.IoctlFn = syscalls.ioctl, path: str = CONTAINER_PATH):
        super().__init__()
        self.fd = fd
        self.path = path
        self.iommu_type: int | None = None
        self._ioctl = ioctl

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

    def _query_info(self) -> IommuInfo:
        """Page sizes and usable IOVA ranges (VFIO_IOMMU_GET_INFO); needs the IOMMU type set."""
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
        return IommuInfo(head["flags"], pgsizes, ranges, avail)

    # -- DMA (the bookkeeping is IommuContext's) ----------------------------

    def _map_op(self, vaddr: int, iova: int, size: int, readable: bool, writable: bool) -> None:
        request = ffi.new("struct vfio_iommu_type1_dma_map *")
        request.argsz = ffi.sizeof(request[0])
        request.flags = ((uapi.VFIO_DMA_MAP_FLAG_READ if readable else 0)
                         | (uapi.VFIO_DMA_MAP_FLAG_WRITE if writable else 0))
        request.vaddr, request.iova, request.size = vaddr, iova, size
        self._ioctl(self.fd, uapi.VFIO_IOMMU_MAP_DMA, request)

    def _unmap_op(self, iova: int, size: int) -> int:
        request = ffi.new("struct vfio_iommu_type1_dma_unmap *")
        request.argsz = ffi.sizeof(request[0])
        request.iova, request.size = iova, size
        self._ioctl(self.fd, uapi.VFIO_IOMMU_UNMAP_DMA, request)
        return request.size

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
            self._forget_mappings()

    def __enter__(self) -> "Container":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require_ready(self, action: str) -> None:
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
