"""Which VFIO backend drives a device: type1 (container/group) or iommufd (/dev/iommu + the
device's cdev).  Only sysfs and /dev are read here -- no ioctl, no cffi -- so a command that
only asks (``vfio-cxl gpu ls``) loads nothing else of the stack."""

from __future__ import annotations

import os
from pathlib import Path

from .bind import Sysfs
from .errors import VfioError

IOMMUFD_PATH = "/dev/iommu"
BACKEND_ENV = "VFIO_CXL_VFIO_BACKEND"
BACKENDS = ("auto", "type1", "iommufd")


def cdev_name(bdf: str, sysfs_root: str | Path = "/sys") -> str | None:
    """``vfioN`` of a device bound to vfio-pci with a cdev (sysfs .../BDF/vfio-dev/vfioN), or None."""
    vfio_dev = Path(sysfs_root) / "bus" / "pci" / "devices" / bdf / "vfio-dev"
    names = sorted(p.name for p in vfio_dev.iterdir()) if vfio_dev.is_dir() else []
    return names[0] if names else None


def available(bdf: str, *, sysfs_root: str | Path = "/sys", iommufd_path: str = IOMMUFD_PATH) -> bool:
    """iommufd can drive ``bdf``: /dev/iommu exists and the device has a VFIO cdev."""
    return os.path.exists(iommufd_path) and cdev_name(bdf, sysfs_root) is not None


def choose_backend(bdf: str, wanted: str | None = None, *, sysfs: Sysfs | None = None,
                   iommufd_path: str = IOMMUFD_PATH) -> str:
    """'type1' or 'iommufd' for ``bdf`` (bound to vfio-pci): ``wanted``, else $VFIO_CXL_VFIO_BACKEND,
    else auto: iommufd when /dev/iommu exists and the device has a VFIO cdev."""
    wanted = wanted or os.environ.get(BACKEND_ENV) or "auto"
    if wanted not in BACKENDS:
        raise VfioError(f"unknown VFIO backend {wanted!r}", f"use one of {', '.join(BACKENDS)} "
                        f"(argument or ${BACKEND_ENV})")
    if wanted != "auto":
        return wanted
    root = (sysfs or Sysfs()).root
    return "iommufd" if available(bdf, sysfs_root=root, iommufd_path=iommufd_path) else "type1"
