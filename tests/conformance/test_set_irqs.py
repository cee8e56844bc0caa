"""VFIO_USER_DEVICE_SET_IRQS (spec section of that name)."""

from __future__ import annotations

import os

import pytest

from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import assert_error_reply, assert_ok_reply

N = 4  # MSI-X vectors (docs/gpu-device.md)
EVENTFD_TRIGGER = vu.IRQ_SET_DATA_EVENTFD | vu.IRQ_SET_ACTION_TRIGGER
NONE_TRIGGER = vu.IRQ_SET_DATA_NONE | vu.IRQ_SET_ACTION_TRIGGER
BOOL_TRIGGER = vu.IRQ_SET_DATA_BOOL | vu.IRQ_SET_ACTION_TRIGGER


@pytest.fixture
def efds():
    fds = [vu.new_eventfd() for _ in range(N)]
    yield fds
    for fd in fds:
        os.close(fd)


def counts(fds):
    return [vu.eventfd_take(fd) for fd in fds]


def eventfds_held(server) -> int:
    return sum(1 for t in server.proc.fd_targets() if t == "anon_inode:[eventfd]")


def test_eventfds_assigned_then_triggered_by_the_client(peer, efds):
    """SET_IRQS: DATA_EVENTFD "indicates an array of event file descriptors was sent
    in the message meta-data. These descriptors will be signalled when the action
    defined by the action flags occurs" and typical operation 5: "A client may
    trigger a device IRQ itself, by sending ... flags=(VFIO_IRQ_SET_DATA_NONE/BOOL|
    VFIO_IRQ_SET_ACTION_TRIGGER)".  Reply: "There is no payload in the reply."""
    reply = peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, EVENTFD_TRIGGER, fds=efds)
    assert_ok_reply(reply, vu.DEVICE_SET_IRQS)
    assert reply.payload == b""
    assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, NONE_TRIGGER), vu.DEVICE_SET_IRQS)
    assert counts(efds) == [1, 1, 1, 1]


def test_bool_data_triggers_only_the_true_entries(peer, efds):
    """SET_IRQS: DATA_BOOL "indicates the data field is an array of boolean bytes.
    The action is performed if the corresponding boolean is true." and argsz "is
    the size of the VFIO IRQ set request payload, including any data field"."""
    assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, EVENTFD_TRIGGER, fds=efds),
                    vu.DEVICE_SET_IRQS)
    assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, BOOL_TRIGGER, data=bytes([0, 1, 0, 1])),
                    vu.DEVICE_SET_IRQS)
    assert counts(efds) == [0, 1, 0, 1]


def test_eventfd_without_fds_deassigns(peer, efds):
    """SET_IRQS: DATA_EVENTFD "If no file descriptors are provided, this de-assigns
    the specified previously configured interrupts." -- only those (start 1,
    count 1)."""
    assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, EVENTFD_TRIGGER, fds=efds),
                    vu.DEVICE_SET_IRQS)
    assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 1, 1, EVENTFD_TRIGGER), vu.DEVICE_SET_IRQS)
    assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, NONE_TRIGGER), vu.DEVICE_SET_IRQS)
    assert counts(efds) == [1, 0, 1, 1]


def test_count_zero_data_none_disables_all_and_closes_the_fds(peer, gpu_server, efds):
    """SET_IRQS: "As a special case, a count (and start) of 0, with data flags of
    VFIO_IRQ_SET_DATA_NONE disables all interrupts of the index."  Nothing fires
    afterwards and the server holds none of the eventfds any more."""
    before = eventfds_held(gpu_server)
    assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, EVENTFD_TRIGGER, fds=efds),
                    vu.DEVICE_SET_IRQS)
    assert eventfds_held(gpu_server) == before + N
    assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, 0, NONE_TRIGGER), vu.DEVICE_SET_IRQS)
    assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, NONE_TRIGGER), vu.DEVICE_SET_IRQS)
    assert counts(efds) == [0, 0, 0, 0]
    assert eventfds_held(gpu_server) == before


@pytest.mark.parametrize("flags, why", [
    (vu.IRQ_SET_DATA_NONE | vu.IRQ_SET_DATA_BOOL | vu.IRQ_SET_ACTION_TRIGGER, "two DATA flags"),
    (vu.IRQ_SET_DATA_NONE | vu.IRQ_SET_ACTION_MASK | vu.IRQ_SET_ACTION_TRIGGER, "two ACTION flags"),
    (vu.IRQ_SET_ACTION_TRIGGER, "no DATA flag"),
    (vu.IRQ_SET_DATA_NONE, "no ACTION flag"),
    (NONE_TRIGGER | (1 << 6), "undefined flag bit 6"),
], ids=["two-data", "two-actions", "no-data", "no-action", "bit6"])
def test_flags_must_name_exactly_one_data_and_one_action(peer, flags, why):
    """SET_IRQS: "The DATA flags describe the data field sent in the message; the
    ACTION flags describe the action to be performed. The flags are mutually
    exclusive for both sets."  Anything else is an error, header only."""
    assert_error_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, 1, flags), vu.DEVICE_SET_IRQS)


@pytest.mark.parametrize("index, start, count", [
    (vu.PCI_MSIX_IRQ, 0, N + 1), (vu.PCI_MSIX_IRQ, N, 1), (vu.PCI_MSIX_IRQ, 0xFFFFFFFF, 2),
    (vu.PCI_INTX_IRQ, 0, 1), (vu.PCI_NUM_IRQS, 0, 1)])
def test_range_beyond_the_irq_count_is_refused(peer, index, start, count):
    """SET_IRQS: "start is the start of the sub-index being set. count describes the
    number of sub-indexes being set" -- within GET_IRQ_INFO's count for the index
    (MSI-X 4, INTx 0) and an index the device has; otherwise an error."""
    assert_error_reply(peer.set_irqs(index, start, count, NONE_TRIGGER), vu.DEVICE_SET_IRQS)


def test_eventfd_count_mismatch_is_refused_and_the_fds_not_kept(peer, gpu_server, efds):
    """SET_IRQS DATA_EVENTFD: "an array of event file descriptors" for the count
    sub-indexes; three fds for count 4 is an error, and none is kept."""
    before = eventfds_held(gpu_server)
    reply = peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, EVENTFD_TRIGGER, fds=efds[:3])
    assert_error_reply(reply, vu.DEVICE_SET_IRQS)
    assert eventfds_held(gpu_server) == before


def test_bool_data_length_must_match_argsz_and_count(peer):
    """SET_IRQS: argsz "is the size of the VFIO IRQ set request payload, including
    any data field"; DATA_BOOL with count 4 needs 4 bytes of data.  Missing data
    or an argsz that disagrees is an error."""
    assert_error_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, BOOL_TRIGGER, data=b"\1\1"),
                       vu.DEVICE_SET_IRQS)
    assert_error_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, N, BOOL_TRIGGER, data=b"\1" * N,
                                     argsz=vu.IRQ_SET.size), vu.DEVICE_SET_IRQS)


def test_fd_that_is_not_an_eventfd_is_refused_and_not_kept(peer, gpu_server):
    """SET_IRQS: "These descriptors will be signalled" -- they must be eventfds; a
    memfd is an error, and the server does not keep it."""
    w = vu.Window(0x7100_0000, vu.PAGE, direct=True, name="notevent")
    try:
        reply = peer.set_irqs(vu.PCI_MSIX_IRQ, 0, 1, EVENTFD_TRIGGER, fds=[w.fd])
        assert_error_reply(reply, vu.DEVICE_SET_IRQS)
        assert not gpu_server.proc.holds(w.name)
    finally:
        w.close()
