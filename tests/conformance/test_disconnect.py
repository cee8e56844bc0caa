"""Client disconnection (spec "Socket Disconnection Behavior" / "Client
Disconnection"): "the server should respond to a client disconnection as
follows: all client memory regions are unmapped and cleaned up (including
closing any passed file descriptors); all IRQ file descriptors passed from the
old client are closed; the device state should otherwise be retained"."""

from __future__ import annotations

import os
import time

import pytest

from vfio_cxl.bench import gpu_doc as gpu
from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import DATA_IOVA, RING_IOVA, TIMEOUT, Rig, assert_ok_reply, fresh_client_works


def eventfds_held(server) -> int:
    return sum(1 for t in server.proc.fd_targets() if t == "anon_inode:[eventfd]")


def wait_released(server, names, timeout=TIMEOUT):
    """The server notices a disconnect asynchronously: poll (with a deadline) until
    it holds none of the memfds."""
    deadline = time.monotonic() + timeout
    while any(server.proc.holds(n) for n in names):
        if time.monotonic() > deadline:
            held = [n for n in names if server.proc.holds(n)]
            raise AssertionError(f"{timeout} s after the disconnect the server still holds {held}")
        time.sleep(0.02)  # polling a /proc condition with a deadline, not synchronisation


def test_disconnect_releases_memory_and_irq_fds_and_keeps_device_state(gpu_server):
    """Client Disconnection: all three rules -- client memory unmapped and its fds
    closed, IRQ eventfds closed, device state (SCRATCH, VRAM) retained -- and the
    next client is served ("The expectation is that when a client reconnects, it
    will re-establish IRQ and client memory mappings")."""
    baseline = None
    with gpu_server.connect() as p:
        assert_ok_reply(p.handshake(), vu.VERSION)
        baseline = eventfds_held(gpu_server)
        windows = [vu.Window(DATA_IOVA + i * 0x100000, 64 * 1024, direct=True) for i in range(3)]
        for w in windows:
            assert_ok_reply(p.dma_map(w), vu.DMA_MAP)
        efds = [vu.new_eventfd() for _ in range(gpu.MSIX_VECTORS)]
        assert_ok_reply(p.set_irqs(vu.PCI_MSIX_IRQ, 0, 4, vu.IRQ_SET_DATA_EVENTFD
                                   | vu.IRQ_SET_ACTION_TRIGGER, fds=efds), vu.DEVICE_SET_IRQS)
        assert eventfds_held(gpu_server) == baseline + 4
        p.write32(gpu.SCRATCH, 0xFEEDF00D)
        vram = os.urandom(8192)
        assert_ok_reply(p.region_write(gpu.BAR_VRAM, 0x4000, vram), vu.REGION_WRITE)
        names = [w.name for w in windows]
        p.close(keep_windows=True)
    try:
        wait_released(gpu_server, names)
        deadline = time.monotonic() + TIMEOUT
        while eventfds_held(gpu_server) > baseline and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eventfds_held(gpu_server) == baseline, "the old client's eventfds are still open"
        with gpu_server.connect() as q:
            assert_ok_reply(q.handshake(), vu.VERSION)
            assert q.read32(gpu.SCRATCH) == 0xFEEDF00D, "device state lost on disconnect"
            got = q.region_read(gpu.BAR_VRAM, 0x4000, len(vram))
            assert got.payload[16:] == vram, "VRAM lost on disconnect"
            # the old eventfds never fire for the new client's interrupts
            assert_ok_reply(q.set_irqs(vu.PCI_MSIX_IRQ, 0, 4, vu.IRQ_SET_DATA_NONE
                                       | vu.IRQ_SET_ACTION_TRIGGER), vu.DEVICE_SET_IRQS)
            assert [vu.eventfd_take(fd) for fd in efds] == [0, 0, 0, 0]
    finally:
        for fd in efds:
            os.close(fd)
        for w in windows:
            w.close()


def test_new_client_gets_no_dma_to_the_old_clients_windows(gpu_server):
    """Client Disconnection: "all client memory regions are unmapped"; with the ring
    still configured and enabled (device state is retained), a new client that
    mapped nothing gets no DMA_READ / DMA_WRITE at all ("This address must have
    been previously exported")."""
    with gpu_server.connect() as p:
        assert_ok_reply(p.handshake(), vu.VERSION)
        p.request(vu.DEVICE_RESET)
        rig = Rig(p, direct=False)
        rig.submit(gpu.descriptor(gpu.OP_NOP, 0, 0, 0))
        assert rig.wait_idle() & gpu.STATUS_HALTED == 0
        rig.close()
    with gpu_server.connect() as q:
        assert_ok_reply(q.handshake(), vu.VERSION)
        assert q.read32(gpu.RING_BASE_LO) == RING_IOVA, "ring configuration not retained"
        q.write32(gpu.RING_TAIL, 2, posted=True)
        try:
            q.pump(lambda: False, 1.0)
        except vu.PeerTimeout:
            pass
        assert q.dma_log == [] and q.violations == [], q.violations


@pytest.mark.parametrize("cut", [3, 16, 20, 35])
def test_disconnect_in_the_middle_of_a_message(gpu_server, cut):
    """Socket Disconnection Behavior: "The server and the client can disconnect from
    each other, either intentionally or unexpectedly."  A client that leaves after
    ``cut`` bytes of a REGION_WRITE changes nothing, and the next client is served."""
    with gpu_server.connect() as p:
        assert_ok_reply(p.handshake(), vu.VERSION)
        p.write32(gpu.SCRATCH, 0xAAAA)
        body = vu.REGION_RW.pack(gpu.SCRATCH, 0, 4) + (0xBBBB).to_bytes(4, "little")
        p.send_bytes((vu.header(5, vu.REGION_WRITE, len(body)) + body)[:cut])
    with gpu_server.connect() as q:
        assert_ok_reply(q.handshake(), vu.VERSION)
        assert q.read32(gpu.SCRATCH) == 0xAAAA


def test_disconnect_while_the_server_waits_for_a_dma_reply(gpu_server):
    """Socket Disconnection Behavior: a client that vanishes while the device waits
    for its DMA_WRITE reply; the server lives and serves the next client."""
    with gpu_server.connect() as p:
        assert_ok_reply(p.handshake(), vu.VERSION)
        p.request(vu.DEVICE_RESET)
        rig = Rig(p)
        w = vu.Window(DATA_IOVA, 4 << 20, direct=False)
        assert_ok_reply(p.dma_map(w), vu.DMA_MAP)
        rig.submit(gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA, 4 << 20))
        first = p.recv(10)
        assert first.command == vu.DMA_WRITE
        rig.close()
    fresh_client_works(gpu_server)


def test_second_client_is_served_after_the_first_leaves(gpu_server):
    """Socket: the server "can serve one or more clients"; this one serves one at a
    time.  A second client connected meanwhile is served as soon as the first one
    leaves, without reconnecting."""
    first = gpu_server.connect()
    assert_ok_reply(first.handshake(), vu.VERSION)
    second = gpu_server.connect(timeout=TIMEOUT)
    try:
        second.send(vu.VERSION, vu.version_body(0, 0, {"max_msg_fds": 8}))
        first.close()
        reply = second.next_reply()
        assert_ok_reply(reply, vu.VERSION)
        assert second.read32(gpu.ID) == gpu.ID_VALUE
    finally:
        first.close()
        second.close()
