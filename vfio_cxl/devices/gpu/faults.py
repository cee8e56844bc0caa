"""How a protocol-level DMA fault shows in the GPU's status codes: one table for every part of the
engine (the ring, far memory, NVME_IO)."""

from __future__ import annotations

from ..vfio_user.dma import FaultKind
from .regs import Status

FAULT_STATUS = {
    FaultKind.UNMAPPED: Status.DMA_UNMAPPED,
    FaultKind.PERMISSION: Status.DMA_PERMISSION,
    FaultKind.REFUSED: Status.DMA_REFUSED,
    FaultKind.TIMEOUT: Status.DMA_TIMEOUT,
    FaultKind.CLOSED: Status.DMA_ABORTED,
    FaultKind.IO: Status.DMA_IO_ERROR,
}
