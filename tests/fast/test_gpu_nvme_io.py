"""NVME_IO and the message window (docs/gpu-device.md, interfaces 1.2 and 1.3), on the in-process server.

A stand-in NVMe controller answers the GPU's doorbell writes: it sits behind the client's DMA
handler, as QEMU's nvme sits behind the vIOMMU, reads the submission entries the device wrote
into VRAM and writes data and completion entries back into VRAM.  It checks the device's side
of the contract (entries, doorbells, phase, request status); QEMU's real controller is driven by
tests/vm/test_storage.py."""

import struct

import pytest

from vfio_user_client import Rig, ServerThread, gpu_server  # noqa: F401

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.gpu.regs import DESC_FLAG_INTERRUPT as IRQ, Op, Status, pack_descriptor
from vfio_cxl.devices.vfio_user import wire

DOORBELLS = 0x7000_0000          # the NVMe's doorbell page, as the GPU's IOVA
SQ_DB, CQ_DB = DOORBELLS + 0x1008, DOORBELLS + 0x100C   # queue 1, 4-byte stride
VRAM_IOVA = 0x10_0000_0000       # VRAM as the NVMe reaches it
BLOCK = 512
SQ, CQ, QBLOCK, REQS, DATA = 0x0, 0x10000, 0x20000, 0x21000, 0x100000
CMB = DOORBELLS + 0x10000        # the NVMe's CMB, as the GPU's IOVA (interface 1.3: the SQ there)


class FakeNvme:
    """Queue 1 of an NVMe controller whose queues and data live in the GPU's VRAM."""

    def __init__(self, vram: memoryview, entries: int, disk: bytearray, memory, *, alive: bool = True):
        self.vram, self.entries, self.disk, self.memory, self.alive = vram, entries, disk, memory, alive
        self.head = self.tail = self.cq_tail = 0
        self.phase = 1
        self.sq_doorbells = self.cq_doorbells = 0
        self.cq_head_seen = 0
        self.sq_in_cmb = False           # where the submission entries are: VRAM at SQ, or the CMB

    def after_write(self) -> None:
        tail, head = struct.unpack("<II", bytes(self.memory.view(SQ_DB, 8)))
        if head != self.cq_head_seen:
            self.cq_head_seen, self.cq_doorbells = head, self.cq_doorbells + 1
        if tail == self.tail or not self.alive:
            return
        self.sq_doorbells += 1
        self.tail = tail
        while self.head != self.tail:
            raw = (bytes(self.memory.view(CMB + self.head * 64, 64)) if self.sq_in_cmb
                   else bytes(self.vram[SQ + self.head * 64:SQ + self.head * 64 + 64]))
            opc, flags, cid, nsid, _, _, addr, word, slba, _hi, nlb, *_ = struct.unpack("<BBHIQQQQIIIIII", raw)
            assert flags == 0x40 and word >> 56 == 0 and nsid == 1     # one SGL Data Block
            length, off = word & 0xFFFFFFFF, addr - VRAM_IOVA
            assert length == (nlb + 1) * BLOCK
            if opc == 2:
                self.vram[off:off + length] = self.disk[slba * BLOCK:slba * BLOCK + length]
            else:
                self.disk[slba * BLOCK:slba * BLOCK + length] = self.vram[off:off + length]
            self.head = (self.head + 1) % self.entries
            self.vram[CQ + self.cq_tail * 16:CQ + self.cq_tail * 16 + 16] = struct.pack(
                "<IIHHHH", 0, 0, self.head, 1, cid, self.phase)
            self.cq_tail += 1
            if self.cq_tail == self.entries:
                self.cq_tail, self.phase = 0, self.phase ^ 1


def rig_with_nvme(srv, entries: int, *, window: bool = True, alive: bool = True, sq_in_cmb: bool = False):
    rig = Rig(srv, direct=True)
    # The doorbell page: the client answers DMA messages for it (QEMU translates them through
    # the vIOMMU into the NVMe's BAR0) but never DMA_MAPs it (QEMU sends no DMA_MAP for MMIO).
    rig.memory.add(DOORBELLS, 0x2000, shared=False).mapped = True
    rig.memory.add(CMB, 0x10000, shared=False).mapped = True
    vram = srv.device.vram
    disk = bytearray(regs.prng_bytes(7, 1 << 20))
    nvme = FakeNvme(vram, entries, disk, rig.memory, alive=alive)
    nvme.sq_in_cmb = sq_in_cmb
    serve = rig.client._serve_dma

    def serve_then_controller(header, body, fds):
        serve(header, body, fds)
        if header.command == wire.DMA_WRITE:
            nvme.after_write()
    rig.client._serve_dma = serve_then_controller
    if window:
        c = rig.client
        c.reg_write(regs.REG_MSGWIN_BASE_LO, DOORBELLS & 0xFFFFFFFF)
        c.reg_write(regs.REG_MSGWIN_BASE_HI, DOORBELLS >> 32)
        c.reg_write(regs.REG_MSGWIN_SIZE_LO, 0x20000)      # the doorbells and the CMB
    return rig, vram, nvme


