"""A GPU the host moves away while a NIC session holds its VRAM (issue 35, "Bad input"): the
session watches the GPU's vfio-pci release request (an eventfd here, signalled as the kernel
would), and the call that finds it -- at its start, or the wait it is in -- tears the
bindings down in order (the RX queue stopped and its descriptors taken back, then the NIC's
mappings of the BAR removed, then the GPU closed) and raises GpuReleased naming the GPU's BDF.

The NICs are the stand-ins of test_nic_devmem.py and test_nic_rdma.py, each with a journal of
the steps; the real path (QMP device_del of the GPU) is tests/vm/test_nic.py's."""

import contextlib
import os
import time
from types import SimpleNamespace

import pytest

import test_nic_devmem as devmem_stand_in
import test_nic_rdma as rdma_stand_in
from vfio_cxl.guest.nic import devmem, rdma
from vfio_cxl.guest.nic.rdma import Access, Header, Op
from vfio_cxl.guest.nic.release import GpuReleased
from vfio_cxl.guest.nic.session import NicSession
from vfio_cxl.guest.vfio.interrupts import wait_readable

BDF = "0000:03:00.0"


class ReleaseRequest:
    """VFIO_PCI_REQ_IRQ_INDEX's eventfd, as ``VfioDevice.release_request`` gives it."""

    def __init__(self):
        self.eventfds = [os.eventfd(0, os.EFD_NONBLOCK)]

    def fire(self) -> None:
        """What vfio-pci does when the device is being hot-removed."""
        os.eventfd_write(self.eventfds[0], 1)

    def pending(self, vector: int) -> int:
        try:
            return os.eventfd_read(self.eventfds[vector])
        except BlockingIOError:
            return 0


class MovableGpu:
    """A GpuDriver's part the session uses: VRAM, its release request, close."""

    def __init__(self, journal: list):
        self.device = SimpleNamespace(bdf=BDF)
        self.vram_size = devmem_stand_in.VRAM
        self.memory = bytearray(self.vram_size)
        self.vram = SimpleNamespace(view=lambda off, n: memoryview(self.memory)[off:off + n])
        self.request = ReleaseRequest()
        self.journal, self.closed = journal, False

    def release_requested(self) -> bool:
        return self.request.pending(0) > 0

    def close(self) -> None:
        self.journal.append(("gpu closed (BAR mmaps dropped, fd closed)",))
        self.closed = True
        os.close(self.request.eventfds[0])


def journaled(journal: list, nic) -> None:
    """Each queue take-back and DMA (un)mapping of ``nic`` goes into ``journal``."""
    take_back = nic.take_back_rx

    def take_back_rx(queue, **kwargs):
        journal.append(("queue stopped, descriptors taken back", queue, kwargs.get("enable", False)))
        return take_back(queue)
    nic.take_back_rx = take_back_rx


def mapping(journal: list, what: str, iova: int, live: set):
    live.add(iova)

    def close():
        journal.append((f"{what} unmapped", iova))
        live.discard(iova)
    return SimpleNamespace(iova=iova, close=close)


def session(nic, gpu) -> NicSession:
    nic.wake_fds = ()
    return NicSession(nic, gpu, SimpleNamespace(), "type1", contextlib.ExitStack())


@pytest.fixture
def devmem_session(monkeypatch):
    journal, live = [], set()
    nic = devmem_stand_in.StandInNic()
    journaled(journal, nic)
    nic.device.map_dma = lambda buffer, iova: mapping(journal, "header buffers", iova, live)
    gpu = MovableGpu(journal)
    monkeypatch.setattr(devmem, "map_peer_bar",
                        lambda nic_, gpu_, iova, size, offset, notes: mapping(journal, "VRAM", iova, live))
    return session(nic, gpu), nic, gpu, journal, live


