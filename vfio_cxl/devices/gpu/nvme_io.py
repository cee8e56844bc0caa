"""NVME_IO (interface 1.2): the GPU drives an NVMe queue pair that lives in its own VRAM.

One descriptor carries a batch of requests (docs/gpu-device.md, "GPU-initiated NVMe I/O"):
the device builds each request's submission entry in the SQ in VRAM, rings the SQ tail
doorbell once per batch of up to ``depth`` new entries (a 4-byte DMA_WRITE into the message
window: QEMU translates it through the vIOMMU into the NVMe's BAR0), polls the phase tags of
the CQ in VRAM (the NVMe writes completions there by DMA through its own IOMMU mapping of
BAR2), writes each request's status back, and rings the CQ head doorbell once per pass.
Nothing here involves the guest CPU; the engine thread runs it, never a message handler.

The command identifier of request i is i; a data pointer is one SGL Data Block descriptor,
so a request needs no PRP list.  With NVME_QUEUE_SQ_PEER (interface 1.3) the SQ is not in VRAM
but at an IOVA -- the NVMe's Controller Memory Buffer -- and the device writes each batch's
entries there with DMA writes (one per contiguous run, through the message window) before
ringing the doorbell; the CQ stays in VRAM.  Every VRAM access holds the engine's gate and re-checks
``stale()``, so a reset stops the batch between two accesses like any other descriptor.
"""

from __future__ import annotations

import struct
import time
from typing import Callable

from ..vfio_user.dma import DmaAborted, DmaFault, DmaPort, FaultKind
from . import regs
from .regs import Status
from .faults import FAULT_STATUS

SQE = struct.Struct("<BBHIQQQQIIIIII")   # NVMe 1.4 submission entry (64 bytes)
CQE = struct.Struct("<IIHHHH")           # completion entry (16 bytes)
PSDT_SGL = 1 << 6
SGL_DATA_BLOCK = 0x00
NVME_WRITE, NVME_READ = 0x01, 0x02
POLL_INTERVAL = 20e-6                    # seconds between looks at an empty CQ



class _Bad(Exception):
    def __init__(self, status: Status, addr: int):
        self.status, self.addr = status, addr


