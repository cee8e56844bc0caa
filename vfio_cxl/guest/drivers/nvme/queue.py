"""One submission/completion queue pair: entries in DMA memory, doorbells in the controller's BAR0.

The memory is any buffer the controller reaches at the given IOVAs: guest RAM the driver mapped,
or a GPU's VRAM (GPU-initiated I/O, where this class only sets the queue up).  ``push`` writes an
entry at the tail without telling the controller; ``ring`` writes the tail doorbell once for
everything pushed since (one doorbell per batch); ``reap`` takes every new completion (phase tag
flips at each wrap) and writes the CQ head doorbell once half the CQ has been consumed since the
last one; ``flush`` writes it for whatever is left (the driver does when the queue is idle).

Why not at every reap: a doorbell is an MMIO exit, and under QEMU it waits for the global lock,
which the controller holds while it moves data -- so a doorbell rung while commands are in
flight costs the CPU a wait of up to one transfer.  Deferring it is safe while the controller
always has room to post: with at most half the CQ unacknowledged, and nothing unreaped when the
driver goes to sleep, at least ``entries // 2`` slots are free (SPDK and Linux batch the CQ head
doorbell per pass in the same spirit)."""

from __future__ import annotations

from typing import Callable

from .errors import NvmeError
from .spec import CQE_SIZE, SQE_SIZE, Completion
from .tracker import RequestTracker


class QueuePair:
    def __init__(self, qid: int, entries: int, sq, sq_iova: int, cq, cq_iova: int,
                 sq_doorbell: Callable[[int], None], cq_doorbell: Callable[[int], None],
                 tracker: RequestTracker | None, vector: int | None = None):
        self.qid, self.entries = qid, entries
        self.sq, self.cq = memoryview(sq)[:entries * SQE_SIZE], memoryview(cq)[:entries * CQE_SIZE]
        if len(self.sq) < entries * SQE_SIZE or len(self.cq) < entries * CQE_SIZE:
            raise NvmeError(f"queue {qid}: {len(self.sq)} + {len(self.cq)} bytes for {entries} entries",
                            f"give {entries * SQE_SIZE} bytes of SQ and {entries * CQE_SIZE} of CQ memory")
        self.sq_iova, self.cq_iova = sq_iova, cq_iova
        self._sq_doorbell, self._cq_doorbell = sq_doorbell, cq_doorbell
        self.tracker = tracker
        self.vector = vector          # MSI-X vector of the CQ, None: polled (IEN = 0)
        self.doorbells = 0            # SQ tail + CQ head doorbell writes (MMIO) since creation
        self.clear()

    def release(self) -> None:
        """Let go of the queue memory (a BAR mapping cannot close while views of it live)."""
        self.sq.release()
        self.cq.release()

    def clear(self) -> None:
        """Empty queues, as the controller sees them after (re)creation."""
        self.sq[:] = bytes(len(self.sq))
        self.cq[:] = bytes(len(self.cq))
        self.tail = self.rung_tail = self.sq_head = self.cq_head = self.rung_head = 0
        self.phase = 1

    @property
    def space(self) -> int:
        """Entries free in the SQ (one stays empty: full is tail + 1 == head)."""
        return (self.sq_head - self.tail - 1) % self.entries

    def push(self, sqe: bytes) -> None:
        if self.space == 0:
            raise NvmeError(f"SQ {self.qid} is full ({self.entries - 1} commands outstanding)",
                            "reap completions before submitting more")
        offset = self.tail * SQE_SIZE
        self.sq[offset:offset + SQE_SIZE] = sqe
        self.tail = (self.tail + 1) % self.entries

    def ring(self) -> bool:
        """Tell the controller about everything pushed since the last ring (False: nothing new)."""
        if self.tail == self.rung_tail:
            return False
        self._sq_doorbell(self.tail)
        self.rung_tail = self.tail
        self.doorbells += 1
        return True

    def reap(self, limit: int | None = None) -> list[Completion]:
        done = []
        while limit is None or len(done) < limit:
            offset = self.cq_head * CQE_SIZE
            if (self.cq[offset + 14] & 1) != self.phase:
                break
            cqe = Completion.unpack(self.cq[offset:offset + CQE_SIZE])
            done.append(cqe)
            self.sq_head = cqe.sq_head % self.entries
            self.cq_head += 1
            if self.cq_head == self.entries:
                self.cq_head, self.phase = 0, self.phase ^ 1
        if (self.cq_head - self.rung_head) % self.entries >= max(1, self.entries // 2):
            self.flush()
        return done

    def flush(self) -> bool:
        """Write the CQ head doorbell for every entry reaped since the last one (False: none)."""
        if self.cq_head == self.rung_head:
            return False
        self._cq_doorbell(self.cq_head)
        self.rung_head = self.cq_head
        self.doorbells += 1
        return True
