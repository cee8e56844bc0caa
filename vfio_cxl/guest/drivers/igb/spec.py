"""The 82576 (igb) as this driver uses it: registers, bits and the advanced descriptors.

Numbers from the 82576 datasheet as QEMU's model implements them (hw/net/igb_regs.h,
e1000x_regs.h, igb_core.c; docs/nic.md lists what was checked there).  Each descriptor
layout is packed and unpacked in one place, with ``struct``: 16 bytes, little-endian.

Advanced TX data descriptor (read form; the device writes DD into ``status`` when RS is set)::

    0  buffer_addr u64 | 8 cmd_type_len u32 | 12 olinfo_status u32
    cmd_type_len: DTALEN 15:0, DTYP 23:20 (0011 data), EOP 24, IFCS 25, RS 27, DEXT 29
    olinfo_status: PAYLEN 31:14;  write-back: 12 status u32, DD bit 0

Advanced RX descriptor, read form (posted by the driver) and write-back form (by the device)::

    read:  0 pkt_addr u64 | 8 hdr_addr u64
    wb:    0 pkt_info u16 | 2 hdr_info u16 | 4 rss u32 | 8 status_error u32 | 12 length u16 | 14 vlan u16
    hdr_info: HDR_LEN 14:5, SPH 15;  status_error: DD 0, EOP 1, HBO 23, RXE 31
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PCI_VENDOR_INTEL = 0x8086
PCI_DEVICE_82576 = 0x10C9
DESC_SIZE = 16
MAX_QUEUES = 8                    # VMDq pools 0-7, one queue each (queue n = pool n)
MSIX_VECTORS = 10                 # QEMU's igb: IGB_MSIX_VEC_NUM

# -- general ---------------------------------------------------------------------------------
CTRL = 0x00000
CTRL_FD = 1 << 0
CTRL_SLU = 1 << 6                 # set link up
CTRL_RST = 1 << 26                # self-clearing
STATUS = 0x00008
STATUS_LU = 1 << 1
CTRL_EXT = 0x00018
CTRL_EXT_DRV_LOAD = 1 << 28
MDIC = 0x00020
MDIC_REG_SHIFT = 16
MDIC_PHY_SHIFT = 21
MDIC_OP_WRITE = 1 << 26
MDIC_READY = 1 << 28
MDIC_ERROR = 1 << 30
PHY_BMCR = 0x00
BMCR_ANRESTART = 1 << 9
BMCR_ANENABLE = 1 << 12

# -- interrupts ------------------------------------------------------------------------------
ICR = 0x000C0                     # read to clear (with IMS = 0)
ICR_RXO = 1 << 6                  # receiver overrun: a frame found its queue without buffers
IMC = 0x000D8
GPIE = 0x01514
GPIE_MSIX_MODE = 1 << 4
EIMS = 0x01524
EIMC = 0x01528
EIAC = 0x0152C
EICR = 0x01580
IVAR0 = 0x01700                   # IVAR[n]: byte 0 RX queue n, byte 1 TX queue n (n < 8)
IVAR_VALID = 0x80

# -- receive ---------------------------------------------------------------------------------
RCTL = 0x00100
RCTL_EN = 1 << 1
RCTL_LPE = 1 << 5
RCTL_BAM = 1 << 15
RCTL_SECRC = 1 << 26              # strip the FCS (else 4 bytes follow every frame)
RLPML = 0x05004
RAL0 = 0x05400                    # RAL[n] = RAL0 + 8n, RAH[n] = RAL[n] + 4, n < 16
RAH_AV = 1 << 31
RAH_POOL_SHIFT = 18               # RAH.POOLSEL 25:18: one bit per VMDq pool
RECEIVE_ADDRESSES = 16
MRQC = 0x05818
MRQC_VMDQ = 0x3                   # QEMU steers by VMDq when MRQC bit 0 is set
VT_CTL = 0x0581C                  # default pool 9:7 = 0
VFRE = 0x00C8C                    # pools allowed to receive
VFTE = 0x00C90                    # pools allowed to transmit
VMOLR0 = 0x05AD0                  # VMOLR[n] = VMOLR0 + 4n
VMOLR_LPE = 1 << 16
VMOLR_BAM = 1 << 27
VMOLR_RLPML_MASK = 0x3FFF

RX_QUEUE_STRIDE = 0x40
RDBAL0, RDBAH0, RDLEN0, SRRCTL0, RDH0, RDT0, RXDCTL0 = (0x0C000, 0x0C004, 0x0C008, 0x0C00C, 0x0C010,
                                                       0x0C018, 0x0C028)
QUEUE_ENABLE = 1 << 25            # RXDCTL / TXDCTL

SRRCTL_BSIZEPACKET_MASK = 0x7F    # 6:0, 1 KiB units
SRRCTL_BSIZEPACKET_UNIT = 1024
SRRCTL_BSIZEHEADER_SHIFT = 8      # 11:8, 64-byte units (QEMU reads four bits: at most 960 bytes)
SRRCTL_BSIZEHEADER_MASK = 0xF
SRRCTL_BSIZEHEADER_UNIT = 64
SRRCTL_DESCTYPE_ADV_ONEBUF = 0x1 << 25
SRRCTL_DESCTYPE_HDR_SPLIT = 0x2 << 25
SRRCTL_DESCTYPE_HDR_SPLIT_ALWAYS = 0x5 << 25
MAX_HEADER_BUFFER = SRRCTL_BSIZEHEADER_MASK * SRRCTL_BSIZEHEADER_UNIT
MAX_PACKET_BUFFER = SRRCTL_BSIZEPACKET_MASK * SRRCTL_BSIZEPACKET_UNIT

# -- transmit --------------------------------------------------------------------------------
TCTL = 0x00400
TCTL_EN = 1 << 1
TCTL_PSP = 1 << 3                 # pad short frames to 64 bytes
TX_QUEUE_STRIDE = 0x40
TDBAL0, TDBAH0, TDLEN0, TDH0, TDT0, TXDCTL0 = 0x0E000, 0x0E004, 0x0E008, 0x0E010, 0x0E018, 0x0E028

# -- descriptor bits -------------------------------------------------------------------------
TXD_DTALEN_MASK = 0xFFFF
TXD_DTYP_DATA = 0x3 << 20
TXD_CMD_EOP = 1 << 24
TXD_CMD_IFCS = 1 << 25
TXD_CMD_RS = 1 << 27
TXD_CMD_DEXT = 1 << 29
TXD_PAYLEN_SHIFT = 14
TXD_STAT_DD = 1 << 0

RXD_STAT_DD = 1 << 0
RXD_STAT_EOP = 1 << 1
RXD_STAT_HBO = 1 << 23            # header buffer overflow: the header was longer than BSIZEHEADER
RXD_ERR_RXE = 1 << 31
RXD_HDR_LEN_SHIFT = 5
RXD_HDR_LEN_MASK = 0x3FF
RXD_HDR_SPH = 1 << 15             # split header: the split fell on a protocol header boundary

# -- statistics (clear on read; the 64-bit octet counters read low, then high) -------------------
STATS32 = {"crcerrs": 0x04000, "mpc": 0x04010, "gprc": 0x04074, "bprc": 0x04078, "mprc": 0x0407C,
           "gptc": 0x04080, "rnbc": 0x040A0, "ruc": 0x040A4, "roc": 0x040AC, "tpr": 0x040D0,
           "tpt": 0x040D4}
STATS64 = {"gorc": 0x04088, "gotc": 0x04090, "tor": 0x040C0, "tot": 0x040C8}

_DESC = struct.Struct("<QII")          # TX read / write-back
_RX_READ = struct.Struct("<QQ")
_RX_WB = struct.Struct("<HHIIHH")


def rx_reg(base: int, queue: int) -> int:
    return base + RX_QUEUE_STRIDE * queue


def tx_reg(base: int, queue: int) -> int:
    return base + TX_QUEUE_STRIDE * queue


# -- TX --------------------------------------------------------------------------------------

def pack_tx(buffer_addr: int, length: int, *, eop: bool = True, rs: bool = True, paylen: int | None = None) -> bytes:
    """An advanced TX data descriptor for ``length`` bytes at ``buffer_addr`` (FCS inserted);
    ``paylen``: the whole frame's bytes when it spans several descriptors (default ``length``)."""
    if not 0 < length <= TXD_DTALEN_MASK:
        raise ValueError(f"a TX buffer of {length} bytes: DTALEN holds 1 to {TXD_DTALEN_MASK}")
    cmd = length | TXD_DTYP_DATA | TXD_CMD_DEXT | TXD_CMD_IFCS
    cmd |= (TXD_CMD_EOP if eop else 0) | (TXD_CMD_RS if rs else 0)
    return _DESC.pack(buffer_addr, cmd, (length if paylen is None else paylen) << TXD_PAYLEN_SHIFT)


