"""A single-producer/single-consumer channel in shared CXL memory (stdlib only).

VM a (producer) and VM b (consumer) map the same memory -- ``/dev/dax0.0`` in
the guests, any writable buffer (an mmap of a file) elsewhere.  Payloads are
placed in the shared data area (by the CPU, or by a GPU's DMA) and announced by
records in a ring; the consumer checks them and reads them in place, with no copy.

    # VM a                                        # VM b
    p = Producer.create(mm, coherence=C)          c = Consumer.open(mm, coherence=C, wait=30)
    r = p.reserve(n)        # where to put it     rec = c.receive(timeout=5)
    gpu DMAs n bytes to IOVA_BASE + r.offset      use(rec.view)   # zero copy, CRC32 checked
    seq = p.publish(r.offset, r.length)           c.ack(rec)      # frees its space
    p.send(b"small things are copied in")

``C`` says how each host keeps its caches honest (see "Coherence"): the lab's
memory is coherent, so it passes ``COHERENT`` (explicitly no cache
maintenance); real CXL 2.0 shared memory needs ``vfio_cxl.guest.cacheline.x86()``.

Offsets are relative to the start of the buffer handed to ``create``/``open``
(the devdax offset when the whole device is the channel).

API
---
* ``Producer.create(buf, coherence=, ring_entries=256, on_publish=None,
  wakeup=None)`` writes a fresh header; ``Producer.attach(buf, coherence=,
  wakeup=None)`` resumes on an existing channel (after a crash too: see
  "Restart"); ``resume()`` does it again on a live producer (producers taking
  turns); ``set_fence(token, tag)`` stamps the next records;
  ``wait_acked(seq, timeout)``.
  ``reserve(length, align=64, timeout=None) -> Reservation`` (``.offset``,
  ``.length``, ``.view``), ``publish(offset, length, checksum=None) -> seq``,
  ``send(data, timeout=None) -> seq``.  Several reservations may be
  outstanding; they are published in reserve order.
* ``Consumer.open(buf, coherence=, wait=0, wakeup=None, fence_check=None)``
  (resumes after the last ack),
  ``receive(timeout=None, expect=None) -> Record`` (``.seq``, ``.offset``,
  ``.length``, ``.checksum``, ``.view``, ``.tobytes()``), ``ack(record=None)``
  (cumulative), ``skip()`` after a CorruptRecord, ``wait_for(seq, timeout)``,
  ``published``.
* Timeouts: None waits forever, 0 looks once.  Errors are ChannelError
  subclasses: NoChannel (BadMagic), VersionMismatch, BadHeader, ChannelFull,
  ChannelTimeout (also a TimeoutError), CorruptRecord (``.seq``, ``.reason``)
  and its subclass StaleRecord (refused by ``fence_check``).
* A ``Record.view`` stays valid, and unchanged, until it is acked (the space is
  not reused before); ack() releases it.  ``close()`` releases the buffer.

Memory layout (little endian; every line is 64 bytes, one cache line)
----------------------------------------------------------------------
::

    0    header, written once by Producer.create (magic last)
         0 magic b"VCXLCHAN" | 8 u32 version (3) | 12 u32 ring entries N
         16 u32 record size (64) | 20 u32 flags (0) | 24 u64 ring offset (192)
         32 u64 data offset | 40 u64 data size | 48 u64 epoch (random, per create)
         56 u32 reserved | 60 u32 CRC32 of bytes 8..60
    64   producer line (only the producer writes it)
         64 u64 records published: a hint, written after the commit | 72 reserved
    128  consumer line (only the consumer writes it)
         128 u64 records acked (= oldest unreleased seq) | 136 u64 data tail (bytes freed)
    192  record ring: N records of 64 bytes (one line each), record ``seq`` in slot ``seq % N``
         +0 u64 seq | +8 u64 payload offset | +16 u64 length | +24 u64 end
         +32 u32 payload CRC32 | +36 u32 fence token | +40 u32 fence tag (both 0: unfenced)
         +44 u32 CRC32 of +0..+44 (seeded with the epoch)
         +48..+56 reserved | +56 u64 commit word = (epoch & 0xffffffff) << 32 | (seq + 1) & 0xffffffff
    data offset (4 KiB aligned, after the ring) .. end: the data area

The data area is a circular byte buffer addressed by monotonic positions:
the producer's head and the consumer's ``tail`` only grow; position ``p`` lives
at ``data_offset + p % data_size``.  Payloads start on a cache line (``align``
>= 64), so two payloads never share a line.  A payload is never split: if it
does not fit before the end of the area, the producer skips to the start of
the next lap.  A record's ``end`` is the position just after its payload;
acking it moves ``tail`` to ``end``.  Space is reused only when
``end - tail <= data_size`` (back-pressure); ring slots only when fewer than N
records are unacked.  Acks are cumulative.  (Bytes skipped at the end of a lap
are freed with the record placed after them, so free space is counted
conservatively.)

Checksums are zlib's CRC32 (C, GB/s; one call per payload): one over the
payload, one over the record's fields seeded with the channel's epoch.  They
catch torn, stale and accidentally corrupted records, not a malicious writer.
The consumer never copies or walks a payload in Python.

The commit word tells the consumer that *this* seq (of *this* channel
incarnation) is complete; a slot still holding the previous lap's record, a
zeroed slot or a slot from before a re-create never matches.

Coherence
---------
Every cross-host store and load of the channel goes through three cache
operations of a ``Coherence`` object: ``flush(view, offset, length)`` (write
this host's modified lines back to memory), ``invalidate(view, offset,
length)`` (drop this host's copies, so later loads come from memory) and
``fence()`` (wait for the earlier two, order loads and stores).  Flushes and
invalidations are weak, as on x86: they may complete in any order, at any time
up to this host's next fence.

* ``COHERENT``: no-ops.  Right for one host and for the lab, where both
  guests map one host file through QEMU and host memory is coherent (x86 TSO),
  so program order is enough.
* ``vfio_cxl.guest.cacheline.x86()``: CLWB (else CLFLUSHOPT) / CLFLUSHOPT (else
  CLFLUSH) over the lines, and MFENCE, through cffi -- what CXL 2.0 memory
  shared between hosts needs, since it is **not** coherent between hosts: each
  host may keep lines the other has changed, and may write its own modified
  lines back at any time.
* The fast tests run the channel on a model of non-coherent memory (per-host
  write-back caches, random eviction), and a mutation test removes each call
  below in turn to show that every one is needed.

Ordering rules (each arrow is a flush + fence, or an invalidate + fence)
-----------------------------------------------------------------------
Producer publish: payload and record fields written back -> fence -> commit
word and published hint stored and written back -> fence (the record is now
visible; then ``on_publish`` is called).  When the caller has no checksum (a
DMA placed the payload), the payload lines are first invalidated so the CRC is
computed over memory, not over stale lines.  Before a reserved range is
handed out, this CPU's modified lines over it are written back (a producer
that died mid-record may have left some), so they cannot land later on top of
a DMA-written payload.

Consumer receive: invalidate the commit word's line -> fence -> load it; the
fields come from the same line (fetched with the commit word); check them;
invalidate the payload lines -> fence -> one CRC32 over the payload.  It
validates the field CRC, the seq, the bounds (offset/length inside the data
area, consistent with ``end``, not over unacked data) and the payload CRC, and
raises ``CorruptRecord`` instead of ever delivering bad data.  Consumer ack:
data tail and acked count (one line) written back -> fence.  The producer
invalidates the consumer's line before each look at the acks; each side reads
the header and its own counters from memory when it starts.

Assumptions: a cache line is written back and fetched whole (64 bytes); the
8-byte words (commit, counters) are single aligned stores and loads through
a ``memoryview.cast("Q")``; only the producer writes the producer line, ring
and payloads, only the consumer the consumer line.  A device that DMAs a
payload may bypass the producer CPU's caches.

Restart
-------
``Producer.attach`` rebuilds its state from shared memory only: the
consumer's acked count and tail, and the commit words from there on (every
seq whose slot holds its commit word is published; the head is the end of the
last one).  The published hint is never trusted, so a producer that died
between its commit and anything after it neither republishes a record the
consumer may have received nor reuses space the consumer has not acked.
Reserved but uncommitted records are forgotten.  Its invalidation of the ring
also writes back a commit word the dead producer stored but did not flush (a
restart on the same host); a restart on another host sees exactly what the
consumer can see.

Wake-ups
--------
Three ways for the consumer to learn of a record, all measured by
``scripts/bench share``:

* polling (no ``wakeup``): ``receive`` spins on the commit word, then backs off;
* a link message: ``on_publish=callback`` is called with ``(seq, offset,
  length)`` after the commit is visible (e.g. to send "record N ready" over a
  socket); the consumer, told a seq, calls ``receive(expect=seq)``, which
  validates it is the next one;
* a ``Wakeup`` on both sides (see the class): the producer notifies after each
  publish, the consumer sleeps in ``receive`` until notified and looks again;
  the consumer notifies after each ack, and a producer waiting for space or
  for an ack (``wait_acked``) sleeps the same way.  With the shared-memory
  controller the notification is a doorbell and the sleep is a wait on the
  doorbell's MSI-X eventfd (``vfio_cxl.guest.smc_channel``).  The sleeper
  looks at shared memory before each sleep and the notification queues (a
  doorbell FIFO), so a notification given between the look and the sleep is
  not lost.

Several producers (taking turns)
--------------------------------
Producers on several hosts may share one channel if they take turns under a
lock: each one, holding the lock, calls ``resume()`` (the others may have
published), ``set_fence(token, tag)`` with the lock's fencing token, publishes,
and -- before it releases the lock -- waits for the consumer's ack
(``wait_acked``).  The consumer's ``fence_check(token, tag)`` is asked about
every record before its payload is checked and rejects one whose stamp is not
the lock's current holder and token (StaleRecord; ``skip()`` moves past it).
Because a producer keeps the lock until its records are acked, a record whose
token is no longer current at the consumer's check was written by a holder
that lost the lock (died, or was forcibly released) before its critical
section ended: it is refused, not delivered.  A record the consumer checked
before the lock was released counts; from the release on (the holder's death
included, once the lock's owner learns of it) a record stamped with the old
token never does.  ``vfio_cxl.guest.smc_channel`` does this with an SMC semaphore:
token = epoch, tag = writer host and semaphore.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections import deque

__all__ = ["Producer", "Consumer", "Record", "Reservation", "Geometry", "read_header", "Coherence",
           "COHERENT", "Wakeup", "ChannelError", "NoChannel", "BadMagic", "VersionMismatch", "BadHeader",
           "ChannelFull", "ChannelTimeout", "CorruptRecord", "StaleRecord"]

MAGIC = b"VCXLCHAN"
VERSION = 3
LINE = 64
RECORD_SIZE = 64
PRODUCER_LINE = 64
CONSUMER_LINE = 128
RING_OFFSET = 192
DATA_ALIGN = 4096

HEADER = struct.Struct("<8sIIIIQQQQII")     # 64 bytes
RECORD = struct.Struct("<QQQQIIII")         # 48 bytes of fields; commit word at +56
FIELDS_CRC_AT = 44
COMMIT_AT = 56
# indices of the 8-byte words in the control area (memoryview.cast("Q"))
W_PUBLISHED = PRODUCER_LINE // 8
W_ACKED, W_TAIL = CONSUMER_LINE // 8, CONSUMER_LINE // 8 + 1


# --- coherence: how this host's stores reach the other host, and back -------------

class Coherence:
    """The three cache operations the channel needs on memory shared between hosts.

    ``offset``/``length`` are relative to ``view`` (the channel's buffer).  The
    operations are *weak*, like the x86 instructions behind them: a flush or an
    invalidation may take effect at any time up to the next ``fence()`` of this
    host, in any order, and only ``fence()`` waits for them.

    * ``flush(view, offset, length)``: write this host's modified cache lines
      over the range back to memory (CLWB, or CLFLUSHOPT).
    * ``invalidate(view, offset, length)``: drop this host's copies of the lines
      (a modified line is written back first), so loads after the next fence come
      from memory (CLFLUSHOPT, or CLFLUSH).
    * ``fence()``: wait for this host's earlier flushes and invalidations and
      order its earlier loads and stores before later ones (MFENCE).

    This class itself is the choice for *coherent* memory -- one host, or
    QEMU's shared file in the lab -- where all three do nothing: use
    ``COHERENT``.  ``vfio_cxl.guest.cacheline`` has the x86 instructions for real
    CXL shared memory; the fast tests have a model of non-coherent memory.
    """

    name = "coherent (no cache maintenance)"

    def flush(self, view: memoryview, offset: int, length: int) -> None:
        """Coherent memory: nothing to write back."""

    def invalidate(self, view: memoryview, offset: int, length: int) -> None:
        """Coherent memory: no stale copies to drop."""

    def fence(self) -> None:
        """Coherent memory: x86 TSO keeps stores in order and loads in order, which is all the channel needs
        (it never relies on a store being seen before a later load of its own)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.name}>"


