"""A MODEL of non-coherent shared memory (CXL 2.0 shared between hosts), for the channel's fast tests.

This is test code: a model, not a driver.  One backing store (``memory``) is
shared by several hosts; each host sees it through its own write-back cache
with 64-byte lines, and the channel runs on a host's ``view`` with that host's
``coherence`` (a ``vfio_cxl.guest.channel.Coherence``):

* Every line is cached by every host from the start (the worst case), so a
  host keeps reading its stale copy of a line until it invalidates it.
* A host's stores go to its cache only.  A line the host has changed (dirty:
  different from what it last exchanged with memory) reaches memory only when
  it is written back: by ``flush`` or ``invalidate`` (which writes a dirty line
  back before dropping it) -- or by an eviction at a random moment.
* ``flush`` and ``invalidate`` are weak, like CLWB/CLFLUSHOPT: they are queued,
  and a queued operation takes effect at the host's next ``fence`` or, at
  random, earlier -- at any later cache operation of the same host, in any
  order.  An operation is never completed by another host's activity: a host
  that stops issuing cache operations leaves its queue pending (stricter than
  hardware, where it completes "eventually"; that is what makes a missing
  final fence visible).
* ``dma_write`` is a device writing memory without snooping any CPU cache.
* A host's process may crash (``crash_at``: the N-th cache operation raises
  Crash before it runs): the cache and its queue stay, and a restarted process
  on that host sees them.  A host may die (``die``): its dirty lines and queue
  are lost.
* ``on_event`` (a callable) runs after each cache operation of a host: a test
  runs the other side there, to look at memory between two of this host's
  steps.

Randomness (early completion, eviction) comes from one seeded
``random.Random``, so every run is reproducible from its seed.

Simplifications: a line is dirty when its bytes differ from the copy last
exchanged with memory, so storing the bytes a line already holds is not seen
as a write (a test that relies on such a store says so with ``will_store``); lines
are written back and fetched whole, atomically; there are no clean evictions
(they only make a reader fresher).
"""

from __future__ import annotations

import random
import sys

from vfio_cxl.guest.channel import Coherence

LINE = 64


class Crash(BaseException):
    """The process of a host was killed at this cache operation (not an Exception: nothing catches it)."""


class SharedMemoryModel:
    """The backing store, its hosts, and the seeded randomness."""

    def __init__(self, size: int, *, seed: int = 0, early: float = 0.25, evict: float = 0.05):
        if size % LINE:
            raise ValueError(f"size {size} is not a multiple of {LINE}")
        self.size, self.memory = size, bytearray(size)
        self.rng = random.Random(seed)
        self.early, self.evict = early, evict
        self.hosts: dict[str, Host] = {}
        self._in_event = False
        self.skip: set[tuple[str, int]] = set()     # call sites whose cache operations do nothing (mutants)
        self.seen: set[tuple[str, int]] = set()     # call sites that issued cache operations

    def host(self, name: str) -> "Host":
        if name not in self.hosts:
            self.hosts[name] = Host(self, name)
        return self.hosts[name]

    def dma_write(self, offset: int, data: bytes) -> None:
        """A device writes memory directly: no host cache sees it until that host invalidates."""
        self.memory[offset:offset + len(data)] = data


