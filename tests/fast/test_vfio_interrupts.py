"""Interrupt vectors on eventfds: enable, wait, timeout, disable.

FAKE KERNEL: ``FakeIrqs`` stands in for VFIO_DEVICE_SET_IRQS and remembers
the eventfds it was given; the test "raises" a vector by writing to that
eventfd, as the kernel would.  The eventfds, poll and timeouts are real.
"""

import errno
import os
import time

import pytest

from vfio_cxl.guest.vfio import uapi
from vfio_cxl.guest.vfio.errors import InterruptError, InterruptTimeout
from vfio_cxl.guest.vfio.interrupts import IrqInfo, MsixVectors
from vfio_cxl.guest.vfio.uapi import ffi

MSIX = IrqInfo(uapi.VFIO_PCI_MSIX_IRQ_INDEX,
               uapi.VFIO_IRQ_INFO_EVENTFD | uapi.VFIO_IRQ_INFO_NORESIZE, 8)


class FakeIrqs:
    """A stand-in for the kernel's SET_IRQS on one device (unit tests only)."""

    def __init__(self, fail_errno=None):
        self.fail_errno = fail_errno
        self.eventfds = []
        self.calls = []  # (flags, index, start, count)

    def __call__(self, fd, request, arg):
        assert request == uapi.VFIO_DEVICE_SET_IRQS
        irq = ffi.cast("struct vfio_irq_set *", arg)
        self.calls.append((irq.flags, irq.index, irq.start, irq.count))
        assert irq.argsz == ffi.sizeof("struct vfio_irq_set") + (
            4 * irq.count if irq.flags & uapi.VFIO_IRQ_SET_DATA_EVENTFD else 0)
        if self.fail_errno:
            raise OSError(self.fail_errno, os.strerror(self.fail_errno))
        if irq.flags & uapi.VFIO_IRQ_SET_DATA_EVENTFD:
            self.eventfds = list(ffi.cast("int32_t *", irq.data)[0:irq.count])
        elif irq.count == 0:
            self.eventfds = []
        else:  # DATA_NONE trigger: loopback
            os.eventfd_write(self.eventfds[irq.start], 1)
        return 0

    def fire(self, vector, times=1):
        for _ in range(times):
            os.eventfd_write(self.eventfds[vector], 1)


def fd_is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError as error:
        assert error.errno == errno.EBADF
        return False


def test_enable_passes_one_eventfd_per_vector():
    kernel = FakeIrqs()
    with MsixVectors(3, MSIX, 4, ioctl=kernel) as vectors:
        assert kernel.calls == [(uapi.VFIO_IRQ_SET_DATA_EVENTFD | uapi.VFIO_IRQ_SET_ACTION_TRIGGER,
                                 uapi.VFIO_PCI_MSIX_IRQ_INDEX, 0, 4)]
        assert kernel.eventfds == vectors.eventfds
        assert len(set(vectors.eventfds)) == 4


def test_wait_returns_when_the_vector_fires():
    kernel = FakeIrqs()
    with MsixVectors(3, MSIX, 4, ioctl=kernel) as vectors:
        kernel.fire(2, times=3)
        assert vectors.wait(2, timeout=1.0) == 3  # the eventfd counts
        assert vectors.pending(2) == 0
        kernel.fire(1)
        assert vectors.wait_any(timeout=1.0) == {1: 1}


def test_wait_times_out_naming_vector_and_timeout():
    kernel = FakeIrqs()
    with MsixVectors(3, MSIX, 4, ioctl=kernel) as vectors:
        kernel.fire(0)  # another vector firing must not wake vector 1
        start = time.monotonic()
        with pytest.raises(InterruptTimeout) as raised:
            vectors.wait(1, timeout=0.2)
        elapsed = time.monotonic() - start
        assert 0.2 <= elapsed < 1.0
        assert isinstance(raised.value, TimeoutError)
        assert "MSI-X vector 1 did not fire within 0.2 s" in str(raised.value)
        assert raised.value.vector == 1 and raised.value.timeout == 0.2
        assert vectors.pending(0) == 1  # drain it
        with pytest.raises(InterruptTimeout, match="vector 0-3"):
            vectors.wait_any(timeout=0.05)


