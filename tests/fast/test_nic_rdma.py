"""RDMA-shaped writes, their own logic: the wire header, keys and their generations, bounds,
the offset -> descriptor plan, the frame check, the seeded pattern; and the responder over a
stand-in NIC whose "device" lands each wire frame in the next posted descriptor (header into
the header buffer, payload at ``pkt_addr``): a write placed byte for byte with no payload
byte copied by the CPU, a bad frame ending the write with nothing outside the region
written, stale / freed / unknown keys and out-of-range writes refused with a NAK.  The real
path, QEMU's igbs between two guests, is tests/vm/test_nic.py's."""

import time
from types import SimpleNamespace

import pytest

from vfio_cxl.guest.drivers.igb import spec
from vfio_cxl.guest.drivers.igb.errors import IgbError
from vfio_cxl.guest.drivers.igb.ring import RxRing
from vfio_cxl.guest.nic import rdma
from vfio_cxl.guest.nic.rdma import (Access, Header, KeyTable, MemoryRegion, Op, RdmaEndpoint, RdmaError, Status,
                                     check_range, frame_problem, pattern, plan_frames, unpack_header)

VRAM = 1 << 20
ENTRIES = 16
PEER = bytes.fromhex("525400000001")
OWN = bytes.fromhex("525400000002")


# -- the wire header -------------------------------------------------------------------------------

def test_a_header_packs_into_64_bytes_and_back():
    h = Header(Op.DATA, key=0x1203, write_id=7, seq=9, offset=0x12345678_9A, length=1024, imm=0xFEEDBEEF)
    wire = h.pack(PEER, OWN)
    assert len(wire) == rdma.HEADER == 64
    assert wire[:6] == PEER and wire[6:12] == OWN and wire[12:14] == b"\x88\xb5"
    assert unpack_header(wire) == h and unpack_header(wire + b"payload") == h
    assert unpack_header(Header(Op.NAK, status=Status.STALE_KEY).pack(PEER, OWN)).status is Status.STALE_KEY


def test_other_frames_are_not_headers():
    wire = Header(Op.DATA).pack(PEER, OWN)
    assert unpack_header(wire[:63]) is None                              # too short
    assert unpack_header(wire[:12] + b"\x08\x00" + wire[14:]) is None    # IPv4, not ours
    assert unpack_header(wire[:14] + b"\x63" + wire[15:]) is None        # no such op


# -- keys ----------------------------------------------------------------------------------------

def region(table: KeyTable, length: int = 64 << 10, access=Access.REMOTE_WRITE) -> MemoryRegion:
    r = MemoryRegion(table.allocate(), None, 0, length, access, 0)
    table.insert(r)
    return r


def test_a_slot_registered_again_has_a_new_generation_and_the_old_key_is_stale():
    table = KeyTable()
    first = region(table)
    assert first.key == 1 << 8 | 0 and table.check(first.key) is Status.OK
    table.remove(first)
    assert table.check(first.key) is Status.FREED
    second = region(table)
    assert second.slot == first.slot and second.key == 2 << 8 | 0
    assert table.check(first.key) is Status.STALE_KEY and table.check(second.key) is Status.OK
    with pytest.raises(RdmaError, match="earlier registration"):
        table.lookup(first.key)


@pytest.mark.parametrize("key", [0, 3 << 8 | 0, 1 << 8 | 5, 1 << 8 | 200, -1, True, "1"])
def test_keys_never_handed_out_are_unknown(key):
    table = KeyTable()
    region(table)
    assert table.check(key) is Status.UNKNOWN_KEY
    with pytest.raises(RdmaError, match="names no registration"):
        table.lookup(key)


def test_slots_run_out_with_a_clear_error():
    table = KeyTable(slots=2)
    region(table), region(table)
    with pytest.raises(RdmaError, match="all 2 registration slots are in use"):
        table.allocate()


@pytest.mark.parametrize("offset,length,ok", [(0, 1, True), (0, 4096, True), (4095, 1, True),
                                              (4096, 1, False), (4000, 97, False), (0, 0, False), (-1, 2, False)])