class NvmeBatch:
    def __init__(self, vram: memoryview, gate, port: DmaPort, stale: Callable[[], bool]):
        self.vram, self.gate, self.port, self.stale = vram, gate, port, stale
        self.size = len(vram)

    # -- VRAM, one gated access at a time --------------------------------------------
    def _read(self, offset: int, length: int) -> bytes:
        with self.gate:
            if self.stale():
                raise DmaAborted()
            return bytes(self.vram[offset:offset + length])

    def _write(self, offset: int, data: bytes) -> None:
        with self.gate:
            if self.stale():
                raise DmaAborted()
            self.vram[offset:offset + len(data)] = data

    def _inside(self, offset: int, length: int) -> bool:
        return 0 <= offset and offset + length <= self.size

    # -- the descriptor --------------------------------------------------------------
    def run(self, block_at: int, requests_at: int, count: int):
        """-> (status, bytes_done, fault_addr, errno) as ``Engine._execute`` returns them."""
        if count == 0:
            return Status.OK, 0, 0, 0
        try:
            q = self._queue(block_at, requests_at, count)
            reqs = self._requests(requests_at, count, q["lba_shift"])
        except _Bad as bad:
            return bad.status, 0, bad.addr, 0
        done_bytes = 0
        try:
            status, addr, err, done_bytes = self._drive(q, reqs, requests_at)
        finally:
            self._write(block_at + 40, struct.pack("<HHB", q["sq_tail"], q["cq_head"], q["phase"]))
        return status, done_bytes & 0xFFFFFFFF, addr, err

    def _queue(self, at: int, requests_at: int, count: int) -> dict:
        if not self._inside(at, regs.NVME_QUEUE_SIZE):
            raise _Bad(Status.VRAM_RANGE, at)
        (sq, cq, sq_db, cq_db, entries, depth, nsid, sq_tail, cq_head, phase, lba_shift, flags, timeout_ms,
         _r2, _r3) = regs.NVME_QUEUE.unpack(self._read(at, regs.NVME_QUEUE_SIZE))
        peer = bool(flags & regs.NVME_QUEUE_SQ_PEER)
        ok = (2 <= entries <= regs.NVME_MAX_ENTRIES and 1 <= depth <= min(regs.NVME_MAX_DEPTH, entries - 1)
              and not flags & ~regs.NVME_QUEUE_SQ_PEER
              and (peer or self._inside(sq, entries * SQE.size)) and self._inside(cq, entries * CQE.size)
              and sq_tail < entries and cq_head < entries and phase in (0, 1) and 9 <= lba_shift <= 12
              and count <= regs.NVME_MAX_REQUESTS)
        if not ok:
            raise _Bad(Status.BAD_QUEUE, at)
        if not self._inside(requests_at, count * regs.NVME_REQUEST_SIZE):
            raise _Bad(Status.VRAM_RANGE, requests_at)
        return {"sq": sq, "cq": cq, "sq_db": sq_db, "cq_db": cq_db, "entries": entries, "depth": depth,
                "nsid": nsid, "sq_tail": sq_tail, "cq_head": cq_head, "phase": phase, "lba_shift": lba_shift,
                "timeout": (timeout_ms or regs.NVME_DEFAULT_TIMEOUT_MS) / 1000, "sq_peer": peer}

    def _requests(self, at: int, count: int, lba_shift: int) -> list[tuple]:
        raw = self._read(at, count * regs.NVME_REQUEST_SIZE)
        reqs = []
        for i in range(count):
            opcode, flags, _s, length, slba, iova, _res, _lat = regs.NVME_REQUEST.unpack_from(
                raw, i * regs.NVME_REQUEST_SIZE)
            block = 1 << lba_shift
            if (opcode not in (NVME_READ, NVME_WRITE) or flags or length == 0 or length % block
                    or length // block > 0x10000):
                raise _Bad(Status.BAD_QUEUE, at + i * regs.NVME_REQUEST_SIZE)
            reqs.append((opcode, length, slba, iova))
        return reqs

    def _drive(self, q: dict, reqs: list[tuple], requests_at: int):
        entries, depth = q["entries"], q["depth"]
        count = len(reqs)
        submitted_at = [0.0] * count
        pending = set()
        nxt = done = done_bytes = 0
        sq_head = q["sq_tail"]          # an idle queue: everything before the tail was consumed
        last_progress = time.monotonic()
        while done < count:
            # submit up to depth in flight, then one doorbell for all of them
            batch = 0
            run_at, run = q["sq_tail"], bytearray()      # a peer SQ's entries, written per contiguous run
            while nxt < count and len(pending) < depth and (sq_head - q["sq_tail"] - 1) % entries:
                opcode, length, slba, iova = reqs[nxt]
                nlb = length >> q["lba_shift"]
                sqe = SQE.pack(opcode, PSDT_SGL, nxt, q["nsid"], 0, 0, iova, length | SGL_DATA_BLOCK << 56,
                               slba & 0xFFFFFFFF, slba >> 32, nlb - 1, 0, 0, 0)
                if q["sq_peer"]:
                    run += sqe
                else:
                    self._write(q["sq"] + q["sq_tail"] * SQE.size, sqe)
                q["sq_tail"] = (q["sq_tail"] + 1) % entries
                if run and q["sq_tail"] == 0:           # the queue wrapped: the run ends here
                    fault = self._peer_write(q["sq"] + run_at * SQE.size, bytes(run))
                    if fault:
                        return fault + (done_bytes,)
                    run_at, run = 0, bytearray()
                pending.add(nxt)
                nxt += 1
                batch += 1
            if run:                                      # the entries are in place before the doorbell
                fault = self._peer_write(q["sq"] + run_at * SQE.size, bytes(run))
                if fault:
                    return fault + (done_bytes,)
            if batch:
                now = time.monotonic()
                for i in range(nxt - batch, nxt):
                    submitted_at[i] = now
                fault = self._doorbell(q["sq_db"], q["sq_tail"])
                if fault:
                    return fault + (done_bytes,)
            # reap what completed
            reaped = 0
            while True:
                at = q["cq"] + q["cq_head"] * CQE.size
                raw = self._read(at, CQE.size)
                _dw0, _dw1, sqhd, _sqid, cid, sf = CQE.unpack(raw)
                if sf & 1 != q["phase"]:
                    break
                if cid not in pending:
                    return Status.BAD_QUEUE, at, 0, done_bytes
                pending.discard(cid)
                status = (sf >> 1) & 0x7FF
                latency = int((time.monotonic() - submitted_at[cid]) * 1e6)
                self._write(requests_at + cid * regs.NVME_REQUEST_SIZE + 2, struct.pack("<H", status))
                self._write(requests_at + cid * regs.NVME_REQUEST_SIZE + 24,
                            struct.pack("<II", _dw0, min(latency, 0xFFFFFFFF)))
                if status == 0:
                    done_bytes += reqs[cid][1]
                sq_head = sqhd % entries
                q["cq_head"] += 1
                if q["cq_head"] == entries:
                    q["cq_head"], q["phase"] = 0, q["phase"] ^ 1
                done += 1
                reaped += 1
            if reaped:
                last_progress = time.monotonic()
                fault = self._doorbell(q["cq_db"], q["cq_head"])
                if fault:
                    return fault + (done_bytes,)
                continue
            if time.monotonic() - last_progress > q["timeout"]:
                late = min(pending) if pending else nxt
                return Status.QUEUE_TIMEOUT, requests_at + late * regs.NVME_REQUEST_SIZE, 0, done_bytes
            time.sleep(POLL_INTERVAL)   # the engine thread polling its own VRAM, as a GPU kernel spins
        return Status.OK, 0, 0, done_bytes

    def _doorbell(self, iova: int, value: int):
        """A 4-byte posted write to a peer's doorbell; (status, addr, errno) on a fault, else None."""
        return self._peer_write(iova, struct.pack("<I", value))

    def _peer_write(self, iova: int, data: bytes):
        """A posted write to a peer (a doorbell, entries of an SQ in its memory); (status, addr,
        errno) on a fault, else None."""
        try:
            self.port.write(iova, data, self.stale)
        except DmaFault as fault:
            if fault.kind == FaultKind.CLOSED:
                raise DmaAborted() from None
            return FAULT_STATUS[fault.kind], fault.addr, fault.errno
        return None
