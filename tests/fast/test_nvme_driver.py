"""The NVMe driver's own logic without a controller: entry layouts, PRP lists and SGLs, the
request tracker and its pages, queue-pair phase and doorbells, IOVA space, CAP decoding.

The real controller (QEMU's nvme) is driven by tests/vm/test_storage.py."""

import struct

import pytest

from vfio_cxl.guest.drivers.nvme import prp
from vfio_cxl.guest.drivers.nvme.errors import NvmeError
from vfio_cxl.guest.drivers.nvme.iova import IovaWindow
from vfio_cxl.guest.drivers.nvme.queue import QueuePair
from vfio_cxl.guest.drivers.nvme.spec import (PAGE, Cap, CmbInfo, Completion, ControllerInfo, IoOp,
                                              NamespaceInfo, pack_sqe, status_name)
from vfio_cxl.guest.drivers.nvme.tracker import SLOT_BITS, RequestTracker

LIST_IOVA = 0x7000


def test_sqe_layout():
    sqe = pack_sqe(IoOp.READ, 0x1234, 7, psdt=1, dptr=(0xAAAA000, 0xBBBB000), cdw10=0x10, cdw11=0x2, cdw12=7)
    assert len(sqe) == 64
    assert sqe[0] == 0x02 and sqe[1] == 0x40 and struct.unpack_from("<H", sqe, 2)[0] == 0x1234
    assert struct.unpack_from("<I", sqe, 4)[0] == 7
    assert struct.unpack_from("<QQ", sqe, 24) == (0xAAAA000, 0xBBBB000)
    assert struct.unpack_from("<III", sqe, 40) == (0x10, 0x2, 7)


def test_cqe_status_and_phase():
    raw = struct.pack("<IIHHHH", 5, 0, 3, 1, 0x42, (0x1 << 8 | 0x80) << 1 | 1 | 1 << 15)
    c = Completion.unpack(raw)
    assert (c.result, c.sq_head, c.sqid, c.cid, c.phase) == (5, 3, 1, 0x42, 1)
    assert (c.sct, c.sc, c.dnr, c.ok) == (1, 0x80, True, False)
    assert status_name(0x004) == "Data Transfer Error" and status_name(0x080) == "LBA Out of Range"
    assert status_name(0x7FE) == "status type 0x7 code 0xfe"


def test_cap_decodes_qemu_values_and_doorbell_stride():
    # QEMU 11.1: MQES 0x7ff, CQR, TO 0xf, CSS NVM + I/O command sets, MPSMAX 4, DSTRD 0
    cap = 0x7FF | 1 << 16 | 0xF << 24 | 1 << 37 | 1 << 43 | 4 << 52
    c = Cap.decode(cap)
    assert (c.max_entries, c.cqr, c.timeout_ms, c.dstrd, c.css_nvm, c.mpsmin, c.mpsmax, c.cmbs) == \
        (2048, True, 7500, 0, True, 4096, 65536, False)
    assert (c.sq_doorbell(0), c.cq_doorbell(0), c.sq_doorbell(1), c.cq_doorbell(1)) == (0x1000, 0x1004, 0x1008, 0x100C)
    wide = Cap.decode(cap | 2 << 32)          # DSTRD 2: 16-byte doorbell stride
    assert (wide.sq_doorbell(1), wide.cq_doorbell(1)) == (0x1020, 0x1030)


def test_cmb_registers_decode_as_qemu_sets_them():
    # QEMU 11.1 after CMBMSC.CRE (nvme_cmb_enable_regs): CMBLOC BIR 2, OFST 0, CDPCILS and CDPMLS;
    # CMBSZ SQS 1, CQS 0, LISTS 1, RDS 1, WDS 1, SZU 2 (1 MiB units), SZ = cmb_size_mb
    cmbloc = 2 | 1 << 8 | 1 << 9
    cmbsz = 1 | 1 << 2 | 1 << 3 | 1 << 4 | 2 << 8 | 4 << 12
    c = CmbInfo.decode(cmbloc, cmbsz)
    assert (c.bir, c.offset, c.size, c.sqs, c.cqs, c.lists, c.rds, c.wds) == (2, 0, 4 << 20, True, False, True,
                                                                              True, True)
    assert CmbInfo.decode(0, 0).size == 0          # before CRE: both registers read 0
    assert CmbInfo.decode(2 | 3 << 12, 0 << 8 | 16 << 12).offset == 3 * 4096   # SZU 0: 4 KiB units