class Host:
    """One host: what its CPU sees (``view``), its cache operations (``coherence``)."""

    def __init__(self, model: SharedMemoryModel, name: str):
        self.model, self.name = model, name
        self.visible = bytearray(model.memory)       # every line cached, as memory is now
        self.clean = bytearray(model.memory)         # each line as last exchanged with memory
        self.view = memoryview(self.visible)
        self.queue: list[tuple[str, int]] = []       # (op, line) flushes/invalidations not yet done
        self.coherence = ModelCoherence(self)
        self.on_event = None
        self.ops = 0                                 # cache operations issued so far
        self.crash_at: int | None = None             # raise Crash at this operation number

    # -- lines -----------------------------------------------------------------------------------
    def _dirty(self, line: int) -> bool:
        a = line * LINE
        return self.visible[a:a + LINE] != self.clean[a:a + LINE]

    def write_back(self, line: int) -> None:
        if self._dirty(line):
            a = line * LINE
            self.model.memory[a:a + LINE] = self.visible[a:a + LINE]
            self.clean[a:a + LINE] = self.visible[a:a + LINE]

    def drop(self, line: int) -> None:
        """Invalidate: write back if dirty, then re-fetch from memory."""
        self.write_back(line)
        a = line * LINE
        self.visible[a:a + LINE] = self.clean[a:a + LINE] = self.model.memory[a:a + LINE]

    def will_store(self, offset: int, length: int) -> None:
        """Mark the lines over the range modified: the code about to run stores there, maybe unchanged bytes."""
        for n in range(offset // LINE, (offset + length - 1) // LINE + 1):
            a = n * LINE
            self.clean[a:a + LINE] = bytes(b ^ 0xFF for b in self.visible[a:a + LINE])

    def dirty_lines(self) -> list[int]:
        if self.visible == self.clean:
            return []
        return [n for n in range(self.model.size // LINE) if self._dirty(n)]

    def _complete(self, op: str, line: int) -> None:
        (self.write_back if op == "flush" else self.drop)(line)

    # -- events ----------------------------------------------------------------------------------
    def event(self) -> None:
        """Before each cache operation: maybe crash; maybe complete queued ones early; maybe evict."""
        self.ops += 1
        if self.crash_at is not None and self.ops == self.crash_at:
            self.crash_at = None
            raise Crash(f"host {self.name}: process killed at cache operation {self.ops}")
        rng = self.model.rng
        if self.queue and rng.random() < self.model.early:
            for item in rng.sample(self.queue, rng.randint(1, len(self.queue))):   # any subset, any order
                self.queue.remove(item)
                self._complete(*item)
        if rng.random() < self.model.evict:
            dirty = self.dirty_lines()
            if dirty:
                self.write_back(rng.choice(dirty))

    def after(self) -> None:
        model = self.model
        if self.on_event is not None and not model._in_event:
            model._in_event = True
            try:
                self.on_event()
            finally:
                model._in_event = False

    def fence(self) -> None:
        for item in self.queue:
            self._complete(*item)
        self.queue.clear()

    def die(self) -> None:
        """The host is gone: its dirty lines and queued operations never reach memory."""
        self.queue.clear()
        self.visible[:] = self.clean[:] = self.model.memory
        self.crash_at = None


class ModelCoherence(Coherence):
    """The channel's cache operations on a Host of the model."""

    name = "non-coherent memory model"

    def __init__(self, host: Host):
        self.host = host

    def _lines(self, view, offset: int, length: int) -> range:
        if view.obj is not self.host.visible or len(view) != self.host.model.size:
            raise AssertionError("the model expects the channel over the whole of its host's view")
        if length <= 0:
            return range(0)
        return range(offset // LINE, (offset + length - 1) // LINE + 1)

    def _skipped(self) -> bool:
        site = call_site(3)
        self.host.model.seen.add(site)
        return site in self.host.model.skip

    def flush(self, view, offset, length):
        if self._skipped():
            return
        self.host.event()
        self.host.queue += [("flush", n) for n in self._lines(view, offset, length)]
        self.host.after()

    def invalidate(self, view, offset, length):
        if self._skipped():
            return
        self.host.event()
        self.host.queue += [("invalidate", n) for n in self._lines(view, offset, length)]
        self.host.after()

    def fence(self):
        if self._skipped():
            return
        self.host.event()
        self.host.fence()
        self.host.after()


def call_site(depth: int = 2) -> tuple[str, int]:
    """(file, line) of the code that called the cache operation which calls this."""
    frame = sys._getframe(depth)
    return frame.f_code.co_filename, frame.f_lineno
