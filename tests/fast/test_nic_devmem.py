"""devmem-shaped receive, its own logic: chunk carving, token bookkeeping, what recv makes of
the descriptors the device wrote back (split, linear, HBO, frames over several chunks, frames
that fit the header buffer), reposting only after dontneed, unbinding, bad input.

The NIC here is a stand-in for the driver's queue operations over a real ``RxRing``; the
device's part (writing headers, payloads and write-backs) is played by ``land``.  The real
path, QEMU's igb writing into the GPU's BAR2, is tests/vm/test_nic.py's."""

import struct
from types import SimpleNamespace

import pytest

from vfio_cxl.guest.drivers.igb import spec
from vfio_cxl.guest.drivers.igb.errors import IgbError
from vfio_cxl.guest.drivers.igb.ring import RxRing
from vfio_cxl.guest.nic import devmem
from vfio_cxl.guest.nic.devmem import ChunkPool, DevmemError, DevmemReceiver, TokenTable

VRAM = 1 << 20
ENTRIES = 8


class FakeMapping:
    def __init__(self, iova: int, size: int):
        self.iova, self.size, self.active = iova, size, True

    def close(self) -> None:
        self.active = False


class StandInNic:
    """The driver operations DevmemReceiver uses, over a real RxRing per queue."""

    def __init__(self, queues: int = 2):
        self.queue_count = queues
        self.rx = {q: SimpleNamespace(ring=RxRing(memoryview(bytearray(ENTRIES * 16)), ENTRIES, f"rx {q}"))
                   for q in range(queues)}
        self.maps: list[FakeMapping] = []
        self.device = SimpleNamespace(map_dma=self._map)
        self.configured: dict[int, tuple[int, int]] = {}

    def _map(self, buffer, iova):
        self.maps.append(FakeMapping(iova, len(buffer)))
        return self.maps[-1]

    def rx_queue(self, queue):
        if queue not in self.rx:
            raise IgbError(f"RX queue {queue}", "open it")
        return self.rx[queue]

    def configure_external_rx(self, queue, packet_buffer, header_buffer):
        self.rx[queue].ring.reset()
        self.configured[queue] = (packet_buffer, header_buffer)

    def post_rx(self, queue, buffers):
        ring = self.rx[queue].ring
        n = 0
        for pkt, hdr, cookie in buffers[:ring.free]:
            ring.post(spec.pack_rx(pkt, hdr), cookie)
            n += 1
        return n

    def reap_rx(self, queue, frames=None):
        return self.rx[queue].ring.reap(frames)

    def wait_rx(self, queue, deadline):
        return False                       # nothing more will come: recv returns what is there

    def take_back_rx(self, queue):
        return self.rx[queue].ring.reset()


@pytest.fixture
def setup(monkeypatch):
    nic = StandInNic()
    gpu = SimpleNamespace(vram_size=VRAM, memory=bytearray(VRAM))
    gpu.vram = SimpleNamespace(view=lambda off, n: memoryview(gpu.memory)[off:off + n])
    vram_maps = []

    def map_peer_bar(initiator, peer, iova, size, offset, notes):
        assert (initiator, peer) == (nic, gpu)
        vram_maps.append(FakeMapping(iova, size))
        return vram_maps[-1]

    monkeypatch.setattr(devmem, "map_peer_bar", map_peer_bar)
    return nic, gpu, DevmemReceiver(nic), vram_maps


def land(nic, gpu, binding, header: bytes, payload: bytes, *, hdr_len=None, sph=True, hbo=False, eop=True):
    """The device: the next posted descriptor of the binding's queue gets ``header`` in its
    header buffer, ``payload`` in its VRAM chunk, and its write-back."""
    ring = nic.rx[binding.queue].ring
    slot = (ring.clean + sum(spec.rx_done(ring.desc(s)) for s in range(ring.entries))) % ring.entries
    pkt, hdr = struct.unpack("<QQ", ring.desc(slot))
    h = hdr - binding.header_mapping.iova
    binding.headers[h:h + len(header)] = header
    v = pkt - devmem.VRAM_IOVA
    gpu.memory[v:v + len(payload)] = payload
    ring.desc(slot)[:] = spec.pack_rx_writeback(spec.RxCompletion(
        len(payload), len(header) if hdr_len is None else hdr_len, sph, hbo, eop, False, 0, 0))