def test_identify_decoding():
    ctrl = bytearray(4096)
    ctrl[4:24] = b"vfio-cxl-nvme0".ljust(20)
    ctrl[24:64] = b"QEMU NVMe Ctrl".ljust(40)
    ctrl[77] = 7
    ctrl[536:540] = (1).to_bytes(4, "little")
    info = ControllerInfo.decode(bytes(ctrl), 4096)
    assert (info.serial, info.model, info.mdts, info.sgl_supported) == ("vfio-cxl-nvme0", "QEMU NVMe Ctrl",
                                                                         512 << 10, True)
    ns = bytearray(4096)
    struct.pack_into("<QQ", ns, 0, 131072, 131072)
    ns[26] = 1                                 # FLBAS: format 1
    ns[132:136] = (12 << 16).to_bytes(4, "little")   # LBAF1: 4 KiB blocks
    n = NamespaceInfo.decode(1, bytes(ns))
    assert (n.block_size, n.size) == (4096, 131072 * 4096)


def test_prp_one_two_and_list():
    page = bytearray(PAGE)
    assert prp.prp(0x10000, 4096, page, LIST_IOVA) == (0x10000, 0)
    assert prp.prp(0x10200, 3584, page, LIST_IOVA) == (0x10200, 0)          # ends at the page end
    assert prp.prp(0x10200, 4096, page, LIST_IOVA) == (0x10200, 0x11000)    # spills into a 2nd page
    assert prp.prp(0x10000, 8192, page, LIST_IOVA) == (0x10000, 0x11000)
    assert prp.prp(0x10000, 16384, page, LIST_IOVA) == (0x10000, LIST_IOVA)
    assert struct.unpack_from("<4Q", page) == (0x11000, 0x12000, 0x13000, 0)
    prp.prp(0x10000, 512 << 10, page, LIST_IOVA)                            # MDTS: 127 list entries
    assert struct.unpack_from("<Q", page, 126 * 8)[0] == 0x10000 + 127 * PAGE


def test_prp_rules_name_the_fix():
    page = bytearray(PAGE)
    with pytest.raises(NvmeError, match="not dword aligned.*4-byte aligned"):
        prp.prp(0x10002, 512, page, LIST_IOVA)
    with pytest.raises(NvmeError, match="more than one page holds"):
        prp.prp(0x10000, prp.MAX_PRP_BYTES + 2 * PAGE, page, LIST_IOVA)
    with pytest.raises(NvmeError, match="at least one block"):
        prp.prp(0x10000, 0, page, LIST_IOVA)


def test_sgl_single_block_and_segment_list():
    page = bytearray(PAGE)
    one = prp.sgl([(0x10_0000_0000, 1 << 20)], page, LIST_IOVA)
    assert prp.sgl_descriptor(one) == (0x10_0000_0000, 1 << 20, 0x00)        # one Data Block
    many = prp.sgl([(0x1000, 512), (0x9000, 3584)], page, LIST_IOVA)
    assert prp.sgl_descriptor(many) == (LIST_IOVA, 32, 0x30)                  # Last Segment, 2 descriptors
    assert struct.unpack_from("<QI3xB", page, 0) == (0x1000, 512, 0)
    assert struct.unpack_from("<QI3xB", page, 16) == (0x9000, 3584, 0)
    with pytest.raises(NvmeError, match="length > 0"):
        prp.sgl([(0x1000, 0)], page, LIST_IOVA)


def test_tracker_gives_each_request_its_own_page_and_catches_stale_cids():
    pages = bytearray(4 * PAGE)
    t = RequestTracker(4, pages, 0x40000)
    reqs = [t.alloc(f"r{i}") for i in range(4)]
    assert sorted(r.page_iova for r in reqs) == [0x40000 + i * PAGE for i in range(4)]
    assert len({r.cid for r in reqs}) == 4 and t.free == 0
    reqs[0].page[:4] = b"mine"
    assert pages[reqs[0].slot * PAGE:reqs[0].slot * PAGE + 4] == b"mine"    # the page is the tracker's memory
    with pytest.raises(NvmeError, match="all 4 request slots are in flight"):
        t.alloc()
    done = t.complete(Completion(0, 0, 1, reqs[1].cid, 1, 0, False))
    assert done is reqs[1] and done.completion.cid == reqs[1].cid and t.outstanding == 3
    stale_cid = reqs[1].cid
    again = t.alloc("next")                    # the same slot, a new generation
    assert again.slot == reqs[1].slot and again.cid != stale_cid and again.cid & ((1 << SLOT_BITS) - 1) == again.slot
    with pytest.raises(NvmeError, match="no command outstanding"):
        t.complete(Completion(0, 0, 1, stale_cid, 1, 0, False))
    assert len(t.drain()) == 4 and t.free == 4 and t.outstanding == 0


