"""One PCI device driven from userspace through VFIO, set up and torn down in one place.

``VfioPciDevice.open(bdf)`` does the whole type1 sequence:

    bind to vfio-pci -> find the IOMMU group -> open the container -> open the
    group, check it is viable -> put the group in the container -> select the
    type1 IOMMU -> get the device fd

Every step registers its undo on an ExitStack, so a failure part-way releases
exactly what was built, newest first, and ``close()`` does the same for a
working device: device fd (interrupts, regions) -> DMA mappings -> group out
of the container -> group fd -> container fd -> previous driver back.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from . import syscalls, uapi
from .bind import Binding, Sysfs, bind_vfio_pci, iommu_group, normalize_bdf, require_vfio_pci
from .container import CONTAINER_PATH, IOMMU_TYPES, Container, IommuInfo
from .device import Device, DeviceInfo
from .dma import DmaMapping
from .errors import VfioError
from .group import DEV_VFIO, Group
from .interrupts import Interrupts, IrqInfo, MsixVectors
from .region import Region


class VfioPciDevice:
    """A vfio-pci device with its own container.  Use as a context manager."""

    def __init__(self, bdf: str):
        self.bdf = bdf
        self.binding: Binding | None = None
        self.container: Container | None = None
        self.group: Group | None = None
        self.device: Device | None = None
        self._stack = contextlib.ExitStack()

    @classmethod
    def open(cls, bdf: str, *, bind: bool = True, iommu_types: tuple[int, ...] | None = None,
             sysfs: Sysfs | None = None, dev_vfio: str = DEV_VFIO,
             ioctl: syscalls.IoctlFn = syscalls.ioctl) -> "VfioPciDevice":
        """Bind (unless ``bind=False``), attach and open ``bdf``; see the module docstring.

        ``sysfs``, ``dev_vfio`` and ``ioctl`` exist so tests can stand in for the kernel.
        """
        sysfs = sysfs or Sysfs()
        self = cls(normalize_bdf(bdf))
        with self._stack as stack:
            if bind:
                self.binding = bind_vfio_pci(self.bdf, sysfs=sysfs)
                stack.callback(self.binding.restore)
            else:
                require_vfio_pci(self.bdf, sysfs)
            group_number = iommu_group(self.bdf, sysfs)

            self.container = Container.open(str(Path(dev_vfio) / Path(CONTAINER_PATH).name), ioctl=ioctl)
            stack.callback(self.container.close)
            self.group = Group.open(group_number, dev_vfio=dev_vfio, ioctl=ioctl)
            stack.callback(self.group.close)
            self.group.require_viable(lambda: sysfs.group_members(group_number))

            self.group.set_container(self.container)
            stack.callback(self.group.unset_container)
            self.container.set_iommu(iommu_types or tuple(IOMMU_TYPES))
            # Mappings go before the group leaves: that drops the IOMMU and all its state.
            stack.callback(self.container.unmap_all)

            self.device = Device(self.group.device_fd(self.bdf), self.bdf, ioctl=ioctl)
            stack.callback(self.device.close)
            self.device.info  # fail now, inside the stack, if the fd is unusable
            self._stack = stack.pop_all()  # success: keep everything for close()
        return self

    # -- what a driver uses -------------------------------------------------

    @property
    def info(self) -> DeviceInfo:
        return self._device.info

    def region(self, index: int) -> Region:
        """Region ``index``: 0-5 are BARs, uapi.VFIO_PCI_CONFIG_REGION_INDEX is config space."""
        return self._device.region(index)

    def bar(self, number: int) -> Region:
        return self.region(uapi.VFIO_PCI_BAR0_REGION_INDEX + number)

    @property
    def config(self) -> Region:
        return self.region(uapi.VFIO_PCI_CONFIG_REGION_INDEX)

    def iommu_info(self) -> IommuInfo:
        return self._container.iommu_info()

    def map_dma(self, buffer, iova: int, *, readable: bool = True, writable: bool = True) -> DmaMapping:
        """Let the device reach ``buffer`` at ``iova``; unmapped on close at the latest."""
        return self._container.map_dma(buffer, iova, readable=readable, writable=writable)

    def irq_info(self, index: int) -> IrqInfo:
        """VFIO_DEVICE_GET_IRQ_INFO for IRQ ``index`` (how many vectors it offers)."""
        return self._device.irq_info(index)

    def interrupts(self, index: int, count: int) -> Interrupts:
        """Enable ``count`` vectors of IRQ ``index`` (e.g. MSI) on eventfds."""
        return self._device.interrupts(index, count)

    def msix(self, count: int) -> MsixVectors:
        return self._device.msix(count)

    def reset(self) -> None:
        self._device.reset()

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Undo everything ``open`` did, newest first; safe to call again."""
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.close()

    def __enter__(self) -> "VfioPciDevice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def _device(self) -> Device:
        if self.device is None or self.device.fd < 0:
            raise _closed(self.bdf)
        return self.device

    @property
    def _container(self) -> Container:
        if self.container is None or self.container.fd < 0:
            raise _closed(self.bdf)
        return self.container

    def __repr__(self) -> str:
        return f"<VfioPciDevice {self.bdf}>"


def _closed(bdf: str) -> VfioError:
    return VfioError(f"VFIO device {bdf} is closed", f"open it again with VfioPciDevice.open({bdf!r})")
