"""The guest library's GPU driver against the real device model, without a VM.

``VfioUserPciDevice`` is the part of ``vfio_cxl.guest.vfio.VfioPciDevice`` that
``GpuDriver`` uses (config space, BARs, DMA mappings, MSI-X on eventfds), carried out
by the fast tests' vfio-user client (tests/fast/vfio_user_client.py) against an
in-process GPU server: the client plays QEMU, this module plays the guest kernel's
vfio-pci.  A buffer the driver maps is served from its own memory on the message path
(DMA_READ/DMA_WRITE), except a memfd-backed ``FakeDax`` region, which is handed to
the server with its fd (the direct path, as QEMU hands over the CXL backend file).
"""

from __future__ import annotations

import os
import select
from types import SimpleNamespace

from vfio_user_client import Area, VfioUserClient

from vfio_cxl.devices.gpu import regs
from vfio_cxl.guest.vfio import uapi
from vfio_cxl.guest.vfio.errors import InterruptTimeout


class _Config:
    def __init__(self, client):
        self.c = client

    def read16(self, offset):
        return int.from_bytes(self.c.config_read(offset, 2), "little")

    def write16(self, offset, value):
        self.c.config_write(offset, value.to_bytes(2, "little"))


class _Bar:
    def __init__(self, client, index):
        self.c, self.index = client, index

    def read32(self, offset):
        return int.from_bytes(self.c.read(self.index, offset, 4), "little")

    def write32(self, offset, value):
        self.c.write(self.index, offset, value.to_bytes(4, "little"))

    def read(self, offset, length):
        return self.c.read(self.index, offset, length)

    def write(self, offset, data):
        self.c.write(self.index, offset, bytes(data))


class _Vectors:
    """MSI-X vectors on the eventfds the client registered with SET_IRQS."""

    def __init__(self, eventfds):
        self.eventfds = eventfds

    def pending(self, vector):
        try:
            return os.eventfd_read(self.eventfds[vector])
        except BlockingIOError:
            return 0

    def wait_any(self, timeout):
        poller = select.poll()
        for fd in self.eventfds:
            poller.register(fd, select.POLLIN)
        if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
            raise InterruptTimeout("MSI-X", "0-3", timeout)
        return {v: n for v in range(len(self.eventfds)) if (n := self.pending(v))}


class _BufferArea(Area):
    """An area of guest memory that is a buffer the driver owns (no fd: the message path)."""

    def __init__(self, iova, buffer):
        self.iova, self.writable, self.mapped, self.fd = iova, True, False, None
        self.view = memoryview(buffer).cast("B")
        self.size = len(self.view)
        self.buf = None

    def close(self):
        self.view.release()


class _Mapping:
    def __init__(self, device, area, owned):
        self.device, self.area, self.owned = device, area, owned

    def close(self):
        if self.area is None:
            return
        self.device.client.dma_unmap(self.area.iova, self.area.size)
        self.device.client.memory.areas.remove(self.area)
        if self.owned:
            self.area.close()
        self.area = None


class VfioUserPciDevice:
    """What GpuDriver needs of a VfioPciDevice, over a vfio-user client of the GPU server."""

    backend = "vfio-user"

    def __init__(self, server):
        self.client: VfioUserClient = server.client()
        self.config = _Config(self.client)
        self._eventfds = []
        self._dax = []    # (FakeDax) regions whose memfd goes to the server with the DMA_MAP

    def bar(self, index):
        return _Bar(self.client, index)

    def irq_info(self, index):
        count = regs.MSIX_VECTORS if index == uapi.VFIO_PCI_MSIX_IRQ_INDEX else 0
        return SimpleNamespace(index=index, flags=0, count=count)

    def msix(self, count):
        self._eventfds = self.client.attach_msix(count)
        return _Vectors(self._eventfds)

    def release_request(self):
        return None

    def map_dma(self, buffer, iova):
        view = memoryview(buffer)
        for dax in self._dax:
            if view.obj is dax.area.buf and view.nbytes == dax.size:
                area = dax.area               # the whole region: the direct path, with its memfd
                area.iova = iova
                self.client.map_area(area)
                self.client.memory.areas.append(area)
                return _Mapping(self, area, owned=False)
        area = _BufferArea(iova, buffer)
        self.client.memory.areas.append(area)
        self.client.map_area(area, direct=False)
        return _Mapping(self, area, owned=True)

    def close(self):
        for fd in self._eventfds:
            os.close(fd)
        self._eventfds = []
        self.client.close()


class FakeDax:
    """What GpuMemory uses of a DaxMapping: a memfd standing in for the CXL devdax region."""

    def __init__(self, device: VfioUserPciDevice, size: int):
        self.area = Area(0, size, shared=True)
        self.size = size
        self.view = self.area.view
        self.dax = SimpleNamespace(name="dax-fake")
        device._dax.append(self)

    def read(self, offset, length):
        return bytes(self.view[offset:offset + length])

    def write(self, offset, data):
        self.view[offset:offset + len(data)] = data

    def close(self):
        self.area.close()


__all__ = ["VfioUserPciDevice", "FakeDax"]
