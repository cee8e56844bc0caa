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
interrupts, bind (sysfs and pyudev), backend (which backend drives a
device), pci (the whole sequence), errors.

The names below load their module on first use: a command that only lists devices
(``bind``) or asks which backend would drive one (``backend``) loads no cffi and no ioctl code.
"""

from ..lazy import lazy_names

_HOMES = {
    "bind": ("Binding", "bind_vfio_pci", "find_pci_devices", "iommu_group", "normalize_bdf"),
    "backend": ("choose_backend",),
    "container": ("Container",),
    "iommu": ("DmaMapping", "IommuContext", "IommuInfo"),
    "iommufd": ("IommufdContext",),
    "device": ("Device", "DeviceInfo"),
    "errors": ("DeviceBoundElsewhereError", "DmaMapError", "DmaUnmapError", "DriverBindError",
               "GroupError", "GroupNotViableError", "InterruptError", "InterruptTimeout",
               "IommuTypeUnsupportedError", "NoIommuGroupError", "RegionError", "VfioError"),
    "group": ("Group", "GroupStatus"),
    "interrupts": ("Interrupts", "IrqInfo", "MsixVectors"),
    "pci": ("VfioPciDevice",),
    "region": ("Region", "RegionInfo"),
}
__getattr__, __dir__, __all__ = lazy_names(__name__, _HOMES)
