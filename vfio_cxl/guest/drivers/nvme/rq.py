"""The request side: one command on one queue pair, from its data pointer to its completion.

Bring-up (``controller.py``) makes the queues; what travels on them is built here, as libvfn
keeps ``rq.c`` apart from ``core.c``: ``data_pointer`` writes a request's PRP list or SGL segment
into the page the request owns (``tracker.Request.page``), ``rw_command`` is the Read or Write
entry for whole blocks, ``submit`` pushes an entry (the caller rings once per batch), ``reap``
matches new completions to their requests, and ``check`` turns an error status into an
``NvmeCommandError`` naming the command, the status and its usual fix.  Functions of a queue
pair and its requests only: no register but the doorbells the queue pair rings.
"""

from __future__ import annotations

import time

from . import prp as dptr
from .errors import NvmeCommandError
from .queue import QueuePair
from .spec import PSDT_PRP, PSDT_SGL, IoOp, pack_sqe, status_name
from .tracker import Request

LOW32 = 0xFFFFFFFF


def data_pointer(req: Request, segments: list[tuple[int, int]], sgl: bool) -> tuple[tuple[int, int], int]:
    """(DPTR, PSDT) for data at ``segments`` ((iova, length) pairs): an SGL when ``sgl``, else
    PRPs of the one contiguous segment; a list goes into ``req``'s page."""
    if sgl:
        return dptr.sgl(segments, req.page, req.page_iova), PSDT_SGL
    (iova, length), = segments
    return dptr.prp(iova, length, req.page, req.page_iova), PSDT_PRP


def rw_command(op: IoOp, req: Request, nsid: int, block_size: int, offset: int, length: int,
               pointer: tuple[int, int], psdt: int) -> bytes:
    """The SQE of a Read or Write of ``length`` bytes at byte ``offset`` (whole blocks)."""
    slba, nlb = offset // block_size, length // block_size
    return pack_sqe(op, req.cid, nsid, psdt=psdt, dptr=pointer, cdw10=slba & LOW32, cdw11=slba >> 32,
                    cdw12=nlb - 1)


def submit(queue: QueuePair, req: Request, sqe: bytes) -> None:
    """Push ``sqe`` (carrying ``req.cid``) at the SQ tail; the doorbell waits for ``queue.ring``."""
    queue.push(sqe)
    req.submitted = time.monotonic()


def reap(queue: QueuePair) -> list[Request]:
    """The requests that completed since last asked (their ``completion`` set; errors included)."""
    return [queue.tracker.complete(cqe) for cqe in queue.reap()]


def pieces(length: int, limit: int) -> list[tuple[int, int]]:
    """(offset, length) of the commands that move ``length`` bytes, each at most ``limit``."""
    return [(o, min(limit, length - o)) for o in range(0, length, limit)]


def check(bdf: str, req: Request) -> None:
    """Raise ``NvmeCommandError`` if ``req`` completed with an error status."""
    c = req.completion
    if not c.ok:
        raise NvmeCommandError(f"{bdf}: {req.what} failed: {status_name(c.status)} "
                               f"(SCT {c.sct:#x} SC {c.sc:#04x})", c.status, status_fix(c.status))


def status_fix(status: int) -> str:
    """What usually fixes a command that completed with ``status`` (SCT << 8 | SC)."""
    sct, sc = status >> 8, status & 0xFF
    if (sct, sc) == (0, 0x04):
        return ("the controller could not DMA the data: is every IOVA of the buffer mapped for it "
                "(for VRAM: the GPU's BAR2 mapped into the NVMe's IOMMU context)? see dmesg for DMAR faults")
    if (sct, sc) in ((0, 0x80), (0, 0x81)):
        return "stay inside the namespace (Identify Namespace NSZE)"
    if (sct, sc) == (0, 0x0B):
        return "use an active namespace ID (vfio-cxl nvme identify)"
    return "see the NVMe base specification's status code tables"