def tx_done(desc: bytes) -> bool:
    """The device wrote DD back into this TX descriptor."""
    return bool(_DESC.unpack_from(desc)[2] & TXD_STAT_DD)


# -- RX --------------------------------------------------------------------------------------

def pack_rx(pkt_addr: int, hdr_addr: int = 0) -> bytes:
    """An advanced RX descriptor, read form: payload at ``pkt_addr``, header at ``hdr_addr``."""
    return _RX_READ.pack(pkt_addr, hdr_addr)


@dataclass(frozen=True)
class RxCompletion:
    """An RX descriptor's write-back form, decoded."""

    length: int          # bytes in the packet buffer (the payload when the frame was split)
    hdr_len: int         # bytes in the header buffer (HDR_LEN)
    sph: bool            # the split fell on a header boundary
    hbo: bool            # the header did not fit BSIZEHEADER
    eop: bool
    error: bool
    pkt_info: int
    vlan: int

    @property
    def split(self) -> bool:
        """Header and payload were separated at a protocol boundary (SPH set, no HBO)."""
        return self.sph and not self.hbo


def rx_done(desc: bytes) -> bool:
    return bool(_RX_WB.unpack_from(desc)[3] & RXD_STAT_DD)


def unpack_rx(desc: bytes) -> RxCompletion:
    pkt_info, hdr_info, _rss, status, length, vlan = _RX_WB.unpack_from(desc)
    return RxCompletion(length=length, hdr_len=hdr_info >> RXD_HDR_LEN_SHIFT & RXD_HDR_LEN_MASK,
                        sph=bool(hdr_info & RXD_HDR_SPH), hbo=bool(status & RXD_STAT_HBO),
                        eop=bool(status & RXD_STAT_EOP), error=bool(status & RXD_ERR_RXE),
                        pkt_info=pkt_info, vlan=vlan)


