"""IgbDevice's own sequencing over a register file that stands in for BAR0: what bring-up
writes and in which order, steering, ring programming, send and receive through the rings
(the stand-in loops each sent frame into RX queue 0 as the device would write it back),
statistics folding, shutdown, and the bounds on every wait.

QEMU's igb behind real VFIO is tests/vm/test_nic.py's."""

import struct
import types

import pytest

from vfio_cxl.guest.drivers.igb import spec
from vfio_cxl.guest.drivers.igb.device import IgbDevice
from vfio_cxl.guest.drivers.igb.errors import IgbError, IgbTimeout

MAC = bytes.fromhex("525400123456")
FLOW = bytes.fromhex("020000000101")


class Registers:
    """BAR0 as the driver sees it: CTRL.RST self-clears, an MDIC write is ready at once and
    (autoneg) raises STATUS.LU, statistics clear on read, a TDT write "sends" through ``on_tdt``."""

    def __init__(self, *, reset_clears=True, autoneg=True):
        self.r = {spec.RAL0: int.from_bytes(MAC[:4], "little"),
                  spec.RAL0 + 4: int.from_bytes(MAC[4:], "little") | spec.RAH_AV}
        self.log: list[tuple[int, int]] = []
        self.reset_clears, self.autoneg, self.on_tdt = reset_clears, autoneg, None

    def read32(self, reg):
        value = self.r.get(reg, 0)
        if reg in spec.STATS32.values() or reg == spec.ICR:
            self.r[reg] = 0
        return value

    def write32(self, reg, value):
        self.log.append((reg, value))
        if reg == spec.CTRL and self.reset_clears:
            value &= ~spec.CTRL_RST
        if reg == spec.MDIC:
            value |= spec.MDIC_READY
            if self.autoneg:
                self.r[spec.STATUS] = spec.STATUS_LU
        self.r[reg] = value
        if reg == spec.TDT0 and self.on_tdt:
            self.on_tdt(value)


class Device:
    bdf, backend = "0000:03:00.0", "type1"

    def __init__(self, registers):
        self.regs, self.mapped = registers, []
        self.config = types.SimpleNamespace(read16=lambda off: 0, write16=lambda off, v: None)
        self.device = types.SimpleNamespace(fd=3)

    def bar(self, n):
        return self.regs

    def close(self):
        self.device.fd = -1

    def map_dma(self, buffer, iova):
        mapping = types.SimpleNamespace(iova=iova, active=True)
        mapping.close = lambda: setattr(mapping, "active", False)
        self.mapped.append(mapping)
        return mapping


def loopback(nic: IgbDevice):
    """Each descriptor up to the new TX tail goes out and comes back on RX queue 0."""
    def on_tdt(tail):
        tx, rx = nic.tx[0].ring, nic.rx[0].ring
        slot = tx.clean
        while slot != tail:
            addr, cmd, _ = struct.unpack_from("<QII", tx.desc(slot))
            at = addr - nic.control_iova
            data = bytes(nic._view[at:at + (cmd & 0xFFFF)])
            done = sum(spec.rx_done(rx.desc(k)) for k in range(rx.entries))
            pkt, _ = struct.unpack_from("<QQ", rx.desc((rx.clean + done) % rx.entries))
            nic._view[pkt - nic.control_iova:pkt - nic.control_iova + len(data)] = data
            rx.desc((rx.clean + done) % rx.entries)[:] = spec.pack_rx_writeback(
                spec.RxCompletion(len(data), 0, False, False, True, False, 0, 0))
            tx.desc(slot)[12] |= spec.TXD_STAT_DD
            slot = (slot + 1) % tx.entries
    return on_tdt


@pytest.fixture
def nic():
    regs = Registers()
    device = IgbDevice(Device(regs), interrupts=False)
    regs.on_tdt = loopback(device)
    return device