def test_a_range_must_lie_inside_the_region(offset, length, ok):
    r = MemoryRegion(1 << 8, None, 0, 4096, Access.REMOTE_WRITE, 0)
    assert (check_range(r, offset, length) is Status.OK) == ok


# -- planning ------------------------------------------------------------------------------------

def test_frames_are_mtu_sized_and_each_payload_has_its_own_offset():
    plan = plan_frames(0x1000, 2 * rdma.MTU + 100)
    assert [(f.seq, f.offset, f.size) for f in plan] == [(0, 0x1000, 1024), (1, 0x1400, 1024), (2, 0x1800, 100)]
    assert len(plan_frames(0, 16 << 20)) == 16 << 10 and plan_frames(5, 1)[0].size == 1
    with pytest.raises(RdmaError, match="at least one byte"):
        plan_frames(0, 0)


def test_a_frame_is_checked_against_its_place_in_the_write():
    plan = plan_frames(0, 3000)[1]
    good = Header(Op.DATA, 0x100, 4, 1, 1024, 1024)
    assert frame_problem(good, plan, 0x100, 4, 1024) is None
    assert "expected key" in frame_problem(Header(Op.DATA, 0x200, 4, 1, 1024, 1024), plan, 0x100, 4, 1024)
    assert "expected frame 1" in frame_problem(Header(Op.DATA, 0x100, 4, 2, 2048, 952), plan, 0x100, 4, 1024)
    assert "landed" in frame_problem(good, plan, 0x100, 4, 512)
    assert "not a data frame" in frame_problem(None, plan, 0x100, 4, 1024)


def test_the_pattern_is_the_same_bytes_whatever_range_is_asked():
    whole = pattern(3, 0, 3 * rdma.PATTERN_BLOCK)
    assert len(whole) == 3 * rdma.PATTERN_BLOCK and pattern(3, 5000, 3000) == whole[5000:8000]
    assert pattern(4, 0, 64) != whole[:64]


# -- the responder over a stand-in NIC -----------------------------------------------------------

