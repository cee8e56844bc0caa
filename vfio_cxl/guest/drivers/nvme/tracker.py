"""Requests in flight on one queue pair: a command identifier (CID) and a page each.

Every slot owns one page of DMA memory (its PRP list or SGL segment), so building a request's
data pointer never allocates, and a page is reused only after its request completed.  A CID
carries the slot and a generation count: a completion for a CID that is not outstanding (stale,
duplicated, or made up) is caught, never matched to the slot's next request."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import NvmeError
from .spec import PAGE, Completion

SLOT_BITS = 11                       # up to 2048 entries (QEMU's CAP.MQES + 1)
MAX_DEPTH = 1 << SLOT_BITS


@dataclass(eq=False)      # identity: requests are dict keys while in flight
class Request:
    slot: int
    cid: int
    page: memoryview                  # this slot's page: PRP list / SGL segment
    page_iova: int
    opcode: int = 0
    what: str = ""                    # for errors: "read nsid 1 lba 0x10 x 8"
    tag: object = None                # the caller's
    completion: Completion | None = None
    submitted: float = 0.0
    extra: dict = field(default_factory=dict)


class RequestTracker:
    def __init__(self, depth: int, pages, pages_iova: int):
        if not 1 <= depth <= MAX_DEPTH:
            raise NvmeError(f"a tracker of depth {depth}", f"use 1 to {MAX_DEPTH} requests")
        view = memoryview(pages)
        if len(view) < depth * PAGE or pages_iova % PAGE:
            raise NvmeError(f"{len(view)} bytes at IOVA {pages_iova:#x} for {depth} request pages",
                            f"give {depth * PAGE} bytes at a page-aligned IOVA")
        self.depth = depth
        self._slots = [Request(i, i, view[i * PAGE:(i + 1) * PAGE], pages_iova + i * PAGE) for i in range(depth)]
        self._free = list(range(depth - 1, -1, -1))
        self._busy: dict[int, Request] = {}       # cid -> request
        self._generation = [0] * depth

    @property
    def outstanding(self) -> int:
        return len(self._busy)

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, what: str = "", opcode: int = 0, tag: object = None) -> Request:
        if not self._free:
            raise NvmeError(f"all {self.depth} request slots are in flight", "reap completions before submitting more")
        slot = self._free.pop()
        self._generation[slot] = (self._generation[slot] + 1) % (1 << (16 - SLOT_BITS))
        req = self._slots[slot]
        req.cid = self._generation[slot] << SLOT_BITS | slot
        req.opcode, req.what, req.tag, req.completion, req.extra = opcode, what, tag, None, {}
        self._busy[req.cid] = req
        return req

    def cancel(self, req: Request) -> None:
        """Give back a slot whose command was never submitted."""
        self._release(req.cid)

    def complete(self, completion: Completion) -> Request:
        """The request ``completion`` answers; its slot is free again."""
        req = self._busy.get(completion.cid)
        if req is None:
            raise NvmeError(f"completion for CID {completion.cid:#x} on SQ {completion.sqid}, which has no "
                            "command outstanding", "the controller answered a command twice or made one up: "
                            "reset the controller")
        self._release(completion.cid)
        req.completion = completion
        return req

    def drain(self) -> list[Request]:
        """Every outstanding request, all slots freed (the queue was torn down under them)."""
        reqs = list(self._busy.values())
        for req in reqs:
            self._release(req.cid)
        return reqs

    def _release(self, cid: int) -> None:
        req = self._busy.pop(cid)
        self._free.append(req.slot)
