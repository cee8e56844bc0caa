"""A VFIO group (/dev/vfio/N): the unit of isolation a container takes in."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Callable

from . import syscalls, uapi
from .container import Container
from .errors import INTEL_IOMMU_HINT, GroupError, GroupNotViableError, IoctlError
from .uapi import ffi

DEV_VFIO = "/dev/vfio"


@dataclass(frozen=True)
class GroupStatus:
    viable: bool  # every device of the group is bound to vfio (or to no driver)
    container_set: bool


class Group:
    """An open group fd.  ``close()`` detaches it from its container, then closes it."""

    def __init__(self, number: int, fd: int, *, ioctl: syscalls.IoctlFn = syscalls.ioctl):
        self.number = number
        self.fd = fd
        self.container: Container | None = None
        self._ioctl = ioctl

    @classmethod
    def open(cls, number: int, *, dev_vfio: str = DEV_VFIO, ioctl: syscalls.IoctlFn = syscalls.ioctl) -> "Group":
        path = os.path.join(dev_vfio, str(number))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise GroupError(f"{path} does not exist",
                             f"bind a device of IOMMU group {number} to vfio-pci first; "
                             f"if /dev/vfio has only noiommu-* nodes, {INTEL_IOMMU_HINT}") from None
        except PermissionError:
            raise GroupError(f"no permission to open {path}", "run as root") from None
        except OSError as error:
            if error.errno == errno.EBUSY:
                raise GroupError(f"{path} is already open (EBUSY)",
                                 "only one process (one open) may hold a VFIO group: close the other user") from None
            raise
        return cls(number, fd, ioctl=ioctl)

    def status(self) -> GroupStatus:
        status = ffi.new("struct vfio_group_status *")
        status.argsz = ffi.sizeof(status[0])
        self._call("VFIO_GROUP_GET_STATUS", uapi.VFIO_GROUP_GET_STATUS, status)
        return GroupStatus(bool(status.flags & uapi.VFIO_GROUP_FLAGS_VIABLE),
                           bool(status.flags & uapi.VFIO_GROUP_FLAGS_CONTAINER_SET))

    def require_viable(self, members: Callable[[], list[tuple[str, str | None]]] = list) -> None:
        """Raise GroupNotViableError, listing ``members()`` (bdf, driver), unless the group is viable."""
        if not self.status().viable:
            raise GroupNotViableError(self.number, members())

    def set_container(self, container: Container) -> None:
        fd = ffi.new("int32_t *", container.fd)  # the kernel reads the fd through a pointer
        self._call("VFIO_GROUP_SET_CONTAINER", uapi.VFIO_GROUP_SET_CONTAINER, fd,
                   fix="the group must be viable and not in another container")
        self.container = container

    def unset_container(self) -> None:
        """Detach from the container (all device fds must be closed first).  Safe to call again."""
        if self.container is None:
            return
        try:
            self._call("VFIO_GROUP_UNSET_CONTAINER", uapi.VFIO_GROUP_UNSET_CONTAINER,
                       fix="close every device fd of the group first")
        except IoctlError as err:
            # EINVAL: the group has no container any more -- the kernel detached it when the
            # group's last device went away (a hot-unplug waits for the device fd to close, then
            # removes the device and detaches its group).  Nothing is left to undo.
            if err.errno != errno.EINVAL:
                raise
        self.container = None

    def device_fd(self, name: str) -> int:
        """A new fd for the device ``name`` (its BDF for PCI); the caller owns it."""
        if self.container is None:
            raise GroupError(f"cannot open {name}: group {self.number} has no container",
                             "call Group.set_container() and Container.set_iommu() first")
        try:
            return self._ioctl(self.fd, uapi.VFIO_GROUP_GET_DEVICE_FD, name.encode())
        except OSError as error:
            raise IoctlError(f"VFIO_GROUP_GET_DEVICE_FD({name})", error.errno,
                             f"is {name} in IOMMU group {self.number} and bound to vfio-pci? "
                             "is the IOMMU type set?") from None

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self.unset_container()
        finally:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, name: str, request: int, arg=None, fix: str = "") -> int:
        try:
            return self._ioctl(self.fd, request, arg)
        except OSError as error:
            raise IoctlError(f"{name} on group {self.number}", error.errno, fix) from None