class StandInNic:
    """The driver operations RdmaEndpoint uses.  ``wire`` holds frames the peer sent to the
    data queue; ``wait_rx`` plays the device: each lands in the next posted descriptor."""

    def __init__(self):
        self.mac, self.entries, self.queue_count = OWN, ENTRIES, 2
        self.rx = {q: SimpleNamespace(ring=RxRing(memoryview(bytearray(ENTRIES * 16)), ENTRIES, f"rx {q}"))
                   for q in range(2)}
        self.buffers: dict[int, object] = {}
        self.device = SimpleNamespace(map_dma=self._map)
        self.control_in: list[bytes] = []
        self.sent: list[bytes] = []
        self.wire: list[bytes] = []
        self.gathered: list[tuple[bytes, int, int]] = []
        self.regions: dict[int, tuple[object, int, int]] = {}   # iova -> (gpu, vram offset, length)
        self.dropped = 0   # frames the device had no room for (RXO)

    def _map(self, buffer, iova):
        self.buffers[iova] = buffer
        return SimpleNamespace(iova=iova, close=lambda: self.buffers.pop(iova))

    def steer(self, mac, queue):
        self.steered = (mac, queue)

    def rx_queue(self, queue):
        if queue not in self.rx:
            raise IgbError(f"RX queue {queue}", "open it")
        return self.rx[queue]

    def configure_external_rx(self, queue, packet_buffer, header_buffer):
        assert (packet_buffer, header_buffer) == (rdma.MTU, rdma.HEADER)

    def post_rx(self, queue, buffers):
        ring = self.rx[queue].ring
        for pkt, hdr, cookie in buffers:
            ring.post(spec.pack_rx(pkt, hdr), cookie)
        return len(buffers)

    def reap_rx(self, queue, frames=None):
        return self.rx[queue].ring.reap(frames)

    def take_back_rx(self, queue, *, enable=False):
        return self.rx[queue].ring.reset()

    def rx_ring_state(self, queue):
        ring = self.rx[queue].ring
        return {"head": ring.clean, "tail": ring.tail, "driver_clean": ring.clean, "driver_tail": ring.tail,
                "posted": ring.posted, "oldest_done": False}

    def stats(self):
        return {"gprc": 0, "gptc": len(self.sent), "mpc": 0, "rnbc": 0, "rx_overrun_events": self.dropped}

    def send(self, frames, queue=0):
        self.sent += frames
        return len(frames)

    def send_gather(self, frames, queue=0):
        self.gathered += frames
        return len(frames)

    def recv(self, queue, count, timeout):
        assert queue == 0
        got, self.control_in = self.control_in[:count], self.control_in[count:]
        return got

    def wait_rx(self, queue, deadline):
        ring, landed = self.rx[queue].ring, False
        for i in range(ring.posted):
            slot = (ring.clean + i) % ring.entries
            if spec.rx_done(ring.desc(slot)) or not self.wire or unpack_header(self.wire[0]).seq >= self.granted:
                continue                   # the peer sends only what it was granted
            if len(self.wire[0]) > (ring.posted - i) * rdma.MTU:
                # QEMU's igb (igb_has_rxbufs): a frame is taken only if the free descriptors'
                # packet buffers could hold all of it, its split-off header included; else dropped
                self.wire.pop(0)
                self.dropped += 1
                continue
            frame = self.wire.pop(0)
            pkt, hdr = spec._RX_READ.unpack_from(ring.desc(slot))
            self._dma(hdr, frame[:rdma.HEADER])
            self._dma(pkt, frame[rdma.HEADER:])
            ring.desc(slot)[:] = spec.pack_rx_writeback(spec.RxCompletion(
                len(frame) - rdma.HEADER, rdma.HEADER, False, False, True, False, 0, 0))
            landed = True
        return landed

    @property
    def granted(self) -> int:
        return max([h.seq for h in map(unpack_header, self.sent) if h.op is Op.GRANT], default=0)

    def _dma(self, iova, data):
        """A DMA write through the stand-in IOMMU: only mapped IOVAs reach memory."""
        if iova >= rdma.MR_IOVA:
            gpu, off, length = self.regions[iova - (iova - rdma.MR_IOVA) % rdma.MR_WINDOW]
            at = (iova - rdma.MR_IOVA) % rdma.MR_WINDOW
            assert at + len(data) <= length, "a DMA beyond a registered region"
            gpu.memory[off + at:off + at + len(data)] = data
        else:
            base = max(b for b in self.buffers if b <= iova)
            self.buffers[base][iova - base:iova - base + len(data)] = data


@pytest.fixture
def responder(monkeypatch):
    nic = StandInNic()
    gpu = SimpleNamespace(vram_size=VRAM, memory=bytearray(VRAM))

    def map_peer_bar(initiator, peer, iova, size, offset, notes=None):
        nic.regions[iova] = (peer, offset, size)
        return SimpleNamespace(iova=iova, close=lambda: nic.regions.pop(iova))

    monkeypatch.setattr(rdma, "map_peer_bar", map_peer_bar)
    ep = RdmaEndpoint(nic, first_write_id=1)
    return ep, nic, gpu


def request(key, offset, length, write_id=1, imm=0x77):
    return Header(Op.REQUEST, key, write_id, 0, offset, length, imm).pack(OWN, PEER)


def data_frames(key, offset, source: bytes, write_id=1):
    return [Header(Op.DATA, key, write_id, f.seq, f.offset, f.size).pack(rdma.DATA_MAC, PEER)
            + source[f.offset - offset:f.offset - offset + f.size] for f in plan_frames(offset, len(source))]


def answers(nic, op):
    return [h for h in map(unpack_header, nic.sent) if h.op is op]