COHERENT = Coherence()


# --- wake-ups: how a side sleeps until the other has done something ------------------

class Wakeup:
    """How one side of the channel sleeps until the other side did something, and how it tells the other.

    Without one, a side that waits polls shared memory.  With one:

    * ``notify()`` tells the other side: the producer calls it after each
      publish (once the record is visible) and after ``create``; the consumer
      after each ack (once the freed space is visible).
    * ``wait(timeout) -> bool`` sleeps until a notification arrives (True) or
      ``timeout`` seconds pass (False; None waits forever).  A notification
      given before ``wait`` is called must still end it -- a queue, not an
      edge (the SMC's doorbell FIFO is one) -- so no wake-up is lost between a
      look at shared memory and the sleep.  Spurious wake-ups are fine: the
      channel looks at shared memory again after every ``wait``.
    * ``describe()``: what the side sleeps on, for timeout messages.

    ``vfio_cxl.guest.smc_channel.SmcWakeup`` rings the other host's doorbell on
    the shared-memory controller and sleeps on this host's doorbell vector.
    """

    def notify(self) -> None:
        raise NotImplementedError

    def wait(self, timeout: float | None) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


# --- errors --------------------------------------------------------------------

class ChannelError(Exception):
    """A channel problem; the message says what is wrong and what to do."""

    def __init__(self, what: str, fix: str = ""):
        self.what, self.fix = what, fix
        super().__init__(f"{what}{' -- ' + fix if fix else ''}")


