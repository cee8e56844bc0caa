"""Userspace VFIO for the guest: iommufd (/dev/iommu + device cdev) or container/group type1.

    from vfio_cxl.guest.vfio import VfioPciDevice

    with VfioPciDevice.open("0000:01:00.0") as gpu:
        bar0 = gpu.bar(0)
        bar0.write32(0x10, 1)
        with gpu.map_dma(mmap.mmap(-1, 1 << 20), iova=0x100000) as dma:
            ...
        vectors = gpu.msix(4)
        vectors.wait(0, timeout=1.0)

Modules, one job each: uapi and uapi_iommufd (kernel ABI), syscalls (ioctl),
caps (INFO buffers), iommu (the IOMMU context both backends share: IOVA
bookkeeping), container + group (type1), iommufd, device, region, dma,
interrupts, bind (sysfs and pyudev), pci (the whole sequence, backend
choice), errors.
"""

from .bind import Binding, bind_vfio_pci, find_pci_devices, iommu_group, normalize_bdf
from .container import Container
from .iommu import DmaMapping, IommuContext, IommuInfo
from .iommufd import IommufdContext
from .device import Device, DeviceInfo
from .errors import (DeviceBoundElsewhereError, DmaMapError, DmaUnmapError, DriverBindError,
                     GroupError, GroupNotViableError, InterruptError, InterruptTimeout,
                     IommuTypeUnsupportedError, NoIommuGroupError, RegionError, VfioError)
from .group import Group, GroupStatus
from .interrupts import Interrupts, IrqInfo, MsixVectors
from .pci import VfioPciDevice
from .region import Region, RegionInfo

__all__ = [
    "Binding", "bind_vfio_pci", "find_pci_devices", "iommu_group", "normalize_bdf",
    "Container", "IommuContext", "IommufdContext", "IommuInfo", "Device", "DeviceInfo", "DmaMapping",
    "DeviceBoundElsewhereError", "DmaMapError", "DmaUnmapError", "DriverBindError", "GroupError",
    "GroupNotViableError", "InterruptError", "InterruptTimeout", "IommuTypeUnsupportedError",
    "NoIommuGroupError", "RegionError", "VfioError",
    "Group", "GroupStatus", "Interrupts", "IrqInfo", "MsixVectors", "VfioPciDevice",
    "Region", "RegionInfo",
]
