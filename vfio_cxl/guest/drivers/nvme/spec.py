"""NVMe 1.4 as the driver uses it: registers, commands, queue entries, status codes.

Numbers from the NVM Express Base Specification 1.4 (what QEMU's ``nvme`` implements).  Only
what this driver needs; ``pack_*`` and ``unpack_*`` build and read the 64-byte submission and
16-byte completion entries."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

PAGE = 4096                 # CC.MPS = 0: the host memory page size the driver uses
SQE_SIZE, CQE_SIZE = 64, 16
SQES_LOG2, CQES_LOG2 = 6, 4

# Controller registers (BAR0)
REG_CAP = 0x00
REG_VS = 0x08
REG_INTMS = 0x0C
REG_INTMC = 0x10
REG_CC = 0x14
REG_CSTS = 0x1C
REG_AQA = 0x24
REG_ASQ = 0x28
REG_ACQ = 0x30
REG_CMBLOC = 0x38
REG_CMBSZ = 0x3C
REG_CMBMSC = 0x50   # CMB Memory Space Control (NVMe 1.4), 64-bit: CRE, CMSE, CBA
REG_CMBSTS = 0x58
DOORBELL_BASE = 0x1000

CC_EN = 1 << 0
CC_CSS_NVM = 0 << 4
CC_MPS_SHIFT = 7
CC_SHN_NORMAL = 1 << 14
CC_IOSQES_SHIFT = 16
CC_IOCQES_SHIFT = 20

CMBMSC_CRE = 1 << 0       # Capabilities Registers Enabled: CMBLOC/CMBSZ read non-zero
CMBMSC_CMSE = 1 << 1      # Controller Memory Space Enable: data pointers in [CBA, CBA + size) hit the CMB
CMBSTS_CBAI = 1 << 0      # Controller Base Address Invalid

CSTS_RDY = 1 << 0
CSTS_CFS = 1 << 1
CSTS_SHST_MASK = 3 << 2
CSTS_SHST_DONE = 2 << 2


@dataclass(frozen=True)
class CmbInfo:
    """CMBLOC and CMBSZ, decoded (zero until CMBMSC.CRE is set on an NVMe 1.4 controller)."""

    bir: int           # the BAR that holds it
    offset: int        # bytes into that BAR
    size: int          # bytes
    sqs: bool          # submission queues may live in it
    cqs: bool          # completion queues may
    lists: bool        # PRP lists / SGL segments may
    rds: bool          # read data (controller -> host transfers) may land in it
    wds: bool          # write data may come from it

    @classmethod
    def decode(cls, cmbloc: int, cmbsz: int) -> "CmbInfo":
        unit = 1 << (12 + 4 * (cmbsz >> 8 & 0xF))     # SZU: 4K, 64K, 1M, 16M, ...
        return cls(bir=cmbloc & 7, offset=(cmbloc >> 12) * unit, size=(cmbsz >> 12) * unit,
                   sqs=bool(cmbsz & 1), cqs=bool(cmbsz >> 1 & 1), lists=bool(cmbsz >> 2 & 1),
                   rds=bool(cmbsz >> 3 & 1), wds=bool(cmbsz >> 4 & 1))


@dataclass(frozen=True)
class Cap:
    """CAP, decoded."""

    mqes: int          # maximum queue entries supported, 0's based
    cqr: bool          # contiguous queues required
    timeout_ms: int    # CAP.TO: worst case for CSTS.RDY to follow CC.EN
    dstrd: int         # doorbell stride: 4 << dstrd bytes
    css_nvm: bool
    mpsmin: int        # bytes
    mpsmax: int
    cmbs: bool

    @classmethod
    def decode(cls, cap: int) -> "Cap":
        return cls(mqes=cap & 0xFFFF, cqr=bool(cap >> 16 & 1), timeout_ms=(cap >> 24 & 0xFF) * 500,
                   dstrd=cap >> 32 & 0xF, css_nvm=bool(cap >> 37 & 1),
                   mpsmin=1 << (12 + (cap >> 48 & 0xF)), mpsmax=1 << (12 + (cap >> 52 & 0xF)),
                   cmbs=bool(cap >> 57 & 1))

    @property
    def max_entries(self) -> int:
        return self.mqes + 1

    def sq_doorbell(self, qid: int) -> int:
        return DOORBELL_BASE + (2 * qid) * (4 << self.dstrd)

    def cq_doorbell(self, qid: int) -> int:
        return DOORBELL_BASE + (2 * qid + 1) * (4 << self.dstrd)


class AdminOp(IntEnum):
    DELETE_SQ = 0x00
    CREATE_SQ = 0x01
    DELETE_CQ = 0x04
    CREATE_CQ = 0x05
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A


class IoOp(IntEnum):
    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02


class Cns(IntEnum):
    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NSIDS = 0x02


FEAT_NUMBER_OF_QUEUES = 0x07

# CDW0 PSDT: how the data pointer is given
PSDT_PRP = 0
PSDT_SGL = 1                  # SGLs, MPTR a contiguous buffer

# SGL descriptor identifiers (type << 4 | subtype 0: an address)
SGL_DATA_BLOCK = 0x0 << 4
SGL_SEGMENT = 0x2 << 4
SGL_LAST_SEGMENT = 0x3 << 4
SGL_DESC_SIZE = 16


_SQE = struct.Struct("<BBHIQQQQIIIIII")   # opc, flags, cid, nsid, cdw2-3, mptr, dptr1, dptr2, cdw10-15
assert _SQE.size == SQE_SIZE
_CQE = struct.Struct("<IIHHHH")           # dw0, dw1, sqhd, sqid, cid, status (with phase)
assert _CQE.size == CQE_SIZE


def pack_sqe(opc: int, cid: int, nsid: int = 0, *, psdt: int = PSDT_PRP, dptr: tuple[int, int] = (0, 0),
             cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, cdw13: int = 0, cdw14: int = 0,
             cdw15: int = 0, mptr: int = 0) -> bytes:
    return _SQE.pack(opc, psdt << 6, cid, nsid, 0, mptr, dptr[0], dptr[1],
                     cdw10, cdw11, cdw12, cdw13, cdw14, cdw15)


@dataclass(frozen=True)
class Completion:
    result: int        # DW0, command specific
    sq_head: int
    sqid: int
    cid: int
    phase: int
    status: int        # SCT << 8 | SC (phase bit removed); 0 = success
    dnr: bool          # do not retry

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def sct(self) -> int:
        return self.status >> 8

    @property
    def sc(self) -> int:
        return self.status & 0xFF

    @classmethod
    def unpack(cls, raw) -> "Completion":
        dw0, _dw1, sqhd, sqid, cid, sf = _CQE.unpack(raw)
        return cls(result=dw0, sq_head=sqhd, sqid=sqid, cid=cid, phase=sf & 1,
                   status=(sf >> 1) & 0x7FF, dnr=bool(sf >> 15 & 1))


# What a status means (SCT, SC) -> name (NVMe 1.4, figures 127-130)
STATUS_NAMES = {
    (0, 0x00): "Successful Completion",
    (0, 0x01): "Invalid Command Opcode",
    (0, 0x02): "Invalid Field in Command",
    (0, 0x03): "Command ID Conflict",
    (0, 0x04): "Data Transfer Error",
    (0, 0x06): "Internal Error",
    (0, 0x07): "Command Abort Requested",
    (0, 0x08): "Command Aborted due to SQ Deletion",
    (0, 0x0B): "Invalid Namespace or Format",
    (0, 0x0F): "Invalid SGL Segment Descriptor",
    (0, 0x13): "PRP Offset Invalid",
    (0, 0x15): "SGL Data Block Granularity Invalid",
    (0, 0x80): "LBA Out of Range",
    (0, 0x81): "Capacity Exceeded",
    (0, 0x82): "Namespace Not Ready",
    (1, 0x00): "Completion Queue Invalid",
    (1, 0x01): "Invalid Queue Identifier",
    (1, 0x02): "Invalid Queue Size",
    (1, 0x08): "Invalid Interrupt Vector",
    (1, 0x0C): "Invalid Queue Deletion",
    (2, 0x81): "Unrecovered Read Error",
    (2, 0x85): "Compare Failure",
}


def status_name(status: int) -> str:
    sct, sc = status >> 8, status & 0xFF
    return STATUS_NAMES.get((sct, sc), f"status type {sct:#x} code {sc:#04x}")


# Identify Controller / Namespace fields (offsets in the 4 KiB data structure)
@dataclass(frozen=True)
class ControllerInfo:
    vid: int
    serial: str
    model: str
    firmware: str
    mdts: int           # bytes (0: no limit)
    cntlid: int
    version: int
    oacs: int
    nn: int
    sgls: int
    vwc: int

    @property
    def sgl_supported(self) -> bool:
        return bool(self.sgls & 0x3)

    @property
    def doorbell_buffer_config(self) -> bool:
        return bool(self.oacs & (1 << 8))

    @classmethod
    def decode(cls, data: bytes, mpsmin: int) -> "ControllerInfo":
        mdts = data[77]
        return cls(vid=int.from_bytes(data[0:2], "little"),
                   serial=data[4:24].decode("ascii", "replace").strip(),
                   model=data[24:64].decode("ascii", "replace").strip(),
                   firmware=data[64:72].decode("ascii", "replace").strip(),
                   mdts=(mpsmin << mdts) if mdts else 0,
                   cntlid=int.from_bytes(data[78:80], "little"),
                   version=int.from_bytes(data[80:84], "little"),
                   oacs=int.from_bytes(data[256:258], "little"),
                   nn=int.from_bytes(data[516:520], "little"),
                   vwc=data[525],
                   sgls=int.from_bytes(data[536:540], "little"))


@dataclass(frozen=True)
class NamespaceInfo:
    nsid: int
    blocks: int          # NSZE
    capacity: int        # NCAP
    block_size: int      # bytes, from the LBA format FLBAS selects

    @property
    def size(self) -> int:
        return self.blocks * self.block_size

    @classmethod
    def decode(cls, nsid: int, data: bytes) -> "NamespaceInfo":
        nsze, ncap = struct.unpack_from("<QQ", data, 0)
        flbas = data[26]
        index = (flbas & 0xF) | ((flbas >> 5 & 0x3) << 4)
        lbaf = int.from_bytes(data[128 + 4 * index: 132 + 4 * index], "little")
        return cls(nsid=nsid, blocks=nsze, capacity=ncap, block_size=1 << (lbaf >> 16 & 0xFF))
