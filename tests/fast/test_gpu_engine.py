"""The engine state machine (docs/gpu-device.md, "Engine states"): halt, reset,
Bus Master Enable and disconnect stop the work in flight, and a dropped
descriptor never completes.

To catch the device mid-descriptor, the client stand-in holds one DMA request
(``before_dma`` blocks its reader thread) while the test acts; register writes
made meanwhile are posted (no reply), as QEMU's BAR writes are.
"""

import errno
import os
import threading

from vfio_user_client import DATA_IOVA, Rig, ServerThread, eventfd_count, gpu_server, no_leaks  # noqa: F401

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.gpu.regs import DESC_FLAG_INTERRUPT as IRQ, Op, Status, pack_descriptor
from vfio_cxl.devices.vfio_user import wire
from vfio_cxl.devices.vfio_user.dma import DmaTable

TIMEOUT = 5


class Hold:
    """Blocks the client's reader on the first DMA_WRITE to ``iova`` until released."""

    def __init__(self, client, iova: int):
        self.iova = iova
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.after: list[tuple[int, int]] = []  # DMA requests seen once released
        client.before_dma = self

    def __call__(self, header):
        if self.release.is_set():
            self.after.append((header.command, header.msg_id))
            return
        if header.command == wire.DMA_WRITE and not self.arrived.is_set():
            self.arrived.set()
            assert self.release.wait(TIMEOUT), "test never released the held DMA request"


def completions(rig, n):
    return [rig.completion(i) for i in range(n)]


def start_held_batch(rig, count=8):
    """VRAM -> host descriptors on the message path; the first data write is held."""
    hold = Hold(rig.client, DATA_IOVA)
    rig.submit([pack_descriptor(Op.VRAM_TO_HOST, 0, DATA_IOVA + 4096 * i, 4096, IRQ, cookie=i + 1)
                for i in range(count)], posted=True)
    assert hold.arrived.wait(TIMEOUT), "the device never started the first descriptor"
    return hold


def test_halt_stops_the_running_batch(gpu_server):
    """Item 2: after BAD_TAIL halts the ring, the descriptor in flight and the rest of
    its batch never complete and no further DMA is issued."""
    rig = Rig(gpu_server, direct=False, entries=16)
    c = rig.client
    try:
        hold = start_held_batch(rig)
        c.reg_write(regs.REG_RING_TAIL, 16, posted=True)  # BAD_TAIL: halt
        hold.release.set()  # the reply to the held write reaches the device after the halt
        assert rig.wait_vector(regs.VEC_ERROR) == 1
        assert c.reg_read(regs.REG_ERR_STATUS) == Status.BAD_TAIL
        assert c.reg_read(regs.REG_RING_HEAD) == 0 and c.reg_read(regs.REG_COMPLETED) == 0
        assert all(rec["seq"] == 0 for rec in completions(rig, 8)), completions(rig, 8)
        assert hold.after == [], f"DMA after the halt: {hold.after}"
        assert eventfd_count(rig.efds[regs.VEC_DMA_DONE]) == 0
    finally:
        rig.close()


def test_disable_drops_the_descriptor_in_flight_and_reruns_it(gpu_server):
    rig = Rig(gpu_server, direct=False, entries=16)
    c = rig.client
    try:
        hold = start_held_batch(rig, count=2)
        c.reg_write(regs.REG_CONTROL, 0, posted=True)  # ENABLE 1 -> 0
        hold.release.set()
        assert c.reg_read(regs.REG_STATUS) == 0  # IDLE, nothing busy
        assert (c.reg_read(regs.REG_RING_HEAD), c.reg_read(regs.REG_COMPLETED)) == (0, 0)
        assert all(rec["seq"] == 0 for rec in completions(rig, 2))
        c.reg_write(regs.REG_CONTROL, regs.CONTROL_ENABLE)  # runs it again from the start
        rig.wait_head(2)
        assert [rec["seq"] for rec in completions(rig, 2)] == [1, 2]
    finally:
        rig.close()


def test_no_completion_lands_after_reset_is_acknowledged(gpu_server, monkeypatch):
    """Item 3: the engine is caught between deciding to write a completion record
    (direct path) and copying it; the reset must not be answered before the copy
    is over, and nothing may land after the answer."""
    rig = Rig(gpu_server, direct=True, entries=16)
    c = rig.client
    compl_iova = rig.compl_iova
    at_copy, go = threading.Event(), threading.Event()
    real_find = DmaTable.find
    lookups = []

    def find(self, iova):
        # the engine looks the record's IOVA up twice: the range check, then the copy
        if iova == compl_iova and threading.current_thread().name == "gpu-engine":
            lookups.append(iova)
            if len(lookups) == 2:
                at_copy.set()
                go.wait(TIMEOUT)
        return real_find(self, iova)

    monkeypatch.setattr(DmaTable, "find", find)
    try:
        rig.submit([pack_descriptor(Op.FILL_PATTERN, 0x77, 0, 64, IRQ, cookie=9)], posted=True)
        assert at_copy.wait(TIMEOUT)
        answered, snapshot = threading.Event(), {}

        def do_reset():
            c.reg_write(regs.REG_CONTROL, regs.CONTROL_RESET)  # not posted: wait for the answer
            snapshot["compl"] = rig.completion(0)
            answered.set()

        resetter = threading.Thread(target=do_reset)
        resetter.start()
        early = answered.wait(1.0)  # the device must not answer while the copy is pending
        go.set()
        resetter.join(TIMEOUT)
        assert answered.is_set()
        assert not early, "reset acknowledged while the engine was about to write a completion"
        # once the engine is idle again, memory is what it was at the acknowledgement
        assert c.reg_read(regs.REG_STATUS) == 0
        gpu_server.device.stop()  # joins the engine thread: it has nothing left to do
        assert rig.completion(0) == snapshot["compl"]
        assert c.reg_read(regs.REG_COMPLETED) == 0
        gpu_server.device.start()
    finally:
        go.set()
        rig.close()