def test_tracker_rejects_memory_that_does_not_fit():
    with pytest.raises(NvmeError, match="page-aligned IOVA"):
        RequestTracker(2, bytearray(PAGE), 0x1000)
    with pytest.raises(NvmeError, match="page-aligned"):
        RequestTracker(1, bytearray(PAGE), 0x1200)


def _cqe(cid: int, sqhd: int, phase: int, status: int = 0) -> bytes:
    return struct.pack("<IIHHHH", 0, 0, sqhd, 1, cid, status << 1 | phase)


def logged_queue(entries: int):
    """A queue pair in plain memory whose doorbell writes land in ``rung`` as ("sq"|"cq", value)."""
    rung = []
    sq, cq = bytearray(entries * 64), bytearray(entries * 16)
    q = QueuePair(1, entries, sq, 0x1000, cq, 0x2000, lambda v: rung.append(("sq", v)),
                  lambda v: rung.append(("cq", v)), None)
    return q, cq, rung


def test_queue_pair_batches_doorbells_and_follows_the_phase_across_a_wrap():
    q, cq, rung = logged_queue(4)
    for cid in range(3):
        q.push(pack_sqe(IoOp.READ, cid, 1))
    with pytest.raises(NvmeError, match="SQ 1 is full"):
        q.push(pack_sqe(IoOp.READ, 9, 1))
    assert q.ring() and not q.ring() and rung == [("sq", 3)]        # one doorbell for the batch
    for i in range(3):                                                # the controller completes them
        cq[i * 16:(i + 1) * 16] = _cqe(i, i + 1, 1)
    assert [c.cid for c in q.reap()] == [0, 1, 2] and rung[-1] == ("cq", 3) and q.space == 3
    assert q.reap() == [] and len(rung) == 2                           # nothing new: no doorbell
    q.push(pack_sqe(IoOp.READ, 3, 1))
    q.push(pack_sqe(IoOp.READ, 4, 1))
    q.ring()
    cq[48:64] = _cqe(3, 0, 1)
    cq[0:16] = _cqe(4, 1, 0)                                          # after the wrap: phase 0
    assert [c.cid for c in q.reap()] == [3, 4] and q.phase == 0 and rung[-1] == ("cq", 1)


def test_queue_pair_defers_the_cq_head_doorbell_until_half_the_cq_is_consumed():
    """A CQ head doorbell is an MMIO exit that waits for QEMU's lock while the controller moves
    data: reap rings it once entries // 2 are consumed, flush() for the rest (the driver flushes
    when the queue is idle); the controller keeps room to post either way."""
    q, cq, rung = logged_queue(8)
    for cid in range(6):
        q.push(pack_sqe(IoOp.READ, cid, 1))
    q.ring()
    cq[0:16] = _cqe(0, 1, 1)
    assert [c.cid for c in q.reap()] == [0] and rung == [("sq", 6)]      # 1 of 8 consumed: not yet
    cq[16:48] = _cqe(1, 2, 1) + _cqe(2, 3, 1)
    assert [c.cid for c in q.reap()] == [1, 2] and rung[-1] == ("sq", 6)  # 3 of 8
    cq[48:64] = _cqe(3, 4, 1)
    assert [c.cid for c in q.reap()] == [3] and rung[-1] == ("cq", 4)    # 4 = half: rung
    cq[64:80] = _cqe(4, 5, 1)
    q.reap()
    assert q.flush() and rung[-1] == ("cq", 5) and not q.flush() and q.doorbells == 3


def test_iova_window_first_fit_and_merge():
    w = IovaWindow(0x100000, 0x10000)
    a, b, c = w.alloc(0x4000), w.alloc(0x1), w.alloc(0x4000)
    assert (a, b, c) == (0x100000, 0x104000, 0x105000)
    w.free(b, 0x1000)
    assert w.alloc(0x1000) == b
    w.free(a, 0x4000)
    w.free(b, 0x1000)
    assert w.alloc(0x5000) == a                                       # merged with its neighbour
    with pytest.raises(NvmeError, match="freed twice"):
        w.free(c, 0x4000)
        w.free(c, 0x4000)
    with pytest.raises(NvmeError, match="no 0x20000 bytes"):
        w.alloc(0x20000)