def pack_rx_writeback(c: RxCompletion) -> bytes:
    """The write-back form of ``c`` with DD set: what the device writes (tests, fakes)."""
    hdr_info = (c.hdr_len & RXD_HDR_LEN_MASK) << RXD_HDR_LEN_SHIFT | (RXD_HDR_SPH if c.sph else 0)
    status = RXD_STAT_DD | (RXD_STAT_EOP if c.eop else 0) | (RXD_STAT_HBO if c.hbo else 0)
    status |= RXD_ERR_RXE if c.error else 0
    return _RX_WB.pack(c.pkt_info, hdr_info, 0, status, c.length, c.vlan)


def srrctl(packet_buffer: int, header_buffer: int = 0) -> int:
    """SRRCTL for a queue: ``packet_buffer`` bytes per descriptor (whole KiB); with
    ``header_buffer`` (whole 64-byte units, at most 960) header split always, else one buffer."""
    if packet_buffer <= 0 or packet_buffer % SRRCTL_BSIZEPACKET_UNIT or packet_buffer > MAX_PACKET_BUFFER:
        raise ValueError(f"a packet buffer of {packet_buffer} bytes: BSIZEPACKET takes whole KiB, "
                         f"1 to {MAX_PACKET_BUFFER // SRRCTL_BSIZEPACKET_UNIT} of them")
    value = packet_buffer // SRRCTL_BSIZEPACKET_UNIT
    if not header_buffer:
        return value | SRRCTL_DESCTYPE_ADV_ONEBUF
    if header_buffer < 0 or header_buffer % SRRCTL_BSIZEHEADER_UNIT or header_buffer > MAX_HEADER_BUFFER:
        raise ValueError(f"a header buffer of {header_buffer} bytes: BSIZEHEADER takes 64-byte units, "
                         f"64 to {MAX_HEADER_BUFFER} bytes")
    units = header_buffer // SRRCTL_BSIZEHEADER_UNIT
    return value | units << SRRCTL_BSIZEHEADER_SHIFT | SRRCTL_DESCTYPE_HDR_SPLIT_ALWAYS


# -- addresses -------------------------------------------------------------------------------

def parse_mac(text: str) -> bytes:
    """``aa:bb:cc:dd:ee:ff`` -> 6 bytes (a clear ValueError otherwise)."""
    parts = text.strip().split(":")
    try:
        mac = bytes(int(p, 16) for p in parts)
    except ValueError:
        mac = b""
    if len(parts) != 6 or len(mac) != 6 or any(len(p) != 2 for p in parts):
        raise ValueError(f"{text!r} is not a MAC address (six hex pairs: 52:54:00:12:34:56)")
    return mac


def format_mac(mac: bytes) -> str:
    return ":".join(f"{b:02x}" for b in mac)


def receive_address(mac: bytes, pool: int) -> tuple[int, int]:
    """(RAL, RAH) matching ``mac`` and steering it to VMDq ``pool``."""
    if len(mac) != 6:
        raise ValueError(f"a MAC address of {len(mac)} bytes")
    if not 0 <= pool < MAX_QUEUES:
        raise ValueError(f"pool {pool}: the 82576 has pools 0-{MAX_QUEUES - 1}")
    ral = int.from_bytes(mac[:4], "little")
    rah = int.from_bytes(mac[4:], "little") | RAH_AV | 1 << (RAH_POOL_SHIFT + pool)
    return ral, rah


def mac_from_receive_address(ral: int, rah: int) -> bytes:
    return ral.to_bytes(4, "little") + (rah & 0xFFFF).to_bytes(2, "little")


def ivar(queue: int, vector: int) -> int:
    """IVAR[queue] mapping RX queue ``queue`` to MSI-X ``vector`` (TX: no vector, polled)."""
    return IVAR_VALID | vector
