"""Storage straight into the GPU, in the guest (docs/storage.md).

``session.StorageSession`` is the cuFile-shaped API: one IOMMU context (a type1 container or an
iommufd IOAS) for an NVMe controller and a GPU; ``handle_register`` (a namespace is the file),
``buf_register`` (a range of VRAM), ``read``/``write`` and ``batch_submit``/``Batch.poll``, in
``p2p`` mode (the NVMe DMAs straight into VRAM: the GPU's BAR2 is mapped into the NVMe's IOMMU
context), ``compat`` mode (NVMe -> guest RAM -> a GPU copy descriptor) or ``cmb`` mode (NVMe ->
its own Controller Memory Buffer -> a GPU peer copy).  ``gpu_initiated``: an NVMe queue pair in
VRAM that the GPU drives itself (NVME_IO, GPU interface 1.2), its SQ optionally in the NVMe's CMB
(1.3)."""

from .session import Batch, FileHandle, GpuBuffer, IoParams, StorageError, StorageSession

__all__ = ["Batch", "FileHandle", "GpuBuffer", "IoParams", "StorageError", "StorageSession"]