def test_trigger_asks_the_kernel_for_a_loopback():
    kernel = FakeIrqs()
    with MsixVectors(3, MSIX, 2, ioctl=kernel) as vectors:
        vectors.trigger(1)
        assert kernel.calls[-1] == (uapi.VFIO_IRQ_SET_DATA_NONE | uapi.VFIO_IRQ_SET_ACTION_TRIGGER,
                                    uapi.VFIO_PCI_MSIX_IRQ_INDEX, 1, 1)
        assert vectors.wait(1, timeout=1.0) == 1


def test_close_disables_the_index_and_closes_every_eventfd():
    kernel = FakeIrqs()
    vectors = MsixVectors(3, MSIX, 4, ioctl=kernel)
    fds = list(vectors.eventfds)
    vectors.close()
    vectors.close()  # idempotent: no second disable
    assert kernel.calls[1:] == [(uapi.VFIO_IRQ_SET_DATA_NONE | uapi.VFIO_IRQ_SET_ACTION_TRIGGER,
                                 uapi.VFIO_PCI_MSIX_IRQ_INDEX, 0, 0)]
    assert not any(fd_is_open(fd) for fd in fds)
    with pytest.raises(InterruptError, match="closed"):
        vectors.wait(0, timeout=0)


def test_failed_enable_leaves_no_eventfd_open():
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(InterruptError, match="enabling 4 MSI-X vectors failed .EINVAL"):
        MsixVectors(3, MSIX, 4, ioctl=FakeIrqs(fail_errno=errno.EINVAL))
    assert set(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("info, count, message", [
    (MSIX, 9, "the device offers 8"),
    (MSIX, 0, "ask for 1 to 8"),
    (IrqInfo(uapi.VFIO_PCI_MSIX_IRQ_INDEX, uapi.VFIO_IRQ_INFO_EVENTFD, 0), 1, "has no MSI-X interrupts"),
    (IrqInfo(uapi.VFIO_PCI_MSIX_IRQ_INDEX, 0, 8), 1, "cannot signal an eventfd"),
])
def test_impossible_requests_are_refused_before_the_kernel(info, count, message):
    kernel = FakeIrqs()
    with pytest.raises(InterruptError, match=message):
        MsixVectors(3, info, count, ioctl=kernel)
    assert kernel.calls == []


def test_unknown_vector_is_refused():
    with MsixVectors(3, MSIX, 2, ioctl=FakeIrqs()) as vectors:
        with pytest.raises(InterruptError, match="vector 5 is not enabled .0-1 are."):
            vectors.wait(5, timeout=0)


class FakeDeviceKernel(FakeIrqs):
    """SET_IRQS as above, plus GET_INFO and GET_IRQ_INFO for one vfio-pci device whose release
    request (VFIO_PCI_REQ_IRQ_INDEX) has ``req_count`` vectors."""

    def __init__(self, req_count):
        super().__init__()
        self.req_count = req_count

    def __call__(self, fd, request, arg):
        if request == uapi.VFIO_DEVICE_GET_INFO:
            info = ffi.cast("struct vfio_device_info *", arg)
            info.flags, info.num_regions, info.num_irqs = uapi.VFIO_DEVICE_FLAGS_PCI, 9, 5
            return 0
        if request == uapi.VFIO_DEVICE_GET_IRQ_INFO:
            info = ffi.cast("struct vfio_irq_info *", arg)
            req = info.index == uapi.VFIO_PCI_REQ_IRQ_INDEX
            info.flags, info.count = uapi.VFIO_IRQ_INFO_EVENTFD, self.req_count if req else 0
            return 0
        return super().__call__(fd, request, arg)


@pytest.mark.parametrize("req_count", [1, 0])
def test_release_request_is_an_eventfd_or_none_where_the_device_has_none(req_count):
    from vfio_cxl.guest.vfio.device import Device

    kernel = FakeDeviceKernel(req_count)
    fd = os.open("/dev/null", os.O_RDONLY)      # the device fd: never read, closed by close()
    device = Device(fd, "0000:05:00.0", ioctl=kernel)
    request = device.release_request()
    if not req_count:
        assert request is None and kernel.calls == []
        device.close()
        return
    assert kernel.calls[-1][1] == uapi.VFIO_PCI_REQ_IRQ_INDEX and request.pending(0) == 0
    kernel.fire(0)                               # the kernel asks for the device back
    assert request.pending(0) == 1
    (eventfd,) = kernel.eventfds
    device.close()                               # disables the index and closes its eventfd
    assert kernel.calls[-1][1:] == (uapi.VFIO_PCI_REQ_IRQ_INDEX, 0, 0) and not fd_is_open(eventfd)
