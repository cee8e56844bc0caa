"""DMA: which IOVAs the client opened to us, and the two ways to reach them.

* **direct path** -- DMA_MAP came with a file descriptor (guest RAM on a
  memfd, or the CXL memdev's backing file): we mmap it and copy with
  memoryview slices, no message at all.
* **message path** -- DMA_MAP came without one: every access becomes a
  VFIO_USER_DMA_READ / DMA_WRITE message and QEMU does the copy, translating
  through the vIOMMU on its side.

A transfer whose range is not fully mapped (with the access it needs)
faults before a single byte moves, like a device behind an IOMMU: the
vfio-user spec says DMA addresses "must have been previously exported with
DMA_MAP".  DMA_UNMAP takes the table lock, which direct copies hold only per
bounded chunk, so an unmap waits at most for one chunk and never for a
socket round trip.
"""

from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import threading
from typing import Callable, Protocol

from . import wire
from enum import IntEnum

log = logging.getLogger(__name__)

IOVA_LIMIT = 1 << 64
MAX_MAPPINGS = 65535
DIRECT_CHUNK = 2 << 20  # bytes copied per table-lock hold
PAGE = mmap.ALLOCATIONGRANULARITY


class FaultKind(IntEnum):
    """Why a DMA access failed, in protocol terms; a device maps it to its own codes."""

    UNMAPPED = 1  # no DMA_MAP covers (part of) the range
    PERMISSION = 2  # the mapping lacks read (or write) permission
    REFUSED = 3  # the client answered a DMA message with an error (errno set)
    TIMEOUT = 4  # the client did not answer a DMA message in time
    CLOSED = 5  # the client went away mid-transfer
    IO = 6  # the memory behind a mapping could not be accessed (errno set)


class DmaFault(Exception):
    """A transfer failed; ``kind`` is a FaultKind, ``addr`` the failing IOVA."""

    def __init__(self, kind: int, addr: int, err: int = 0, why: str = "", done: int = 0):
        self.kind = FaultKind(kind)
        self.addr = addr
        self.errno = err
        self.done = done  # bytes of the transfer that completed before the fault
        super().__init__(f"{self.kind.name} at {addr:#x}: {why}")


class DmaAborted(Exception):
    """The transfer was abandoned on purpose (device reset mid-descriptor)."""


