"""Interrupts: eventfds the client hands over with SET_IRQS, and raising them.

The device raises MSI-X vectors by writing 1 to the vector's eventfd; QEMU
(or KVM's irqfd) turns that into the guest's MSI.  Masking of MSI-X vectors
is done by the client, which emulates the MSI-X table, so a raise is simply
an eventfd write.  Semantics follow VFIO_DEVICE_SET_IRQS in linux/vfio.h.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

from . import wire
from .transport import close_fds

log = logging.getLogger(__name__)


def irq_types(msix_vectors: int = 0, msi_vectors: int = 0) -> dict[int, tuple[int, int]]:
    """index -> (count, VFIO_IRQ_INFO flags).  One error-recovery IRQ quiets QEMU's
    "Could not enable error recovery" warning; INTx is not implemented."""
    return {
        wire.PCI_INTX_IRQ: (0, wire.IRQ_INFO_EVENTFD),
        wire.PCI_MSI_IRQ: (msi_vectors, wire.IRQ_INFO_EVENTFD | wire.IRQ_INFO_NORESIZE),
        wire.PCI_MSIX_IRQ: (msix_vectors, wire.IRQ_INFO_EVENTFD | wire.IRQ_INFO_NORESIZE),
        wire.PCI_ERR_IRQ: (1, wire.IRQ_INFO_EVENTFD),
        wire.PCI_REQ_IRQ: (0, wire.IRQ_INFO_EVENTFD),
    }


def is_eventfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:
        return False


class IrqTable:
    """Eventfds per (IRQ index, sub-index); thread-safe."""

    def __init__(self, types: dict[int, tuple[int, int]]):
        self.types = dict(types)
        self._lock = threading.Lock()
        self._fds: dict[int, list[int | None]] = {
            index: [None] * count for index, (count, _) in self.types.items()
        }
        self.raised = {index: [0] * count for index, (count, _) in self.types.items()}

    def info(self, index: int) -> tuple[int, int]:
        if index not in self.types:
            raise wire.ProtocolError(errno.EINVAL, f"no IRQ index {index}")
        return self.types[index]

    def set_irqs(self, flags: int, index: int, start: int, count: int,
                 data: bytes, fds: list[int]) -> None:
        """Apply one SET_IRQS request.  Takes ownership of ``fds`` (kept or closed)."""
        try:
            self._set_irqs(flags, index, start, count, data, fds)
        except BaseException:
            close_fds(fds)
            raise

    def _set_irqs(self, flags, index, start, count, data, fds):
        total, _ = self.info(index)
        data_kind = flags & wire.IRQ_SET_DATA_MASK
        action = flags & wire.IRQ_SET_ACTION_MASK_ALL
        if flags & ~(wire.IRQ_SET_DATA_MASK | wire.IRQ_SET_ACTION_MASK_ALL):
            raise wire.ProtocolError(errno.EINVAL, f"unknown SET_IRQS flags {flags:#x}")
        if bin(data_kind).count("1") != 1 or bin(action).count("1") != 1:
            raise wire.ProtocolError(errno.EINVAL, "need exactly one DATA and one ACTION flag")
        if fds and data_kind != wire.IRQ_SET_DATA_EVENTFD:
            raise wire.ProtocolError(errno.EINVAL, "file descriptors without DATA_EVENTFD")

        if action != wire.IRQ_SET_ACTION_TRIGGER:
            # MSI-X masking lives in the client; nothing here is maskable.
            raise wire.ProtocolError(errno.EINVAL, "only ACTION_TRIGGER is supported")

        if data_kind == wire.IRQ_SET_DATA_NONE and count == 0:
            if start != 0:
                raise wire.ProtocolError(errno.EINVAL, "disable-all needs start 0")
            with self._lock:
                self._release(index, 0, total)
            return
        if start >= total or count > total - start or count == 0:
            raise wire.ProtocolError(
                errno.EINVAL, f"IRQ {index} range {start}+{count} outside 0..{total}")

        if data_kind == wire.IRQ_SET_DATA_EVENTFD:
            if fds and len(fds) != count:
                raise wire.ProtocolError(
                    errno.EINVAL, f"{len(fds)} eventfds for {count} vectors")
            if not all(map(is_eventfd, fds)):
                # a pipe or socket could block the engine on write
                raise wire.ProtocolError(errno.EINVAL, "SET_IRQS fd is not an eventfd")
            with self._lock:
                self._release(index, start, count)
                for i, fd in enumerate(fds):  # none attached = de-assign
                    self._fds[index][start + i] = fd
            return

        if data_kind == wire.IRQ_SET_DATA_BOOL and len(data) != count:
            raise wire.ProtocolError(errno.EINVAL, f"DATA_BOOL has {len(data)} bytes for "
                                     f"{count} vectors")
        for i in range(count):
            if data_kind == wire.IRQ_SET_DATA_NONE or data[i]:
                self.raise_irq(index, start + i)  # loopback trigger, as VFIO does

    def _release(self, index: int, start: int, count: int) -> None:
        slots = self._fds[index]
        for i in range(start, start + count):
            if slots[i] is not None:
                close_fds([slots[i]])
                slots[i] = None

    def raise_irq(self, index: int, vector: int) -> bool:
        """Signal one vector; False if no eventfd is attached (the raise is lost)."""
        with self._lock:
            fd = self._fds[index][vector]
            self.raised[index][vector] += 1
            if fd is None:
                return False
            try:
                os.eventfd_write(fd, 1)
            except OSError as exc:  # a bad fd from the client must not kill the engine
                log.warning("IRQ %d/%d eventfd write failed: %s", index, vector, exc)
                return False
        return True

    def raise_msix(self, vector: int) -> bool:
        return self.raise_irq(wire.PCI_MSIX_IRQ, vector)

    def raise_msi(self, vector: int) -> bool:
        """MSI: a vector beyond those the client registered is sent as the last one
        registered (PCI multi-message MSI: a device folds vectors it was not granted)."""
        with self._lock:
            slots = self._fds[wire.PCI_MSI_IRQ]
            granted = next((i for i, fd in enumerate(slots) if fd is None), len(slots))
        return self.raise_irq(wire.PCI_MSI_IRQ, min(vector, max(granted - 1, 0)))

    def has_eventfd(self, index: int, vector: int) -> bool:
        with self._lock:
            return self._fds[index][vector] is not None

    def close_all(self) -> None:
        """Drop every eventfd (the client went away)."""
        with self._lock:
            for index, slots in self._fds.items():
                self._release(index, 0, len(slots))
