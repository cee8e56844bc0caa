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
from .errors import INTEL_IOMMU_HINT, IoctlError, VfioError
from .iommu import IommuContext, IommuInfo

IOMMUFD_PATH = "/dev/iommu"
DEV_VFIO_DEVICES = "/dev/vfio/devices"
ffi = u.ffi


class IommufdError(VfioError):
    pass


def cdev_name(bdf: str, sysfs_root: str | Path = "/sys") -> str | None:
    """``vfioN`` of a device bound to vfio-pci with a cdev (sysfs .../BDF/vfio-dev/vfioN), or None."""
    vfio_dev = Path(sysfs_root) / "bus" / "pci" / "devices" / bdf / "vfio-dev"
    names = sorted(p.name for p in vfio_dev.iterdir()) if vfio_dev.is_dir() else []
    return names[0] if names else None


def available(bdf: str, *, sysfs_root: str | Path = "/sys", iommufd_path: str = IOMMUFD_PATH) -> bool:
    """iommufd can drive ``bdf``: /dev/iommu exists and the device has a VFIO cdev."""
    return os.path.exists(iommufd_path) and cdev_name(bdf, sysfs_root) is not None


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
        self._call(f"VFIO_DEVICE_BIND_IOMMUFD({name})", u.VFIO_DEVICE_BIND_IOMMUFD, request, fd=device_fd,
                   fix=f"{INTEL_IOMMU_HINT}; a device cdev binds once, before any other ioctl")
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
