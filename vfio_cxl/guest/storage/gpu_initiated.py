"""GPU-initiated NVMe I/O (BaM-style): an NVMe I/O queue pair in VRAM that the GPU drives.

    with StorageSession.open(nvme_bdf, gpu_bdf) as s:
        q = GpuQueue(s, entries=64)
        result = q.run([(slba, 4096, vram_offset), ...], depth=32)   # reads; op="write" for writes

The CPU sets up and reads the result only.  Set-up: the GPU's BAR2 is mapped for the NVMe
(``VRAM_IOVA``), the NVMe's BAR0 for the GPU (``DOORBELL_IOVA``), both in the session's one
IOMMU context; the SQ and CQ are created with their VRAM IOVAs (Create I/O CQ with IEN = 0:
the GPU polls); the GPU's message window covers the doorbells, so its doorbell writes go to
QEMU as DMA_WRITE messages that the vIOMMU translates into the NVMe's BAR0 (docs/gpu-device.md,
interface 1.2).  Then one NVME_IO descriptor per ``run``: the GPU writes the SQEs into VRAM,
rings the SQ tail doorbell once per batch, polls the CQ phase tags in VRAM, rings the CQ head
doorbell, and writes each request's status; the CPU waits for one MSI-X and reads them.

``GpuQueue(session, sq_in_cmb=True)``: the SQ in the NVMe's Controller Memory Buffer instead
(BaM's and SPDK's variant; GPU interface 1.3, ``NVME_QUEUE_SQ_PEER``).  The CMB is on at
controller address ``CMB_IOVA`` and its BAR is mapped for the GPU at that same IOVA, so one
number is the SQ's address for both: the NVMe reads its entries inside itself (no DMA), the
GPU writes them by peer writes through its message window, which then spans the doorbells and
the CMB.  The CQ stays in VRAM (QEMU's CMB holds no CQs: CMBSZ.CQS = 0).
"""

from __future__ import annotations

import contextlib
import struct
import time

from ...devices.gpu import regs
from ...devices.gpu.regs import Op
from ..drivers.nvme.queue import QueuePair
from ..drivers.gpu import Transfer
from ..p2p import map_peer_bar
from .session import CMB_IOVA, DOORBELL_IOVA, VRAM_IOVA, StorageError, StorageSession

QUEUE_AREA = 4 << 20          # the top of VRAM: SQ, CQ, queue block, request list
NVME_READ, NVME_WRITE = 0x02, 0x01


