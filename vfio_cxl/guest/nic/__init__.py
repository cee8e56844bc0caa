"""The network in the guest: frames the lab sends (frames), devmem-shaped receive into GPU
VRAM over the userspace igb driver (devmem), RDMA-shaped writes from one host's VRAM into
another's (rdma), the session that opens a NIC and a GPU in one IOMMU context (session), and
the watch on the GPU's release request that tears its bindings down when the host moves it (release).
Design: docs/nic.md.

The names below load their module on first use."""

from ..lazy import lazy_names

_HOMES = {
    "devmem": ("DevmemReceiver", "DevmemError", "RxBinding", "Fragment", "DevmemFrame", "ChunkPool", "TokenTable"),
    "rdma": ("RdmaEndpoint", "RdmaError", "PeerLost", "MemoryRegion", "Access", "Completion", "WriteResult"),
    "release": ("ReleaseWatch", "GpuReleased"),
    "session": ("NicSession",),
}
__getattr__, __dir__, __all__ = lazy_names(__name__, _HOMES)