class NoChannel(ChannelError):
    """No channel header (yet) at offset 0: the producer has not created it."""


class BadMagic(NoChannel):
    """Offset 0 holds something that is not a channel header."""


class VersionMismatch(ChannelError):
    """The header was written by another version of this module."""


class BadHeader(ChannelError):
    """The header is torn, corrupt, or its geometry does not fit the buffer."""


class ChannelFull(ChannelError):
    """No ring slot or data space until the consumer acks (back-pressure)."""


class ChannelTimeout(ChannelError, TimeoutError):
    """Nothing arrived in time."""


class CorruptRecord(ChannelError):
    """A committed record failed validation; it was not delivered."""

    def __init__(self, seq: int, reason: str):
        self.seq, self.reason = seq, reason
        super().__init__(f"record {seq} rejected: {reason}",
                         "it was not delivered; call skip() to move past it, or reopen the channel")


class StaleRecord(CorruptRecord):
    """A committed record's fence (token, tag) was refused by the consumer's ``fence_check``: its writer
    no longer held the lock it stamped the record with.  Not delivered; skip() moves past it."""


# --- shared helpers --------------------------------------------------------------

def _poll(ready, timeout: float | None) -> bool:
    """Call ``ready()`` until it is true or ``timeout`` seconds passed (None: forever)."""
    if ready():
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    spins, delay = 0, 0.0
    while True:
        if deadline is not None and time.monotonic() >= deadline:
            return ready()
        if spins < 200:
            spins += 1
        else:
            time.sleep(delay)
            delay = min(max(delay * 2, 10e-6), 1e-3)
        if ready():
            return True


