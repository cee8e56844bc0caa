"""Descriptor rings as the driver sees them: which slots are posted, what each one carries.

Pure bookkeeping over a writable view of the ring memory (the device reads and writes the
same bytes through DMA): no registers here, so the logic is tested with a bytearray.  One
slot stays empty, as on every e1000-family ring: head == tail means empty to the device.
"""

from __future__ import annotations

from typing import Any

from . import spec
from .errors import IgbError


class Ring:
    """``entries`` descriptors in ``memory``; ``tail`` is the next slot the driver fills,
    ``clean`` the oldest slot the device still owns (or has written back)."""

    def __init__(self, memory: memoryview, entries: int, what: str):
        if entries < 8 or entries % 8:
            raise IgbError(f"{what}: a ring of {entries} descriptors",
                           "use a multiple of 8 (RDLEN/TDLEN are multiples of 128 bytes), at least 8")
        if len(memory) < entries * spec.DESC_SIZE:
            raise IgbError(f"{what}: {len(memory)} bytes of ring memory for {entries} descriptors",
                           f"give {entries * spec.DESC_SIZE} bytes")
        self.memory, self.entries, self.what = memory, entries, what
        self.tail = self.clean = 0
        self.cookies: list[Any] = [None] * entries     # what each posted slot carries

    @property
    def posted(self) -> int:
        return (self.tail - self.clean) % self.entries

    @property
    def free(self) -> int:
        return self.entries - 1 - self.posted

    def desc(self, slot: int) -> memoryview:
        return self.memory[slot * spec.DESC_SIZE:(slot + 1) * spec.DESC_SIZE]

    def post(self, desc: bytes, cookie: Any) -> int:
        """Write ``desc`` at the tail; the slot it took.  Refuses a full ring."""
        if self.free == 0:
            raise IgbError(f"{self.what}: all {self.entries - 1} usable descriptors are posted",
                           "reap completions before posting more")
        slot = self.tail
        self.desc(slot)[:] = desc
        self.cookies[slot] = cookie
        self.tail = (slot + 1) % self.entries
        return slot

    def pop(self) -> Any:
        """Take back the oldest posted slot; its cookie."""
        if self.posted == 0:
            raise IgbError(f"{self.what}: nothing posted to take back", "post before reaping")
        slot = self.clean
        cookie, self.cookies[slot] = self.cookies[slot], None
        self.clean = (slot + 1) % self.entries
        return cookie

    def reset(self) -> list[Any]:
        """Forget every posted slot (the queue was disabled); the cookies they held."""
        held = [self.pop() for _ in range(self.posted)]
        self.tail = self.clean = 0
        self.memory[:self.entries * spec.DESC_SIZE] = bytes(self.entries * spec.DESC_SIZE)
        return held


class TxRing(Ring):
    def reclaim(self) -> list[Any]:
        """Cookies of the sent descriptors (DD written back), oldest first."""
        done = []
        while self.posted and spec.tx_done(self.desc(self.clean)):
            done.append(self.pop())
        return done


class RxRing(Ring):
    def reap(self, frames: int | None = None) -> list[tuple[Any, spec.RxCompletion]]:
        """(cookie, completion) of the written-back descriptors, oldest first: all of them,
        or those of the first ``frames`` whole frames (up to their EOP descriptor), as NAPI's
        budget.  What is not taken stays written back in the ring for the next call: a caller
        takes only what it will handle, so no frame is popped and then forgotten."""
        done = []
        while self.posted and spec.rx_done(self.desc(self.clean)) and frames != 0:
            completion = spec.unpack_rx(self.desc(self.clean))
            done.append((self.pop(), completion))
            if completion.eop and frames is not None:
                frames -= 1
        return done
