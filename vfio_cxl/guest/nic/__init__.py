"""The network in the guest: frames the lab sends (frames), devmem-shaped receive into GPU
VRAM over the userspace igb driver (devmem), and the session that opens a NIC and a GPU in
one IOMMU context (session).  Design: docs/nic.md.

The names below load their module on first use."""

from ..lazy import lazy_names

_HOMES = {
    "devmem": ("DevmemReceiver", "DevmemError", "RxBinding", "Fragment", "DevmemFrame", "ChunkPool", "TokenTable"),
    "session": ("NicSession",),
}
__getattr__, __dir__, __all__ = lazy_names(__name__, _HOMES)