def _until(ready, timeout: float | None, wakeup: "Wakeup | None") -> bool:
    """``ready()`` true within ``timeout`` seconds: polled, or with a wakeup, looked at after each wake-up."""
    if wakeup is None:
        return _poll(ready, timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ready():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        wakeup.wait(left)
    return True


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:         # the caller still exports it (e.g. numpy); it goes with its last user
        pass


def _marker(epoch: int, seq: int) -> int:
    return (epoch & 0xFFFF_FFFF) << 32 | (seq + 1) & 0xFFFF_FFFF


def _record_bytes(epoch: int, seq: int, offset: int, length: int, end: int, crc: int,
                  fence: tuple[int, int] = (0, 0)) -> bytes:
    """The 48 field bytes of a record, with their own CRC (seeded with the epoch)."""
    head = RECORD.pack(seq, offset, length, end, crc, fence[0], fence[1], 0)[:FIELDS_CRC_AT]
    return head + struct.pack("<I", zlib.crc32(head, epoch & 0xFFFF_FFFF))


class Geometry:
    """The header's contents, read back and checked against the buffer size."""

    __slots__ = ("ring_entries", "data_offset", "data_size", "epoch")

    def __init__(self, ring_entries: int, data_offset: int, data_size: int, epoch: int):
        self.ring_entries, self.data_offset, self.data_size, self.epoch = ring_entries, data_offset, data_size, epoch

    def __repr__(self) -> str:
        return (f"Geometry(ring_entries={self.ring_entries}, data_offset={self.data_offset:#x}, "
                f"data_size={self.data_size:#x}, epoch={self.epoch:#x})")


def _as_view(buf) -> memoryview:
    view = memoryview(buf)
    if view.readonly or view.format not in ("B", "b", "c") or not view.c_contiguous:
        view.release()
        raise ChannelError("the channel buffer must be a writable, contiguous byte buffer",
                           "pass an mmap opened with PROT_READ|PROT_WRITE and MAP_SHARED")
    return view.cast("B")


def read_header(view: memoryview, coherence: Coherence) -> Geometry:
    """Validate the header at offset 0 of ``view``; raise a ChannelError subclass if unusable."""
    if len(view) < HEADER.size:
        raise BadHeader(f"the buffer is {len(view)} bytes, too small for a channel header", "map the whole device")
    coherence.invalidate(view, 0, LINE)
    coherence.fence()
    magic, version, entries, rec_size, _flags, ring_off, data_off, data_size, epoch, _r, crc = \
        HEADER.unpack_from(view, 0)
    if magic == bytes(8):
        raise NoChannel("no channel header at offset 0 (all zero): the producer has not created the channel yet",
                        "start the producer first (Producer.create), or pass wait=SECONDS to Consumer.open; "
                        "check both sides map the same memory")
    if magic != MAGIC:
        raise BadMagic(f"offset 0 does not hold a channel header: magic is {magic!r}, expected {MAGIC!r}",
                       "something else uses this memory or the offset is wrong; "
                       "recreate the channel with Producer.create")
    if version != VERSION:
        raise VersionMismatch(f"the channel has version {version}, this code speaks version {VERSION}",
                              "run the same vfio_cxl version on producer and consumer, or recreate the channel")
    if zlib.crc32(view[8:60]) != crc:
        raise BadHeader("the channel header fails its checksum (torn or overwritten)",
                        "recreate the channel with Producer.create")
    ring_end = RING_OFFSET + entries * RECORD_SIZE
    if (rec_size != RECORD_SIZE or ring_off != RING_OFFSET or entries < 1 or data_off < ring_end
            or data_off % DATA_ALIGN or data_size < LINE or data_off + data_size > len(view)):
        raise BadHeader(f"the header's geometry (ring {entries} x {rec_size} B at {ring_off}, data {data_size} B "
                        f"at {data_off}) does not fit this {len(view)}-byte buffer",
                        "map the same memory, with the same size, on both sides")
    return Geometry(entries, data_off, data_size, epoch)


class _Side:
    """What producer and consumer share: the buffer views, the geometry, the cache operations."""

    def __init__(self, view: memoryview, geo: Geometry, coherence: Coherence, wakeup: Wakeup | None = None):
        self._view, self.geometry, self.coherence, self.wakeup = view, geo, coherence, wakeup
        self._words = view[:geo.data_offset].cast("Q")

    def _slot(self, seq: int) -> int:
        return RING_OFFSET + (seq % self.geometry.ring_entries) * RECORD_SIZE

    def _commit_index(self, seq: int) -> int:
        return (self._slot(seq) + COMMIT_AT) // 8

    def close(self) -> None:
        """Release the views of the buffer (the caller can then close its mmap)."""
        self._words.release()
        self._view.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_wakeup(wakeup) -> Wakeup | None:
    if wakeup is not None and not all(callable(getattr(wakeup, op, None)) for op in ("notify", "wait", "describe")):
        raise ChannelError(f"wakeup={wakeup!r} has no notify/wait/describe",
                           "pass None (poll shared memory) or a channel.Wakeup such as "
                           "vfio_cxl.guest.smc_channel.SmcWakeup")
    return wakeup


def _check_coherence(coherence) -> Coherence:
    if not all(callable(getattr(coherence, op, None)) for op in ("flush", "invalidate", "fence")):
        raise ChannelError(f"coherence={coherence!r} has no flush/invalidate/fence",
                           "pass channel.COHERENT for coherent memory (the lab), or a Coherence such as "
                           "vfio_cxl.guest.cacheline.x86() for real non-coherent shared memory")
    return coherence


class Reservation:
    """Space for one payload: bytes ``offset .. offset+length`` of the buffer."""

    __slots__ = ("offset", "length", "end", "view")

    def __init__(self, offset: int, length: int, end: int, view: memoryview):
        self.offset, self.length, self.end, self.view = offset, length, end, view

    def __repr__(self) -> str:
        return f"Reservation(offset={self.offset:#x}, length={self.length})"


class Producer(_Side):
    """The writing side.  Create the channel with ``Producer.create(buf, coherence=...)``."""

    def __init__(self, view: memoryview, geo: Geometry, coherence: Coherence, on_publish=None, *,
                 fresh: bool = False, wakeup: Wakeup | None = None):
        super().__init__(view, geo, coherence, wakeup)
        self.on_publish = on_publish
        self.fence: tuple[int, int] | None = None
        self._pending: deque[Reservation] = deque()
        self._seq, self._head = (0, 0) if fresh else self._recover()

    def set_fence(self, token: int | None, tag: int = 0) -> None:
        """Stamp the records published from now on with ``(token, tag)`` (u32 each; None: unfenced).

        For producers that take turns under a lock with a fencing token (the
        SMC semaphore's epoch): the consumer's ``fence_check`` refuses a record
        whose stamp is no longer current (StaleRecord)."""
        if token is None:
            self.fence = None
            return
        if not (0 < token <= 0xFFFF_FFFF and 0 <= tag <= 0xFFFF_FFFF):
            raise ValueError(f"fence token {token} / tag {tag}: the token is 1..2**32-1, the tag 0..2**32-1")
        self.fence = (token, tag)

    def resume(self) -> None:
        """Rebuild the next seq and the data head from shared memory, as ``attach`` does.

        For producers that take turns (on several hosts, under a lock): call it
        after taking the lock, since the others may have published since this
        one last did."""
        if self._pending:
            raise ChannelError(f"resume() with {len(self._pending)} reservations outstanding",
                               "publish them first (or close this producer)")
        self._seq, self._head = self._recover()

    def _recover(self) -> tuple[int, int]:
        """Next seq and data head, rebuilt from what is in shared memory: the consumer's line and the commit words.

        The published count in the producer line is only a hint written after
        the commit; a producer that died between its commit and that hint must
        not reuse the committed record's slot or space.  Every seq from the
        consumer's acked count on whose slot holds its commit word is
        published; the head is just after the last one's payload.
        """
        geo, view, coh, words = self.geometry, self._view, self.coherence, self._words
        # Fresh copies of the consumer's line and the ring; this host's modified lines (a commit stored by
        # a producer that died before flushing it) are written back by the invalidation.
        coh.invalidate(view, CONSUMER_LINE, LINE)
        coh.invalidate(view, RING_OFFSET, geo.ring_entries * RECORD_SIZE)
        coh.fence()
        acked, head = words[W_ACKED], words[W_TAIL]
        seq = acked
        while seq < acked + geo.ring_entries and words[self._commit_index(seq)] == _marker(geo.epoch, seq):
            slot = self._slot(seq)
            fields = bytes(view[slot:slot + RECORD.size])
            rseq, _offset, _length, end, _crc, _token, _tag, meta = RECORD.unpack(fields)
            if rseq != seq or zlib.crc32(fields[:FIELDS_CRC_AT], geo.epoch & 0xFFFF_FFFF) != meta:
                raise ChannelError(f"cannot resume: record {seq} is committed but its fields are corrupt",
                                   "recreate the channel with Producer.create")
            head = max(head, end)
            seq += 1
        return seq, head

    @classmethod
    def create(cls, buf, *, coherence: Coherence, ring_entries: int = 256, on_publish=None,
               wakeup: Wakeup | None = None) -> "Producer":
        """Write a fresh header (new epoch) and empty ring over ``buf``; the data area is the rest.

        ``coherence``: ``channel.COHERENT`` for coherent memory, else the cache
        operations of this host (see Coherence).  ``wakeup``: notify the
        consumer after each publish (and once the header is written), and sleep
        on it when the channel is full (see Wakeup); None: the waits poll.
        """
        coh = _check_coherence(coherence)
        wakeup = _check_wakeup(wakeup)
        view = _as_view(buf)
        data_off = -(-(RING_OFFSET + ring_entries * RECORD_SIZE) // DATA_ALIGN) * DATA_ALIGN
        data_size = (len(view) - data_off) // LINE * LINE
        if not 1 <= ring_entries < 2**31 or data_size < LINE:
            size = len(view)
            view.release()
            raise ChannelError(f"a {size}-byte buffer cannot hold a channel with {ring_entries} ring entries "
                               f"(the data area would start at {data_off})",
                               "use a bigger buffer or fewer ring entries")
        epoch = int.from_bytes(os.urandom(8), "little") | 1
        # Header (magic zero), counters and ring in one go: the header line is written back whole, so a
        # consumer sees no magic until the last step; commit words never match the new epoch.
        view[0:data_off] = bytes(data_off)
        view[8:60] = HEADER.pack(MAGIC, VERSION, ring_entries, RECORD_SIZE, 0, RING_OFFSET,
                                 data_off, data_size, epoch, 0, 0)[8:60]
        view[60:64] = struct.pack("<I", zlib.crc32(view[8:60]))
        coh.flush(view, 0, data_off)
        coh.fence()
        view[0:8] = MAGIC                             # the header's commit: written last
        coh.flush(view, 0, LINE)
        coh.fence()
        producer = cls(view, Geometry(ring_entries, data_off, data_size, epoch), coh, on_publish, fresh=True,
                       wakeup=wakeup)
        if wakeup is not None:
            wakeup.notify()                           # a consumer sleeping in open(wait=...)
        return producer

    @classmethod
    def attach(cls, buf, *, coherence: Coherence, on_publish=None, wakeup: Wakeup | None = None) -> "Producer":
        """Resume producing on an existing channel (e.g. after a producer restart, on this host or another).

        The next seq and the data head are rebuilt from the commit words and the
        consumer's acks in shared memory; records reserved but not committed
        before the restart are forgotten (their space is reused).
        """
        coh = _check_coherence(coherence)
        wakeup = _check_wakeup(wakeup)
        view = _as_view(buf)
        try:
            return cls(view, read_header(view, coh), coh, on_publish, wakeup=wakeup)
        except ChannelError:
            view.release()
            raise

    def _room(self, state: dict, end: int) -> bool:
        coh, geo = self.coherence, self.geometry
        coh.invalidate(self._view, CONSUMER_LINE, 16)
        coh.fence()
        state["acked"], state["tail"] = self._words[W_ACKED], self._words[W_TAIL]
        return self._seq + len(self._pending) - state["acked"] < geo.ring_entries and \
            end - state["tail"] <= geo.data_size

    def reserve(self, length: int, *, align: int = LINE, timeout: float | None = None) -> Reservation:
        """Space for a ``length``-byte payload; the caller (or its DMA engine) fills it, then publish().

        ``align`` is a power of two from 64 (a cache line: two payloads never
        share a line) to 4096.  Waits up to ``timeout`` seconds (None: forever,
        0: not at all) for the consumer to free space, then raises ChannelFull.
        Several reservations may be outstanding; publish them in the order they
        were reserved.
        """
        geo = self.geometry
        size = geo.data_size
        if length < 0 or align < LINE or align & (align - 1) or align > DATA_ALIGN:
            raise ValueError(f"bad length {length} or align {align} (a power of two from {LINE} to {DATA_ALIGN})")
        if length > size:
            raise ChannelError(f"a {length}-byte payload can never fit the {size}-byte data area",
                               "split the payload or create the channel over more memory")
        pos = self._head
        lap = pos - pos % size
        start = lap + -(-(pos % size) // align) * align
        if start - lap + max(length, 1) > size:       # not before the end of the area: next lap
            start = lap + size
        end = start + length
        state: dict = {}
        if not _until(lambda: self._room(state, end), timeout, self.wakeup):
            if self._seq + len(self._pending) - state["acked"] >= geo.ring_entries:
                what = (f"all {geo.ring_entries} ring records are in use ({len(self._pending)} reserved, "
                        f"consumer acked up to seq {state['acked']})")
            else:
                what = (f"the data area has no room for {length} bytes "
                        f"({end - state['tail'] - size} more must be freed; {size} bytes in all)")
            raise ChannelFull(f"channel full after {timeout}s: {what}",
                              "the consumer must receive() and ack(); wait longer or use a bigger channel")
        offset = geo.data_offset + start % size
        # A DMA engine may fill this range without snooping this CPU's caches: write back any modified line
        # over it first (one left by a producer that died before publishing), so that it cannot land later,
        # on top of the payload.
        self.coherence.flush(self._view, offset, length)
        self.coherence.fence()
        self._head = end
        res = Reservation(offset, length, end, self._view[offset:offset + length])
        self._pending.append(res)
        return res

    def publish(self, offset: int, length: int, checksum: int | None = None) -> int:
        """Publish the oldest reservation, whose bytes are now in place; returns its seq.

        ``checksum`` is the payload's ``zlib.crc32`` if the caller already has
        it; otherwise it is computed here from the bytes in shared memory.
        When publish() returns (and before ``on_publish`` is called), the record
        is visible to the consumer.
        """
        if not self._pending or (self._pending[0].offset, self._pending[0].length) != (offset, length):
            oldest = self._pending[0] if self._pending else "none"
            raise ChannelError(f"publish({offset:#x}, {length}) does not match the oldest reservation ({oldest})",
                               "publish reservations in the order reserve() returned them")
        res, view, coh = self._pending[0], self._view, self.coherence
        seq, epoch = self._seq, self.geometry.epoch
        if checksum is None:
            coh.invalidate(view, offset, length)      # DMA-written bytes: read them from memory
            coh.fence()
            checksum = zlib.crc32(res.view)
        slot = self._slot(seq)
        view[slot:slot + RECORD.size] = _record_bytes(epoch, seq, offset, length, res.end, checksum,
                                                      self.fence or (0, 0))
        coh.flush(view, offset, length)               # 1. the payload (if this CPU wrote it) in memory,
        coh.fence()                                   #    before the commit word is stored
        # 2. the fields need no flush of their own: they share the commit word's line, which goes to memory
        # whole, with them in place (a line evicted before the commit only shows uncommitted fields).
        self._words[self._commit_index(seq)] = _marker(epoch, seq)   # 3. the commit word
        self._words[W_PUBLISHED] = seq + 1            # 4. a hint (counts, messages); restart ignores it
        coh.flush(view, slot + COMMIT_AT, 8)
        coh.flush(view, PRODUCER_LINE, 8)
        coh.fence()                                   # visible before publish() returns / on_publish is told
        self._pending.popleft()
        _release(res.view)
        self._seq = seq + 1
        if self.wakeup is not None:
            self.wakeup.notify()
        if self.on_publish is not None:
            self.on_publish(seq, offset, length)
        return seq

    def send(self, data, *, timeout: float | None = None) -> int:
        """Copy ``data`` into the channel and publish it; returns its seq."""
        res = self.reserve(len(data), timeout=timeout)
        res.view[:] = data
        return self.publish(res.offset, res.length, zlib.crc32(data))

    @property
    def next_seq(self) -> int:
        return self._seq

    def wait_acked(self, seq: int, timeout: float | None = None) -> None:
        """Wait until the consumer has acked record ``seq`` (sleeping on the wakeup, else polling)."""
        state: dict = {}

        def acked() -> bool:
            self._room(state, 0)
            return state["acked"] > seq

        if not _until(acked, timeout, self.wakeup):
            waited = f"slept on {self.wakeup.describe()}" if self.wakeup else "polled"
            raise ChannelTimeout(f"record {seq} not acked within {timeout}s (the consumer acked up to "
                                 f"{state['acked']}; this producer {waited})", "is the consumer running? wait longer")

    @property
    def acked(self) -> int:
        """How many records the consumer has acked (its counter in shared memory)."""
        state: dict = {}
        self._room(state, 0)
        return state["acked"]

    def close(self) -> None:
        for res in self._pending:
            _release(res.view)
        self._pending.clear()
        super().close()


class Record:
    """One delivered payload: ``view`` is the shared memory itself, valid until ack()."""

    __slots__ = ("seq", "offset", "length", "checksum", "view", "fence", "_end")

    def __init__(self, seq: int, offset: int, length: int, checksum: int, view: memoryview, end: int,
                 fence: tuple[int, int] = (0, 0)):
        self.seq, self.offset, self.length, self.checksum = seq, offset, length, checksum
        self.view, self._end, self.fence = view, end, fence

    def tobytes(self) -> bytes:
        return self.view.tobytes()

    def __repr__(self) -> str:
        return f"Record(seq={self.seq}, offset={self.offset:#x}, length={self.length})"


class Consumer(_Side):
    """The reading side.  Open with ``Consumer.open(buf, coherence=..., wait=seconds)``."""

    def __init__(self, view: memoryview, geo: Geometry, coherence: Coherence, wakeup: Wakeup | None = None,
                 fence_check=None):
        super().__init__(view, geo, coherence, wakeup)
        self.fence_check = fence_check
        coherence.invalidate(view, CONSUMER_LINE, 16)   # our own line, as memory has it (re-created channel,
        coherence.fence()                               # or a consumer moved to another host)
        self._next = self._acked = self._words[W_ACKED]
        self._tail = self._last_end = self._words[W_TAIL]
        self._outstanding: deque[Record | tuple[int, int | None]] = deque()
        self._rejected: tuple[int, int | None] | None = None

    @classmethod
    def open(cls, buf, *, coherence: Coherence, wait: float | None = 0, wakeup: Wakeup | None = None,
             fence_check=None) -> "Consumer":
        """Attach to the channel at offset 0 of ``buf``, resuming after the last ack.

        ``coherence``: as for Producer.create.  ``wait``: seconds to wait for the
        producer to create the channel (None: forever).  A wrong version fails
        at once.  ``wakeup``: sleep on it for records (and for the header) and
        notify the producer after each ack; None: poll.  ``fence_check(token,
        tag) -> reason or None``: called for each record before its payload is
        checked; a reason rejects it (StaleRecord).  Unfenced records have
        token 0.
        """
        coh = _check_coherence(coherence)
        wakeup = _check_wakeup(wakeup)
        view = _as_view(buf)
        last: list = []

        def valid() -> bool:
            try:
                last[:] = [read_header(view, coh)]
                return True
            except (NoChannel, BadHeader) as e:
                last[:] = [e]
                return False
            except ChannelError:
                view.release()
                raise

        if not _until(valid, wait, wakeup):
            view.release()
            e = last[0]
            if wait:
                raise type(e)(f"no valid channel after waiting {wait}s: {e.what}", e.fix)
            raise e
        return cls(view, last[0], coh, wakeup, fence_check)

    @property
    def next_seq(self) -> int:
        """The seq receive() returns next."""
        return self._next

    @property
    def published(self) -> int:
        """How many records the producer has published so far (its hint in shared memory)."""
        self.coherence.invalidate(self._view, PRODUCER_LINE, 8)
        self.coherence.fence()
        return self._words[W_PUBLISHED]

    def _committed(self, seq: int) -> bool:
        index = self._commit_index(seq)
        self.coherence.invalidate(self._view, index * 8, 8)
        self.coherence.fence()
        return self._words[index] == _marker(self.geometry.epoch, seq)

    def _timeout(self, seq: int, timeout: float | None) -> ChannelTimeout:
        try:
            current = read_header(self._view, self.coherence).epoch
        except ChannelError as e:
            return ChannelTimeout(f"no record {seq} within {timeout}s, and the header is gone: {e.what}",
                                  "the producer is re-creating the channel; reopen the consumer")
        if current != self.geometry.epoch:
            return ChannelTimeout(f"no record {seq} within {timeout}s: the producer re-created the channel",
                                  "reopen the consumer (Consumer.open)")
        how = (f"slept on {self.wakeup.describe()} and was not woken for it" if self.wakeup is not None
               else "polled shared memory")
        return ChannelTimeout(f"no record {seq} within {timeout}s (the producer has published "
                              f"{self.published} records; the consumer {how})",
                              "is the producer running and publishing? wait longer")

    def wait_for(self, seq: int, timeout: float | None = None) -> None:
        """Poll until record ``seq`` is committed (already received: return at once)."""
        if seq < self._next:
            return
        if seq >= self._acked + self.geometry.ring_entries:
            raise ChannelError(f"record {seq} cannot be published before records up to "
                               f"{seq - self.geometry.ring_entries} are acked", "ack() what you have received")
        if not _until(lambda: self._committed(seq), timeout, self.wakeup):
            raise self._timeout(seq, timeout)

    def receive(self, timeout: float | None = None, *, expect: int | None = None) -> Record:
        """The next record, validated; its ``view`` is the payload in shared memory.

        Raises ChannelTimeout if none is committed within ``timeout`` seconds
        (None: wait forever, 0: just look), CorruptRecord if the committed
        record fails a check (it stays the next record until skip()).  With
        ``expect`` (a seq announced out of band) it must be the next record.
        The payload is checked with one zlib.crc32 call and not copied.
        """
        seq, geo = self._next, self.geometry
        if expect is not None and expect != seq:
            raise ChannelError(f"told that record {expect} is ready, but the next record in order is {seq}",
                               "a notification was lost or repeated; receive in seq order")
        if not _until(lambda: self._committed(seq), timeout, self.wakeup):
            raise self._timeout(seq, timeout)
        # The fields share the commit word's cache line, which _committed() just fetched from memory after
        # the producer had written it back with the fields in place (line-sized write-backs and fetches),
        # and x86 loads are not reordered with older loads: no second invalidation.
        slot = self._slot(seq)
        fields = bytes(self._view[slot:slot + RECORD.size])
        rseq, offset, length, end, crc, token, tag, meta = RECORD.unpack(fields)
        self._rejected = (seq, None)
        if zlib.crc32(fields[:FIELDS_CRC_AT], geo.epoch & 0xFFFF_FFFF) != meta:
            raise CorruptRecord(seq, "its fields fail their checksum (torn or overwritten record)")
        if rseq != seq:
            raise CorruptRecord(seq, f"its slot holds seq {rseq} (a lost or duplicated record)")
        start, size = end - length, geo.data_size
        if not (self._last_end <= start and end - self._tail <= size and length <= size
                and offset == geo.data_offset + start % size and start % size + length <= size):
            raise CorruptRecord(seq, f"payload {offset:#x}+{length} (end {end}) is outside the free part of the "
                                     f"data area {geo.data_offset:#x}+{size:#x}")
        self._rejected = (seq, end)
        if self.fence_check is not None:
            reason = self.fence_check(token, tag)
            if reason:
                raise StaleRecord(seq, reason)
        self.coherence.invalidate(self._view, offset, length)   # stale copies from an earlier lap
        self.coherence.fence()
        view = self._view[offset:offset + length]
        if zlib.crc32(view) != crc:
            view.release()
            raise CorruptRecord(seq, f"the {length}-byte payload at {offset:#x} fails its checksum")
        self._rejected = None
        record = Record(seq, offset, length, crc, view, end, (token, tag))
        self._outstanding.append(record)
        self._next, self._last_end = seq + 1, end
        return record

    def skip(self) -> int:
        """Move past the record receive() just rejected, without delivering it; ack() frees it."""
        if self._rejected is None or self._rejected[0] != self._next:
            raise ChannelError("there is no rejected record to skip", "call skip() only after CorruptRecord")
        seq, end = self._rejected
        self._outstanding.append((seq, end))
        self._next, self._rejected = seq + 1, None
        if end is not None:
            self._last_end = end
        return seq

    def ack(self, record: Record | None = None) -> None:
        """Release ``record`` and every record before it (default: all received or skipped).

        Their views are released; the producer may then overwrite the space.
        When ack() returns, the producer can see the freed space.
        """
        upto = (record.seq if record is not None else self._next - 1)
        if record is not None and not self._acked <= upto < self._next:
            raise ChannelError(f"record {upto} is not outstanding (outstanding: {self._acked}..{self._next - 1})",
                               "ack each received record once")
        tail = self._tail
        while self._outstanding and self._seq_of(self._outstanding[0]) <= upto:
            item = self._outstanding.popleft()
            end = item._end if isinstance(item, Record) else item[1]
            if isinstance(item, Record):
                _release(item.view)
            if end is not None:
                tail = max(tail, end)
        self._tail, self._acked = tail, upto + 1
        self._words[W_TAIL] = tail                  # both in this line, written back together
        self._words[W_ACKED] = upto + 1
        self.coherence.flush(self._view, CONSUMER_LINE, 16)
        self.coherence.fence()
        if self.wakeup is not None:
            self.wakeup.notify()

    @staticmethod
    def _seq_of(item) -> int:
        return item.seq if isinstance(item, Record) else item[0]

    def close(self) -> None:
        for item in self._outstanding:
            if isinstance(item, Record):
                _release(item.view)
        self._outstanding.clear()
        super().close()
