"""One PCI device driven from userspace through VFIO, set up and torn down in one place.

Two backends give the device its IOMMU context (``iommu.IommuContext``):

* **type1**: bind to vfio-pci -> find the IOMMU group -> open the container ->
  open the group, check it is viable -> put the group in the container ->
  select the type1 IOMMU -> get the device fd;
* **iommufd**: bind to vfio-pci -> open /dev/iommu, allocate an IOAS -> open
  the device cdev /dev/vfio/devices/vfioN -> VFIO_DEVICE_BIND_IOMMUFD ->
  VFIO_DEVICE_ATTACH_IOMMUFD_PT to the IOAS.

``backend="auto"`` (the default, or ``$VFIO_CXL_VFIO_BACKEND``) takes iommufd
when /dev/iommu exists and the device has a cdev, type1 otherwise.  Drivers
use ``map_dma``/``iommu``, never the backend's own objects.

Every step registers its undo on an ExitStack, so a failure part-way releases
exactly what was built, newest first, and ``close()`` does the same for a
working device: device fd (interrupts, regions) -> DMA mappings -> group out
of the container -> group fd -> container fd -> previous driver back.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from . import iommufd, syscalls, uapi
from .backend import BACKEND_ENV, BACKENDS, choose_backend  # noqa: F401 (this module's names too)
from .bind import Binding, Sysfs, bind_vfio_pci, iommu_group, normalize_bdf, require_vfio_pci
from .container import CONTAINER_PATH, IOMMU_TYPES, Container, IommuInfo
from .device import Device, DeviceInfo
from .errors import VfioError
from .group import DEV_VFIO, Group
from .interrupts import Interrupts, IrqInfo, MsixVectors
from .iommu import DmaMapping, IommuContext
from .region import Region


class VfioPciDevice:
    """A vfio-pci device with its own IOMMU context.  Use as a context manager."""

    def __init__(self, bdf: str):
        self.bdf = bdf
        self.backend: str | None = None
        self.binding: Binding | None = None
        self.iommu: IommuContext | None = None
        self.container: Container | None = None   # type1 only
        self.group: Group | None = None           # type1 only
        self.device: Device | None = None
        self._stack = contextlib.ExitStack()

    @classmethod
    def open(cls, bdf: str, *, bind: bool = True, backend: str | None = None,
             iommu_types: tuple[int, ...] | None = None,
             sysfs: Sysfs | None = None, dev_vfio: str = DEV_VFIO, iommufd_path: str = iommufd.IOMMUFD_PATH,
             ioctl: syscalls.IoctlFn = syscalls.ioctl,
             container: Container | None = None,
             ioas: "iommufd.IommufdContext | None" = None) -> "VfioPciDevice":
        """Bind (unless ``bind=False``), attach and open ``bdf``; see the module docstring.

        ``sysfs``, ``dev_vfio``, ``iommufd_path`` and ``ioctl`` exist so tests can stand in
        for the kernel.  ``container``: join this caller-owned type1 container instead of
        opening one, so several devices share one IOMMU context (peer-to-peer DMA); the
        backend is then type1, and the caller owns the container and its mappings.
        ``ioas``: the same on iommufd -- bind to this caller-owned iommufd and attach to its
        IOAS (one IO address space for several devices).
        """
        if container is not None and ioas is not None:
            raise VfioError(f"{bdf}: both a type1 container and an iommufd IOAS were given",
                            "share one IOMMU context: a container or an IOAS, not both")
        sysfs = sysfs or Sysfs()
        self = cls(normalize_bdf(bdf))
        with self._stack as stack:
            if bind:
                self.binding = bind_vfio_pci(self.bdf, sysfs=sysfs)
                stack.callback(self.binding.restore)
            else:
                require_vfio_pci(self.bdf, sysfs)
            self.backend = ("type1" if container is not None else "iommufd" if ioas is not None else
                            choose_backend(self.bdf, backend, sysfs=sysfs, iommufd_path=iommufd_path))
            if self.backend == "iommufd":
                self._open_iommufd(stack, sysfs, dev_vfio, iommufd_path, ioctl, ioas)
            else:
                self._open_type1(stack, sysfs, dev_vfio, iommu_types, ioctl, container)
            self.device.info  # fail now, inside the stack, if the fd is unusable
            self._stack = stack.pop_all()  # success: keep everything for close()
        return self

    def _open_iommufd(self, stack: contextlib.ExitStack, sysfs: Sysfs, dev_vfio: str, iommufd_path: str,
                      ioctl: syscalls.IoctlFn, shared: "iommufd.IommufdContext | None" = None) -> None:
        if shared is not None:
            ctx = self.iommu = shared      # the caller owns it and its mappings
        else:
            ctx = self.iommu = iommufd.IommufdContext.open(iommufd_path, ioctl=ioctl)
            stack.callback(ctx.close)
            # Mappings go after the device fd is closed (that unbinds it from the iommufd).
            stack.callback(ctx.unmap_all)
        fd = iommufd.open_device_cdev(self.bdf, sysfs_root=sysfs.root,
                                      dev_dir=str(Path(dev_vfio) / "devices"))
        self.device = Device(fd, self.bdf, ioctl=ioctl)
        stack.callback(self.device.close)
        ctx.bind(fd, self.bdf)
        ctx.attach(fd, self.bdf)

    def _open_type1(self, stack: contextlib.ExitStack, sysfs: Sysfs, dev_vfio: str,
                    iommu_types: tuple[int, ...] | None, ioctl: syscalls.IoctlFn,
                    shared: Container | None = None) -> None:
        group_number = iommu_group(self.bdf, sysfs)

        if shared is not None:
            self.container = self.iommu = shared
        else:
            self.container = self.iommu = Container.open(str(Path(dev_vfio) / Path(CONTAINER_PATH).name),
                                                         ioctl=ioctl)
            stack.callback(self.container.close)
        self.group = Group.open(group_number, dev_vfio=dev_vfio, ioctl=ioctl)
        stack.callback(self.group.close)
        self.group.require_viable(lambda: sysfs.group_members(group_number))

        self.group.set_container(self.container)
        stack.callback(self.group.unset_container)
        if self.container.iommu_type is None:
            self.container.set_iommu(iommu_types or tuple(IOMMU_TYPES))
        if shared is None:
            # Mappings go before the group leaves: that drops the IOMMU and all its state.
            stack.callback(self.container.unmap_all)

        self.device = Device(self.group.device_fd(self.bdf), self.bdf, ioctl=ioctl)
        stack.callback(self.device.close)

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
        return self._iommu.iommu_info()

    def map_dma(self, buffer, iova: int, *, readable: bool = True, writable: bool = True) -> DmaMapping:
        """Let the device reach ``buffer`` at ``iova``; unmapped on close at the latest."""
        return self._iommu.map_dma(buffer, iova, readable=readable, writable=writable)

    @property
    def mappings(self) -> tuple[DmaMapping, ...]:
        return self._iommu.mappings

    def irq_info(self, index: int) -> IrqInfo:
        """VFIO_DEVICE_GET_IRQ_INFO for IRQ ``index`` (how many vectors it offers)."""
        return self._device.irq_info(index)

    def interrupts(self, index: int, count: int) -> Interrupts:
        """Enable ``count`` vectors of IRQ ``index`` (e.g. MSI) on eventfds."""
        return self._device.interrupts(index, count)

    def msix(self, count: int) -> MsixVectors:
        return self._device.msix(count)

    def release_request(self) -> Interrupts | None:
        """vfio-pci's release request on an eventfd, or None (``Device.release_request``)."""
        return self._device.release_request()

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
    def _iommu(self) -> IommuContext:
        if self.iommu is None or self.iommu.fd < 0:
            raise _closed(self.bdf)
        return self.iommu

    def __repr__(self) -> str:
        return f"<VfioPciDevice {self.bdf} {self.backend or 'closed'}>"


def _closed(bdf: str) -> VfioError:
    return VfioError(f"VFIO device {bdf} is closed", f"open it again with VfioPciDevice.open({bdf!r})")
