"""Device interrupts delivered to eventfds (VFIO_DEVICE_SET_IRQS).

Each enabled vector gets its own eventfd; the kernel bumps its counter when
the device raises the vector.  Waiting is a poll(2) on that fd with a
timeout -- never a sleep loop.
"""

from __future__ import annotations

import math
import os
import select
from dataclasses import dataclass

from . import syscalls, uapi
from .errors import InterruptError, InterruptTimeout, describe_errno
from .uapi import ffi

IRQ_KIND = {
    uapi.VFIO_PCI_INTX_IRQ_INDEX: "INTx",
    uapi.VFIO_PCI_MSI_IRQ_INDEX: "MSI",
    uapi.VFIO_PCI_MSIX_IRQ_INDEX: "MSI-X",
    uapi.VFIO_PCI_ERR_IRQ_INDEX: "error",
    uapi.VFIO_PCI_REQ_IRQ_INDEX: "request",
}


@dataclass(frozen=True)
class IrqInfo:
    index: int
    flags: int
    count: int

    @property
    def eventfd(self) -> bool:
        return bool(self.flags & uapi.VFIO_IRQ_INFO_EVENTFD)


def wait_readable(fds, timeout: float | None) -> bool:
    """poll(2) the eventfds ``fds`` until one fires (``timeout`` seconds at most, None: for ever);
    whether one did.  Nothing is read: the caller takes the counts it wants."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))))


def irq_set(index: int, start: int, flags: int, fds: list[int] | None = None, count: int | None = None):
    """A struct vfio_irq_set, with ``fds`` as its eventfd array when given."""
    fds = fds or []
    size = ffi.sizeof("struct vfio_irq_set") + 4 * len(fds)
    buf = ffi.new("char[]", size)
    request = ffi.cast("struct vfio_irq_set *", buf)
    request.argsz = size
    request.flags = flags
    request.index, request.start = index, start
    request.count = len(fds) if count is None else count
    data = ffi.cast("int32_t *", request.data)
    for i, fd in enumerate(fds):
        data[i] = fd
    return buf


class Interrupts:
    """``count`` vectors of IRQ ``index``, each signalled on its own eventfd.

    Enabled on construction; ``close()`` disables the index and closes the
    eventfds (safe to call again).  Nothing is left open if enabling fails.
    """

    def __init__(self, device_fd: int, info: IrqInfo, count: int, *,
                 ioctl: syscalls.IoctlFn = syscalls.ioctl):
        self.device_fd = device_fd
        self.index = info.index
        self.kind = IRQ_KIND.get(info.index, f"IRQ index {info.index}")
        self._ioctl = ioctl
        self._check(info, count)
        self.eventfds: list[int] = []
        try:
            for _ in range(count):
                self.eventfds.append(os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))
            flags = uapi.VFIO_IRQ_SET_DATA_EVENTFD | uapi.VFIO_IRQ_SET_ACTION_TRIGGER
            self._set_irqs(irq_set(self.index, 0, flags, self.eventfds), f"enabling {count} {self.kind} vectors")
        except BaseException:
            self._close_eventfds()
            raise
        self.enabled = True

    @property
    def count(self) -> int:
        return len(self.eventfds)

    def _check(self, info: IrqInfo, count: int) -> None:
        if info.count == 0:
            raise InterruptError(f"the device has no {self.kind} interrupts",
                                 "check the device's PCI capabilities (lspci -vv)")
        if not 1 <= count <= info.count:
            raise InterruptError(f"cannot enable {count} {self.kind} vectors: the device offers {info.count}",
                                 f"ask for 1 to {info.count}")
        if not info.eventfd:
            raise InterruptError(f"{self.kind} interrupts cannot signal an eventfd",
                                 "use another interrupt index")

    def wait(self, vector: int, timeout: float | None) -> int:
        """Block until ``vector`` fires (``timeout`` seconds at most); returns how many times it fired."""
        fd = self._eventfd(vector)
        if not wait_readable((fd,), timeout):
            raise InterruptTimeout(self.kind, vector, timeout)
        return os.eventfd_read(fd)

    def wait_any(self, timeout: float | None) -> dict[int, int]:
        """Block until any vector fires; returns {vector: times fired} for each that did."""
        self._eventfd(0)
        if not wait_readable(self.eventfds, timeout):
            raise InterruptTimeout(self.kind, f"0-{self.count - 1}", timeout)
        return {v: n for v in range(self.count) if (n := self.pending(v))}

    def pending(self, vector: int) -> int:
        """How many times ``vector`` fired since last asked (0 if not), without blocking."""
        try:
            return os.eventfd_read(self._eventfd(vector))
        except BlockingIOError:
            return 0

    def trigger(self, vector: int) -> None:
        """Have the kernel signal ``vector`` as if the device had (a loopback self-test)."""
        self._eventfd(vector)
        flags = uapi.VFIO_IRQ_SET_DATA_NONE | uapi.VFIO_IRQ_SET_ACTION_TRIGGER
        self._set_irqs(irq_set(self.index, vector, flags, count=1), f"triggering {self.kind} vector {vector}")

    def close(self) -> None:
        """Disable the whole index, then close the eventfds."""
        if not self.eventfds:
            return
        try:
            flags = uapi.VFIO_IRQ_SET_DATA_NONE | uapi.VFIO_IRQ_SET_ACTION_TRIGGER
            self._set_irqs(irq_set(self.index, 0, flags, count=0), f"disabling {self.kind}")
        finally:
            self._close_eventfds()
            self.enabled = False

    def __enter__(self) -> "Interrupts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _eventfd(self, vector: int) -> int:
        if not self.eventfds:
            raise InterruptError(f"{self.kind} interrupts are closed", "enable them again")
        if not 0 <= vector < len(self.eventfds):
            raise InterruptError(f"{self.kind} vector {vector} is not enabled (0-{len(self.eventfds) - 1} are)",
                                 "enable more vectors")
        return self.eventfds[vector]

    def _set_irqs(self, request, what: str) -> None:
        try:
            self._ioctl(self.device_fd, uapi.VFIO_DEVICE_SET_IRQS, request)
        except OSError as error:
            raise InterruptError(f"{what} failed ({describe_errno(error.errno)})",
                                 "check dmesg; MSI-X needs the device's MSI-X capability and a working "
                                 "interrupt remapping / MSI domain in the guest") from None

    def _close_eventfds(self) -> None:
        for fd in reversed(self.eventfds):
            os.close(fd)
        self.eventfds = []


class MsixVectors(Interrupts):
    """MSI-X vectors of a vfio-pci device."""

    def __init__(self, device_fd: int, info: IrqInfo, count: int, *,
                 ioctl: syscalls.IoctlFn = syscalls.ioctl):
        if info.index != uapi.VFIO_PCI_MSIX_IRQ_INDEX:
            raise ValueError(f"IRQ index {info.index} is not vfio-pci's MSI-X index")
        super().__init__(device_fd, info, count, ioctl=ioctl)
