"""The GPU's halt, reset and bus-master rules (docs/gpu-device.md), checked from
outside like the vfio-user rules: what a client can observe through DMA
requests, its direct windows, registers and MSI-X eventfds.

The message path lets the client hold the engine mid-transfer: it keeps the
first DMA_WRITE unanswered, acts (halt / reset), gets that acknowledged, and
only then answers.  Everything the device does after the acknowledgement is
then visible.  A bounded observation window (serving DMA for ``OBSERVE``
seconds) stands for "never"."""

from __future__ import annotations

import pytest

from vfio_cxl.bench import gpu_doc as gpu
from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import DATA_IOVA, PCI_COMMAND, PCI_COMMAND_MEMORY, Rig, assert_ok_reply

OBSERVE = 1.0
ATTEMPTS = 30
PIECE = 1 << 20  # the client's max_data_xfer_size: one DMA_WRITE per MiB


def observe(peer, seconds=OBSERVE, poll_fds=()):
    """Serve the server's DMA requests for ``seconds`` (an observation window)."""
    try:
        peer.pump(lambda: False, seconds, poll_fds=poll_fds)
    except vu.PeerTimeout:
        pass


def completions(rig, n):
    """Completion records with seq != 0 (written) among the first n."""
    return [i for i in range(n) if rig.completion(i)[4] != 0]


@pytest.fixture
def held(peer):
    """A rig whose ring holds 6 descriptors of 2 MiB VRAM -> host (message path),
    with the engine stopped inside the first one: its first DMA_WRITE piece is
    received and not yet answered."""
    rig = Rig(peer)
    w = vu.Window(DATA_IOVA, 12 << 20, direct=False, name="held")
    assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    rig.submit(gpu.descriptor(gpu.OP_FILL_PATTERN, 0x1111, 0, 2 << 20))
    rig.wait_idle()
    descs = [gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA + i * (2 << 20), 2 << 20,
                            flags=gpu.DESC_FLAG_INTERRUPT, cookie=100 + i) for i in range(6)]
    rig.submit(*descs)
    first = peer.recv(10)
    assert first.command == vu.DMA_WRITE and first.type == vu.TYPE_COMMAND, first
    yield rig, first
    rig.close()


def test_clearing_enable_stops_after_the_descriptor_in_flight(peer, held):
    """docs/gpu-device.md "The ring": "Clearing ENABLE stops the ring after the
    descriptor in flight."  Once the CONTROL write is answered, at most that one
    descriptor completes and no later descriptor moves a byte (issue 9 item 2)."""
    rig, first = held
    peer.write32(gpu.CONTROL, 0)  # acknowledged: the reply is back
    log_at_ack = len(peer.dma_log)
    peer.serve_dma(first)
    observe(peer)
    done = completions(rig, 1 + 6)
    assert [i for i in done if i > 1] == [], f"descriptors completed after the halt: {done}"
    later = [r for r in peer.dma_log[log_at_ack:] if r.address >= DATA_IOVA + (2 << 20)]
    assert later == [], f"{len(later)} DMA requests for descriptors after the one in flight"
    assert peer.read32(gpu.COMPLETED) <= 2


def test_ring_halted_by_a_bad_doorbell_runs_no_later_descriptor(peer, held):
    """docs/gpu-device.md: "A doorbell value >= RING_SIZE halts the ring with
    BAD_TAIL" and a halted ring "stops: HEAD stays at the failing descriptor, ...
    later descriptors are not fetched, doorbells do nothing, until reset."  Once the
    bad doorbell is acknowledged (STATUS.HALTED reads 1), no descriptor after the
    one in flight moves a byte or completes (issue 9 item 2: the fetched batch
    keeps running)."""
    rig, first = held
    peer.write32(gpu.RING_TAIL, rig.entries + 1)
    assert peer.read32(gpu.STATUS) & gpu.STATUS_HALTED, "BAD_TAIL did not halt the ring"
    assert peer.read32(gpu.ERR_STATUS) == gpu.ST_BAD_TAIL
    log_at_ack = len(peer.dma_log)
    peer.serve_dma(first)
    observe(peer)
    later = [r for r in peer.dma_log[log_at_ack:] if r.address >= DATA_IOVA + (2 << 20)]
    assert later == [], f"{len(later)} DMA requests for descriptors after the halt"
    done = completions(rig, 7)
    assert [i for i in done if i > 1] == [], f"descriptors completed after the halt: {done}"