def test_bind_carves_chunks_and_posts_what_the_ring_holds(setup):
    nic, gpu, rx, vram_maps = setup
    b = rx.bind_rx(1, gpu, 0x10000, 16 * 4096, chunk=4096, header_buffer=128)
    assert (b.pool.count, b.iova, nic.configured[1]) == (16, devmem.VRAM_IOVA + 0x10000, (4096, 128))
    assert (vram_maps[0].iova, vram_maps[0].size) == (devmem.VRAM_IOVA + 0x10000, 16 * 4096)
    ring = nic.rx[1].ring
    assert ring.posted == ENTRIES - 1 and len(b.pool.free) == 16 - (ENTRIES - 1)
    pkt, hdr = struct.unpack("<QQ", ring.desc(0))
    assert pkt == devmem.VRAM_IOVA + 0x10000 and hdr == devmem.HEADER_IOVA + devmem.HEADER_WINDOW
    pkt, hdr = struct.unpack("<QQ", ring.desc(3))
    assert pkt == devmem.VRAM_IOVA + 0x10000 + 3 * 4096 and hdr == devmem.HEADER_IOVA + devmem.HEADER_WINDOW + 3 * 128


def test_recv_hands_out_fragments_and_reposts_only_after_dontneed(setup):
    nic, gpu, rx, _ = setup
    b = rx.bind_rx(1, gpu, 0, (ENTRIES - 1) * 4096)
    sent = [(bytes([k]) * 42, bytes([0x80 + k]) * (1000 + k)) for k in range(3)]
    for header, payload in sent:
        land(nic, gpu, b, header, payload)
    got = rx.recv(b, count=5, timeout=0)
    assert [(f.header, rx.read(f.fragments[0])) for f in got] == sent
    assert [f.fragments[0].vram_offset for f in got] == [0, 4096, 8192]
    assert all(f.split and not f.fragments[0].linear for f in got)
    ring = nic.rx[1].ring
    assert ring.posted == ENTRIES - 1 - 3 and len(b.pool.held) == 3    # held chunks are not reposted
    tokens = [f.fragments[0].token for f in got]
    assert rx.dontneed(tokens[:2]) == 2
    assert ring.posted == ENTRIES - 1 - 1
    with pytest.raises(DevmemError, match=f"token {tokens[0]} was already returned"):
        rx.dontneed([tokens[0]])
    with pytest.raises(DevmemError, match="token 99 was never handed out"):
        rx.dontneed([tokens[2], 99])
    assert rx.tokens.outstanding == 1                 # all checked first: the good one stays out
    assert rx.dontneed([tokens[2]]) == 1 and ring.posted == ENTRIES - 1


def test_recv_one_at_a_time_loses_no_frame_and_no_chunk(setup):
    """Three frames landed together, taken one per ``recv(count=1)``: each is returned in
    order with its chunk held for its token, none is reaped and forgotten (its chunk then
    neither held nor free, lost until unbind)."""
    nic, gpu, rx, _ = setup
    b = rx.bind_rx(1, gpu, 0, (ENTRIES - 1) * 4096)
    sent = [(bytes([k]) * 42, bytes([0x80 + k]) * 100) for k in range(3)]
    for header, payload in sent:
        land(nic, gpu, b, header, payload)
    got = [rx.recv(b, count=1, timeout=0) for _ in range(4)]
    assert [[(f.header, rx.read(f.fragments[0])) for f in frames] for frames in got] == [[s] for s in sent] + [[]]
    assert len(b.pool.held) == 3 and nic.rx[1].ring.posted == ENTRIES - 1 - 3
    assert rx.dontneed([frames[0].fragments[0].token for frames in got[:3]]) == 3
    assert nic.rx[1].ring.posted == ENTRIES - 1


def test_no_split_and_hbo_give_linear_fragments_and_a_bounded_header(setup):
    nic, gpu, rx, _ = setup
    b = rx.bind_rx(1, gpu, 0, 4 * 4096, header_buffer=128)
    land(nic, gpu, b, b"\x11" * 128, b"p" * 500, sph=False)          # not IP: split at BSIZEHEADER
    land(nic, gpu, b, b"\x22" * 128, b"q" * 300, hdr_len=1000, hbo=True)   # headers longer than the buffer
    plain, overflow = rx.recv(b, count=2, timeout=0)
    assert not plain.split and plain.fragments[0].linear and plain.header == b"\x11" * 128
    assert not overflow.split and overflow.fragments[0].linear
    assert overflow.header == b"\x22" * 128           # HDR_LEN says 1000; the buffer held 128