def test_a_release_during_recv_tears_the_binding_down_in_order_and_names_the_gpu(devmem_session):
    s, nic, gpu, journal, live = devmem_session
    b = s.rx.bind_rx(1, gpu, 0x10000, 4 * 4096)
    devmem_stand_in.land(nic, gpu, b, b"h" * 42, b"x" * 64)
    (frame,) = s.rx.recv(b, count=1, timeout=0)
    assert nic.wake_fds == tuple(gpu.request.eventfds)       # the driver's waits end on the request too

    def wait_rx(queue, deadline):
        """The real driver's wait: the queue's vector or a wake fd; the request comes meanwhile."""
        gpu.request.fire()
        wait_readable(nic.wake_fds, deadline - time.monotonic())
        return False
    nic.wait_rx = wait_rx
    t0 = time.monotonic()
    with pytest.raises(GpuReleased, match=f"GPU {BDF} was released by the host .*moved.*bind again once a GPU"):
        s.rx.recv(b, count=1, timeout=30)
    assert time.monotonic() - t0 < 5                         # the wait ended on the request, not the timeout
    assert journal == [("queue stopped, descriptors taken back", 1, False),
                       ("VRAM unmapped", devmem.VRAM_IOVA + 0x10000),
                       ("header buffers unmapped", devmem.HEADER_IOVA + devmem.HEADER_WINDOW),
                       ("gpu closed (BAR mmaps dropped, fd closed)",)]
    assert live == set() and nic.rx[1].ring.posted == 0 and s.rx.bindings == {} and gpu.closed
    assert nic.wake_fds == ()                                # the closed eventfd is waited on no more
    for call in (lambda: s.rx.dontneed([frame.fragments[0].token]), lambda: s.rx.recv(b),
                 lambda: s.rx.bind_rx(2, gpu, 0, 4096)):
        with pytest.raises(GpuReleased, match=BDF):
            call()
    s.close()                                                # closing after the release is clean
    assert len(journal) == 4


def test_a_release_found_at_the_start_of_a_call_tears_down_before_it_runs(devmem_session):
    s, nic, gpu, journal, live = devmem_session
    b = s.rx.bind_rx(1, gpu, 0, 2 * 4096)
    gpu.request.fire()
    with pytest.raises(GpuReleased, match=BDF):
        s.rx.dontneed([])
    assert [step[0] for step in journal] == ["queue stopped, descriptors taken back", "VRAM unmapped",
                                             "header buffers unmapped", "gpu closed (BAR mmaps dropped, fd closed)"]
    assert live == set() and not b.bound


@pytest.fixture
def rdma_session(monkeypatch):
    journal, live = [], set()
    nic = rdma_stand_in.StandInNic()
    journaled(journal, nic)
    gpu = MovableGpu(journal)

    def map_peer_bar(initiator, peer, iova, size, offset, notes=None):
        nic.regions[iova] = (peer, offset, size)
        m = mapping(journal, "region", iova, live)
        close = m.close
        m.close = lambda: (close(), nic.regions.pop(iova))
        return m

    monkeypatch.setattr(rdma, "map_peer_bar", map_peer_bar)
    s = session(nic, gpu)
    return s, s.endpoint(first_write_id=1), nic, gpu, journal, live


def test_a_release_while_the_responder_places_a_write_stops_the_queue_then_unmaps(rdma_session):
    s, ep, nic, gpu, journal, live = rdma_session
    mr = ep.reg_mr(gpu, 0, 0x4000, Access.REMOTE_WRITE)
    nic.control_in.append(rdma_stand_in.request(mr.key, 0, 4 * rdma.MTU))
    nic.wire += rdma_stand_in.data_frames(mr.key, 0, rdma.pattern(3, 0, 4 * rdma.MTU))[:2]
    device_lands = nic.wait_rx

    def wait_rx(queue, deadline):
        if not nic.wire:                  # two frames landed, then the host takes the GPU away
            gpu.request.fire()
            return False
        return device_lands(queue, deadline)
    nic.wait_rx = wait_rx
    with pytest.raises(GpuReleased, match=BDF):
        ep.serve(timeout=30)
    stopped = journal.index(("queue stopped, descriptors taken back", 1, False))
    unmapped = journal.index(("region unmapped", mr.iova))
    assert stopped < unmapped < journal.index(("gpu closed (BAR mmaps dropped, fd closed)",))
    # serve's own take-back after the failure keeps the data queue off
    assert all(not step[2] for step in journal if step[0].startswith("queue stopped"))
    assert live == set() and nic.regions == {} and nic.rx[1].ring.posted == 0
    with pytest.raises(GpuReleased, match=BDF):
        ep.write(mr, 0, 0x100, mr.key, 0, to=rdma_stand_in.PEER)
    ep.close()
    s.close()


def test_a_release_while_the_writer_waits_for_a_grant_ends_the_write(rdma_session):
    s, ep, nic, gpu, journal, live = rdma_session
    mr = ep.reg_mr(gpu, 0, 0x4000)
    answered = nic.recv

    def recv(queue, count, timeout):
        got = answered(queue, count, timeout)
        if not got:
            gpu.request.fire()            # the host moved the GPU while the peer was silent
        return got
    nic.recv = recv
    nic.control_in.append(Header(Op.GRANT, 0x300, 1, 2, 0).pack(rdma_stand_in.OWN, rdma_stand_in.PEER))
    with pytest.raises(GpuReleased, match=BDF):
        ep.write(mr, 0, 3 * rdma.MTU, 0x300, 0, to=rdma_stand_in.PEER, timeout=30)
    assert len(nic.gathered) == 2 and live == set() and gpu.closed