class FakeRegisters:
    """BAR0 of a controller for the driver's failure logic: CC.EN = 0 clears CSTS.RDY at once;
    ``csts`` is what CSTS reads otherwise (the real controller: tests/vm/test_storage.py)."""

    def __init__(self, csts: int):
        self.csts, self.cc, self.writes = csts, 1, []

    def read32(self, offset: int) -> int:
        return {0x14: self.cc, 0x1C: self.csts}.get(offset, 0)

    def write32(self, offset: int, value: int) -> None:
        self.writes.append((offset, value))
        if offset == 0x14:
            self.cc = value
            if not value & 1 and self.csts != 0xFFFFFFFF:
                self.csts &= ~1


class FakeRequestChannel:
    def __init__(self, fired: bool):
        self.fired = fired

    def pending(self, vector: int) -> int:
        fired, self.fired = self.fired, False
        return int(fired)


def controller_with_batch(csts: int, release: bool = False):
    from vfio_cxl.guest.drivers.nvme import NvmeController

    nvme = NvmeController.__new__(NvmeController)
    nvme.bdf, nvme.failed, nvme.vectors, nvme.cap = "0000:05:00.0", None, None, Cap.decode(0x7FF | 0xF << 24)
    nvme.bar0, nvme.request = FakeRegisters(csts), FakeRequestChannel(release)
    tracker = RequestTracker(4, bytearray(4 * PAGE), 0x10000)
    queue = QueuePair(1, 8, bytearray(8 * 64), 0x1000, bytearray(8 * 16), 0x2000, lambda v: None, lambda v: None,
                      tracker)
    nvme.queues = {1: queue}
    reqs = [tracker.alloc(f"read {i}", IoOp.READ) for i in range(3)]
    return nvme, queue, reqs


def test_controller_fatal_status_fails_every_outstanding_request_at_once():
    from vfio_cxl.guest.drivers.nvme import NvmeFatalError

    nvme, queue, reqs = controller_with_batch(csts=0x1 | 0x2)          # RDY and CFS
    with pytest.raises(NvmeFatalError, match=r"Controller Fatal Status \(CSTS.CFS\)") as err:
        nvme.wait(queue, reqs[:1], timeout=5)
    assert "reset the controller" in err.value.fix
    assert all("CSTS.CFS" in r.extra["error"] for r in reqs) and queue.tracker.outstanding == 0
    with pytest.raises(NvmeFatalError, match="CSTS.CFS"):           # and nothing new is taken
        nvme.submit_rw(queue, IoOp.READ, 1, 0, 4096, 0x3000)


def test_release_request_tears_the_queues_down_and_names_the_removal():
    from vfio_cxl.guest.drivers.nvme import NvmeRemovedError

    nvme, queue, reqs = controller_with_batch(csts=0x1, release=True)
    with pytest.raises(NvmeRemovedError, match="being removed from this VM") as err:
        nvme.wait(queue, reqs, timeout=5)
    assert "close the controller" in err.value.fix
    assert (0x14, 0) in nvme.bar0.writes                                # CC.EN = 0: its DMA stopped
    assert nvme.queues == {} and all("torn down" in r.extra["error"] for r in reqs)


def test_release_request_on_a_controller_already_gone_does_not_touch_it():
    from vfio_cxl.guest.drivers.nvme import NvmeRemovedError

    nvme, queue, reqs = controller_with_batch(csts=0xFFFFFFFF, release=True)
    with pytest.raises(NvmeRemovedError):
        nvme.wait(queue, reqs, timeout=5)
    assert nvme.bar0.writes == []


class FakeVectors:
    """MSI-X eventfds of a controller whose ``complete`` posts the next CQE when the driver
    sleeps: the driver must reap it without reading a register."""

    def __init__(self, complete):
        self.complete, self.sleeps = complete, 0

    def wait(self, vector: int, timeout: float) -> int:
        self.sleeps += 1
        self.complete()
        return 1


def test_wait_with_msix_reads_no_register_and_rings_the_cq_head_once_idle():
    """Each register access stalls the vCPU for QEMU's global lock under TCG while the controller
    moves data: with MSI-X the wait reads no register while completions come (CSTS only after a
    quiet 0.2 s), and the CQ head doorbell is rung once, when the batch is in."""
    nvme, queue, reqs = controller_with_batch(csts=0x1)
    rung, reads = [], []
    queue._cq_doorbell = rung.append
    nvme.request, queue.vector = None, 1
    nvme.bar0.read32 = lambda offset: reads.append(offset) or 0x1
    posted = iter(range(3))

    def complete():
        i = next(posted)
        queue.cq[i * 16:(i + 1) * 16] = _cqe(reqs[i].cid, i + 1, 1)

    nvme.vectors = FakeVectors(complete)
    nvme.wait(queue, reqs, timeout=5)
    assert all(r.completion is not None for r in reqs) and nvme.vectors.sleeps == 3
    assert reads == [] and rung == [3]
