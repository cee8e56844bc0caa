"""A VFIO device fd: its info, regions, interrupts and reset."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from . import caps, syscalls, uapi
from .errors import InterruptError, IoctlError, RegionError, VfioError
from .interrupts import Interrupts, IrqInfo, MsixVectors
from .region import PCI_REGION_NAMES, Region, RegionInfo
from .uapi import ffi


@dataclass(frozen=True)
class DeviceInfo:
    flags: int
    num_regions: int
    num_irqs: int

    @property
    def resettable(self) -> bool:
        return bool(self.flags & uapi.VFIO_DEVICE_FLAGS_RESET)

    @property
    def is_pci(self) -> bool:
        return bool(self.flags & uapi.VFIO_DEVICE_FLAGS_PCI)


class Device:
    """An open device fd.  ``close()`` disables its interrupts, unmaps its regions, closes the fd."""

    def __init__(self, fd: int, name: str, *, ioctl: syscalls.IoctlFn = syscalls.ioctl):
        self.fd = fd
        self.name = name
        self._ioctl = ioctl
        self._regions: dict[int, Region] = {}
        self._interrupts: dict[int, Interrupts] = {}
        self._info: DeviceInfo | None = None

    @property
    def info(self) -> DeviceInfo:
        if self._info is None:
            info = ffi.new("struct vfio_device_info *")
            info.argsz = ffi.sizeof(info[0])
            self._call("VFIO_DEVICE_GET_INFO", uapi.VFIO_DEVICE_GET_INFO, info)
            self._info = DeviceInfo(info.flags, info.num_regions, info.num_irqs)
        return self._info

    # -- regions ----------------------------------------------------------

    def region_info(self, index: int) -> RegionInfo:
        self._require_open()
        if not 0 <= index < self.info.num_regions:
            raise RegionError(f"{self.name} has no region {index} (it has {self.info.num_regions})",
                              f"use an index below {self.info.num_regions}")
        try:
            buf = caps.query_info(self._ioctl, self.fd, uapi.VFIO_DEVICE_GET_REGION_INFO,
                                  "struct vfio_region_info", index=index)
        except OSError as error:
            raise IoctlError(f"VFIO_DEVICE_GET_REGION_INFO({index}) on {self.name}", error.errno) from None
        return RegionInfo.from_buffer(buf)

    def region(self, index: int) -> Region:
        """The region ``index`` (vfio-pci: 0-5 BARs, 6 ROM, 7 config); one shared object per index."""
        if index not in self._regions:
            info = self.region_info(index)
            name = PCI_REGION_NAMES.get(index, f"region {index}") if self.info.is_pci else f"region {index}"
            if info.size == 0:
                raise RegionError(f"{name} of {self.name} is not implemented (size 0)",
                                  "check which BARs the device really has (lspci -v)")
            self._regions[index] = Region(self.fd, info, name=name)
        return self._regions[index]

    # -- interrupts -------------------------------------------------------

    def irq_info(self, index: int) -> IrqInfo:
        self._require_open()
        if not 0 <= index < self.info.num_irqs:
            raise InterruptError(f"{self.name} has no IRQ index {index} (it has {self.info.num_irqs})",
                                 f"use an index below {self.info.num_irqs}")
        info = ffi.new("struct vfio_irq_info *")
        info.argsz = ffi.sizeof(info[0])
        info.index = index
        self._call(f"VFIO_DEVICE_GET_IRQ_INFO({index})", uapi.VFIO_DEVICE_GET_IRQ_INFO, info)
        return IrqInfo(info.index, info.flags, info.count)

    def interrupts(self, index: int, count: int) -> Interrupts:
        """Enable ``count`` vectors of IRQ ``index`` on eventfds; disabled again on close."""
        return self._enable(Interrupts, index, count)

    def release_request(self) -> Interrupts | None:
        """vfio-pci's release request (VFIO_PCI_REQ_IRQ_INDEX) on an eventfd, or None where the
        device has none: when the device is hot-removed the kernel signals it and waits for the
        device fd to be closed; without it the removal blocks ("blocked until released by user").
        A driver polls it (``pending(0)``) beside its completions and gives the device up."""
        try:
            return self.interrupts(uapi.VFIO_PCI_REQ_IRQ_INDEX, 1)
        except InterruptError:
            return None

    def msix(self, count: int) -> MsixVectors:
        """Enable ``count`` MSI-X vectors on eventfds; disabled again on close."""
        return self._enable(MsixVectors, uapi.VFIO_PCI_MSIX_IRQ_INDEX, count)

    def _enable(self, kind: type, index: int, count: int):
        live = self._interrupts.get(index)
        if live is not None and live.eventfds:
            raise InterruptError(f"{live.kind} is already enabled with {live.count} vectors",
                                 "close() the earlier one before enabling the index again")
        vectors = kind(self.fd, self.irq_info(index), count, ioctl=self._ioctl)
        self._interrupts[index] = vectors
        return vectors

    # -- reset and lifetime -------------------------------------------------

    def reset(self) -> None:
        if not self.info.resettable:
            raise VfioError(f"{self.name} does not support VFIO_DEVICE_RESET",
                            "the device needs FLR, a PM reset or a resettable slot/bus")
        self._call("VFIO_DEVICE_RESET", uapi.VFIO_DEVICE_RESET)

    def close(self) -> None:
        """Disable interrupts, unmap regions, close the fd -- all of it even if one step fails."""
        if self.fd < 0:
            return
        with contextlib.ExitStack() as stack:  # runs last-pushed first
            stack.callback(self._close_fd)
            for region in self._regions.values():
                stack.callback(region.close)
            for vectors in self._interrupts.values():
                stack.callback(vectors.close)
            self._regions = {}
            self._interrupts = {}

    def _close_fd(self) -> None:
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require_open(self) -> None:
        if self.fd < 0:
            raise VfioError(f"{self.name} is closed", "open the device again")

    def _call(self, name: str, request: int, arg=None) -> int:
        self._require_open()
        try:
            return self._ioctl(self.fd, request, arg)
        except OSError as error:
            raise IoctlError(f"{name} on {self.name}", error.errno) from None
