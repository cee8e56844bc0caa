"""The igb driver's own logic without a NIC: descriptor layouts at the bit positions QEMU's
model reads and writes (hw/net/igb_regs.h, igb_core.c), SRRCTL, receive addresses, the
rings' bookkeeping, the frames the lab sends, and the CLI's usage errors.

The real NIC (QEMU's igb on the nic2 topology) is driven by tests/vm/test_nic.py."""

import os
import struct
import time
from types import SimpleNamespace

import pytest

from vfio_cxl.guest.cmd import cli
from vfio_cxl.guest.drivers.igb import IgbDevice
from vfio_cxl.guest.drivers.igb import spec
from vfio_cxl.guest.drivers.igb.errors import IgbError
from vfio_cxl.guest.drivers.igb.ring import Ring, RxRing, TxRing
from vfio_cxl.guest.nic import frames


def test_tx_data_descriptor_bits():
    desc = spec.pack_tx(0x1_2345_6780, 1514)
    assert len(desc) == spec.DESC_SIZE
    addr, cmd, olinfo = struct.unpack("<QII", desc)
    assert addr == 0x1_2345_6780
    # DTALEN 15:0, DTYP 0011 at 23:20, EOP 24, IFCS 25, RS 27, DEXT 29 (E1000_ADVTXD_*)
    assert cmd == 1514 | 0x0030_0000 | 1 << 24 | 1 << 25 | 1 << 27 | 1 << 29
    assert olinfo == 1514 << 14                       # PAYLEN 31:14
    _, cmd, _ = struct.unpack("<QII", spec.pack_tx(0x1000, 60, eop=False, rs=False))
    assert not cmd & (1 << 24 | 1 << 27)
    with pytest.raises(ValueError, match="DTALEN"):
        spec.pack_tx(0x1000, 0x10000)


def test_tx_writeback_dd_is_bit_0_of_the_last_dword():
    desc = bytearray(spec.pack_tx(0x1000, 64))
    assert not spec.tx_done(desc)
    desc[12] |= 1
    assert spec.tx_done(desc)


def test_rx_read_form():
    assert struct.unpack("<QQ", spec.pack_rx(0x10_0000_2000, 0x0800_0080)) == (0x10_0000_2000, 0x0800_0080)


def test_rx_writeback_fields_at_qemu_s_positions():
    # hdr_info: HDR_LEN << 5 (E1000_ADVRXD_HDR_LEN_OFFSET = 21 - 16), SPH bit 15;
    # status_error: DD 0, EOP 1, HBO bit 23 (E1000_ADVRXD_ST_ERR_HBO_OFFSET = BIT(3 + 20))
    raw = struct.pack("<HHIIHH", 0x0041, 42 << 5 | 1 << 15, 0, 1 | 2, 1000, 0)
    c = spec.unpack_rx(raw)
    assert spec.rx_done(raw)
    assert (c.hdr_len, c.sph, c.hbo, c.eop, c.length, c.split) == (42, True, False, True, 1000, True)
    hbo = spec.unpack_rx(struct.pack("<HHIIHH", 0, 1000 << 5 | 1 << 15, 0, 1 | 1 << 23, 64, 0))
    assert (hbo.hdr_len, hbo.sph, hbo.hbo, hbo.eop, hbo.split) == (1000, True, True, False, False)
    assert not spec.rx_done(spec.pack_rx(0x1000, 0x2000)[:8] + bytes(8))


def test_rx_writeback_round_trip():
    c = spec.RxCompletion(length=4096, hdr_len=0x3FF, sph=False, hbo=True, eop=True, error=True,
                          pkt_info=0x123, vlan=7)
    assert spec.unpack_rx(spec.pack_rx_writeback(c)) == c


@pytest.mark.parametrize("packet, header, value", [
    (2048, 0, 0x0200_0002),                          # DESCTYPE 001 advanced one buffer, BSIZEPACKET 2 KiB
    (4096, 128, 0x0A00_0204),                        # DESCTYPE 101 header split always, BSIZEHEADER 2 x 64
    (127 * 1024, 960, 0x0A00_0F7F),                  # the largest each field holds
])
def test_srrctl(packet, header, value):
    assert spec.srrctl(packet, header) == value