def test_a_write_lands_in_place_with_no_payload_byte_copied(responder):
    ep, nic, gpu = responder
    mr = ep.reg_mr(gpu, 0x10000, 0x20000, Access.REMOTE_WRITE)
    source = pattern(1, 0, 40 * rdma.MTU + 17)            # more frames than the ring holds: grants in turn
    nic.control_in.append(request(mr.key, 0x100, len(source)))
    nic.wire += data_frames(mr.key, 0x100, source)
    done = ep.serve(timeout=1)
    assert done.status is Status.OK and done.error is None and done.frames == 41 and done.imm == 0x77
    assert bytes(gpu.memory[0x10100:0x10100 + len(source)]) == source
    assert not any(gpu.memory[:0x10100]) and not any(gpu.memory[0x10100 + len(source):])
    assert ep.counts["payload_bytes_copied"] == 0 and ep.counts["header_bytes_copied"] == 41 * rdma.HEADER
    grants = answers(nic, Op.GRANT)
    assert all(g.offset.to_bytes(6, "big") == rdma.DATA_MAC for g in grants)
    # the ring holds ENTRIES - 1; a frame is granted once a descriptor follows its own (QEMU's
    # buffer check), the last one once the guard follows it
    assert grants[0].seq == ENTRIES - 2 and grants[-1].seq == 41 and all(g.write_id == 1 for g in grants)
    # each grant acknowledges the frames placed when it was sent: none yet, then more each time
    assert grants[0].length == 0 and [g.length for g in grants] == sorted(g.length for g in grants)
    assert all(g.length < g.seq for g in grants) and grants[-1].length > 0
    assert nic.dropped == 0
    (fin,) = answers(nic, Op.DONE)
    assert (fin.imm, fin.seq, fin.length) == (0x77, 41, len(source))


def test_a_lost_interrupt_costs_a_watchdog_period_not_the_write(responder, monkeypatch):
    """The device lands frames but no interrupt comes (each wait lasts until its deadline): the
    responder looks at its ring again every RX_WATCHDOG and the write completes."""
    ep, nic, gpu = responder
    monkeypatch.setattr(rdma, "RX_WATCHDOG", 0.05)
    land = nic.wait_rx

    def no_interrupt(queue, deadline):
        land(queue, deadline)
        time.sleep(max(0.0, deadline - time.monotonic()))   # the stand-in's wait: nothing wakes it
        return False

    nic.wait_rx = no_interrupt
    mr = ep.reg_mr(gpu, 0, 0x20000, Access.REMOTE_WRITE)
    source = pattern(2, 0, 40 * rdma.MTU)
    nic.control_in.append(request(mr.key, 0, len(source)))
    nic.wire += data_frames(mr.key, 0, source)
    t0 = time.monotonic()
    done = ep.serve(timeout=30)
    assert done.status is Status.OK and bytes(gpu.memory[:len(source)]) == source
    assert time.monotonic() - t0 < 5, "the responder waited out its timeout for an interrupt"


def test_a_bad_frame_ends_the_write_and_nothing_lands_outside_the_region(responder):
    ep, nic, gpu = responder
    mr = ep.reg_mr(gpu, 0x10000, 0x4000, Access.REMOTE_WRITE)
    frames = data_frames(mr.key, 0, pattern(2, 0, 4 * rdma.MTU))
    frames[2] = Header(Op.DATA, mr.key, 1, 2, 0x3C00, 1024).pack(rdma.DATA_MAC, PEER) + b"x" * 1024
    nic.control_in.append(request(mr.key, 0, 4 * rdma.MTU))
    nic.wire += frames
    done = ep.serve(timeout=1)
    assert done.status is Status.BAD_FRAME and "frame 2 at offset 0x3c00" in done.error and "expected frame 2 at 0x800" in done.error
    # the refused frame's payload landed where frame 2 was posted: inside the write, inside the region
    assert bytes(gpu.memory[0x10800:0x10C00]) == b"x" * 1024
    assert not any(gpu.memory[:0x10000]) and not any(gpu.memory[0x14000:])
    (nak,) = answers(nic, Op.NAK)
    assert nak.status is Status.BAD_FRAME and nic.rx[1].ring.posted == 0      # nothing left posted


def test_a_write_whose_frames_stop_coming_times_out_and_takes_its_descriptors_back(responder):
    ep, nic, gpu = responder
    mr = ep.reg_mr(gpu, 0, 0x4000, Access.REMOTE_WRITE)
    nic.control_in.append(request(mr.key, 0, 4 * rdma.MTU))
    nic.wire += data_frames(mr.key, 0, pattern(3, 0, 4 * rdma.MTU))[:2]
    t0 = time.monotonic()
    done = ep.serve(timeout=0.05)
    assert time.monotonic() - t0 < 5                   # bounded: the silence timeout, not a hang
    assert done.status is Status.TIMEOUT and "2 of 4 frames came" in done.error and done.frames == 2
    # the error names the writer and the offset its frames reached
    assert "from 52:54:00:00:00:01" in done.error and "[0x0, 0x800) placed" in done.error, done.error
    # and what its NIC saw: the data queue's ring, its counters
    assert "this NIC: data queue 1" in done.error and " posted, oldest written back False" in done.error and "gprc 0" in done.error
    assert answers(nic, Op.NAK)[0].status is Status.TIMEOUT and nic.rx[1].ring.posted == 0


