"""Userspace drivers for the guest, each on the VFIO library (``vfio_cxl.guest.vfio``).

``gpu``: the lab GPU (0601:1991, docs/gpu-device.md); ``smc``: the shared-memory
controller (docs/smc-device.md); ``nvme``: QEMU's NVMe controller (docs/storage.md).
A driver imports its device's register map (``vfio_cxl.devices.<x>.regs``) and
nothing else of the devices.
"""

from .gpu import GpuCompletionError, GpuDmaError, GpuDriver, GpuError, GpuRemovedError, Transfer
from .nvme import NvmeController, NvmeError
from .smc import SmcDriver, SmcError, SmcTimeout

__all__ = ["GpuDriver", "Transfer", "GpuError", "GpuRemovedError", "GpuCompletionError", "GpuDmaError",
           "SmcDriver", "SmcError", "SmcTimeout", "NvmeController", "NvmeError"]
