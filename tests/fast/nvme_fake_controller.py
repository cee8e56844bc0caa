"""An NVMe controller model behind a stand-in ``VfioPciDevice``, for the driver's bring-up verbs
and I/O path without a VM (the real controller, QEMU's nvme: tests/vm/test_storage.py).

``FakeNvme`` is the device the driver opens: config space, BAR0 (CAP, VS, CC, CSTS, AQA, ASQ,
ACQ, doorbells) and DMA mappings (the driver's own memory, found again by IOVA).  A write of an
SQ tail doorbell runs the commands up to it at once and posts their completions, so nothing
waits: the driver reaps them on its first look.  It answers what the driver sends -- Identify
(controller, active namespace list, namespace), Set Features Number of Queues, Create/Delete
I/O CQ and SQ, Read, Write (PRPs), Flush -- and logs each register write and command in
``log`` so a test can assert the order of the steps."""

from __future__ import annotations

import struct

from vfio_cxl.guest.drivers.nvme.spec import PAGE, AdminOp, IoOp

SQE = struct.Struct("<BBHIQQQQIIIIII")
CQE = struct.Struct("<IIHHHH")
CC, CSTS, AQA, ASQ, ACQ = 0x14, 0x1C, 0x24, 0x28, 0x30
REGISTER_NAMES = {CC: "CC", AQA: "AQA", ASQ: "ASQ", ASQ + 4: "ASQ+4", ACQ: "ACQ", ACQ + 4: "ACQ+4"}
BLOCK = 512