def test_the_nic_report_of_a_nic_that_cannot_be_read_says_so(responder):
    """The report goes into a timeout's error: a NIC whose registers fail to read is named as
    such, and the error stays the timeout's."""
    ep, nic, gpu = responder
    mr = ep.reg_mr(gpu, 0, 0x4000, Access.REMOTE_WRITE)
    nic.control_in.append(request(mr.key, 0, 4 * rdma.MTU))

    def unreadable():
        raise OSError(5, "Input/output error")
    nic.stats = unreadable
    done = ep.serve(timeout=0.05)
    assert done.status is Status.TIMEOUT and "0 of 4 frames came" in done.error, done.error
    assert "the writer is gone (this NIC could not be read: [Errno 5] Input/output error)" in done.error


@pytest.mark.parametrize("case,status", [("stale", Status.STALE_KEY), ("freed", Status.FREED),
                                         ("unknown", Status.UNKNOWN_KEY), ("beyond", Status.OUT_OF_RANGE),
                                         ("no-access", Status.ACCESS)])
def test_refused_writes_are_nakked_and_post_nothing(responder, case, status):
    ep, nic, gpu = responder
    mr = ep.reg_mr(gpu, 0, 0x4000, Access.LOCAL_WRITE if case == "no-access" else Access.REMOTE_WRITE)
    key, offset = mr.key, 0
    if case in ("stale", "freed"):
        ep.dereg_mr(mr)
        if case == "stale":
            assert ep.reg_mr(gpu, 0, 0x4000, Access.REMOTE_WRITE).slot == mr.slot
    key = 0x7F00 if case == "unknown" else key
    offset = 0x3F00 if case == "beyond" else offset
    nic.control_in.append(request(key, offset, 0x200))
    done = ep.serve(timeout=1)
    assert done.status is status and done.frames == 0 and done.error
    (nak,) = answers(nic, Op.NAK)
    assert nak.status is status and nic.rx[1].ring.posted == 0 and not any(gpu.memory)


def test_registration_maps_a_window_per_slot_and_dereg_unmaps_it(responder):
    ep, nic, gpu = responder
    a = ep.reg_mr(gpu, 0, 0x2000)
    b = ep.reg_mr(gpu, 0x1000, 0x1000, Access.REMOTE_WRITE)      # overlapping ranges are two regions
    assert (a.iova, b.iova) == (rdma.MR_IOVA, rdma.MR_IOVA + rdma.MR_WINDOW)
    ep.dereg_mr(a)
    assert set(nic.regions) == {b.iova}
    with pytest.raises(RdmaError, match="was freed"):
        ep.dereg_mr(a)
    ep.close()
    assert nic.regions == {} and rdma.HEADER_IOVA not in nic.buffers


@pytest.mark.parametrize("offset,length,access,match", [
    (0x800, 0x1000, 0, "whole pages"), (0, 0x1800, 0, "whole pages"), (0, 0, 0, "whole pages"),
    (VRAM - 0x1000, 0x2000, 0, "outside the GPU"), (0, 0x1000, 4, "access 4"), (0, 0x1000, "rw", "access")])
def test_bad_registrations_are_refused_and_map_nothing(responder, offset, length, access, match):
    ep, nic, gpu = responder
    with pytest.raises(RdmaError, match=match):
        ep.reg_mr(gpu, offset, length, access)
    assert nic.regions == {}