@pytest.mark.parametrize("path", ["direct", "message"])
def test_reset_is_a_quiesce_point_under_load(peer, path):
    """docs/gpu-device.md "Reset": the engine drops what it was doing and "writes
    nothing more for it"; the issue: reset is "acknowledged only when the engine
    has stopped touching the affected memory".  Repeatedly: a ring of PRNG fills
    is reset mid-run; after CONTROL.RESET is answered the completion area (direct:
    the server's mmap; message: DMA_WRITEs) must not change and no DMA request may
    arrive (issue 9 item 3; a race, so it is hit in some runs only)."""
    rig = Rig(peer, entries=256, direct=path == "direct")
    try:
        for attempt in range(ATTEMPTS):
            rig.compl.write(rig.compl.iova, bytes(rig.compl.size))
            rig.tail = 0
            rig.submit(*[gpu.descriptor(gpu.OP_FILL_PRNG, i, 0, 16384, cookie=i)
                         for i in range(255)])
            for _ in range(attempt % 12):  # land the reset at different points of the run
                peer.read32(gpu.COMPLETED)
            peer.write32(gpu.CONTROL, gpu.CONTROL_RESET)
            at_ack = rig.compl.body()
            peer.dma_forbidden = "after CONTROL.RESET was acknowledged"
            observe(peer, 0.03)
            peer.dma_forbidden = None
            assert peer.violations == [], f"attempt {attempt}: {peer.violations}"
            assert rig.compl.body() == at_ack, \
                f"attempt {attempt}: completion records written after the reset was acknowledged"
            peer.write32(gpu.RING_BASE_LO, rig.ring.iova)
            peer.write32(gpu.RING_SIZE, rig.entries)
            peer.write32(gpu.COMPL_BASE_LO, rig.compl.iova)
            peer.write32(gpu.CONTROL, gpu.CONTROL_ENABLE)
    finally:
        rig.close()


@pytest.mark.parametrize("how", ["CONTROL.RESET", "DEVICE_RESET"])
def test_reset_drops_the_descriptor_in_flight(peer, held, how):
    """docs/gpu-device.md "Reset": CONTROL.RESET and VFIO_USER_DEVICE_RESET "make
    the engine drop the descriptor in flight (it stops between chunks and writes
    nothing more for it)"; issue 9: "a descriptor dropped by reset may have written
    data but never completes".  After the reset is acknowledged: no further DMA
    piece, no completion record, no MSI-X (issue 9 item 3)."""
    rig, first = held
    if how == "CONTROL.RESET":
        peer.write32(gpu.CONTROL, gpu.CONTROL_RESET)
    else:
        assert_ok_reply(peer.request(vu.DEVICE_RESET), vu.DEVICE_RESET)
    for v, fd in enumerate(rig.efds):
        vu.eventfd_take(fd)
    log_at_ack = len(peer.dma_log)
    peer.serve_dma(first)
    observe(peer, poll_fds=rig.efds)
    after = peer.dma_log[log_at_ack + 1:]
    assert after == [], f"{len(after)} DMA requests after the reset was acknowledged"
    assert completions(rig, 7)[1:] == [], "a completion record was written after the reset"
    assert rig.completion(1)[4] == 0, "the dropped descriptor completed"
    fired = [v for v, fd in enumerate(rig.efds) if vu.eventfd_take(fd)]
    assert fired == [], f"MSI-X vectors {fired} raised after the reset"


def test_doorbell_while_halted_does_nothing(peer):
    """docs/gpu-device.md "Faults": after an error the ring "stops: ... later
    descriptors are not fetched, doorbells do nothing, until reset."  An
    out-of-range doorbell while HALTED raises neither INTR_STATUS.ERROR nor vector
    1 and leaves ERR_STATUS as the first error (issue 9 item 4)."""
    rig = Rig(peer)
    try:
        rig.submit(gpu.descriptor(0x77, 0, 0, 16))  # unknown op: BAD_OPCODE, ring halts
        rig.wait_irq(gpu.VEC_ERROR)
        assert peer.read32(gpu.STATUS) & gpu.STATUS_HALTED
        first_error = peer.read32(gpu.ERR_STATUS)
        peer.write32(gpu.INTR_STATUS, gpu.INTR_ERROR | gpu.INTR_DMA_DONE)  # W1C
        assert peer.read32(gpu.INTR_STATUS) == 0
        peer.write32(gpu.RING_TAIL, rig.entries + 3)  # would be BAD_TAIL if it did anything
        observe(peer, 0.5, poll_fds=rig.efds)
        assert peer.read32(gpu.INTR_STATUS) == 0, "INTR_STATUS set by a doorbell while halted"
        assert vu.eventfd_take(rig.efds[gpu.VEC_ERROR]) == 0, "vector 1 raised while halted"
        assert peer.read32(gpu.ERR_STATUS) == first_error
    finally:
        rig.close()


def test_no_dma_and_no_msi_without_bus_master_enable(peer):
    """PCI semantics the issue asks the device to follow (issue 9 item 7): with the
    command register's Bus Master Enable clear a function issues no memory
    requests -- no DMA and no MSI-X.  A doorbell then moves nothing: no DMA
    message, nothing in the direct completion area, no eventfd."""
    rig = Rig(peer, bus_master=False)
    try:
        data = vu.Window(DATA_IOVA, 64 * 1024, direct=False, name="nobme")
        assert_ok_reply(peer.dma_map(data), vu.DMA_MAP)
        rig.submit(gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA, 4096,
                                  flags=gpu.DESC_FLAG_INTERRUPT))
        observe(peer, poll_fds=rig.efds)
        assert peer.dma_log == [], f"{len(peer.dma_log)} DMA requests with bus mastering off"
        assert completions(rig, 1) == [], "completion record written with bus mastering off"
        fired = [v for v, fd in enumerate(rig.efds) if vu.eventfd_take(fd)]
        assert fired == [], f"MSI-X vectors {fired} raised with bus mastering off"
    finally:
        peer.region_write(vu.PCI_CONFIG_REGION, PCI_COMMAND,
                          PCI_COMMAND_MEMORY.to_bytes(2, "little"))
        rig.close()