class Disk:
    """A namespace's bytes, sparse: pages never written read as zeros."""

    def __init__(self, size: int):
        self.size, self.pages = size, {}

    def read(self, at: int, length: int) -> bytes:
        return b"".join(self._page(p)[max(at, p * PAGE) - p * PAGE:min(at + length, (p + 1) * PAGE) - p * PAGE]
                        for p in range(at // PAGE, -(-(at + length) // PAGE)))

    def write(self, at: int, data: bytes) -> None:
        for p in range(at // PAGE, -(-(at + len(data)) // PAGE)):
            page = bytearray(self._page(p))
            lo, hi = max(at, p * PAGE), min(at + len(data), (p + 1) * PAGE)
            page[lo - p * PAGE:hi - p * PAGE] = data[lo - at:hi - at]
            self.pages[p] = bytes(page)

    def _page(self, p: int) -> bytes:
        return self.pages.get(p, bytes(PAGE))


class _Config:
    def __init__(self):
        self.command = 0

    def read16(self, offset: int) -> int:
        return self.command if offset == 0x04 else 0

    def write16(self, offset: int, value: int) -> None:
        if offset == 0x04:
            self.command = value


class _Mapping:
    def __init__(self, device: "FakeNvme", iova: int, buffer):
        self.device, self.iova, self.view = device, iova, memoryview(buffer).cast("B")

    def close(self) -> None:
        self.device.mappings.remove(self)
        self.view.release()


class _NoRelease:
    """The kernel's release request, never fired."""
    eventfds = ()

    def pending(self, timeout: float = 0) -> int:
        return 0

    def close(self) -> None:
        pass


class FakeNvme:
    """Device, BAR0 and controller at once: ``NvmeController(FakeNvme())``."""

    bdf, backend = "0000:04:00.0", "type1"

    def __init__(self, *, namespaces: dict[int, int] | None = None, max_queue_pairs: int = 4,
                 mdts: int = 0, timeout_units: int = 1, ready: bool = True, fatal: bool = False,
                 model: str = "vfio-cxl FakeNvme"):
        self.namespaces = {nsid: Disk(blocks * BLOCK) for nsid, blocks in (namespaces or {1: 256}).items()}
        self.max_queue_pairs, self.mdts, self.model = max_queue_pairs, mdts, model
        self.cap = 0x7FF | 1 << 16 | timeout_units << 24 | 1 << 37    # MQES 2047, CQR, TO, CSS NVM
        self.ready, self.fatal = ready, fatal       # whether CC.EN = 1 makes it ready; CFS on enable
        self.config = _Config()
        self.mappings: list[_Mapping] = []
        self.regs = {CC: 0, CSTS: 0, AQA: 0, ASQ: 0, ASQ + 4: 0, ACQ: 0, ACQ + 4: 0}
        self.sqs: dict[int, dict] = {}      # qid -> iova, entries, cqid, head
        self.cqs: dict[int, dict] = {}      # qid -> iova, entries, tail, phase
        self.log: list[str] = []
        self.device = object()              # open (NvmeController.shutdown looks)

    # -- the device the driver opens --------------------------------------------------------

    def bar(self, index: int) -> "FakeNvme":
        assert index == 0
        return self

    def map_dma(self, buffer, iova: int) -> _Mapping:
        mapping = _Mapping(self, iova, buffer)
        self.mappings.append(mapping)
        return mapping

    def release_request(self) -> _NoRelease:
        return _NoRelease()

    def close(self) -> None:
        self.device = None

    def memory(self, iova: int, length: int) -> memoryview:
        """The driver's memory at ``iova`` (what the controller DMAs)."""
        for m in self.mappings:
            if m.iova <= iova and iova + length <= m.iova + len(m.view):
                return m.view[iova - m.iova:iova - m.iova + length]
        raise AssertionError(f"the controller DMAs to unmapped IOVA {iova:#x} (+{length:#x})")

    # -- BAR0 ---------------------------------------------------------------------------------

    def read32(self, offset: int) -> int:
        if offset in (0x00, 0x04):
            return self.cap >> (8 * offset) & 0xFFFFFFFF
        if offset == 0x08:
            return 0x10400                          # VS 1.4.0
        return self.regs.get(offset, 0)

    def write32(self, offset: int, value: int) -> None:
        if offset >= 0x1000:
            self._doorbell((offset - 0x1000) // 4, value)
            return
        self.log.append(f"{REGISTER_NAMES[offset]}={value:#x}")
        self.regs[offset] = value
        if offset == CC:
            self._cc(value)

    def _cc(self, cc: int) -> None:
        if not cc & 1:                              # CC.EN = 0: a controller reset, every queue gone
            self.regs[CSTS] = 0
            self.sqs, self.cqs = {}, {}
            return
        if self.fatal:
            self.regs[CSTS] = 2
            return
        aqa = self.regs[AQA]
        self.cqs[0] = dict(iova=self.regs[ACQ] | self.regs[ACQ + 4] << 32, entries=(aqa >> 16) + 1, tail=0, phase=1)
        self.sqs[0] = dict(iova=self.regs[ASQ] | self.regs[ASQ + 4] << 32, entries=(aqa & 0xFFF) + 1, cqid=0,
                           head=0)
        self.regs[CSTS] = int(self.ready)

    def _doorbell(self, index: int, value: int) -> None:
        qid, is_cq_head = divmod(index, 2)
        if is_cq_head:
            return
        sq = self.sqs[qid]
        while sq["head"] != value:
            raw = bytes(self.memory(sq["iova"] + sq["head"] * 64, 64))
            sq["head"] = (sq["head"] + 1) % sq["entries"]
            opcode, _, cid, nsid, _, _, prp1, prp2, *cdw = SQE.unpack(raw)
            result, status = (self._admin if qid == 0 else self._io)(opcode, nsid, prp1, prp2, cdw)
            self._post(sq["cqid"], qid, sq["head"], cid, result, status)

    def _post(self, cqid: int, sqid: int, sq_head: int, cid: int, result: int, status: int) -> None:
        cq = self.cqs[cqid]
        self.memory(cq["iova"] + cq["tail"] * 16, 16)[:] = CQE.pack(result, 0, sq_head, sqid, cid,
                                                                  status << 1 | cq["phase"])
        cq["tail"] += 1
        if cq["tail"] == cq["entries"]:
            cq["tail"], cq["phase"] = 0, cq["phase"] ^ 1

    # -- commands -----------------------------------------------------------------------------

    def _admin(self, opcode: int, nsid: int, prp1: int, prp2: int, cdw: list[int]) -> tuple[int, int]:
        op = AdminOp(opcode)
        self.log.append(f"{op.name} {cdw[0]:#x}" + (f" nsid {nsid}" if nsid else ""))
        if op == AdminOp.IDENTIFY:
            self.memory(prp1, PAGE)[:] = self._identify(cdw[0], nsid)
        elif op == AdminOp.SET_FEATURES:
            n = self.max_queue_pairs - 1             # what it allocates, whatever was asked (as QEMU)
            return n << 16 | n, 0
        elif op == AdminOp.CREATE_CQ:
            self.cqs[cdw[0] & 0xFFFF] = dict(iova=prp1, entries=(cdw[0] >> 16) + 1, tail=0, phase=1)
        elif op == AdminOp.CREATE_SQ:
            self.sqs[cdw[0] & 0xFFFF] = dict(iova=prp1, entries=(cdw[0] >> 16) + 1, cqid=cdw[1] >> 16, head=0)
        elif op == AdminOp.DELETE_SQ:
            del self.sqs[cdw[0]]
        elif op == AdminOp.DELETE_CQ:
            del self.cqs[cdw[0]]
        return 0, 0

    def _identify(self, cns: int, nsid: int) -> bytes:
        page = bytearray(PAGE)
        if cns == 1:                                # controller
            page[4:24] = b"fake-nvme".ljust(20)
            page[24:64] = self.model.encode().ljust(40)
            page[77] = self.mdts
        elif cns == 2:                              # active namespace IDs
            struct.pack_into(f"<{len(self.namespaces)}I", page, 0, *sorted(self.namespaces))
        else:                                       # namespace: LBA format 0, 512-byte blocks
            blocks = self.namespaces[nsid].size // BLOCK
            struct.pack_into("<QQ", page, 0, blocks, blocks)
            page[128:132] = (9 << 16).to_bytes(4, "little")
        return bytes(page)

    def _io(self, opcode: int, nsid: int, prp1: int, prp2: int, cdw: list[int]) -> tuple[int, int]:
        op = IoOp(opcode)
        if op == IoOp.FLUSH:
            return 0, 0
        start, length = (cdw[0] | cdw[1] << 32) * BLOCK, ((cdw[2] & 0xFFFF) + 1) * BLOCK
        disk = self.namespaces[nsid]
        if start + length > disk.size:
            return 0, 0x80                          # LBA Out of Range
        at = start
        for iova, n in self._prp_pages(prp1, prp2, length):
            mem = self.memory(iova, n)
            if op == IoOp.WRITE:
                disk.write(at, bytes(mem))
            else:
                mem[:] = disk.read(at, n)
            at += n
        return 0, 0

    def _prp_pages(self, prp1: int, prp2: int, length: int) -> list[tuple[int, int]]:
        first = min(length, PAGE - prp1 % PAGE)
        pages, rest = [(prp1, first)], length - first
        if rest <= 0:
            return pages
        if rest <= PAGE:
            return pages + [(prp2, rest)]
        count = -(-rest // PAGE)
        entries = struct.unpack_from(f"<{count}Q", self.memory(prp2, count * 8))
        return pages + [(e, min(PAGE, rest - i * PAGE)) for i, e in enumerate(entries)]
