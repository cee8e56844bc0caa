"""A NIC and a GPU in one IOMMU context, with devmem receive into the GPU's VRAM.

    with NicSession.open(nic_bdf, gpu_bdf, backend="type1") as s:     # or "iommufd"
        b = s.rx.bind_rx(1, s.gpu, 0, 1 << 20)
        s.nic.steer(flow_mac, 1)
        frames = s.rx.recv(b, count=8, timeout=2)

``close`` runs newest first: the endpoints and the bindings (queues stopped, VRAM unmapped), the NIC stopped
(it DMAs no more), every mapping left in the context, the NIC, the GPU, the context.

The session watches the GPU's release request (``release.ReleaseWatch``): when the host
moves the GPU away, the next look -- every call of ``rx`` and of an endpoint made with
``endpoint()``, and every wait of theirs, which the request's eventfd ends -- tears the
bindings and registrations down, closes the GPU and raises GpuReleased naming its BDF.  The
NIC stays open: guest-RAM traffic goes on; the queues that pointed into VRAM stay disabled.
"""

from __future__ import annotations

import contextlib

from ..drivers.gpu import GpuDriver
from ..drivers.igb import IgbDevice
from ..p2p import join_context
from .devmem import DevmemReceiver
from .release import ReleaseWatch


class NicSession:
    def __init__(self, nic: IgbDevice, gpu: GpuDriver, context, backend: str, stack: contextlib.ExitStack):
        self.nic, self.gpu, self.context, self.backend = nic, gpu, context, backend
        self.watch = ReleaseWatch(gpu, self._drop_gpu)
        self.rx = DevmemReceiver(nic, watch=self.watch)
        self.endpoints: list = []
        self._stack = stack
        self.kernel: dict[str, str] = {}     # what the kernel said to each BAR mapping
        nic.wake_fds = self.watch.fds

    def endpoint(self, **kwargs):
        """An RdmaEndpoint over the session's NIC (``kwargs``: its queue, placement ...) that
        gives the GPU up with the session's bindings when the host releases it."""
        from .rdma import RdmaEndpoint
        ep = RdmaEndpoint(self.nic, watch=self.watch, **kwargs)
        self.endpoints.append(ep)
        return ep

    def _drop_gpu(self) -> None:
        """The host released the GPU: nothing of its VRAM stays posted to or mapped for the NIC
        (the watch closes the GPU after this).  Each holder's step runs; the first failure is
        raised at the end."""
        self.nic.wake_fds = ()               # the request's eventfd goes with the GPU
        with contextlib.ExitStack() as stack:
            for ep in reversed(self.endpoints):
                stack.callback(ep.drop_gpu, self.gpu)
            stack.callback(self.rx.drop_gpu, self.gpu)

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
            stack.callback(self.rx.close)
            for ep in self.endpoints:            # run first, newest first: regions freed, queues off
                stack.callback(ep.close)

    def __enter__(self) -> "NicSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