def test_a_frame_over_two_chunks_and_a_frame_that_fit_its_header(setup):
    nic, gpu, rx, _ = setup
    b = rx.bind_rx(1, gpu, 0, 6 * 1024, chunk=1024)
    land(nic, gpu, b, b"H" * 42, b"a" * 1024, eop=False)
    land(nic, gpu, b, b"", b"b" * 200, hdr_len=0, sph=False)
    land(nic, gpu, b, b"S" * 60, b"", sph=False)                       # all of it in the header buffer
    big, small = rx.recv(b, count=2, timeout=0)
    assert big.header == b"H" * 42 and [(f.vram_offset, f.size) for f in big.fragments] == [(0, 1024), (1024, 200)]
    assert b"".join(rx.read(f) for f in big.fragments) == b"a" * 1024 + b"b" * 200
    assert small.header == b"S" * 60 and small.fragments == () and small.payload_size == 0
    assert nic.rx[1].ring.posted == 6 - 2                # the unused chunk went straight back


def test_unbind_takes_back_descriptors_voids_tokens_and_unmaps(setup):
    nic, gpu, rx, vram_maps = setup
    b = rx.bind_rx(1, gpu, 0, 4 * 4096)
    land(nic, gpu, b, b"h" * 42, b"x" * 64)
    (frame,) = rx.recv(b, count=1, timeout=0)
    rx.unbind(b)
    assert nic.rx[1].ring.posted == 0 and not vram_maps[0].active and not nic.maps[0].active
    assert len(b.pool.free) == b.pool.count and not b.pool.held and not b.pool.posted
    with pytest.raises(DevmemError, match="which was unbound"):
        rx.dontneed([frame.fragments[0].token])
    with pytest.raises(DevmemError, match="was unbound"):
        rx.recv(b)
    with pytest.raises(DevmemError, match="was unbound"):
        rx.unbind(b)
    assert rx.bind_rx(1, gpu, 0, 4 * 4096).queue == 1    # the queue can be bound again


@pytest.mark.parametrize("queue, offset, length, kw, words", [
    (0, 0, 4096, {}, "queue 0"),
    (5, 0, 4096, {}, "RX queue 5"),
    (1, 100, 4096, {}, "multiple of 4096"),
    (1, VRAM - 4096, 8192, {}, "outside the GPU"),
    (1, 0, 4096, {"chunk": 1500}, "whole KiB"),
    (1, 0, 6000, {}, "whole number of chunks"),
    (1, 0, 4096, {"header_buffer": 100}, "64-byte units"),
    (1, 0, 4096, {"header_buffer": 1024}, "64-byte units"),
])
def test_bind_refuses_bad_input(setup, queue, offset, length, kw, words):
    nic, gpu, rx, vram_maps = setup
    with pytest.raises(Exception, match=words):
        rx.bind_rx(queue, gpu, offset, length, **kw)
    assert not [m for m in vram_maps + nic.maps if m.active]         # nothing left mapped


def test_bind_refuses_a_bound_queue_and_an_overlap():
    nic = StandInNic(queues=3)
    gpu = SimpleNamespace(vram_size=VRAM)
    rx = DevmemReceiver(nic)
    rx.bindings[1] = SimpleNamespace(gpu=gpu, vram_offset=0, length=8192, name="the binding of VRAM [0x0, 0x2000) to queue 1")
    with pytest.raises(DevmemError, match="bound already"):
        rx.bind_rx(1, gpu, 0x10000, 4096)
    with pytest.raises(DevmemError, match="overlaps"):
        rx.bind_rx(2, gpu, 4096, 8192)


def test_chunk_pool_moves_and_refuses_wrong_moves():
    pool = ChunkPool(0x2000, 3 * 1024, 1024)
    assert [pool.offset(i) for i in range(3)] == [0x2000, 0x2400, 0x2800]
    assert pool.take(5) == [0, 1, 2] and pool.take(1) == []
    pool.land(1)
    with pytest.raises(DevmemError, match="chunk 1 is not posted"):
        pool.recycle(1)
    with pytest.raises(DevmemError, match="chunk 0 is not held"):
        pool.release(0)
    pool.release(1)
    assert list(pool.free) == [1]


def test_token_table_refuses_a_token_given_twice_in_one_call():
    table = TokenTable()
    t = table.issue("b", 0)
    with pytest.raises(DevmemError, match="given twice"):
        table.redeem([t, t])
    with pytest.raises(DevmemError, match="not an int"):
        table.redeem(["1"])
    assert table.redeem([t]) == [("b", 0)]
