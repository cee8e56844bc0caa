"""What can go wrong with VFIO in the guest, each with its cause and its fix.

All derive from ``VfioError`` (a ``LabError``: ``.what`` and ``.fix``), so a
caller can catch the whole family, and the CLI prints them as one line.
"""

from __future__ import annotations

import errno as errno_names
import os

from vfio_cxl.errors import LabError

INTEL_IOMMU_HINT = "boot the guest with intel_iommu=on (and a QEMU intel-iommu device)"


def describe_errno(err: int) -> str:
    name = errno_names.errorcode.get(err, f"errno {err}")
    return f"{name}: {os.strerror(err)}"


class VfioError(LabError):
    """A VFIO operation failed; the message says why and what to do."""


class IoctlError(VfioError):
    """An ioctl failed for a reason no more specific class covers."""

    def __init__(self, operation: str, err: int, fix: str = ""):
        self.operation = operation
        self.errno = err
        super().__init__(f"{operation} failed ({describe_errno(err)})", fix)


class NoIommuGroupError(VfioError):
    """The device has no IOMMU group: the IOMMU is off or the device is missing."""


class DriverBindError(VfioError):
    """A PCI device could not be moved to (or back from) vfio-pci."""


class DeviceBoundElsewhereError(DriverBindError):
    """The device is bound to another driver and we were asked not to rebind it."""

    def __init__(self, bdf: str, driver: str):
        self.bdf = bdf
        self.driver = driver
        super().__init__(
            f"{bdf} is bound to {driver}, not vfio-pci",
            f"bind it to vfio-pci first (VfioPciDevice.open({bdf!r}, bind=True) does that)",
        )


class GroupError(VfioError):
    """A VFIO group could not be opened or used."""


class GroupNotViableError(GroupError):
    """Some device in the group is bound to a driver other than vfio-pci."""

    def __init__(self, group: int, members: list[tuple[str, str | None]]):
        self.group = group
        self.members = members
        listing = ", ".join(f"{bdf} ({driver or 'no driver'})" for bdf, driver in members) or "unknown"
        super().__init__(
            f"IOMMU group {group} is not viable: its devices are {listing}",
            "bind every device of the group to vfio-pci (or unbind it from its driver), "
            "or give the device its own group (e.g. put it behind its own root port)",
        )


class ContainerError(VfioError):
    """The VFIO container (/dev/vfio/vfio) is missing or unusable."""


class IommuTypeUnsupportedError(ContainerError):
    """The container supports none of the IOMMU types we can drive."""


class RegionError(VfioError):
    """A device region is missing, too small, or was accessed out of its bounds."""


class DmaMapError(VfioError):
    """VFIO_IOMMU_MAP_DMA (or its checks) refused a buffer at an IOVA."""

    def __init__(self, iova: int, size: int, why: str, fix: str, err: int | None = None):
        self.iova = iova
        self.size = size
        self.errno = err
        cause = f"{describe_errno(err)}; " if err is not None else ""
        super().__init__(f"cannot map {size:#x} bytes at IOVA {iova:#x}: {cause}{why}", fix)


class DmaUnmapError(VfioError):
    """VFIO_IOMMU_UNMAP_DMA failed or unmapped less than was mapped."""


class InterruptError(VfioError):
    """Interrupts could not be enabled, disabled or triggered."""


class InterruptTimeout(InterruptError, TimeoutError):
    """An interrupt vector did not fire in time."""

    def __init__(self, kind: str, vector: int | str, timeout: float):
        self.vector = vector
        self.timeout = timeout
        super().__init__(
            f"{kind} vector {vector} did not fire within {timeout:g} s",
            "check that the device raised it (its MSI-X table entry unmasked, "
            "bus mastering on) and that this vector was enabled",
        )