@pytest.mark.parametrize("packet, header, words", [
    (1500, 0, "whole KiB"), (128 * 1024, 0, "whole KiB"), (0, 0, "whole KiB"),
    (2048, 100, "64-byte units"), (2048, 1024, "64-byte units"),
])
def test_srrctl_refuses_what_the_fields_cannot_hold(packet, header, words):
    with pytest.raises(ValueError, match=words):
        spec.srrctl(packet, header)


def test_receive_address_steers_a_mac_to_a_pool():
    mac = spec.parse_mac("52:54:00:12:34:56")
    ral, rah = spec.receive_address(mac, 1)
    assert ral == 0x1200_5452                         # bytes 0-3, little-endian
    assert rah == 0x5634 | 1 << 31 | 1 << 19          # bytes 4-5, AV, POOLSEL bit 18 + pool
    assert spec.mac_from_receive_address(ral, rah) == mac
    with pytest.raises(ValueError, match="pools 0-7"):
        spec.receive_address(mac, 8)


@pytest.mark.parametrize("text", ["52:54:00:12:34", "52-54-00-12-34-56", "zz:54:00:12:34:56", "5:54:00:12:34:56"])
def test_parse_mac_refuses(text):
    with pytest.raises(ValueError, match="not a MAC address"):
        spec.parse_mac(text)


def test_ivar_maps_a_queue_to_a_vector():
    assert spec.ivar(3, 3) == 0x83


# -- rings -----------------------------------------------------------------------------------

def test_ring_keeps_one_slot_empty_and_refuses_a_full_post():
    ring = Ring(memoryview(bytearray(8 * 16)), 8, "test ring")
    for k in range(7):
        assert ring.post(spec.pack_rx(0x1000 * k), k) == k
    assert (ring.posted, ring.free) == (7, 0)
    with pytest.raises(IgbError, match="all 7 usable descriptors"):
        ring.post(spec.pack_rx(0), "x")
    assert [ring.pop() for _ in range(3)] == [0, 1, 2]
    assert ring.post(spec.pack_rx(0x9000), 7) == 7 and ring.post(spec.pack_rx(0xA000), 8) == 0   # wraps
    assert sorted(ring.reset()) == [3, 4, 5, 6, 7, 8]
    assert (ring.posted, ring.tail, bytes(ring.memory)) == (0, 0, bytes(128))


@pytest.mark.parametrize("entries, memory", [(12, 12 * 16), (0, 0), (8, 64)])
def test_ring_refuses_bad_sizes(entries, memory):
    with pytest.raises(IgbError):
        Ring(memoryview(bytearray(memory)), entries, "bad")


def test_tx_ring_reclaims_in_order_only_what_was_written_back():
    ring = TxRing(memoryview(bytearray(8 * 16)), 8, "tx")
    for k in range(3):
        ring.post(spec.pack_tx(0x1000, 64), k)
    ring.desc(1)[12] |= 1                              # the second done, the first not: nothing yet
    assert ring.reclaim() == []
    ring.desc(0)[12] |= 1
    assert ring.reclaim() == [0, 1] and ring.posted == 1


def test_rx_ring_reaps_written_back_descriptors():
    ring = RxRing(memoryview(bytearray(8 * 16)), 8, "rx")
    ring.post(spec.pack_rx(0x1000, 0x2000), "a")
    ring.post(spec.pack_rx(0x3000, 0x4000), "b")
    assert ring.reap() == []                           # read form: DD clear
    done = spec.RxCompletion(100, 42, True, False, True, False, 0, 0)
    ring.desc(0)[:] = spec.pack_rx_writeback(done)
    assert ring.reap() == [("a", done)] and ring.posted == 1


