"""An 82576 (igb) driven from guest userspace through VFIO: bring-up, rings, send, receive.

    with IgbDevice.open("0000:03:00.0") as nic:              # type1 or iommufd, as VFIO picks
        nic.send([frame], queue=0)
        frames = nic.recv(queue=0, count=1, timeout=1.0)
        nic.steer(bytes.fromhex("020000000101"), queue=1)    # that MAC's frames to queue 1 only

Bring-up is one verb per step, run in order by ``bring_up`` (``open`` runs it): ``reset``
(CTRL.RST, until the device clears it, bounded), ``configure_interrupts`` (MSI-X mode, RX
queue n on vector n, auto-cleared), ``link_up`` (CTRL.SLU; QEMU raises STATUS.LU when its
autonegotiation timer fires, which a PHY autoneg restart starts), ``configure_steering``
(VMDq: queue n is pool n, the NIC's own MAC and broadcasts to pool 0, unknown unicast to the
default pool 0), ``configure_queues`` (each TX and RX ring in DMA-mapped guest RAM, RX
buffers posted) and ``enable`` (RCTL, TCTL).

Each RX queue is in one of two modes: ``ram`` (the driver's buffers in guest RAM: one per
descriptor, or a header and a packet buffer with ``header_buffer``) or ``external``: the
owner posts the addresses (``post_rx``) and takes the completions (``reap_rx``) -- the
devmem receive path, whose payload buffers are another device's memory.  TX descriptors
point into the driver's guest-RAM buffers (``send``) or at any IOVA of the context
(``send_iova``: a GPU's BAR2 mapped in the same IOMMU context).

Every wait has a deadline; receive never blocks past its timeout.  A frame steered to a
queue without buffers is dropped by the device (QEMU: ICR.RXO, and no statistics counter
moves: docs/nic.md); ``stats`` folds the clear-on-read counters into running totals and
counts those RXO events.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, field

from ...vfio import VfioPciDevice, uapi
from ...vfio.bind import find_pci_devices
from ...vfio.interrupts import wait_readable
from . import spec
from .errors import IgbError, IgbTimeout
from .ring import RxRing, TxRing

PCI_COMMAND = 0x04
PCI_COMMAND_MEMORY = 0x2
PCI_COMMAND_MASTER = 0x4
PAGE = 4096
CONTROL_IOVA = 0x0200_0000       # rings and guest-RAM buffers (below the GPU's areas)
RESET_TIMEOUT = 1.0              # seconds for CTRL.RST to clear
LINK_TIMEOUT = 5.0               # seconds for STATUS.LU (QEMU's autoneg timer: 500 ms)
TX_TIMEOUT = 5.0
ETH_HEADER = 14
MAX_FRAME = 1514                 # without FCS; larger needs jumbo (RCTL.LPE, RLPML), not set here
TX_BUFFER = 2048                 # bytes per TX buffer in guest RAM


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


@dataclass
class RxQueue:
    """One RX queue: its ring, its mode and, in ``ram`` mode, its buffers (slot i's packet
    buffer at ``pkt_base + i * packet_buffer``, header buffer at ``hdr_base + i * header_buffer``)."""

    index: int
    ring: RxRing
    ring_iova: int
    mode: str = "ram"                        # "ram" | "external"
    packet_buffer: int = 2048
    header_buffer: int = 0
    pkt_base: int = 0                        # offsets into the control memory (ram mode)
    hdr_base: int = 0
    partial: list = field(default_factory=list)   # pieces of a frame whose EOP has not come


@dataclass
class TxQueue:
    index: int
    ring: TxRing
    ring_iova: int
    buffer: int                              # bytes per TX buffer
    buf_base: int                            # offset of slot 0's buffer in the control memory


class IgbDevice:
    """An 82576 function over VFIO.  Use ``open`` (or wrap an open ``VfioPciDevice``)."""

    def __init__(self, device: VfioPciDevice, *, queues: int = 2, entries: int = 256,
                 packet_buffer: int = 2048, header_buffer: int = 0, rx_buffers: int | None = None,
                 interrupts: bool = True, control_iova: int = CONTROL_IOVA, bring_up: bool = True):
        """Take ``device`` (an 82576): memory decoding and bus mastering on, the control memory
        (rings and buffers of ``queues`` queue pairs of ``entries`` descriptors) mapped at
        ``control_iova``, MSI-X vectors on eventfds; then ``bring_up()`` unless told not to.
        ``rx_buffers``: how many RX buffers each ``ram`` queue posts (default: all it can,
        entries - 1; 0 leaves the queues empty, so what is steered there is dropped)."""
        if not 1 <= queues <= spec.MAX_QUEUES:
            raise IgbError(f"{queues} queues", f"the 82576 has 1 to {spec.MAX_QUEUES} (one per VMDq pool)")
        try:
            spec.srrctl(packet_buffer, header_buffer)      # a clear error now, not at bring-up
        except ValueError as err:
            raise IgbError(f"{device.bdf}: {err}", "pick buffer sizes the 82576 can express") from None
        if packet_buffer < MAX_FRAME:
            raise IgbError(f"a {packet_buffer}-byte RX buffer for {MAX_FRAME}-byte frames",
                           "use packet_buffer=2048 (whole KiB, one frame per descriptor)")
        self.device, self.bdf = device, device.bdf
        self.queue_count, self.entries = queues, entries
        self.packet_buffer, self.header_buffer = packet_buffer, header_buffer
        self.rx_buffers = entries - 1 if rx_buffers is None else rx_buffers
        if not 0 <= self.rx_buffers < entries:
            raise IgbError(f"{rx_buffers} RX buffers on a ring of {entries}", f"post 0 to {entries - 1}")
        self.control_iova = control_iova
        self._totals = dict.fromkeys([*spec.STATS32, *spec.STATS64, "rx_overrun_events"], 0)
        self._steered: dict[bytes, int] = {}
        self.vectors = None
        self.wake_fds: tuple[int, ...] = ()    # eventfds that also end a wait_rx (a GPU's release request)
        command = device.config.read16(PCI_COMMAND)
        device.config.write16(PCI_COMMAND, command | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER)
        self.bar0 = device.bar(0)
        self._layout()
        self._control = mmap.mmap(-1, self._size)
        self._view = memoryview(self._control)
        self._control_dma = device.map_dma(self._control, control_iova)
        try:
            if interrupts:
                count = min(queues, device.irq_info(uapi.VFIO_PCI_MSIX_IRQ_INDEX).count)
                if count < queues:
                    raise IgbError(f"{self.bdf}: {count} MSI-X vectors for {queues} RX queues",
                                   f"use at most {count} queues, or interrupts=False (polling)")
                self.vectors = device.msix(queues)
            if bring_up:
                self.bring_up()
        except BaseException:
            self._release()
            raise

    def _layout(self) -> None:
        """Offsets in the control memory: per queue its TX ring, RX ring, TX buffers, RX
        packet buffers and RX header buffers (all page aligned)."""
        ring = _pages(self.entries * spec.DESC_SIZE)
        at, self.tx, self.rx, self._ring_offsets = 0, {}, {}, {}
        for q in range(self.queue_count):
            tx_ring, rx_ring, at = at, at + ring, at + 2 * ring
            tx_bufs, at = at, at + _pages(self.entries * TX_BUFFER)
            pkt, at = at, at + _pages(self.entries * self.packet_buffer)
            hdr, at = at, at + _pages(self.entries * self.header_buffer)
            self.tx[q] = TxQueue(q, None, self.control_iova + tx_ring, TX_BUFFER, tx_bufs)
            self.rx[q] = RxQueue(q, None, self.control_iova + rx_ring, "ram", self.packet_buffer,
                                 self.header_buffer, pkt, hdr)
            self._ring_offsets[q] = (tx_ring, rx_ring)
        self._size = at

    @classmethod
    def open(cls, bdf: str, *, backend: str | None = None, container=None, ioas=None, **kwargs) -> "IgbDevice":
        device = VfioPciDevice.open(bdf, backend=backend, container=container, ioas=ioas)
        try:
            ids = device.config.read32(0)
            if ids != spec.PCI_DEVICE_82576 << 16 | spec.PCI_VENDOR_INTEL:
                raise IgbError(f"{bdf} is [{ids & 0xFFFF:04x}:{ids >> 16:04x}], not an 82576 "
                               f"[{spec.PCI_VENDOR_INTEL:04x}:{spec.PCI_DEVICE_82576:04x}]",
                               "pick an igb function (vfio-cxl nic ls)")
            return cls(device, **kwargs)
        except BaseException:
            device.close()
            raise

    # -- registers -------------------------------------------------------------------------

    def read(self, reg: int) -> int:
        return self.bar0.read32(reg)

    def write(self, reg: int, value: int) -> None:
        self.bar0.write32(reg, value & 0xFFFFFFFF)

    def _until(self, what: str, done, timeout: float, fix: str) -> None:
        """Poll ``done()`` until true; IgbTimeout naming ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise IgbTimeout(f"{self.bdf}: {what} within {timeout:g} s", fix)
            time.sleep(0.001)       # a register poll on a device with no completion interrupt

    # -- bring-up, one verb per step -----------------------------------------------------------

    def bring_up(self, steering: dict[bytes, int] | None = None) -> None:
        """Every step, in order; ``steering`` ({MAC: queue}) is programmed before the receiver
        is enabled, so frames the link held back meanwhile (QEMU holds them while RX is off)
        reach their queue, not the default one."""
        self.reset()
        self.configure_interrupts()
        self.link_up()
        self.configure_steering()
        for mac, queue in (steering or {}).items():
            self.steer(mac, queue)
        self.configure_queues()
        self.enable()

    def reset(self) -> None:
        """CTRL.RST, until the device clears it; every interrupt masked (IMC), rings forgotten."""
        self.write(spec.CTRL, self.read(spec.CTRL) | spec.CTRL_RST)
        self._until("CTRL.RST did not clear", lambda: not self.read(spec.CTRL) & spec.CTRL_RST,
                    RESET_TIMEOUT, "is the device alive? (lspci -vv; dmesg)")
        self.write(spec.IMC, 0xFFFFFFFF)
        self.write(spec.EIMC, 0xFFFFFFFF)
        self.write(spec.CTRL_EXT, self.read(spec.CTRL_EXT) | spec.CTRL_EXT_DRV_LOAD)
        self._steered.clear()

    def configure_interrupts(self) -> None:
        """MSI-X mode: RX queue n raises vector n, auto-cleared (EIAC), unmasked (EIMS).
        TX completions are polled (descriptor DD)."""
        if self.vectors is None:
            return
        mask = (1 << self.queue_count) - 1
        self.write(spec.GPIE, spec.GPIE_MSIX_MODE)
        for q in range(self.queue_count):
            self.write(spec.IVAR0 + 4 * q, spec.ivar(q, q))
        self.write(spec.EIAC, mask)
        self.write(spec.EIMS, mask)

    def link_up(self, timeout: float = LINK_TIMEOUT) -> None:
        """CTRL.SLU (full duplex), then wait for STATUS.LU; a PHY autoneg restart (MDIC, BMCR)
        if it is not up yet, which is what raises LU on QEMU's model."""
        self.write(spec.CTRL, self.read(spec.CTRL) | spec.CTRL_SLU | spec.CTRL_FD)
        if not self.link:
            self.write_phy(spec.PHY_BMCR, spec.BMCR_ANENABLE | spec.BMCR_ANRESTART)
        self._until("the link did not come up (STATUS.LU = 0)", lambda: self.link, timeout,
                    "is the NIC's netdev connected to its link? (the topology's [[vm.nic]] link)")

    @property
    def link(self) -> bool:
        return bool(self.read(spec.STATUS) & spec.STATUS_LU)

    def write_phy(self, reg: int, value: int) -> None:
        """A PHY register write over MDIO (PHY address 1), until MDIC.READY."""
        self.write(spec.MDIC, value | reg << spec.MDIC_REG_SHIFT | 1 << spec.MDIC_PHY_SHIFT | spec.MDIC_OP_WRITE)
        self._until(f"MDIC write of PHY register {reg} not ready", lambda: self.read(spec.MDIC) & spec.MDIC_READY,
                    RESET_TIMEOUT, "reset the device")
        if self.read(spec.MDIC) & spec.MDIC_ERROR:
            raise IgbError(f"{self.bdf}: the PHY refused a write of register {reg} (MDIC.ERROR)",
                           "check the register number")

    def configure_steering(self) -> None:
        """VMDq by MAC: queue n is pool n (every pool may receive and send); RA[0] (the
        NIC's MAC, loaded at reset) and broadcasts go to pool 0, and so does unicast that
        matches no receive address (VT_CTL's default pool)."""
        pools = (1 << self.queue_count) - 1
        ral, rah = self.read(spec.RAL0), self.read(spec.RAL0 + 4)
        self.write(spec.RAL0 + 4, (rah & ~(0xFF << spec.RAH_POOL_SHIFT)) | spec.RAH_AV | 1 << spec.RAH_POOL_SHIFT)
        self.write(spec.RAL0, ral)
        self.write(spec.VT_CTL, 0)
        self.write(spec.MRQC, spec.MRQC_VMDQ)
        self.write(spec.VFRE, pools)
        self.write(spec.VFTE, pools)
        for q in range(self.queue_count):                  # reset values kept (STRCRC, RLPML); BAM for pool 0
            vmolr = self.read(spec.VMOLR0 + 4 * q) & ~spec.VMOLR_BAM
            self.write(spec.VMOLR0 + 4 * q, vmolr | (spec.VMOLR_BAM if q == 0 else 0))

    @property
    def mac(self) -> bytes:
        return spec.mac_from_receive_address(self.read(spec.RAL0), self.read(spec.RAL0 + 4))

    def steer(self, mac: bytes, queue: int) -> None:
        """Frames to ``mac`` go to ``queue`` only (a receive address in pool ``queue``)."""
        self.rx_queue(queue)
        if mac == self.mac:
            raise IgbError(f"{spec.format_mac(mac)} is the NIC's own address (queue 0's)",
                           "steer another (locally administered) MAC, e.g. 02:00:00:00:01:01")
        if mac[0] & 1:
            raise IgbError(f"{spec.format_mac(mac)} is a multicast address", "steer a unicast MAC")
        slot = self._steered.get(mac) or next(
            (n for n in range(1, spec.RECEIVE_ADDRESSES) if n not in self._steered.values()), None)
        if slot is None:
            raise IgbError(f"all {spec.RECEIVE_ADDRESSES - 1} receive addresses are in use",
                           "steer fewer MACs")
        ral, rah = spec.receive_address(mac, queue)
        self.write(spec.RAL0 + 8 * slot + 4, 0)            # invalid while half written
        self.write(spec.RAL0 + 8 * slot, ral)
        self.write(spec.RAL0 + 8 * slot + 4, rah)
        self._steered[mac] = slot

    def configure_queues(self) -> None:
        """Every TX and RX ring: base, length, head = tail = 0, SRRCTL, enabled; ``ram``
        RX queues get ``rx_buffers`` buffers posted."""
        for q in range(self.queue_count):
            tx_off, rx_off = self._ring_offsets[q]
            ring_bytes = self.entries * spec.DESC_SIZE
            self.tx[q].ring = TxRing(self._view[tx_off:tx_off + ring_bytes], self.entries, f"{self.bdf} TX queue {q}")
            self.rx[q].ring = RxRing(self._view[rx_off:rx_off + ring_bytes], self.entries, f"{self.bdf} RX queue {q}")
            self._program_ring(spec.tx_reg, (spec.TDBAL0, spec.TDBAH0, spec.TDLEN0, spec.TDH0, spec.TDT0),
                               q, self.tx[q].ring_iova)
            self.write(spec.tx_reg(spec.TXDCTL0, q), spec.QUEUE_ENABLE)
            self.configure_rx(q)

    def configure_rx(self, queue: int, buffers: int | None = None) -> None:
        """RX ``queue`` on the driver's guest-RAM buffers (``ram`` mode, the open's layout),
        ``buffers`` of them posted (default ``rx_buffers``; 0: the device drops what is
        steered here, as long as another queue has buffers -- else QEMU holds frames back)."""
        buffers = self.rx_buffers if buffers is None else buffers
        if not 0 <= buffers < self.entries:
            raise IgbError(f"{buffers} RX buffers on a ring of {self.entries}", f"post 0 to {self.entries - 1}")
        rxq = self._program_rx(queue, "ram", self.packet_buffer, self.header_buffer)
        for slot in range(buffers):
            self._post_ram(rxq, slot)
        self._doorbell(queue)

    def configure_external_rx(self, queue: int, packet_buffer: int, header_buffer: int) -> None:
        """RX ``queue`` on buffers its owner posts (``post_rx``): packet buffers of
        ``packet_buffer`` bytes, header buffers of ``header_buffer`` (0: no split)."""
        self._program_rx(queue, "external", packet_buffer, header_buffer)

    def _program_rx(self, queue: int, mode: str, packet_buffer: int, header_buffer: int) -> RxQueue:
        """Disable the queue, forget its ring, program SRRCTL and the ring, enable it.  What
        was posted is forgotten: its owner took it back first (``take_back_rx``)."""
        rxq = self.rx_queue(queue)
        try:
            value = spec.srrctl(packet_buffer, header_buffer)
        except ValueError as err:
            raise IgbError(f"RX queue {queue}: {err}", "pick buffer sizes the 82576 can express") from None
        self.write(spec.rx_reg(spec.RXDCTL0, queue), 0)
        rxq.ring.reset()
        rxq.partial.clear()
        rxq.mode, rxq.packet_buffer, rxq.header_buffer = mode, packet_buffer, header_buffer
        self._program_ring(spec.rx_reg, (spec.RDBAL0, spec.RDBAH0, spec.RDLEN0, spec.RDH0, spec.RDT0),
                           queue, rxq.ring_iova)
        self.write(spec.rx_reg(spec.SRRCTL0, queue), value)
        self.write(spec.rx_reg(spec.RXDCTL0, queue), spec.QUEUE_ENABLE)
        return rxq

    def _program_ring(self, reg, names: tuple[int, ...], queue: int, iova: int) -> None:
        bal, bah, length, head, tail = names
        self.write(reg(bal, queue), iova & 0xFFFFFFFF)
        self.write(reg(bah, queue), iova >> 32)
        self.write(reg(length, queue), self.entries * spec.DESC_SIZE)
        self.write(reg(head, queue), 0)
        self.write(reg(tail, queue), 0)

    def enable(self) -> None:
        """Receiver (broadcasts accepted, FCS stripped) and transmitter (short frames padded) on."""
        self.write(spec.RCTL, spec.RCTL_EN | spec.RCTL_BAM | spec.RCTL_SECRC)
        self.write(spec.TCTL, spec.TCTL_EN | spec.TCTL_PSP)

    # -- transmit --------------------------------------------------------------------------

    def send(self, frames: list[bytes], queue: int = 0, timeout: float = TX_TIMEOUT) -> int:
        """Copy each frame into a TX buffer and send them, one tail write per batch; returns
        once the device wrote every descriptor back (or IgbTimeout).  -> frames sent."""
        txq = self._txq(queue)
        for i, frame in enumerate(frames):
            if not ETH_HEADER <= len(frame) <= min(txq.buffer, MAX_FRAME):
                raise IgbError(f"frame {i} is {len(frame)} bytes: a TX buffer takes "
                               f"{ETH_HEADER} to {min(txq.buffer, MAX_FRAME)} (an Ethernet header at least, "
                               "no FCS: the device appends it)", "send smaller frames (or split them)")
        sent = 0
        while sent < len(frames):
            self._room(txq, timeout)
            while sent < len(frames) and txq.ring.free:
                slot = txq.ring.tail
                at = txq.buf_base + slot * txq.buffer
                self._view[at:at + len(frames[sent])] = frames[sent]
                txq.ring.post(spec.pack_tx(self.control_iova + at, len(frames[sent])), len(frames[sent]))
                sent += 1
            self.write(spec.tx_reg(spec.TDT0, queue), txq.ring.tail)
        self.flush_tx(queue, timeout)
        return sent

    def send_iova(self, iova: int, length: int, queue: int = 0, timeout: float = TX_TIMEOUT) -> None:
        """Send the ``length`` bytes at ``iova`` as one frame: any address of the context (a
        GPU's BAR2 mapped beside the NIC).  The bytes must begin with an Ethernet header."""
        txq = self._txq(queue)
        if not ETH_HEADER <= length <= MAX_FRAME:
            raise IgbError(f"a {length}-byte frame at {iova:#x}", f"send {ETH_HEADER} to {MAX_FRAME} bytes")
        self._room(txq, timeout)
        txq.ring.post(spec.pack_tx(iova, length), length)
        self.write(spec.tx_reg(spec.TDT0, queue), txq.ring.tail)

    def send_gather(self, frames: list[tuple[bytes, int, int]], queue: int = 0, timeout: float = TX_TIMEOUT) -> int:
        """Send frames of two parts each, ``(header, iova, length)``: ``header`` copied into a
        TX buffer (an Ethernet header at least), then ``length`` bytes at ``iova`` -- any
        address of the context, a GPU's BAR2 mapped beside the NIC -- read by the device where
        they are (``length`` 0: the header alone).  Two descriptors per frame, EOP on the
        second, one tail write per batch; returns once every descriptor is written back.
        -> frames sent."""
        txq = self._txq(queue)
        for i, (header, _, length) in enumerate(frames):
            if not ETH_HEADER <= len(header) <= txq.buffer or length < 0 or len(header) + length > MAX_FRAME:
                raise IgbError(f"frame {i}: a {len(header)}-byte header and {length} bytes at its IOVA",
                               f"a header of {ETH_HEADER} to {txq.buffer} bytes, at most {MAX_FRAME} in all "
                               "(no FCS: the device appends it)")
        sent = 0
        while sent < len(frames):
            self._room(txq, timeout, 2)
            while sent < len(frames) and txq.ring.free >= 2:
                self._post_gather(txq, *frames[sent])
                sent += 1
            self.write(spec.tx_reg(spec.TDT0, queue), txq.ring.tail)
        self.flush_tx(queue, timeout)
        return sent

    def _post_gather(self, txq: TxQueue, header: bytes, iova: int, length: int) -> None:
        at = txq.buf_base + txq.ring.tail * txq.buffer
        self._view[at:at + len(header)] = header
        total = len(header) + length
        if not length:
            txq.ring.post(spec.pack_tx(self.control_iova + at, len(header), paylen=total), len(header))
            return
        txq.ring.post(spec.pack_tx(self.control_iova + at, len(header), eop=False, paylen=total), len(header))
        txq.ring.post(spec.pack_tx(iova, length, paylen=total), length)

    def flush_tx(self, queue: int = 0, timeout: float = TX_TIMEOUT) -> None:
        """Until every posted TX descriptor is written back (sent)."""
        txq = self._txq(queue)

        def all_sent() -> bool:
            txq.ring.reclaim()
            return txq.ring.posted == 0

        self._until(f"TX queue {queue}: {txq.ring.posted} descriptors not sent", all_sent, timeout,
                    "is the link up and the transmitter enabled? (vfio-cxl nic stats)")

    def _room(self, txq: TxQueue, timeout: float, need: int = 1) -> None:
        """Until TX queue ``txq`` has ``need`` free descriptors (sent ones reclaimed)."""
        def room() -> bool:
            txq.ring.reclaim()
            return txq.ring.free >= need

        self._until(f"TX queue {txq.index} stayed full", room, timeout, "is the link up? (vfio-cxl nic stats)")

    # -- receive ---------------------------------------------------------------------------

    def recv(self, queue: int = 0, count: int = 1, timeout: float = 1.0) -> list[bytes]:
        """Up to ``count`` frames from ``ram`` queue ``queue`` (header and payload joined when
        split), waiting ``timeout`` seconds at most for the first; [] if none came.  Each
        buffer is posted again once its bytes are copied out."""
        rxq = self.rx_queue(queue)
        if rxq.mode != "ram":
            raise IgbError(f"RX queue {queue} is bound to external buffers (devmem)",
                           "receive from it through its binding (vfio_cxl.guest.nic.devmem)")
        frames: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(frames) < count:
            frames += self._reap_ram(rxq, count - len(frames))
            if len(frames) < count and not self.wait_rx(queue, deadline):
                frames += self._reap_ram(rxq, count - len(frames))
                break
        return frames

    def _reap_ram(self, rxq: RxQueue, most: int) -> list[bytes]:
        frames = []
        reposted = False
        for slot, c in rxq.ring.reap(frames=most):
            pkt = rxq.pkt_base + slot * rxq.packet_buffer
            hdr = rxq.hdr_base + slot * rxq.header_buffer
            head = bytes(self._view[hdr:hdr + min(c.hdr_len, rxq.header_buffer)]) if rxq.header_buffer else b""
            rxq.partial.append(head + bytes(self._view[pkt:pkt + c.length]))
            self._post_ram(rxq, slot)
            reposted = True
            if c.eop:
                frames.append(b"".join(rxq.partial))
                rxq.partial.clear()
        if reposted:
            self._doorbell(rxq.index)
        return frames

    def _post_ram(self, rxq: RxQueue, slot: int) -> None:
        pkt = self.control_iova + rxq.pkt_base + slot * rxq.packet_buffer
        hdr = self.control_iova + rxq.hdr_base + slot * rxq.header_buffer if rxq.header_buffer else 0
        rxq.ring.post(spec.pack_rx(pkt, hdr), slot)

    def post_rx(self, queue: int, buffers: list[tuple[int, int, object]]) -> int:
        """``external`` queue: post (pkt_addr, hdr_addr, cookie) while the ring has room, one
        tail write; -> how many were posted."""
        rxq = self._external(queue)
        n = 0
        for pkt, hdr, cookie in buffers:
            if not rxq.ring.free:
                break
            rxq.ring.post(spec.pack_rx(pkt, hdr), cookie)
            n += 1
        if n:
            self._doorbell(queue)
        return n

    def reap_rx(self, queue: int, frames: int | None = None) -> list[tuple[object, spec.RxCompletion]]:
        """``external`` queue: (cookie, completion) of every written-back descriptor, or of
        the first ``frames`` whole frames' (the rest stay in the ring for the next call)."""
        return self._external(queue).ring.reap(frames)

    def take_back_rx(self, queue: int, *, enable: bool = False) -> list[object]:
        """Disable ``queue`` and take back every buffer still posted on it (their cookies):
        after this the device writes nothing more there.  ``enable``: the queue is enabled
        again, empty, ready for its owner's next ``post_rx``."""
        rxq = self.rx_queue(queue)
        self.write(spec.rx_reg(spec.RXDCTL0, queue), 0)
        self.read(spec.STATUS)                  # the disable is posted: this read flushes it
        held = rxq.ring.reset()
        self._program_ring(spec.rx_reg, (spec.RDBAL0, spec.RDBAH0, spec.RDLEN0, spec.RDH0, spec.RDT0),
                           queue, rxq.ring_iova)
        if enable:
            self.write(spec.rx_reg(spec.RXDCTL0, queue), spec.QUEUE_ENABLE)
        return held

    def rx_ring_state(self, queue: int) -> dict[str, int | bool]:
        """RX ``queue`` as the device and the driver see it: the device's head and tail
        (RDH, RDT), the driver's oldest posted slot and next slot, how many are posted, and
        whether the device has written back the oldest one (its DD bit) -- what a receiver
        that stopped seeing frames reports."""
        ring = self.rx_queue(queue).ring
        return {"head": self.read(spec.rx_reg(spec.RDH0, queue)), "tail": self.read(spec.rx_reg(spec.RDT0, queue)),
                "driver_clean": ring.clean, "driver_tail": ring.tail, "posted": ring.posted,
                "oldest_done": bool(ring.posted) and spec.rx_done(ring.desc(ring.clean))}

    def wait_rx(self, queue: int, deadline: float) -> bool:
        """Until RX ``queue``'s vector fires, one of ``wake_fds`` becomes readable or
        ``deadline`` (time.monotonic()) passes; whether the queue's vector fired (a wake fd
        alone: False, the caller looks at what woke it).  Polled mode: one short poll interval
        (the ring is read again)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if self.vectors is None:
            time.sleep(min(left, 0.001))        # polled mode: no event to wait on
            return True
        wait_readable((self.vectors.eventfds[queue], *self.wake_fds), left)
        return self.vectors.pending(queue) > 0  # consumed: the ring is read next either way

    def _doorbell(self, queue: int) -> None:
        self.write(spec.rx_reg(spec.RDT0, queue), self.rx_queue(queue).ring.tail)

    def rx_queue(self, queue: int) -> RxQueue:
        """RX queue ``queue`` (its ring, mode and buffer layout); a clear error for one not opened."""
        if queue not in self.rx:
            raise IgbError(f"RX queue {queue}", f"this driver opened queues 0-{self.queue_count - 1}")
        return self.rx[queue]

    def _txq(self, queue: int) -> TxQueue:
        self.rx_queue(queue)
        return self.tx[queue]

    def _external(self, queue: int) -> RxQueue:
        rxq = self.rx_queue(queue)
        if rxq.mode != "external":
            raise IgbError(f"RX queue {queue} holds the driver's guest-RAM buffers",
                           "configure_external_rx(queue, ...) first (a devmem binding does)")
        return rxq

    # -- statistics ------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Running totals since open of the statistics registers (they clear on read: every
        read is folded in here), and ``rx_overrun_events``: reads of ICR that found RXO (a
        frame met a queue without buffers)."""
        for name, reg in spec.STATS32.items():
            self._totals[name] += self.read(reg)
        for name, reg in spec.STATS64.items():
            low = self.read(reg)
            self._totals[name] += low | self.read(reg + 4) << 32
        self._totals["rx_overrun_events"] += bool(self.read(spec.ICR) & spec.ICR_RXO)
        return dict(self._totals)

    def describe(self) -> dict:
        return {"bdf": self.bdf, "mac": spec.format_mac(self.mac), "link": self.link,
                "queues": self.queue_count, "entries": self.entries, "vfio_backend": self.device.backend,
                "interrupts": "msix" if self.vectors else "polled",
                "rx": {q: {"mode": r.mode, "packet_buffer": r.packet_buffer, "header_buffer": r.header_buffer,
                           "posted": r.ring.posted if r.ring else 0} for q, r in self.rx.items()}}

    # -- closing ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Receiver, transmitter and every queue off, interrupts masked: the device DMAs no
        more, so its mappings (and any external RX buffers) can go.  No reset here: bring-up
        does one, and vfio-pci resets the function when the device is next opened."""
        if self.device.device is None or self.device.device.fd < 0:
            return
        self.write(spec.RCTL, 0)
        self.write(spec.TCTL, 0)
        for q in range(self.queue_count):
            self.write(spec.rx_reg(spec.RXDCTL0, q), 0)
            self.write(spec.tx_reg(spec.TXDCTL0, q), 0)
        self.write(spec.EIMC, 0xFFFFFFFF)
        self.read(spec.STATUS)                 # the writes are posted: this read flushes them

    def _release(self) -> None:
        if self.vectors is not None:
            self.vectors.close()
            self.vectors = None
        self._control_dma.close()

    def close(self) -> None:
        """``shutdown``, then the vectors, the control mapping and the device."""
        try:
            self.shutdown()
            self._release()
        finally:
            self.device.close()

    def __enter__(self) -> "IgbDevice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def find_nics(sysfs=None) -> list[str]:
    """BDFs of the 82576 functions in this VM (``sysfs``: a ``vfio.bind.Sysfs``, for tests)."""
    return find_pci_devices(spec.PCI_VENDOR_INTEL, spec.PCI_DEVICE_82576, sysfs)