def test_bring_up_programs_vmdq_rings_and_the_receiver(nic):
    r = nic.bar0.r
    assert nic.link and nic.mac == MAC
    assert r[spec.MRQC] == spec.MRQC_VMDQ and r[spec.VFRE] == 0b11 and r[spec.VFTE] == 0b11
    assert r[spec.RAL0 + 4] & 0xFF << spec.RAH_POOL_SHIFT == 1 << spec.RAH_POOL_SHIFT      # own MAC: pool 0
    assert r[spec.VMOLR0] & spec.VMOLR_BAM and not r[spec.VMOLR0 + 4] & spec.VMOLR_BAM
    for q in (0, 1):
        assert r[spec.rx_reg(spec.SRRCTL0, q)] == 0x0200_0002                        # one 2 KiB buffer
        assert r[spec.rx_reg(spec.RDLEN0, q)] == r[spec.tx_reg(spec.TDLEN0, q)] == 256 * 16
        assert r[spec.rx_reg(spec.RDT0, q)] == 255 and r[spec.rx_reg(spec.RXDCTL0, q)] == spec.QUEUE_ENABLE
        assert r[spec.rx_reg(spec.RDBAL0, q)] == nic.rx[q].ring_iova
    assert r[spec.RCTL] == spec.RCTL_EN | spec.RCTL_BAM | spec.RCTL_SECRC
    assert r[spec.TCTL] == spec.TCTL_EN | spec.TCTL_PSP
    order = [reg for reg, _ in nic.bar0.log]
    assert order.index(spec.CTRL) < order.index(spec.MDIC) < order.index(spec.MRQC) < order.index(spec.RCTL)


def test_steering_is_programmed_before_the_receiver_is_enabled():
    regs = Registers()
    nic = IgbDevice(Device(regs), interrupts=False, bring_up=False)
    nic.bring_up({FLOW: 1})
    ral, rah = spec.receive_address(FLOW, 1)
    order = regs.log
    assert (spec.RAL0 + 8, ral) in order and (spec.RAL0 + 12, rah) in order
    assert order.index((spec.RAL0 + 12, rah)) < max(i for i, (reg, _) in enumerate(order) if reg == spec.RCTL)


def test_steer_refuses_its_own_mac_a_multicast_and_a_queue_not_opened(nic):
    with pytest.raises(IgbError, match="own address"):
        nic.steer(MAC, 1)
    with pytest.raises(IgbError, match="multicast"):
        nic.steer(bytes.fromhex("010000000001"), 1)
    with pytest.raises(IgbError, match="queues 0-1"):
        nic.steer(FLOW, 2)
    nic.steer(FLOW, 1)
    nic.steer(FLOW, 1)                                 # the same address slot again
    assert sorted(nic._steered.values()) == [1]


def test_send_and_recv_through_the_rings(nic):
    frames = [bytes([k]) * (60 + k) for k in range(5)] + [b"\xff" * 1514]
    assert nic.send(frames) == 6
    assert nic.recv(0, count=10, timeout=0) == frames
    assert nic.rx[0].ring.posted == 255                # every buffer posted again
    assert nic.tx[0].ring.posted == 0


def test_recv_one_at_a_time_loses_no_frame_that_landed_with_others(nic):
    """Frames that landed together are returned one per ``recv(count=1)``, in order: none is
    taken off the ring and dropped (an RDMA-shaped write once waited 60 s for a final grant
    that had landed beside the one before it, and was reaped and forgotten), and every
    buffer is posted again."""
    frames = [bytes([k]) * 64 for k in range(4)]
    assert nic.send(frames) == 4
    assert [nic.recv(0, count=1, timeout=0) for _ in range(5)] == [[f] for f in frames] + [[]]
    assert nic.rx[0].ring.posted == 255


def test_send_refuses_a_frame_before_writing_any_descriptor(nic):
    with pytest.raises(IgbError, match="frame 1 is 1515 bytes"):
        nic.send([b"a" * 60, b"b" * 1515])
    with pytest.raises(IgbError, match="frame 0 is 13 bytes"):
        nic.send([b"c" * 13])
    assert nic.tx[0].ring.posted == 0 and spec.TDT0 not in dict(nic.bar0.log[-3:])


def test_recv_returns_nothing_by_its_timeout(nic):
    assert nic.recv(0, count=1, timeout=0.01) == []
    with pytest.raises(IgbError, match="RX queue 5"):
        nic.recv(5)


def test_send_times_out_when_nothing_is_written_back():
    nic = IgbDevice(Device(Registers()), interrupts=False)          # no loopback: DD never comes
    with pytest.raises(IgbTimeout, match="descriptors not sent within 0.05 s"):
        nic.send([b"x" * 60], timeout=0.05)


def test_a_queue_without_buffers(nic):
    nic.configure_rx(1, buffers=0)
    assert nic.rx[1].ring.posted == 0 and nic.bar0.r[spec.rx_reg(spec.RDT0, 1)] == 0
    with pytest.raises(IgbError, match="post 0 to 255"):
        nic.configure_rx(1, buffers=256)


