"""The guest stack: a library for programs that run inside a lab VM (docs/guest-library.md).

    from vfio_cxl.guest import GpuDriver, Transfer, Op, DaxMapping, ensure_ram_devdax

Modules: ``vfio`` (userspace VFIO: one IOMMU-context interface, a type1 container
and an iommufd backend behind it; device, regions, interrupts), ``cxl`` (CXL
discovery and regions over cxl-cli/daxctl/ndctl), ``dax`` (devdax mappings),
``drivers`` (``gpu``, ``smc``, ``nvme``, ``igb``), ``storage`` (the cuFile-shaped API),
``nic`` (devmem-shaped receive into VRAM over the igb driver),
``channel`` (the cross-host record channel), ``smc_channel`` (its SMC
wake-ups and fences) and ``cacheline`` (its cache operations as x86 instructions),
``p2p`` (GPUs in one IOMMU context), ``gpumem`` (GPU memory over CXL); and what the
lab's host and guest commands agree on: ``payload`` (the demos' checkable payload)
and ``record_plan`` (the channel benchmarks' plans).  What users run in the guest -- ``vfio-cxl gpu|nvme|nic ...``, the demos',
checks' and benchmarks' guest halves -- is ``vfio_cxl.guest.cmd``, built on this
library; the library never imports it.

The names below load their module on first use, so ``import vfio_cxl.guest``
costs nothing and a host program that needs only the channel does not load cffi.
"""

from .lazy import lazy_names

_HOMES = {
    "vfio": ("VfioPciDevice", "IommuContext", "Container", "IommufdContext", "DmaMapping", "VfioError",
             "InterruptTimeout", "find_pci_devices", "bind_vfio_pci"),
    "cxl": ("CxlError", "DaxDevice", "ensure_ram_devdax", "bring_up"),
    "dax": ("DaxMapping", "open_dax"),
    "drivers.gpu": ("GpuDriver", "Transfer", "Op", "GpuError", "GpuDmaError"),
    "drivers.smc": ("SmcDriver", "SmcError", "SmcTimeout"),
    "drivers.nvme": ("NvmeController", "NvmeError", "IoOp"),
    "drivers.igb": ("IgbDevice", "IgbError"),
    "storage": ("StorageSession", "IoParams", "StorageError"),
    "nic": ("NicSession", "DevmemReceiver", "DevmemError"),
    "channel": ("Producer", "Consumer", "Coherence", "COHERENT", "Wakeup", "ChannelError"),
    "smc_channel": ("SmcWakeup", "FencedProducer"),
    "p2p": ("PeerPair", "map_peer_bar"),
    "gpumem": ("GpuMemory", "UvmPager"),
}
__getattr__, __dir__, __all__ = lazy_names(__name__, _HOMES)
