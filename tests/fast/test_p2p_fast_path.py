"""The peer fast path of the DMA port (docs/gpu-device.md, "P2P"): proofs, their end at
DMA_UNMAP, the switch-off.  The *client* here is a fake standing in for QEMU (it
translates DMA_WRITE/READ messages to a peer's VRAM memfd or to plain memory):
what is under test is our own proof logic; the VM test drives real QEMU."""

import gc
import mmap
import os
from pathlib import Path

import pytest

from vfio_cxl.devices.vfio_user import wire
from vfio_cxl.devices.vfio_user.dma import DmaFault, DmaPort, DmaTable, FaultKind
from vfio_cxl.devices.vfio_user.peer import MemoryShare, PeerSet

MIB = 1 << 20
RW = wire.DMA_MAP_FLAG_READ | wire.DMA_MAP_FLAG_WRITE
BAR_IOVA = 0x10_0000_0000
RAM_IOVA = 0x20_0000_0000


class FakeClient:
    """QEMU's role: IOVA -> (memory, offset) translation for DMA messages."""

    def __init__(self):
        self.windows = []   # (iova, size, memoryview)
        self.messages = 0
        self.closed = False

    def _at(self, iova, n):
        for base, size, mem in self.windows:
            if base <= iova and iova + n <= base + size:
                return mem, iova - base
        raise AssertionError(f"fake client: no window for {iova:#x}")

    def dma_write(self, iova, data, stale):
        self.messages += 1
        mem, off = self._at(iova, len(data))
        mem[off:off + len(data)] = data

    def dma_read(self, iova, into, stale):
        self.messages += 1
        mem, off = self._at(iova, len(into))
        into[:] = mem[off:off + len(into)]

    def abort_transfers(self):
        pass


@pytest.fixture
def rig(tmp_path):
    vram_size = 16 * MIB
    fd = os.memfd_create("peer-vram")
    os.ftruncate(fd, vram_size)
    peer_mm = mmap.mmap(fd, vram_size, flags=mmap.MAP_SHARED)
    share = MemoryShare(str(tmp_path / "peer.sock"), fd, vram_size)
    peers = PeerSet([str(tmp_path / "peer.sock")])
    table, client = DmaTable(), FakeClient()
    enabled = [True]
    port = DmaPort(table, client, peers=peers, peer_enabled=lambda: enabled[0])
    # the guest mapped the peer's BAR from VRAM offset 8 MiB on; QEMU sends 2 MiB pieces
    peer_view = memoryview(peer_mm)
    client.windows.append((BAR_IOVA, 8 * MIB, peer_view[8 * MIB:]))
    for piece in range(4):
        table.map(BAR_IOVA + piece * 2 * MIB, 2 * MIB, RW, None, 0)
    ram = bytearray(4 * MIB)
    client.windows.append((RAM_IOVA, len(ram), memoryview(ram)))
    table.map(RAM_IOVA, len(ram), RW, None, 0)
    yield port, table, client, peer_mm, ram, enabled
    peers.close()
    share.close()
    client.windows.clear()
    peer_view.release()
    peer_mm.close()
    os.close(fd)


def test_proven_pieces_are_copied_straight_into_the_peer(rig):
    port, table, client, peer, ram, _ = rig
    data = os.urandom(5 * MIB + 123)
    port.write(BAR_IOVA + 4096, data)
    assert peer[8 * MIB + 4096: 8 * MIB + 4096 + len(data)] == data
    assert port.proofs == 3 and port.probes == 3          # one per DMA_MAP piece touched
    assert client.messages == 6                            # two nonces per proof, nothing else
    assert port.peer_bytes == len(data)
    back = bytearray(len(data))
    port.read(BAR_IOVA + 4096, back)                       # reads use the proof too
    assert back == data and client.messages == 6


def test_memory_outside_every_peer_gets_no_proof(rig):
    port, table, client, peer, ram, _ = rig
    data = os.urandom(MIB)
    port.write(RAM_IOVA, data)
    assert bytes(ram[:MIB]) == data
    assert port.proofs == 0 and port.probes == 1 and port.peer_bytes == 0
    port.write(RAM_IOVA, data)                             # no second probe for that piece
    assert port.probes == 1


def test_unmap_drops_the_proof_and_the_range_faults(rig):
    port, table, client, peer, ram, _ = rig
    port.write(BAR_IOVA, b"x" * MIB)
    assert port.proofs == 1
    table.unmap(BAR_IOVA, 2 * MIB)                          # the guest unmapped, QEMU said so
    before = peer[8 * MIB: 10 * MIB]
    with pytest.raises(DmaFault) as fault:
        port.write(BAR_IOVA, b"y" * MIB)
    assert fault.value.kind == FaultKind.UNMAPPED and fault.value.addr == BAR_IOVA
    assert peer[8 * MIB: 10 * MIB] == before
    # re-mapped (maybe elsewhere): a new proof is needed and made
    table.map(BAR_IOVA, 2 * MIB, RW, None, 0)
    port.write(BAR_IOVA, b"z" * MIB)
    assert port.proofs == 2 and peer[8 * MIB: 9 * MIB] == b"z" * MIB


def test_a_remap_elsewhere_is_not_written_through_an_old_proof(rig):
    port, table, client, peer, ram, _ = rig
    port.write(BAR_IOVA, b"a" * 4096)
    table.unmap(BAR_IOVA, 2 * MIB)
    table.map(BAR_IOVA, 2 * MIB, RW, None, 0)
    client.windows.insert(0, (BAR_IOVA, 2 * MIB, memoryview(ram)[:2 * MIB]))   # now guest RAM
    port.write(BAR_IOVA, b"b" * 4096)
    assert bytes(ram[:4096]) == b"b" * 4096 and peer[8 * MIB: 8 * MIB + 4096] == b"a" * 4096
    client.windows.pop(0)


def test_fast_disable_keeps_everything_on_messages(rig):
    port, table, client, peer, ram, enabled = rig
    enabled[0] = False
    port.write(BAR_IOVA, b"m" * MIB)
    assert peer[8 * MIB: 9 * MIB] == b"m" * MIB
    assert port.peer_bytes == 0 and port.probes == 0 and client.messages == 1


def peer_vram_maps() -> int:
    return Path("/proc/self/maps").read_text().count("peer-vram")


def test_a_peer_whose_owner_is_gone_is_unmapped_and_its_proofs_dropped(rig, tmp_path):
    """The peer's server stops (a scrub starts a fresh one, a move, a death): its share's
    connection ends, the peer set unmaps that memory at once (nothing of the old owner stays in
    this process) and proven mappings into it go back to messages: issue 23, item 8."""
    port, table, client, peer, ram, _ = rig
    port.write(BAR_IOVA, b"p" * MIB)
    assert port.proofs == 1 and port.peer_bytes == MIB
    assert peer_vram_maps() == 2               # the test's own view, and the peer set's
    [share] = [o for o in gc.get_objects() if isinstance(o, MemoryShare)]   # the rig's
    share.close()                              # the owner's server goes away
    assert port.peers.wait_retired(1, 10)
    assert peer_vram_maps() == 1               # only the test's own view is left
    messages = client.messages
    port.write(BAR_IOVA, b"q" * MIB)           # no fast path into memory that is gone
    assert port.peer_bytes == MIB and client.messages > messages
    assert peer[8 * MIB: 9 * MIB] == b"q" * MIB   # (the message path still reaches it)