def test_a_write_from_outside_the_local_region_is_refused_before_anything_is_sent(responder):
    ep, nic, gpu = responder
    mr = ep.reg_mr(gpu, 0, 0x1000)
    with pytest.raises(RdmaError, match="from inside the local region"):
        ep.write(mr, 0x800, 0x1000, 0x100, 0, to=PEER)
    ep.dereg_mr(mr)
    with pytest.raises(RdmaError, match="was freed"):
        ep.write(mr, 0, 0x100, 0x100, 0, to=PEER)
    assert nic.sent == []


def test_a_refusal_reaches_the_writer_as_an_error_naming_it(responder):
    ep, nic, gpu = responder
    mr = ep.reg_mr(gpu, 0, 0x1000)
    nic.control_in.append(Header(Op.NAK, 0x200, 1, status=Status.STALE_KEY).pack(OWN, PEER))
    with pytest.raises(RdmaError, match="refused write 1.*earlier registration"):
        ep.write(mr, 0, 0x100, 0x200, 0, to=PEER, timeout=1)
    assert unpack_header(nic.sent[0]).op is Op.REQUEST


def test_placement_and_queue_are_checked(responder):
    _, nic, _ = responder
    with pytest.raises(RdmaError, match="placement 'dma'"):
        RdmaEndpoint(nic, placement="dma")
    with pytest.raises(RdmaError, match="queue 0, the control queue"):
        RdmaEndpoint(nic, queue=0)


# -- the commands' usage errors (before any device is opened) --------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["nic", "rdma-recv", "--writes", "0"], "positive count"),
    (["nic", "rdma-recv", "--writes", "2", "--free-after", "3"], "after 1 to --writes"),
    (["nic", "rdma-recv", "--path", "tcp", "--free-after", "1"], "no registrations"),
    (["nic", "rdma-recv", "--reregister"], "without --free-after"),
    (["nic", "rdma-write", "--key", "0x100"], "without --to and --key"),
    (["nic", "rdma-write", "--to", "02:00:00:00:01:01", "--key", "1", "--sizes", "4K,x"], "sizes like 4K"),
    (["nic", "rdma-write", "--to", "02:00:00:00:01:01", "--key", "1", "--sizes", "0"], "sizes like 4K"),
])
def test_rdma_usage_errors(argv, words, capsys):
    from vfio_cxl.guest.cmd import cli
    assert cli.main(argv) == 1
    assert words in capsys.readouterr().err


def test_the_writer_sends_what_is_granted_straight_from_its_region_and_returns_the_immediate(responder):
    ep, nic, gpu = responder
    mr = ep.reg_mr(gpu, 0x4000, 0x4000)
    data_mac = int.from_bytes(rdma.DATA_MAC, "big")
    nic.control_in += [Header(Op.GRANT, 0x300, 1, 2, data_mac).pack(OWN, PEER),
                       Header(Op.GRANT, 0x300, 99, 3, data_mac).pack(OWN, PEER),      # another write's: ignored
                       Header(Op.GRANT, 0x300, 1, 3, data_mac).pack(OWN, PEER),
                       Header(Op.DONE, 0x300, 1, 3, imm=9).pack(OWN, PEER)]
    result = ep.write(mr, 0x100, 2 * rdma.MTU + 10, 0x300, 0x100, to=PEER, imm=9, timeout=1)
    assert (result.frames, result.imm, result.length) == (3, 9, 2 * rdma.MTU + 10)
    assert unpack_header(nic.sent[0]) == Header(Op.REQUEST, 0x300, 1, 3, 0x100, 2 * rdma.MTU + 10, 9)
    sent = [(unpack_header(h), iova, n) for h, iova, n in nic.gathered]
    assert [(h.seq, h.offset, h.length, iova - mr.iova, n) for h, iova, n in sent] == [
        (0, 0x100, 1024, 0x100, 1024), (1, 0x500, 1024, 0x500, 1024), (2, 0x900, 10, 0x900, 10)]
    assert all(h.op is Op.DATA and h.key == 0x300 for h, _, _ in sent)
    assert nic.gathered[0][0][:6] == rdma.DATA_MAC and ep.counts["payload_bytes_copied"] == 0


# -- the TCP reference over loopback ------------------------------------------------------------