class GpuQueue:
    def __init__(self, session: StorageSession, *, entries: int = 64, qid: int | None = None,
                 timeout_ms: int = 5000, sq_in_cmb: bool = False):
        session._require_open("make a GPU queue")
        nvme, gpu = session.nvme, session.gpu
        self.session, self.entries, self.timeout_ms, self.sq_in_cmb = session, entries, timeout_ms, sq_in_cmb
        self.closed = True            # until everything below is in place
        self.qid = qid if qid is not None else nvme.io_queues + 1
        if not 2 <= entries <= min(regs.NVME_MAX_ENTRIES, nvme.cap.max_entries):
            raise StorageError(f"a GPU queue of {entries} entries",
                               f"use 2 to {min(regs.NVME_MAX_ENTRIES, nvme.cap.max_entries)}")
        if not nvme.io_queues < self.qid <= nvme.io_queues + nvme.spare_queues:
            raise StorageError(f"queue {self.qid} was not granted by Set Features Number of Queues",
                               "open the session with spare_queues >= 1")
        if sq_in_cmb:
            if (gpu.bar0.read32(regs.REG_VERSION) & 0xFFFF) < 3:
                raise StorageError("the GPU's interface is older than 1.3: NVME_IO cannot write an SQ in a "
                                   "peer's memory (NVME_QUEUE_SQ_PEER)", "keep the SQ in VRAM (sq_in_cmb=False)")
            if not nvme.cap.cmbs:
                raise StorageError(f"{nvme.bdf} has no Controller Memory Buffer (CAP.CMBS = 0)",
                                   "keep the SQ in VRAM, or use a controller with a CMB")
        base = gpu.vram_size - QUEUE_AREA
        # each queue on a page of its own: the controller refuses a queue that does not start on
        # a page (Create I/O CQ/SQ: PRP Offset Invalid), and a CQ right after a 16-entry SQ does not
        self.sq_off, self.cq_off = base, base + -(-entries * 64 // 4096) * 4096
        self.block_off = base + (1 << 20)
        self.requests_off = self.block_off + 4096
        self.max_requests = (QUEUE_AREA - (1 << 20) - 4096) // regs.NVME_REQUEST_SIZE
        session.map_vram()            # the session's: it stays when the queue closes
        self.sq_iova = VRAM_IOVA + self.sq_off
        # What the queue holds goes on a stack, undone newest first by close() -- or here, if a
        # step fails: views of VRAM and the doorbell mapping left behind would keep the GPU's and
        # the NVMe's BAR mmaps, so their devices and VFIO groups, held after the session closed.
        with contextlib.ExitStack() as stack:
            stack.callback(self._window_off)
            if sq_in_cmb:
                session.map_cmb()
                if not nvme.cmb.sqs:
                    raise StorageError(f"{nvme.bdf}'s CMB does not hold submission queues (CMBSZ.SQS = 0)",
                                       "keep the SQ in VRAM")
                self.sq_iova = session.claim_cmb(-(-entries * 64 // 4096) * 4096)
                stack.callback(session.release_cmb, self.sq_iova)
            self.doorbells = map_peer_bar(gpu, nvme, DOORBELL_IOVA, region=0, size=nvme.bar0.size,
                                          notes=session.kernel)
            stack.callback(self.doorbells.close)
            # the CPU never writes the entries of a GPU-driven SQ: in the CMB its view is a stand-in
            sq_view = bytearray(entries * 64) if sq_in_cmb else gpu.vram.view(self.sq_off, entries * 64)
            if isinstance(sq_view, memoryview):
                stack.callback(sq_view.release)
            cq_view = gpu.vram.view(self.cq_off, entries * 16)
            stack.callback(cq_view.release)
            self.queue = QueuePair(self.qid, entries, sq_view, self.sq_iova, cq_view, VRAM_IOVA + self.cq_off,
                                   _cpu_never, _cpu_never, None, None)
            stack.callback(self.queue.release)
            nvme.create_io_queue(self.qid, self.queue)
            stack.callback(self._delete_queue)
            self.state = (0, 0, 1)        # sq_tail, cq_head, phase: the GPU writes them back
            self._set_window()
            self._stack = stack.pop_all()
        self.closed = False
        session._queues.append(self)      # closed with the session at the latest

    def _set_window(self) -> None:
        """The GPU's message window over the NVMe's doorbells, and its CMB when the SQ is there
        (again after any GPU reset)."""
        s = self.session
        if self.sq_in_cmb:
            s.set_window(DOORBELL_IOVA, CMB_IOVA + s.nvme.cmb.size - DOORBELL_IOVA, "doorbells+cmb")
        else:
            s.set_window(DOORBELL_IOVA, s.nvme.bar0.size, "doorbells")

    @property
    def window(self) -> str:
        return "doorbells+cmb" if self.sq_in_cmb else "doorbells"

    def run(self, requests: list[tuple[int, int, int]], *, depth: int = 32, op: str = "read",
            timeout: float = 120, count_messages: bool = True) -> dict:
        """``requests``: (file byte offset, length, VRAM offset); one NVME_IO descriptor.
        ``count_messages``: read MSGWIN_WRITES before and after for ``doorbell_messages`` (two
        register reads, each a vfio-user round trip that stalls this vCPU: a caller measuring
        CPU time reads them outside its measurement instead)."""
        s, gpu, nvme = self.session, self.session.gpu, self.session.nvme
        s._require_open("run a GPU queue")
        if self.closed:
            raise StorageError(f"cannot run GPU queue {self.qid}: it is closed",
                               "make a new one, GpuQueue(session), and run it before closing it")
        ns = nvme.namespace(1)
        if op not in ("read", "write"):
            raise StorageError(f"op {op!r} for a GPU queue", 'use "read" (namespace -> VRAM) or "write" (VRAM -> namespace)')
        if not 1 <= depth <= min(regs.NVME_MAX_DEPTH, self.entries - 1):
            raise StorageError(f"queue depth {depth}", f"use 1 to {min(regs.NVME_MAX_DEPTH, self.entries - 1)} "
                               f"(at most 64, and one less than the queue's {self.entries} entries)")
        if not 1 <= len(requests) <= self.max_requests:
            raise StorageError(f"{len(requests)} requests in one run", f"use 1 to {self.max_requests}")
        table = bytearray()
        for offset, length, vram in requests:
            nvme.check_range(1, offset, length)
            if length > nvme.max_transfer:
                raise StorageError(f"a {length}-byte request is over the controller's limit of "
                                   f"{nvme.max_transfer} bytes (MDTS)", "split it into requests of at most MDTS")
            if vram < 0 or vram + length > gpu.vram_size - QUEUE_AREA or vram % 4:
                raise StorageError(f"VRAM [{vram:#x}, {vram + length:#x}) for a request",
                                   f"use 4-byte aligned ranges below {gpu.vram_size - QUEUE_AREA:#x} "
                                   "(the top 4 MiB hold the queues)")
            table += regs.pack_nvme_request(NVME_READ if op == "read" else NVME_WRITE, offset // ns.block_size,
                                            length, VRAM_IOVA + vram)
        sq_tail, cq_head, phase = self.state
        gpu.vram.view(self.block_off, regs.NVME_QUEUE_SIZE)[:] = regs.pack_nvme_queue(
            self.sq_iova if self.sq_in_cmb else self.sq_off, self.cq_off,
            DOORBELL_IOVA + nvme.cap.sq_doorbell(self.qid), DOORBELL_IOVA + nvme.cap.cq_doorbell(self.qid),
            self.entries, depth, 1, ns.block_size.bit_length() - 1, sq_tail=sq_tail, cq_head=cq_head, phase=phase,
            timeout_ms=self.timeout_ms, flags=regs.NVME_QUEUE_SQ_PEER if self.sq_in_cmb else 0)
        gpu.vram.view(self.requests_off, len(table))[:] = table
        if s.window != self.window:     # the CMB staging path may have moved it
            self._set_window()
        writes0 = gpu.bar0.read32(regs.REG_MSGWIN_WRITES) if count_messages else None
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            indices = gpu.submit([Transfer(Op.NVME_IO, src=self.block_off, dst=self.requests_off,
                                           length=len(requests))])
            t1, c1 = time.perf_counter(), time.process_time()
            (done,) = gpu.wait(indices, timeout)
        except BaseException:
            self._set_window()        # a failed descriptor resets the GPU (and its window)
            raise
        finally:
            self.state = struct.unpack_from("<HHB", gpu.vram.read(self.block_off + 40, 5))
        t2, c2 = time.perf_counter(), time.process_time()
        seconds = t2 - t0
        out = gpu.vram.read(self.requests_off, len(table))
        statuses, latencies = [], []
        for i in range(len(requests)):
            _o, _f, status, _l, _s, _d, _r, lat = regs.NVME_REQUEST.unpack_from(out, i * regs.NVME_REQUEST_SIZE)
            statuses.append(status)
            latencies.append(lat)
        s.stats["p2p_bytes"] += done["bytes_done"]
        return {"seconds": seconds, "bytes": done["bytes_done"], "statuses": statuses, "latency_us": latencies,
                "doorbell_messages": None if writes0 is None else
                (gpu.bar0.read32(regs.REG_MSGWIN_WRITES) - writes0) & 0xFFFFFFFF,
                "device_ns": done["duration_ns"],
                # where this process's CPU time went: the submission (the RING_TAIL register write,
                # a vfio-user round trip that holds the vCPU) and the wait for the MSI-X
                "submit_s": t1 - t0, "submit_cpu_s": c1 - c0, "wait_s": t2 - t1, "wait_cpu_s": c2 - c1}

    def close(self) -> None:
        """Delete the NVMe queue pair (unless the controller failed), let go of the queue's views
        of VRAM, unmap the NVMe's doorbells, give back its CMB space, turn the GPU's message
        window off.  Every step runs even if one fails.  Safe to call again; the session's close
        does it for a queue still open."""
        if self.closed:
            return
        self.closed = True
        if self in self.session._queues:
            self.session._queues.remove(self)
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.close()

    def __enter__(self) -> "GpuQueue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _delete_queue(self) -> None:
        nvme = self.session.nvme
        try:
            if nvme.failed is None and nvme.queues.get(self.qid) is self.queue:
                nvme.delete_io_queue(self.qid)
        finally:
            nvme.queues.pop(self.qid, None)

    def _window_off(self) -> None:
        for reg in (regs.REG_MSGWIN_SIZE_LO, regs.REG_MSGWIN_SIZE_HI):
            self.session.gpu.bar0.write32(reg, 0)
        self.session.window = None


def _cpu_never(value: int) -> None:
    raise StorageError("the CPU rang a doorbell of a GPU-driven queue", "only the GPU rings this queue")