def test_reset_mid_descriptor_sends_no_more_dma(gpu_server):
    rig = Rig(gpu_server, direct=False, entries=16)
    c = rig.client
    try:
        hold = start_held_batch(rig)
        c.reg_write(regs.REG_CONTROL, regs.CONTROL_RESET, posted=True)
        hold.release.set()
        for offset, value in regs.reset_values(16 * regs.MIB).items():
            assert c.reg_read(offset) == value, hex(offset)
        assert hold.after == [] and all(rec["seq"] == 0 for rec in completions(rig, 8))
        assert eventfd_count(rig.efds[regs.VEC_ERROR]) == 0  # reset raises no vector
        assert eventfd_count(rig.efds[regs.VEC_DMA_DONE]) == 0
    finally:
        rig.close()


def test_halted_doorbells_do_nothing(gpu_server):
    """Item 4: in HALTED an out-of-range doorbell raises no vector and sets no INTR_STATUS."""
    rig = Rig(gpu_server, direct=True, entries=16)
    c = rig.client
    try:
        c.reg_write(regs.REG_RING_TAIL, 16)
        rig.wait_vector(regs.VEC_ERROR)
        c.reg_write(regs.REG_INTR_STATUS, regs.INTR_ERROR)  # W1C
        before = [c.reg_read(r) for r in (regs.REG_ERR_STATUS, regs.REG_ERR_ADDR_LO, regs.REG_RING_TAIL)]
        for tail in (17, 3, 0xFFFF):
            c.reg_write(regs.REG_RING_TAIL, tail)
        c.reg_write(regs.REG_CONTROL, regs.CONTROL_ENABLE)
        assert c.reg_read(regs.REG_INTR_STATUS) == 0
        assert eventfd_count(rig.efds[regs.VEC_ERROR]) == 0
        assert [c.reg_read(r) for r in (regs.REG_ERR_STATUS, regs.REG_ERR_ADDR_LO, regs.REG_RING_TAIL)] == before
        assert c.reg_read(regs.REG_STATUS) == regs.STATUS_HALTED
    finally:
        rig.close()


def test_no_dma_and_no_msix_without_bus_master_enable(gpu_server):
    """Item 7: with BME clear the ring waits (no fetch, no data, no vector); it runs
    as soon as BME is set."""
    rig = Rig(gpu_server, direct=False, entries=16)
    c = rig.client
    try:
        c.set_bus_master(False)
        rig.submit([pack_descriptor(Op.FILL_PATTERN, 0x55, 0, 4096),
                    pack_descriptor(Op.VRAM_TO_HOST, 0, DATA_IOVA, 4096, IRQ)])
        assert c.reg_read(regs.REG_STATUS) == regs.STATUS_ENABLED
        assert c.stats.reads == 0 and c.stats.writes == 0, "DMA without Bus Master Enable"
        assert c.reg_read(regs.REG_RING_HEAD) == 0
        c.set_bus_master(True)
        rig.wait_vector(regs.VEC_DMA_DONE)
        assert rig.host(DATA_IOVA, 4096) == regs.pattern_bytes(0x55, 4096)
        # an error found without DMA still halts, but its MSI-X is not sent without BME
        c.set_bus_master(False)
        c.reg_write(regs.REG_RING_TAIL, 16)
        assert c.reg_read(regs.REG_STATUS) == regs.STATUS_HALTED
        assert c.reg_read(regs.REG_INTR_STATUS) & regs.INTR_ERROR
        assert eventfd_count(rig.efds[regs.VEC_ERROR]) == 0
    finally:
        rig.close()


def test_clearing_bus_master_drops_the_descriptor_in_flight(gpu_server):
    rig = Rig(gpu_server, direct=False, entries=16)
    c = rig.client
    try:
        hold = start_held_batch(rig, count=2)
        # config writes need a reply, and the client's reader is held: send it raw
        payload = wire.REGION_ACCESS.pack(4, wire.PCI_CONFIG_REGION, 2) + (0x2).to_bytes(2, "little")
        c.request(wire.REGION_WRITE, payload, no_reply=True)
        hold.release.set()
        assert c.reg_read(regs.REG_STATUS) == regs.STATUS_ENABLED  # RUNNING, waiting
        assert hold.after == [] and c.reg_read(regs.REG_RING_HEAD) == 0
        c.set_bus_master(True)
        rig.wait_head(2)
        assert [rec["seq"] for rec in completions(rig, 2)] == [1, 2]
    finally:
        rig.close()


def test_disconnect_with_work_queued_halts_for_the_next_client(gpu_server):
    rig = Rig(gpu_server, direct=False, entries=16)
    try:
        hold = start_held_batch(rig, count=2)
        rig.client.transport.shutdown()  # gone mid-descriptor, the held request unanswered
        hold.release.set()
        rig.client.close()
    finally:
        for fd in rig.efds:
            os.close(fd)
        rig.memory.close()
    gpu_server.wait_idle()
    c = gpu_server.client()
    assert c.reg_read(regs.REG_STATUS) == regs.STATUS_HALTED
    assert (c.reg_read(regs.REG_ERR_STATUS), c.reg_read(regs.REG_ERR_ERRNO)) == (
        Status.DMA_ABORTED, errno.ECONNRESET)
    assert c.reg_read(regs.REG_COMPLETED) == 0
