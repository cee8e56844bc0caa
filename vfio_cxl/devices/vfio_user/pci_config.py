"""PCI configuration space of a vfio-user device (4 KiB, PCI Express endpoint).

Layout: type-0 header, capability list at 0x40 (PCI Express v2 endpoint)
-> 0x80 (MSI-X), no extended capabilities.  Writes go through a per-byte
write mask (like real hardware and QEMU's own emulation) plus a
write-1-to-clear mask, so BAR sizing works: writing all ones to a BAR reads
back its size mask with the type bits, and the ROM BAR (absent) reads 0.

QEMU answers the guest's BAR reads itself, but it forwards every config
write to us and reads the whole space once at realize time; the guest's
vfio-pci in turn reads through QEMU.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


SIZE = 0x1000

# standard header offsets
VENDOR_ID = 0x00
DEVICE_ID = 0x02
COMMAND = 0x04
STATUS = 0x06
REVISION = 0x08
CLASS_PROG = 0x09
CACHE_LINE = 0x0C
HEADER_TYPE = 0x0E
BAR0 = 0x10
SUBSYS_VENDOR = 0x2C
SUBSYS_ID = 0x2E
ROM_BAR = 0x30
CAP_PTR = 0x34
INTERRUPT_LINE = 0x3C
INTERRUPT_PIN = 0x3D

STATUS_CAP_LIST = 0x0010
COMMAND_BUS_MASTER = 0x0004
COMMAND_WRITABLE = 0x0546  # memory space, bus master, parity, SERR#, INTx disable
STATUS_W1C = 0xF900  # error bits (never set by this device)

BAR_MEM_64 = 0x4
BAR_PREFETCH = 0x8

# capability offsets
PCIE_CAP = 0x40
PCIE_CAP_ID = 0x10
PCIE_CAP_LEN = 0x3C
MSIX_CAP = 0x80  # the interrupt capability sits here: MSI-X, or MSI instead
MSIX_CAP_ID = 0x11
MSI_CAP = 0x80
MSI_CAP_ID = 0x05

# offsets inside the PCI Express capability
EXP_FLAGS = 0x02
EXP_DEVCAP = 0x04
EXP_DEVCTL = 0x08
EXP_DEVSTA = 0x0A
EXP_LNKCAP = 0x0C
EXP_LNKCTL = 0x10
EXP_LNKSTA = 0x12
EXP_DEVCTL2 = 0x28
EXP_LNKCAP2 = 0x2C
EXP_LNKCTL2 = 0x30

EXP_FLAGS_V2_ENDPOINT = 0x0002  # capability version 2, device/port type 0 (endpoint)
EXP_DEVCAP_RBER = 1 << 15
EXP_DEVCAP_FLR = 1 << 28
EXP_DEVCTL_DEFAULT = 0x2810  # MRRS 512 B, no-snoop, relaxed ordering
EXP_DEVCTL_FLR = 1 << 15  # initiate function-level reset (write-only)
EXP_LINK_X1_GEN1 = 0x0011  # 2.5 GT/s, x1

# offsets inside the MSI-X capability
MSIX_FLAGS = 0x02
MSIX_TABLE = 0x04
MSIX_PBA = 0x08
MSIX_FLAGS_ENABLE = 1 << 15
MSIX_FLAGS_MASKALL = 1 << 14

# offsets inside the MSI capability (64-bit address, no per-vector masking)
MSI_FLAGS = 0x02
MSI_ADDRESS_LO = 0x04
MSI_ADDRESS_HI = 0x08
MSI_DATA = 0x0C
MSI_FLAGS_ENABLE = 1 << 0
MSI_FLAGS_QMASK = 0x7 << 1  # Multiple Message Capable (log2)
MSI_FLAGS_QSIZE = 0x7 << 4  # Multiple Message Enable (log2), written by the OS
MSI_FLAGS_64BIT = 1 << 7


@dataclass(frozen=True)
class PciIdentity:
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int
    subsystem_id: int
    revision: int
    class_code: int  # base << 16 | sub << 8 | prog-if


@dataclass(frozen=True)
class MsixLayout:
    vectors: int
    bar: int  # BAR index holding table and PBA
    table_offset: int
    pba_offset: int


@dataclass(frozen=True)
class Bar:
    index: int
    size: int  # power of two >= 4096, or 0 for unimplemented
    type_bits: int  # low read-only bits: 64-bit / prefetchable


def _put(buf: bytearray, offset: int, fmt: str, value: int) -> None:
    struct.pack_into("<" + fmt, buf, offset, value)


class PciConfig:
    """Config space bytes with write masks; ``write`` reports an FLR request."""

    def __init__(self, identity: PciIdentity, bars: list[Bar], msix: MsixLayout | None = None,
                 msi_vectors: int = 0):
        """The interrupt capability at 0x80 is MSI-X (``msix``) or else MSI with
        ``msi_vectors`` (a power of two, 1..32)."""
        if (msix is None) == (msi_vectors == 0):
            raise ValueError("give either an MSI-X layout or an MSI vector count")
        if msi_vectors and (msi_vectors & (msi_vectors - 1) or msi_vectors > 32):
            raise ValueError(f"MSI vector count {msi_vectors} is not a power of two <= 32")
        self.identity = identity
        self.bars = {bar.index: bar for bar in bars}
        self.msix = msix
        self.msi_vectors = msi_vectors
        self._reset_image = bytearray(SIZE)
        self.wmask = bytearray(SIZE)
        self.w1cmask = bytearray(SIZE)
        self._build()
        self.data = bytearray(self._reset_image)

    # ------------------------------------------------------------ building
    def _build(self) -> None:
        img, wm, w1c, ident = self._reset_image, self.wmask, self.w1cmask, self.identity
        _put(img, VENDOR_ID, "H", ident.vendor_id)
        _put(img, DEVICE_ID, "H", ident.device_id)
        _put(img, STATUS, "H", STATUS_CAP_LIST)
        _put(img, REVISION, "I", (ident.class_code << 8) | ident.revision)
        _put(img, SUBSYS_VENDOR, "H", ident.subsystem_vendor_id)
        _put(img, SUBSYS_ID, "H", ident.subsystem_id)
        img[CAP_PTR] = PCIE_CAP
        _put(wm, COMMAND, "H", COMMAND_WRITABLE)
        _put(w1c, STATUS, "H", STATUS_W1C)
        wm[CACHE_LINE] = 0xFF
        wm[INTERRUPT_LINE] = 0xFF
        # interrupt pin 0: no INTx, MSI-X only

        for bar in self.bars.values():
            off = BAR0 + 4 * bar.index
            _put(img, off, "I", bar.type_bits)
            mask = ~(bar.size - 1) & 0xFFFFFFFFFFFFFFFF
            _put(wm, off, "I", mask & 0xFFFFFFF0)
            if bar.type_bits & BAR_MEM_64:
                _put(wm, off + 4, "I", mask >> 32)
        # ROM BAR stays 0 with no writable bits: "no expansion ROM".

        # PCI Express capability (endpoint, v2)
        p = PCIE_CAP
        img[p] = PCIE_CAP_ID
        img[p + 1] = MSIX_CAP
        _put(img, p + EXP_FLAGS, "H", EXP_FLAGS_V2_ENDPOINT)
        _put(img, p + EXP_DEVCAP, "I", EXP_DEVCAP_RBER | EXP_DEVCAP_FLR)
        _put(img, p + EXP_DEVCTL, "H", EXP_DEVCTL_DEFAULT)
        _put(wm, p + EXP_DEVCTL, "H", 0x7FFF)
        _put(w1c, p + EXP_DEVSTA, "H", 0x000F)
        _put(img, p + EXP_LNKCAP, "I", EXP_LINK_X1_GEN1)
        _put(wm, p + EXP_LNKCTL, "H", 0x0FFB)
        _put(img, p + EXP_LNKSTA, "H", EXP_LINK_X1_GEN1)
        _put(wm, p + EXP_DEVCTL2, "H", 0x041F)
        _put(img, p + EXP_LNKCAP2, "I", 0x2)  # supports 2.5 GT/s
        _put(img, p + EXP_LNKCTL2, "H", 0x1)  # target 2.5 GT/s
        _put(wm, p + EXP_LNKCTL2, "H", 0x000F)

        if self.msix is None:
            self._build_msi()
            return
        # MSI-X capability: table and PBA in BAR4
        m = MSIX_CAP
        img[m] = MSIX_CAP_ID
        img[m + 1] = 0
        _put(img, m + MSIX_FLAGS, "H", self.msix.vectors - 1)
        _put(wm, m + MSIX_FLAGS, "H", MSIX_FLAGS_ENABLE | MSIX_FLAGS_MASKALL)
        _put(img, m + MSIX_TABLE, "I", self.msix.table_offset | self.msix.bar)
        _put(img, m + MSIX_PBA, "I", self.msix.pba_offset | self.msix.bar)

    def _build_msi(self) -> None:
        img, wm, m = self._reset_image, self.wmask, MSI_CAP
        img[m] = MSI_CAP_ID
        img[m + 1] = 0
        capable = (self.msi_vectors.bit_length() - 1) << 1
        _put(img, m + MSI_FLAGS, "H", MSI_FLAGS_64BIT | capable)
        _put(wm, m + MSI_FLAGS, "H", MSI_FLAGS_ENABLE | MSI_FLAGS_QSIZE)
        _put(wm, m + MSI_ADDRESS_LO, "I", 0xFFFFFFFC)
        _put(wm, m + MSI_ADDRESS_HI, "I", 0xFFFFFFFF)
        _put(wm, m + MSI_DATA, "H", 0xFFFF)

    # ------------------------------------------------------------ access
    def read(self, offset: int, count: int) -> bytes:
        return bytes(self.data[offset:offset + count])

    def write(self, offset: int, data) -> bool:
        """Apply a write through the masks.  Returns True if it requested an FLR."""
        flr = False
        devctl_hi = PCIE_CAP + EXP_DEVCTL + 1
        for i, byte in enumerate(bytes(data)):
            pos = offset + i
            if pos == devctl_hi and byte & (EXP_DEVCTL_FLR >> 8):
                flr = True
            wm, w1c = self.wmask[pos], self.w1cmask[pos]
            old = self.data[pos]
            self.data[pos] = ((old & ~wm) | (byte & wm)) & ~(byte & w1c) & 0xFF
        return flr

    def reset(self) -> None:
        """Power-on state (what an FLR leaves behind)."""
        self.data[:] = self._reset_image

    # ------------------------------------------------------------ queries
    def u16(self, offset: int) -> int:
        return struct.unpack_from("<H", self.data, offset)[0]

    @property
    def bus_master(self) -> bool:
        return bool(self.u16(COMMAND) & COMMAND_BUS_MASTER)

    @property
    def msi_enabled_vectors(self) -> int:
        """MSI vectors the OS enabled (0 when MSI is off or absent)."""
        if not self.msi_vectors:
            return 0
        flags = self.u16(MSI_CAP + MSI_FLAGS)
        if not flags & MSI_FLAGS_ENABLE:
            return 0
        return min(1 << ((flags & MSI_FLAGS_QSIZE) >> 4), self.msi_vectors)

    @property
    def msix_enabled(self) -> bool:
        return bool(self.u16(MSIX_CAP + MSIX_FLAGS) & MSIX_FLAGS_ENABLE)

    @property
    def msix_masked(self) -> bool:
        return bool(self.u16(MSIX_CAP + MSIX_FLAGS) & MSIX_FLAGS_MASKALL)