def test_stats_fold_clear_on_read_counters_and_count_rx_overruns(nic):
    r = nic.bar0.r
    r[spec.STATS32["gprc"]], r[spec.STATS64["gorc"]], r[spec.STATS64["gorc"] + 4] = 3, 5, 1
    r[spec.ICR] = spec.ICR_RXO
    first = nic.stats()
    assert first["gprc"] == 3 and first["gorc"] == 5 | 1 << 32 and first["rx_overrun_events"] == 1
    r[spec.STATS32["gprc"]] = 2
    assert nic.stats()["gprc"] == 5 and nic.stats()["rx_overrun_events"] == 1


def test_external_queue_is_posted_and_reaped_by_its_owner(nic):
    with pytest.raises(IgbError, match="guest-RAM buffers"):
        nic.post_rx(1, [(0x10_0000_0000, 0x0900_0000, "c0")])
    nic.configure_external_rx(1, 4096, 128)
    assert nic.bar0.r[spec.rx_reg(spec.SRRCTL0, 1)] == 0x0A00_0204 and nic.rx[1].ring.posted == 0
    assert nic.post_rx(1, [(0x10_0000_0000 + k * 4096, 0x0900_0000 + k * 128, k) for k in range(300)]) == 255
    nic.rx[1].ring.desc(0)[:] = spec.pack_rx_writeback(spec.RxCompletion(1000, 42, True, False, True, False, 0, 0))
    (cookie, c), = nic.reap_rx(1)
    assert cookie == 0 and c.split and c.hdr_len == 42
    assert sorted(nic.take_back_rx(1)) == list(range(1, 255))
    assert nic.bar0.r[spec.rx_reg(spec.RXDCTL0, 1)] == 0 and nic.rx[1].ring.posted == 0
    with pytest.raises(IgbError, match="whole KiB"):
        nic.configure_external_rx(1, 1500, 128)


def test_shutdown_stops_every_queue_and_close_unmaps(nic):
    nic.close()
    r = nic.bar0.r
    assert r[spec.RCTL] == 0 and r[spec.TCTL] == 0
    assert all(r[spec.rx_reg(spec.RXDCTL0, q)] == 0 and r[spec.tx_reg(spec.TXDCTL0, q)] == 0 for q in (0, 1))
    assert not nic.device.mapped[0].active and nic.device.device.fd == -1


def test_waits_are_bounded():
    with pytest.raises(IgbTimeout, match="CTRL.RST did not clear"):
        IgbDevice(Device(Registers(reset_clears=False)), interrupts=False)
    nic = IgbDevice(Device(Registers(autoneg=False)), interrupts=False, bring_up=False)
    nic.reset()
    with pytest.raises(IgbTimeout, match="link did not come up"):
        nic.link_up(timeout=0.05)


def test_bad_open_arguments():
    with pytest.raises(IgbError, match="1 to 8"):
        IgbDevice(Device(Registers()), queues=9, interrupts=False)
    with pytest.raises(IgbError, match="whole KiB"):
        IgbDevice(Device(Registers()), packet_buffer=1500, interrupts=False)
    with pytest.raises(IgbError, match="packet_buffer=2048"):
        IgbDevice(Device(Registers()), packet_buffer=1024, interrupts=False)


def test_send_gather_puts_the_header_in_guest_ram_and_points_the_payload_at_its_iova():
    regs = Registers()
    nic = IgbDevice(Device(regs), interrupts=False)
    seen = []

    def on_tdt(tail):                                   # the device: every descriptor sent
        tx = nic.tx[0].ring
        for k in range(tx.entries):
            if tx.desc(k)[12] & spec.TXD_STAT_DD == 0 and any(tx.desc(k)):
                addr, cmd, status = struct.unpack_from("<QII", tx.desc(k))
                seen.append((addr, cmd & 0xFFFF, bool(cmd & spec.TXD_CMD_EOP), status >> spec.TXD_PAYLEN_SHIFT))
                tx.desc(k)[12] |= spec.TXD_STAT_DD
    regs.on_tdt = on_tdt
    header = b"h" * 64
    assert nic.send_gather([(header, 0x20_0000_0000, 1024), (header, 0x20_0000_0400, 0)]) == 2
    (h0, n0, eop0, len0), (p0, n1, eop1, len1), (h1, n2, eop2, len2) = seen
    assert (n0, eop0, len0) == (64, False, 1088) and (p0, n1, eop1, len1) == (0x20_0000_0000, 1024, True, 1088)
    assert (n2, eop2, len2) == (64, True, 64)                       # header only: one descriptor
    at = h0 - nic.control_iova
    assert bytes(nic._view[at:at + 64]) == header
    with pytest.raises(IgbError, match="frame 0: a 64-byte header and 1451 bytes"):
        nic.send_gather([(header, 0, 1451)])