def put_batch(vram, entries: int, depth: int, count: int, size: int, timeout_ms: int = 0, sq: int = SQ,
              flags: int = 0) -> None:
    vram[QBLOCK:QBLOCK + 64] = regs.pack_nvme_queue(sq, CQ, SQ_DB, CQ_DB, entries, depth, 1, 9,
                                                    timeout_ms=timeout_ms, flags=flags)
    for i in range(count):
        vram[REQS + i * 32:REQS + i * 32 + 32] = regs.pack_nvme_request(
            2, (count - 1 - i) * size // BLOCK, size, VRAM_IOVA + DATA + i * size)


def test_reads_at_depth_16_wrap_the_queue_with_one_doorbell_per_batch(gpu_server):
    rig, vram, nvme = rig_with_nvme(gpu_server, entries=32)
    try:
        count, size = 96, 4096
        put_batch(vram, 32, 16, count, size)
        rig.submit([pack_descriptor(Op.NVME_IO, QBLOCK, REQS, count, IRQ, cookie=22)])
        rig.wait_vector(regs.VEC_DMA_DONE)
        rec = rig.completion(0)
        assert rec["status"] == Status.OK and rec["bytes_done"] == count * size and rec["cookie"] == 22
        for i in range(count):       # request i read block range (count-1-i) into its own VRAM slot
            status, = struct.unpack_from("<H", vram, REQS + i * 32 + 2)
            assert status == 0
            want = nvme.disk[(count - 1 - i) * size:(count - i) * size]
            assert vram[DATA + i * size:DATA + (i + 1) * size] == want, i
        # the queue block says where the queue stands: 96 entries through a 32-entry queue
        tail, head, phase = struct.unpack_from("<HHB", vram, QBLOCK + 40)
        assert (tail, head, phase) == (0, 0, 0)           # three wraps: the phase flipped three times
        # fewer SQ doorbells than requests (batches), and every doorbell was a window message
        assert nvme.sq_doorbells < count and nvme.cq_doorbells >= 1
        writes = rig.client.reg_read(regs.REG_MSGWIN_WRITES)
        assert writes == nvme.sq_doorbells + nvme.cq_doorbells
    finally:
        rig.close()


def test_sq_in_the_cmb_gets_its_entries_by_dma_before_each_doorbell(gpu_server):
    """Interface 1.3: NVME_QUEUE_SQ_PEER puts the SQ at an IOVA (an NVMe's CMB); the device
    writes each batch's entries there (one DMA write per contiguous run), then rings."""
    rig, vram, nvme = rig_with_nvme(gpu_server, entries=16, sq_in_cmb=True)
    try:
        count, size = 40, 4096
        vram[SQ:SQ + 16 * 64] = bytes(16 * 64)
        put_batch(vram, 16, 8, count, size, sq=CMB, flags=regs.NVME_QUEUE_SQ_PEER)
        rig.submit([pack_descriptor(Op.NVME_IO, QBLOCK, REQS, count, IRQ, cookie=13)])
        rig.wait_vector(regs.VEC_DMA_DONE)
        rec = rig.completion(0)
        assert rec["status"] == Status.OK and rec["bytes_done"] == count * size
        for i in range(count):
            assert vram[DATA + i * size:DATA + (i + 1) * size] == nvme.disk[(count - 1 - i) * size:(count - i) * size]
        assert vram[SQ:SQ + 16 * 64] == bytes(16 * 64)                   # nothing went to VRAM
        writes = rig.client.reg_read(regs.REG_MSGWIN_WRITES)
        # entry runs + doorbells: at most one run per doorbell batch plus one more per wrap
        assert nvme.sq_doorbells + nvme.cq_doorbells < writes <= 2 * nvme.sq_doorbells + nvme.cq_doorbells + 3
    finally:
        rig.close()


def test_unknown_queue_flags_are_refused(gpu_server):
    rig, vram, nvme = rig_with_nvme(gpu_server, entries=8)
    try:
        put_batch(vram, 8, 4, 4, 4096, flags=0x2)
        rig.submit([pack_descriptor(Op.NVME_IO, QBLOCK, REQS, 4, IRQ)])
        rig.wait_vector(regs.VEC_ERROR)
        assert rig.client.reg_read(regs.REG_ERR_STATUS) == Status.BAD_QUEUE and nvme.sq_doorbells == 0
    finally:
        rig.close()


@pytest.mark.parametrize("local", [False, True], ids=["reported", "local"])
def test_doorbell_outside_the_window_faults_dma_unmapped(tmp_path, local):
    """The doorbell IOVA has no DMA_MAP: DMA_UNMAPPED at it.  The fault's report (the
    doorbell write itself, sent so the client's IOMMU sees it) reaches the controller here,
    as the fake client's IOMMU maps the doorbell page: the SQ tail is rung once, no window
    transfer counted.  With local DMA faults nothing reaches it."""
    srv = ServerThread(tmp_path, local_dma_faults=local)
    rig, vram, nvme = rig_with_nvme(srv, entries=8, window=False)
    try:
        put_batch(vram, 8, 4, 4, 4096)
        rig.submit([pack_descriptor(Op.NVME_IO, QBLOCK, REQS, 4, IRQ)])
        rig.wait_vector(regs.VEC_ERROR)
        c = rig.client
        assert c.reg_read(regs.REG_ERR_STATUS) == Status.DMA_UNMAPPED
        assert c.reg_read(regs.REG_ERR_ADDR_LO) | c.reg_read(regs.REG_ERR_ADDR_HI) << 32 == SQ_DB
        assert nvme.sq_doorbells == (0 if local else 1) and c.reg_read(regs.REG_MSGWIN_WRITES) == 0
    finally:
        rig.close()
        srv.stop()


def test_a_controller_that_never_answers_times_out(gpu_server):
    rig, vram, nvme = rig_with_nvme(gpu_server, entries=8, alive=False)
    try:
        put_batch(vram, 8, 4, 4, 4096, timeout_ms=200)
        rig.submit([pack_descriptor(Op.NVME_IO, QBLOCK, REQS, 4, IRQ)])
        rig.wait_vector(regs.VEC_ERROR)
        c = rig.client
        assert c.reg_read(regs.REG_ERR_STATUS) == Status.QUEUE_TIMEOUT
        assert c.reg_read(regs.REG_ERR_ADDR_LO) == REQS                     # the oldest request
        assert [struct.unpack_from("<H", vram, REQS + i * 32 + 2)[0] for i in range(4)] == [0xFFFF] * 4
    finally:
        rig.close()


def test_bad_queue_blocks_are_refused_before_anything_moves(gpu_server):
    rig, vram, nvme = rig_with_nvme(gpu_server, entries=128)
    try:
        put_batch(vram, 128, 65, 4, 4096)               # depth 65: more than NVME_MAX_DEPTH
        rig.submit([pack_descriptor(Op.NVME_IO, QBLOCK, REQS, 4, IRQ)])
        rig.wait_vector(regs.VEC_ERROR)
        assert rig.client.reg_read(regs.REG_ERR_STATUS) == Status.BAD_QUEUE
        assert rig.client.reg_read(regs.REG_ERR_ADDR_LO) == QBLOCK
        assert nvme.sq_doorbells == 0
    finally:
        rig.close()


def test_message_window_registers_read_back_and_reset():
    from vfio_cxl.devices.gpu.register_file import RegisterFile
    r = RegisterFile(1 << 20)
    r.set_msg_window(regs.REG_MSGWIN_BASE_HI, 0x12, 0xFFFFFFFF)
    r.set_msg_window(regs.REG_MSGWIN_SIZE_LO, 0x1000, 0xFFFFFFFF)
    assert (r.msgwin_base, r.msgwin_size) == (0x12 << 32, 0x1000)
    assert r.value(regs.REG_MSGWIN_BASE_HI, 0, 0) == 0x12
    r.reset()
    assert (r.msgwin_base, r.msgwin_size) == (0, 0)
    assert regs.reset_values()[regs.REG_MSGWIN_SIZE_LO] == 0