def test_the_tcp_reference_places_the_bytes_and_refuses_a_range_beyond_the_region():
    import threading
    from vfio_cxl.guest.nic.tcp import TcpRequester, TcpResponder

    def gpu():
        g = SimpleNamespace(memory=bytearray(1 << 16))
        g.vram = SimpleNamespace(read=lambda off, n: bytes(g.memory[off:off + n]),
                                 write=lambda off, data: g.memory.__setitem__(slice(off, off + len(data)), data))
        return g
    src, dst = gpu(), gpu()
    src.memory[:] = pattern(9, 0, 1 << 16)
    responder = TcpResponder(port=0, timeout=10)
    served = []
    thread = threading.Thread(target=lambda: served.extend(responder.serve(dst, 0x8000, 0x4000) for _ in range(2)))
    thread.start()
    requester = TcpRequester("127.0.0.1", responder.port, timeout=10)
    try:
        assert requester.write(src, 0x100, 0x1000, 0x100, imm=3)["imm"] == 3
        with pytest.raises(RdmaError, match="beyond the registered region"):
            requester.write(src, 0, 0x2000, 0x3000)
    finally:
        thread.join(10)
        requester.close()
        responder.close()
    assert bytes(dst.memory[0x8100:0x9100]) == pattern(9, 0x100, 0x1000)
    assert not any(dst.memory[:0x8100]) and not any(dst.memory[0x9100:])
    assert [s["status"] for s in served] == [Status.OK, Status.OUT_OF_RANGE]
    assert requester.payload_bytes_copied == 0x3000 and responder.payload_bytes_copied == 0x1000


def test_no_request_and_no_answer_are_timeouts_naming_what_to_start(responder):
    from vfio_cxl.guest.drivers.igb.errors import IgbTimeout
    ep, nic, gpu = responder
    with pytest.raises(IgbTimeout, match="no write request within 0.01 s.*rdma-write"):
        ep.serve(timeout=0.01)
    mr = ep.reg_mr(gpu, 0, 0x1000)
    nic.control_in.append(Header(Op.GRANT, 0x100, 99, 1).pack(OWN, PEER))     # another write's: not an answer
    with pytest.raises(IgbTimeout, match="write 1 to 52:54:00:00:00:01: no answer.*rdma-recv"):
        ep.write(mr, 0, 0x100, 0x100, 0, to=PEER, timeout=0.01)


def test_a_writer_whose_peer_goes_silent_mid_write_names_it_and_what_it_acknowledged(responder):
    ep, nic, gpu = responder
    mr = ep.reg_mr(gpu, 0, 0x10000)
    data_mac = int.from_bytes(rdma.DATA_MAC, "big")
    nic.control_in += [Header(Op.GRANT, 0x300, 1, 8, data_mac, 0).pack(OWN, PEER),
                       Header(Op.GRANT, 0x300, 1, 16, data_mac, 6).pack(OWN, PEER)]   # then the peer's lab dies
    t0 = time.monotonic()
    with pytest.raises(rdma.PeerLost) as lost:
        ep.write(mr, 0, 32 * rdma.MTU, 0x300, 0x1000, to=PEER, timeout=0.05)
    assert time.monotonic() - t0 < 5
    text = str(lost.value)
    assert "write 1 to 52:54:00:00:00:01: the peer went silent mid-transfer" in text, text
    assert "acknowledged 6 of 32 frames placed (remote offsets [0x1000, 0x2800))" in text, text
    assert "granted 16, 16 sent" in text and "write again from offset 0x2800" in text, text
    # and what its NIC saw, before the fix (the fix stays the last words)
    assert "granted 16, 16 sent: no answer within 0.05 s (this NIC: data queue 1 " in text, text
    assert "gptc 1, " in text and text.endswith("once it serves"), text
    assert isinstance(lost.value, RdmaError) and len(nic.gathered) == 16


def test_the_writer_command_names_a_lost_peer_and_a_released_gpu_by_status():
    from vfio_cxl.guest.cmd.nic_rdma import _failure
    from vfio_cxl.guest.nic.release import GpuReleased
    assert _failure(rdma.PeerLost("gone", "fix")) == "PEER_LOST"
    assert _failure(GpuReleased("gone", "fix")) == "GPU_RELEASED"
    assert _failure(RdmaError("refused", "fix")) == "REFUSED"