class _MappedFile:
    """One mmap of a client fd, shared by the pieces of a split mapping."""

    __slots__ = ("mm", "view", "refs")

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.view = memoryview(mm)
        self.refs = 1

    def drop(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            self.view.release()
            self.mm.close()


class Mapping:
    __slots__ = ("iova", "size", "flags", "file", "file_offset")

    def __init__(self, iova: int, size: int, flags: int,
                 file: _MappedFile | None, file_offset: int):
        self.iova, self.size, self.flags = iova, size, flags
        self.file, self.file_offset = file, file_offset

    @property
    def end(self) -> int:
        return self.iova + self.size

    @property
    def direct(self) -> bool:
        return self.file is not None

    def piece(self, start: int, end: int) -> "Mapping":
        """The sub-range [start, end) as its own mapping (shares the mmap)."""
        if self.file is not None:
            self.file.refs += 1
        return Mapping(start, end - start, self.flags, self.file,
                       self.file_offset + (start - self.iova))

    def release(self) -> None:
        if self.file is not None:
            self.file.drop()
            self.file = None

    def __repr__(self) -> str:
        kind = "fd" if self.direct else "msg"
        return f"<Mapping {self.iova:#x}+{self.size:#x} {kind} flags={self.flags}>"


class DmaTable:
    """Sorted, non-overlapping IOVA mappings; thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self._maps: list[Mapping] = []
        self._starts: list[int] = []

    def __len__(self) -> int:
        return len(self._maps)

    def mappings(self) -> list[Mapping]:
        with self.lock:
            return list(self._maps)

    # ------------------------------------------------------------ DMA_MAP
    def map(self, iova: int, size: int, flags: int, fd: int | None, offset: int) -> Mapping:
        """Add a mapping.  Takes ownership of ``fd`` (always closed: mmap keeps its own ref)."""
        try:
            if size == 0 or iova + size > IOVA_LIMIT:
                raise wire.ProtocolError(errno.EINVAL, f"bad DMA range {iova:#x}+{size:#x}")
            if not flags & (wire.DMA_MAP_FLAG_READ | wire.DMA_MAP_FLAG_WRITE):
                raise wire.ProtocolError(errno.EINVAL, "DMA_MAP neither readable nor writable")
            file = file_offset = None
            if fd is not None:
                file, file_offset = self._mmap(fd, offset, size, flags)
        finally:
            if fd is not None:
                os.close(fd)
        new = Mapping(iova, size, flags & 3, file, file_offset or 0)
        with self.lock:
            i = bisect.bisect_right(self._starts, iova)
            for other in self._maps[max(0, i - 1):i + 1]:
                if other.iova < new.end and iova < other.end:
                    if (other.iova, other.size) == (iova, size):
                        self._remove(other)  # a re-map of the same window replaces it
                        break
                    new.release()
                    raise wire.ProtocolError(errno.EEXIST, f"{new!r} overlaps {other!r}")
            if len(self._maps) >= MAX_MAPPINGS:
                new.release()
                raise wire.ProtocolError(errno.ENOSPC, "too many DMA mappings")
            i = bisect.bisect_right(self._starts, iova)
            self._maps.insert(i, new)
            self._starts.insert(i, iova)
        return new

    @staticmethod
    def _mmap(fd: int, offset: int, size: int, flags: int):
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if flags & wire.DMA_MAP_FLAG_WRITE else 0)
        base = offset - offset % PAGE  # mmap offsets must be page-aligned
        try:
            mm = mmap.mmap(fd, size + (offset - base), flags=mmap.MAP_SHARED,
                           prot=prot, offset=base)
        except (OSError, ValueError, OverflowError) as exc:
            # Still usable through DMA_READ/WRITE messages: QEMU can always serve those.
            log.warning("DMA_MAP fd not mappable (%s); using the message path", exc)
            return None, 0
        return _MappedFile(mm), offset - base

    # ------------------------------------------------------------ DMA_UNMAP
    def unmap(self, iova: int, size: int) -> int:
        """Remove [iova, iova+size) from every mapping it touches (splitting
        partial overlaps).  QEMU sends huge ranges; returns bytes unmapped."""
        end = min(iova + size, IOVA_LIMIT)
        removed = 0
        with self.lock:
            for m in [m for m in self._maps if m.iova < end and iova < m.end]:
                self._remove(m)
                if m.iova < iova:
                    self._insert(m.piece(m.iova, iova))
                if end < m.end:
                    self._insert(m.piece(end, m.end))
                removed += min(m.end, end) - max(m.iova, iova)
                m.release()
        return removed

    def unmap_all(self) -> None:
        with self.lock:
            for m in self._maps:
                m.release()
            self._maps.clear()
            self._starts.clear()

    def _remove(self, m: Mapping) -> None:
        i = self._maps.index(m)
        del self._maps[i]
        del self._starts[i]

    def _insert(self, m: Mapping) -> None:
        i = bisect.bisect_right(self._starts, m.iova)
        self._maps.insert(i, m)
        self._starts.insert(i, m.iova)

    # ------------------------------------------------------------ lookups
    def _find(self, iova: int) -> Mapping | None:
        i = bisect.bisect_right(self._starts, iova) - 1
        if i >= 0 and iova < self._maps[i].end:
            return self._maps[i]
        return None

    def check(self, iova: int, length: int, need: int) -> None:
        """Fault unless [iova, iova+length) is fully mapped with ``need`` flags."""
        if length == 0:
            return
        if iova + length > IOVA_LIMIT:
            raise DmaFault(FaultKind.UNMAPPED, iova, why="range wraps past 2**64")
        pos, end = iova, iova + length
        with self.lock:
            while pos < end:
                m = self._find(pos)
                if m is None:
                    raise DmaFault(FaultKind.UNMAPPED, pos, why="no DMA_MAP covers it")
                if m.flags & need != need:
                    raise DmaFault(FaultKind.PERMISSION, pos, why=f"{m!r} lacks flags {need}")
                pos = m.end


class MessagePath(Protocol):
    """What the connection offers for IOVAs without an fd: it splits the range
    into DMA_WRITE / DMA_READ messages itself and raises DmaFault (with
    ``done``) or DmaAborted.  ``stale()`` true means the device dropped the
    work: no further message may be sent for it."""

    def dma_write(self, iova: int, data: memoryview, stale: Callable[[], bool]) -> None: ...
    def dma_read(self, iova: int, into: memoryview, stale: Callable[[], bool]) -> None: ...
    def abort_transfers(self) -> None: ...


def _never() -> bool:
    return False


class DmaPort:
    """The device's bus-master port: moves bytes between local buffers and IOVAs.

    ``gate`` is the device's lock around every memory access of its engine:
    a direct copy holds it per chunk and re-checks ``stale()`` inside, so a
    device that bumps its epoch under the gate knows that no access of the
    dropped work is in progress or will follow.
    """

    def __init__(self, table: DmaTable, messages: MessagePath | None,
                 gate: threading.Lock | None = None):
        self.table = table
        self.messages = messages
        self.gate = gate if gate is not None else threading.Lock()
        self.direct_bytes = 0
        self.message_bytes = 0

    def write(self, iova: int, data, stale: Callable[[], bool] = _never) -> None:
        """Device -> host memory."""
        self._transfer(iova, memoryview(data).cast("B"), wire.DMA_MAP_FLAG_WRITE, stale)

    def read(self, iova: int, into, stale: Callable[[], bool] = _never) -> None:
        """Host memory -> device."""
        self._transfer(iova, memoryview(into).cast("B"), wire.DMA_MAP_FLAG_READ, stale)

    def abort_transfers(self) -> None:
        """Fail every message transfer in flight (the device dropped its work)."""
        if self.messages is not None:
            self.messages.abort_transfers()

    def _transfer(self, iova: int, buf: memoryview, need: int, stale) -> None:
        # like an IOMMU: a range not fully mapped with the access needed faults
        # before a byte moves, and nothing is sent to the client
        self.table.check(iova, len(buf), need)
        done = [0]
        try:
            self._move(iova, buf, need, stale, done)
        except DmaFault as fault:
            fault.done = done[0]
            raise

    def _move(self, iova: int, buf: memoryview, need: int, stale, done: list) -> None:
        length = len(buf)
        to_host = need == wire.DMA_MAP_FLAG_WRITE
        pos = 0
        while pos < length:
            at = iova + pos
            with self.gate:
                if stale():
                    raise DmaAborted()
                with self.table.lock:
                    m = self.table._find(at)
                    if m is None:  # unmapped since check(): a concurrent DMA_UNMAP
                        raise DmaFault(FaultKind.UNMAPPED, at, why="unmapped during transfer")
                    if m.flags & need != need:
                        raise DmaFault(FaultKind.PERMISSION, at, why="re-mapped without access")
                    room = min(length - pos, m.end - at)
                    if m.direct:
                        n = min(room, DIRECT_CHUNK)
                        off = m.file_offset + (at - m.iova)
                        if to_host:
                            m.file.view[off:off + n] = buf[pos:pos + n]
                        else:
                            buf[pos:pos + n] = m.file.view[off:off + n]
                        self.direct_bytes += n
                        pos += n
                        done[0] = pos
                        continue
            # message path, outside the locks: the replies come via the reader thread
            if self.messages is None:
                raise DmaFault(FaultKind.CLOSED, at, errno.ENOTCONN, "no client connected")
            try:
                if to_host:
                    self.messages.dma_write(at, buf[pos:pos + room], stale)
                else:
                    self.messages.dma_read(at, buf[pos:pos + room], stale)
            except DmaFault as fault:
                done[0] = pos + fault.done
                raise
            self.message_bytes += room
            pos += room
            done[0] = pos
