"""A NIC and a GPU in one IOMMU context, with devmem receive into the GPU's VRAM.

    with NicSession.open(nic_bdf, gpu_bdf, backend="type1") as s:     # or "iommufd"
        b = s.rx.bind_rx(1, s.gpu, 0, 1 << 20)
        s.nic.steer(flow_mac, 1)
        frames = s.rx.recv(b, count=8, timeout=2)

``close`` runs newest first: the bindings (queues stopped, VRAM unmapped), the NIC stopped
(it DMAs no more), every mapping left in the context, the NIC, the GPU, the context.
"""

from __future__ import annotations

import contextlib

from ..drivers.gpu import GpuDriver
from ..drivers.igb import IgbDevice
from ..p2p import join_context
from .devmem import DevmemReceiver


class NicSession:
    def __init__(self, nic: IgbDevice, gpu: GpuDriver, context, backend: str, stack: contextlib.ExitStack):
        self.nic, self.gpu, self.context, self.backend = nic, gpu, context, backend
        self.rx = DevmemReceiver(nic)
        self._stack = stack
        self.kernel: dict[str, str] = {}     # what the kernel said to each BAR mapping

    @classmethod
    def open(cls, nic_bdf: str, gpu_bdf: str, *, backend: str = "type1", **nic_kwargs) -> "NicSession":
        """Open both devices in one new context (``backend``: type1 or iommufd); ``nic_kwargs``
        go to ``IgbDevice`` (queues, entries, rx_buffers, interrupts ...)."""
        with contextlib.ExitStack() as stack:
            context, shared = join_context(stack, backend)
            gpu = GpuDriver.open(gpu_bdf, **shared)
            stack.callback(gpu.close)
            nic = IgbDevice.open(nic_bdf, **shared, **nic_kwargs)
            stack.callback(nic.close)
            stack.callback(context.unmap_all)      # type1: mappings go before the devices leave
            stack.callback(nic.shutdown)
            return cls(nic, gpu, context, backend, stack.pop_all())

    def close(self) -> None:
        stack, self._stack = self._stack, contextlib.ExitStack()
        with stack:
            self.rx.close()

    def __enter__(self) -> "NicSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
