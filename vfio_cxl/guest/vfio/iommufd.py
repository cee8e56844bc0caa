"""The iommufd backend: /dev/iommu, an IO address space, and a device cdev bound to it.

    ctx = IommufdContext.open()                 # /dev/iommu + IOMMU_IOAS_ALLOC
    fd = open_device_cdev(bdf)                  # /dev/vfio/devices/vfioN
    ctx.bind(fd, bdf); ctx.attach(fd, bdf)      # VFIO_DEVICE_BIND_IOMMUFD, _ATTACH_IOMMUFD_PT
    ctx.map_dma(buf, iova)                      # IOMMU_IOAS_MAP (FIXED_IOVA), IOVA bookkeeping shared

The usable IOVA ranges come from IOMMU_IOAS_IOVA_RANGES, asked after each
attach (an attached device narrows them: the MSI window, reserved regions).
Closing destroys the IOAS with the fd; the device's own fd must be closed
first (that unbinds it).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from . import syscalls
from . import uapi_iommufd as u
from .backend import IOMMUFD_PATH, available, cdev_name  # noqa: F401 (this module's names too)
from .iommu import DmaMapping
from .errors import INTEL_IOMMU_HINT, DmaMapError, IoctlError, VfioError, describe_errno
from .iommu import IommuContext, IommuInfo

DEV_VFIO_DEVICES = "/dev/vfio/devices"
ffi = u.ffi


class IommufdError(VfioError):
    pass


class DmaBufError(IommufdError):
    """VFIO_DEVICE_FEATURE_DMA_BUF could not export a BAR as a dma-buf."""

    def __init__(self, what: str, fix: str, err: int):
        self.errno = err
        super().__init__(what, fix)


_DMABUF_ERRNO_HELP = {
    errno.ENOTTY: ("this kernel has no VFIO dma-buf export (CONFIG_VFIO_PCI_DMABUF is off: it needs "
                   "PCI_P2PDMA and DMA_SHARED_BUFFER)",
                   "use the type1 container (it maps a BAR mmap directly), or a kernel with "
                   "CONFIG_VFIO_PCI_DMABUF=y (DMA_SHARED_BUFFER has no prompt: CONFIG_SYNC_FILE=y selects it)"),
    errno.ENODEV: ("the BAR is not claimed by vfio-pci, or the device's memory decoding is off "
                   "(the dma-buf starts revoked)", "enable PCI_COMMAND_MEMORY before exporting"),
    errno.EINVAL: ("the kernel refused the range (offset and length must be page-aligned and inside the BAR)",
                   "export whole pages of the BAR"),
    errno.EOPNOTSUPP: ("the device's driver has no dma-buf export", "use a vfio-pci device"),
}


def export_dma_buf(device_fd: int, name: str, region_index: int, offset: int, length: int, *,
                   ioctl: syscalls.IoctlFn = syscalls.ioctl) -> int:
    """VFIO_DEVICE_FEATURE(GET | DMA_BUF): a dma-buf fd for bytes [offset, offset+length) of BAR
    ``region_index`` of the device ``device_fd``; the caller closes it.  Raises DmaBufError."""
    head, body = ffi.sizeof("struct vfio_device_feature"), ffi.sizeof("struct vfio_device_feature_dma_buf")
    size = head + body + ffi.sizeof("struct vfio_region_dma_range")
    raw = ffi.new("char[]", size)
    feature = ffi.cast("struct vfio_device_feature *", raw)
    feature.argsz = size
    feature.flags = u.VFIO_DEVICE_FEATURE_GET | u.VFIO_DEVICE_FEATURE_DMA_BUF
    dma_buf = ffi.cast("struct vfio_device_feature_dma_buf *", raw + head)
    dma_buf.region_index = region_index
    dma_buf.open_flags = os.O_RDWR | os.O_CLOEXEC
    dma_buf.nr_ranges = 1
    dma_buf.dma_ranges[0].offset = offset
    dma_buf.dma_ranges[0].length = length
    try:
        return ioctl(device_fd, u.VFIO_DEVICE_FEATURE, feature)
    except OSError as error:
        why, fix = _DMABUF_ERRNO_HELP.get(error.errno, ("the kernel refused", "see the kernel log (dmesg)"))
        raise DmaBufError(f"VFIO_DEVICE_FEATURE_DMA_BUF({name}, BAR{region_index}, {length:#x} bytes) failed "
                          f"({describe_errno(error.errno)}): {why}", fix, error.errno) from None


_MAP_FILE_ERRNO_HELP = {
    errno.EINVAL: ("the kernel refused the file: not a memfd, and not a dma-buf it can import "
                   "(single-range VFIO PCI dma-bufs only), or the range is outside it",
                   "map a VFIO BAR dma-buf (export_dma_buf) or a memfd, within its size"),
    errno.EOPNOTSUPP: ("this iommufd cannot import the dma-buf (no CONFIG_DMA_SHARED_BUFFER, or the "
                       "exporter is not vfio-pci, or it has more than one range)",
                       "export one range of a vfio-pci BAR, on a kernel with CONFIG_VFIO_PCI_DMABUF=y"),
    errno.ENODEV: ("the dma-buf was revoked (the device was reset or its memory decoding turned off)",
                   "export it again after the device is back"),
    errno.EEXIST: ("the IOVA range overlaps a mapping the kernel already has",
                   "unmap that mapping first, or choose another IOVA"),
}


# VFIO_DEVICE_BIND_IOMMUFD's refusals that name another user of the device (vfio_df_open,
# vfio_device_block_group in drivers/vfio)
_BIND_ERRNO_FIX = {
    errno.EINVAL: ("the device is already bound through another open of its cdev (one not closed, in this "
                   "process or another; a cdev binds once at a time): close that one first"),
    errno.EBUSY: ("the device's VFIO group is open (a device is driven through its cdev or its group, not "
                  "both): close the group's user first"),
}


def open_device_cdev(bdf: str, *, sysfs_root: str | Path = "/sys", dev_dir: str = DEV_VFIO_DEVICES) -> int:
    name = cdev_name(bdf, sysfs_root)
    if name is None:
        raise IommufdError(f"{bdf} has no VFIO device cdev (no vfio-dev/ in sysfs)",
                           "bind it to vfio-pci, on a kernel with CONFIG_VFIO_DEVICE_CDEV=y; "
                           "or use the type1 backend (VFIO_CXL_VFIO_BACKEND=type1)")
    path = os.path.join(dev_dir, name)
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise IommufdError(f"{path} does not exist although sysfs lists {name}",
                           "is devtmpfs mounted on /dev?") from None
    except OSError as error:
        if error.errno == errno.EBUSY:
            raise IommufdError(f"{path} is busy: the device is open through its group or by another process",
                               "close the other user (a device is opened by cdev or by group, not both)"
                               ) from None
        raise


class IommufdContext(IommuContext):
    """An iommufd with one IOAS.  ``close()`` unmaps everything, destroys the IOAS, closes the fd."""

    backend = "iommufd"
    unmap_fix = "close the iommufd: the kernel drops the IOAS and its mappings with it"

    def __init__(self, fd: int, *, ioctl: syscalls.IoctlFn = syscalls.ioctl, path: str = IOMMUFD_PATH):
        super().__init__()
        self.fd = fd
        self.path = path
        self.ioas_id: int | None = None
        self.attached: dict[str, int] = {}   # device name -> devid
        self._ioctl = ioctl

    @classmethod
    def open(cls, path: str = IOMMUFD_PATH, *, ioctl: syscalls.IoctlFn = syscalls.ioctl) -> "IommufdContext":
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise IommufdError(f"{path} does not exist", "the guest kernel needs CONFIG_IOMMUFD "
                               "(boot with --kernel lab), or use the type1 backend") from None
        except PermissionError:
            raise IommufdError(f"no permission to open {path}", "run as root") from None
        ctx = cls(fd, ioctl=ioctl, path=path)
        try:
            ctx.alloc_ioas()
        except BaseException:
            ctx.close()
            raise
        return ctx

    def alloc_ioas(self) -> int:
        request = ffi.new("struct iommu_ioas_alloc *")
        request.size = ffi.sizeof(request[0])
        self._call("IOMMU_IOAS_ALLOC", u.IOMMU_IOAS_ALLOC, request)
        self.ioas_id = request.out_ioas_id
        return self.ioas_id

    # -- devices ------------------------------------------------------------
    def bind(self, device_fd: int, name: str) -> int:
        """VFIO_DEVICE_BIND_IOMMUFD: the cdev ``device_fd`` joins this iommufd; returns its devid."""
        request = ffi.new("struct vfio_device_bind_iommufd *")
        request.argsz = ffi.sizeof(request[0])
        request.iommufd = self.fd
        what = f"VFIO_DEVICE_BIND_IOMMUFD({name})"
        try:
            self._ioctl(device_fd, u.VFIO_DEVICE_BIND_IOMMUFD, request)
        except OSError as error:
            fix = _BIND_ERRNO_FIX.get(error.errno, f"{INTEL_IOMMU_HINT}; a device cdev binds once, before any "
                                                   "other ioctl")
            raise IoctlError(what, error.errno, fix) from None
        return request.out_devid

    def attach(self, device_fd: int, name: str) -> None:
        """VFIO_DEVICE_ATTACH_IOMMUFD_PT to this IOAS; the usable IOVA ranges are asked afresh."""
        request = ffi.new("struct vfio_device_attach_iommufd_pt *")
        request.argsz = ffi.sizeof(request[0])
        request.pt_id = self.ioas_id
        self._call(f"VFIO_DEVICE_ATTACH_IOMMUFD_PT({name})", u.VFIO_DEVICE_ATTACH_IOMMUFD_PT, request,
                   fd=device_fd, fix="bind the device to this iommufd first")
        self.attached[name] = request.pt_id
        self._info = None

    def detach(self, device_fd: int, name: str) -> None:
        if self.attached.pop(name, None) is None:
            return
        request = ffi.new("struct vfio_device_detach_iommufd_pt *")
        request.argsz = ffi.sizeof(request[0])
        self._call(f"VFIO_DEVICE_DETACH_IOMMUFD_PT({name})", u.VFIO_DEVICE_DETACH_IOMMUFD_PT, request,
                   fd=device_fd)
        self._info = None

    # -- the three backend operations --------------------------------------
    def _query_info(self) -> IommuInfo:
        request = ffi.new("struct iommu_ioas_iova_ranges *")
        request.size = ffi.sizeof(request[0])
        request.ioas_id = self.ioas_id
        ranges = ffi.new("struct iommu_iova_range[]", 8)
        while True:
            request.num_iovas = len(ranges)
            request.allowed_iovas = int(ffi.cast("uintptr_t", ranges))
            try:
                self._ioctl(self.fd, u.IOMMU_IOAS_IOVA_RANGES, request)
                break
            except OSError as error:
                if error.errno != errno.EMSGSIZE:
                    raise IoctlError("IOMMU_IOAS_IOVA_RANGES", error.errno) from None
                ranges = ffi.new("struct iommu_iova_range[]", request.num_iovas)
        found = [(ranges[i].start, ranges[i].last) for i in range(request.num_iovas)]
        # The alignment is the only "page size" iommufd states: it is at most PAGE_SIZE.
        return IommuInfo(0, max(request.out_iova_alignment, 4096), found)

    def _map_op(self, vaddr: int, iova: int, size: int, readable: bool, writable: bool) -> None:
        request = ffi.new("struct iommu_ioas_map *")
        request.size = ffi.sizeof(request[0])
        request.flags = (u.IOMMU_IOAS_MAP_FIXED_IOVA
                         | (u.IOMMU_IOAS_MAP_READABLE if readable else 0)
                         | (u.IOMMU_IOAS_MAP_WRITEABLE if writable else 0))
        request.ioas_id = self.ioas_id
        request.user_va, request.length, request.iova = vaddr, size, iova
        self._ioctl(self.fd, u.IOMMU_IOAS_MAP, request)

    def map_file(self, fd: int, start: int, length: int, iova: int, *, readable: bool = True,
                 writable: bool = True) -> DmaMapping:
        """IOMMU_IOAS_MAP_FILE (FIXED_IOVA): bytes [start, start+length) of ``fd`` -- a memfd,
        or a VFIO BAR dma-buf (``export_dma_buf``) -- at ``iova``.  The kernel holds its own
        reference on the file: ``fd`` may be closed once this returns.  Same checks and
        bookkeeping as ``map_dma``; the mapping has no buffer of this process."""
        self._require_ready("map a file")
        info = self._info or self.iommu_info()
        self._check_request(info, start, iova, length)
        request = ffi.new("struct iommu_ioas_map_file *")
        request.size = ffi.sizeof(request[0])
        request.flags = (u.IOMMU_IOAS_MAP_FIXED_IOVA
                         | (u.IOMMU_IOAS_MAP_READABLE if readable else 0)
                         | (u.IOMMU_IOAS_MAP_WRITEABLE if writable else 0))
        request.ioas_id, request.fd = self.ioas_id, fd
        request.start, request.length, request.iova = start, length, iova
        try:
            self._ioctl(self.fd, u.IOMMU_IOAS_MAP_FILE, request)
        except OSError as error:
            why, fix = _MAP_FILE_ERRNO_HELP.get(error.errno, ("IOMMU_IOAS_MAP_FILE failed", "see dmesg"))
            raise DmaMapError(iova, length, f"IOMMU_IOAS_MAP_FILE: {why}", fix, error.errno) from None
        mapping = DmaMapping(self, None, None, 0, iova, length, readable, writable)
        self._mappings.append(mapping)
        return mapping

    def _unmap_op(self, iova: int, size: int) -> int:
        request = ffi.new("struct iommu_ioas_unmap *")
        request.size = ffi.sizeof(request[0])
        request.ioas_id = self.ioas_id
        request.iova, request.length = iova, size
        self._ioctl(self.fd, u.IOMMU_IOAS_UNMAP, request)
        return request.length

    def _require_ready(self, action: str) -> None:
        if self.fd < 0:
            raise IommufdError(f"cannot {action}: the iommufd is closed", "open a new one")
        if self.ioas_id is None:
            raise IommufdError(f"cannot {action} without an IOAS", "call alloc_ioas() first")

    # -- lifetime ---------------------------------------------------------------
    def close(self) -> None:
        """Unmap everything, destroy the IOAS, close the fd.  Safe to call again."""
        if self.fd < 0:
            return
        try:
            if self.ioas_id is not None:
                self.unmap_all()
                request = ffi.new("struct iommu_destroy *")
                request.size = ffi.sizeof(request[0])
                request.id = self.ioas_id
                self._call("IOMMU_DESTROY", u.IOMMU_DESTROY, request,
                           fix="close every device bound to this iommufd first")
                self.ioas_id = None
        finally:
            os.close(self.fd)
            self.fd = -1
            self._forget_mappings()

    def __enter__(self) -> "IommufdContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, name: str, request: int, arg=None, *, fd: int | None = None, fix: str = "") -> int:
        try:
            return self._ioctl(self.fd if fd is None else fd, request, arg)
        except OSError as error:
            raise IoctlError(name, error.errno, fix) from None