def test_rx_ring_reaps_whole_frames_up_to_a_budget_and_leaves_the_rest_written_back():
    """A frame of two descriptors, then two of one: a budget of one frame takes the first
    frame's two descriptors and leaves the other frames in the ring, written back, for the
    next call -- nothing taken off the ring is left unhandled."""
    ring = RxRing(memoryview(bytearray(8 * 16)), 8, "rx")
    for cookie in "abcd":
        ring.post(spec.pack_rx(0x1000, 0), cookie)
    part = spec.RxCompletion(1024, 0, False, False, False, False, 0, 0)
    whole = spec.RxCompletion(100, 0, False, False, True, False, 0, 0)
    for slot, c in enumerate((part, whole, whole, whole)):
        ring.desc(slot)[:] = spec.pack_rx_writeback(c)
    assert ring.reap(frames=1) == [("a", part), ("b", whole)] and ring.posted == 2
    assert ring.reap(frames=0) == [] and ring.posted == 2
    assert ring.reap(frames=1) == [("c", whole)]
    assert ring.reap() == [("d", whole)] and ring.posted == 0


# -- frames ----------------------------------------------------------------------------------

def test_udp_frame_layout_and_ip_checksum():
    dst, src = spec.parse_mac("02:00:00:00:01:01"), spec.parse_mac("52:54:00:00:00:01")
    data = frames.payload(7, 3, 100)
    f = frames.udp_frame(dst, src, data)
    assert len(f) == frames.HEADERS + 100 == 142
    assert f[:6] == dst and f[6:12] == src and f[12:14] == b"\x08\x00"
    ip = f[14:34]
    assert sum(struct.unpack("!10H", ip)) % 0xFFFF == 0    # a header with its checksum sums to 0xFFFF
    assert struct.unpack("!H", ip[2:4])[0] == 128 and ip[9] == 17
    assert struct.unpack("!HHHH", f[34:42]) == (4791, 4791, 108, 0)
    assert f[42:] == data


def test_payload_checks_itself():
    p = frames.payload(5, 9, 64)
    assert frames.check_payload(5, p) == 9
    assert frames.check_payload(6, p) is None
    assert frames.check_payload(5, p[:-1] + bytes([p[-1] ^ 1])) is None
    assert frames.check_payload(5, b"short") is None
    with pytest.raises(ValueError, match="8 to 1472"):
        frames.payload(1, 0, 1473)


# -- the command's usage errors ----------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["nic", "recv", "--queue", "1"], "without --steer"),
    (["nic", "recv", "--gpu", "0000:01:00.0"], "queue 0"),
    (["nic", "recv", "--queue", "1", "--steer", "02:00:00:00:01:01", "--gpu", "01:00.0", "--buffers", "0"],
     "--buffers with --gpu"),
    (["nic", "recv", "--count", "0"], "positive count"),
])
def test_recv_usage_errors(argv, words, capsys):
    assert cli.main(argv) == 1
    assert words in capsys.readouterr().err


def test_send_refuses_a_bad_mac_and_an_oversized_payload(capsys):
    with pytest.raises(SystemExit):
        cli.main(["nic", "send", "--to", "02:00:00:00:01"])
    assert "not a MAC address" in capsys.readouterr().err
    assert cli.main(["nic", "send", "--to", "02:00:00:00:01:01", "--size", "1500"]) == 1
    assert "8 to 1472" in capsys.readouterr().err


def test_wait_rx_ends_on_a_wake_fd_and_says_the_queue_did_not_fire():
    """A GPU's release request (a wake fd) ends a wait on the queue's vector at once; only the
    vector itself counts as the queue firing."""
    vector, wake = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)

    def pending(_):
        try:
            return os.eventfd_read(vector)
        except BlockingIOError:
            return 0
    nic = SimpleNamespace(vectors=SimpleNamespace(eventfds=[vector], pending=pending), wake_fds=(wake,))
    try:
        os.eventfd_write(wake, 1)
        t0 = time.monotonic()
        assert IgbDevice.wait_rx(nic, 0, t0 + 30) is False and time.monotonic() - t0 < 5
        os.eventfd_write(vector, 1)
        assert IgbDevice.wait_rx(nic, 0, time.monotonic() + 30) is True
        assert pending(0) == 0                       # the vector's count was consumed
    finally:
        os.close(vector)
        os.close(wake)
