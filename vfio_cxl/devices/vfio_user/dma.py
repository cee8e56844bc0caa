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
DMA_MAP".  Unless the device keeps such faults local, the faulting access
(its first ``REPORT_BYTES``) is also sent to the client as one message, rate
limited (``FaultReports``): QEMU 11.1 serves a DMA message with
``pci_dma_read``/``pci_dma_write``, so its vIOMMU translates the IOVA,
records the fault the guest kernel logs, and answers with an error (ENODEV).

DMA_UNMAP takes the table lock, which direct copies hold only per bounded
chunk, so an unmap waits at most for one chunk and never for a socket round
trip.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
from typing import Callable, Protocol

from . import wire
from enum import IntEnum

log = logging.getLogger(__name__)

IOVA_LIMIT = 1 << 64
# Mappings one client may hold.  The spec's max_dma_maps defaults to 65535 and
# QEMU 11.1 refuses a server that advertises more ("can only lower it"), yet
# its vIOMMU path sends one DMA_MAP per 4 KiB IOMMU entry without counting
# (a 1 GiB type1-v1 map is 262144): room for 4 GiB of 4 KiB pages.
MAX_MAPPINGS = 1 << 20
DIRECT_CHUNK = 2 << 20  # bytes copied per table-lock hold
NONCE_SIZE = 16  # bytes of each peer-proof nonce
PEER_PAGE = 4096  # a peer mapping starts page-aligned in the peer's memory


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


class ClientFile:
    """A client file handed over with DMA_MAP, shared by every mapping into it.

    QEMU sends one fd per DMA_MAP, and with a vIOMMU that maps 4 KiB pages it
    sends hundreds of thousands of them, all for the same guest-RAM memfd:
    one mmap (or one kept fd) per mapping would exhaust ``vm.max_map_count``
    (65530) or RLIMIT_NOFILE.  So the table keeps one ClientFile per file
    (device, inode, writable, the fd's access mode), counts the mappings that use it, and closes
    each further fd for that file as soon as it has been checked.

    * sealed against shrinking (F_SEAL_SHRINK, e.g. QEMU's memory-backend-memfd):
      the whole file mmapped once and copied with memoryview slices -- the
      client cannot make the mapping fault;
    * anything else (e.g. QEMU's memory-backend-file, which cannot be sealed):
      kept as an fd and accessed with pread/pwrite, so a client that truncates
      the file makes the access fail (DmaFault IO / EFAULT), never the server
      crash with SIGBUS.
    """

    __slots__ = ("fd", "mm", "view", "length", "key", "refs", "on_close")

    def __init__(self, fd: int, st: os.stat_result, writable: bool, key=None, on_close=None):
        """Takes ownership of ``fd``.  ProtocolError(EINVAL) if it cannot serve DMA."""
        self.fd, self.mm, self.view, self.length = fd, None, None, st.st_size
        self.key, self.refs, self.on_close = key, 0, on_close
        try:
            if _seals(fd) & F_SEAL_SHRINK:
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                try:
                    self.mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=prot)
                except (OSError, ValueError, OverflowError) as exc:
                    raise wire.ProtocolError(errno.EINVAL,
                                             f"sealed DMA_MAP fd not mappable: {exc}") from None
                self.view = memoryview(self.mm)
                os.close(fd)
                self.fd = -1
        except BaseException:
            self._close()
            raise

    @property
    def mapped(self) -> bool:
        return self.mm is not None

    def covers(self, offset: int, size: int) -> bool:
        """Whether a mapping of [offset, offset+size) can use this file object
        (a sealed file that grew since it was mmapped needs a new one)."""
        return self.mm is None or offset + size <= self.length

    def write(self, off: int, data: memoryview) -> int:
        """Store ``data`` at file offset ``off``; returns bytes stored (short: EOF)."""
        if self.mm is not None:
            self.view[off:off + len(data)] = data
            return len(data)
        if os.fstat(self.fd).st_size < off + len(data):  # never grow a truncated file
            return max(0, min(len(data), os.fstat(self.fd).st_size - off))
        return os.pwritev(self.fd, [data], off)

    def read(self, off: int, into: memoryview) -> int:
        """Load ``len(into)`` bytes from file offset ``off``; returns bytes loaded."""
        if self.mm is not None:
            into[:] = self.view[off:off + len(into)]
            return len(into)
        done = 0
        while done < len(into):
            n = os.preadv(self.fd, [into[done:]], off + done)
            if n <= 0:
                break
            done += n
        return done

    def drop(self) -> None:
        """One mapping fewer uses the file; the last one closes it."""
        self.refs -= 1
        if self.refs <= 0:
            self._close()
            if self.on_close is not None:
                self.on_close(self)

    def _close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _check_fd(fd: int, offset: int, size: int, flags: int) -> os.stat_result:
    """The fd's stat if it can back [offset, offset+size); ProtocolError(EINVAL) if not."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise wire.ProtocolError(errno.EINVAL, "DMA_MAP fd is not a regular file or memfd")
    if st.st_size < offset + size:
        raise wire.ProtocolError(
            errno.EINVAL, f"DMA_MAP fd has {st.st_size} bytes, the mapping needs "
            f"{offset + size}")
    try:
        os.pread(fd, 0, offset)  # readable (pread/pwrite and mmap need it)
    except OSError as exc:
        raise wire.ProtocolError(errno.EINVAL, f"DMA_MAP fd not readable: {exc.strerror}") from None
    return st


F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)


def _seals(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:  # not a memfd / no sealing support: no seals
        return 0


class Mapping:
    __slots__ = ("iova", "size", "flags", "file", "file_offset", "peer", "peer_offset", "probed")

    def __init__(self, iova: int, size: int, flags: int,
                 file: ClientFile | None, file_offset: int):
        self.iova, self.size, self.flags = iova, size, flags
        self.file, self.file_offset = file, file_offset
        # peer fast path: set only with a proof that this IOVA range is backed by
        # peer memory ``peer`` at ``peer_offset`` (DmaPort._prove); never inherited
        # by pieces, dropped by release() (DMA_UNMAP)
        self.peer = None
        self.peer_offset = 0
        self.probed = False  # a proof was tried and failed: message path for good

    @property
    def end(self) -> int:
        return self.iova + self.size

    @property
    def direct(self) -> bool:
        return self.file is not None

    def release(self) -> None:
        self.peer = None  # the proof dies with the mapping
        if self.file is not None:
            self.file.drop()
            self.file = None

    def __repr__(self) -> str:
        kind = "fd" if self.direct else ("peer" if self.peer is not None else "msg")
        return f"<Mapping {self.iova:#x}+{self.size:#x} {kind} flags={self.flags}>"


class DmaTable:
    """Sorted, non-overlapping IOVA mappings; thread-safe.

    Sized for a vIOMMU that maps page by page (QEMU 11.1 sends one DMA_MAP per
    4 KiB IOMMU entry: 262144 for 1 GiB): lookups, inserts and unmaps bisect
    the sorted starts, and the files behind the mappings are shared
    (ClientFile), never one mmap or fd per mapping.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self._maps: list[Mapping] = []
        self._starts: list[int] = []
        self._files: dict[tuple, ClientFile] = {}  # (st_dev, st_ino, writable, accmode) -> file

    def __len__(self) -> int:
        return len(self._maps)

    @property
    def open_files(self) -> int:
        """Client files the table holds open (mmapped or as an fd)."""
        with self.lock:
            return len(self._files)

    def mappings(self) -> list[Mapping]:
        with self.lock:
            return list(self._maps)

    # ------------------------------------------------------------ DMA_MAP
    def map(self, iova: int, size: int, flags: int, fd: int | None, offset: int) -> Mapping:
        """Add a mapping.  Takes ownership of ``fd`` (kept for the file, or closed)."""
        try:
            if size == 0 or iova + size > IOVA_LIMIT or offset + size > IOVA_LIMIT:
                raise wire.ProtocolError(errno.EINVAL, f"bad DMA range {iova:#x}+{size:#x}")
            if flags & ~(wire.DMA_MAP_FLAG_READ | wire.DMA_MAP_FLAG_WRITE):
                raise wire.ProtocolError(errno.EINVAL, f"DMA_MAP flags {flags:#x}")
            if not flags:
                raise wire.ProtocolError(errno.EINVAL, "DMA_MAP neither readable nor writable")
            st = _check_fd(fd, offset, size, flags) if fd is not None else None
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        new = Mapping(iova, size, flags, None, offset if fd is not None else 0)
        end = iova + size
        with self.lock:
            try:
                i = bisect.bisect_right(self._starts, iova)
                for other in self._maps[max(0, i - 1):i + 1]:
                    if other.iova < end and iova < other.end:
                        # the spec: mapping over an existing region fails
                        raise wire.ProtocolError(errno.EEXIST, f"{new!r} overlaps {other!r}")
                if len(self._maps) >= MAX_MAPPINGS:
                    raise wire.ProtocolError(errno.ENOSPC, f"too many DMA mappings "
                                             f"({MAX_MAPPINGS})")
                if fd is not None:
                    owned, fd = fd, None
                    new.file = self._file(owned, st, offset, size, flags)
            finally:
                if fd is not None:
                    os.close(fd)
            self._maps.insert(i, new)
            self._starts.insert(i, iova)
        return new

    def _file(self, fd: int, st: os.stat_result, offset: int, size: int, flags: int) -> ClientFile:
        """The shared ClientFile for ``fd``'s file, with one more user (caller holds ``lock``).
        Takes ownership of ``fd``: closed at once if the file is already open."""
        # the fd's access mode too: a later fd for the same file must not reach it through an
        # earlier fd that was opened with less (or more) access than it
        key = (st.st_dev, st.st_ino, bool(flags & wire.DMA_MAP_FLAG_WRITE),
               fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE)
        file = self._files.get(key)
        if file is not None and file.covers(offset, size):
            os.close(fd)
        else:  # first mapping into it (or it grew past our mmap): a new one for later maps
            file = ClientFile(fd, st, bool(key[2]), key, self._forget)
            self._files[key] = file
        file.refs += 1
        return file

    def _forget(self, file: ClientFile) -> None:
        if self._files.get(file.key) is file:
            del self._files[file.key]

    # ------------------------------------------------------------ DMA_UNMAP
    def unmap(self, iova: int, size: int) -> int:
        """Remove the mappings [iova, iova+size) covers; returns bytes unmapped.

        The spec wants the range to match one mapping exactly; QEMU 11.1 also
        sends huge ranges covering several whole mappings (or none), so a range
        made of whole mappings is accepted (docs/gpu-device.md, departures).  A
        range that cuts a mapping (bisects it) is refused with EINVAL and
        removes nothing.
        """
        end = min(iova + size, IOVA_LIMIT)
        with self.lock:
            lo = bisect.bisect_right(self._starts, iova) - 1
            if lo < 0 or self._maps[lo].end <= iova:
                lo += 1
            hi = bisect.bisect_left(self._starts, end, lo)
            hit = self._maps[lo:hi]
            for m in (hit[0], hit[-1]) if hit else ():
                if m.iova < iova or end < m.end:
                    raise wire.ProtocolError(
                        errno.EINVAL, f"DMA_UNMAP {iova:#x}+{size:#x} cuts {m!r}: an unmap "
                        f"must cover whole mappings")
            del self._maps[lo:hi]
            del self._starts[lo:hi]
            for m in hit:
                m.release()
        return sum(m.size for m in hit)

    def unmap_all(self) -> None:
        with self.lock:
            for m in self._maps:
                m.release()
            self._maps.clear()
            self._starts.clear()
            for file in list(self._files.values()):  # none left: every mapping dropped its own
                file.refs = 0
                file.drop()

    # ------------------------------------------------------------ lookups
    def find(self, iova: int) -> Mapping | None:
        """The mapping containing ``iova`` (caller holds ``lock``), or None."""
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
                m = self.find(pos)
                if m is None:
                    raise DmaFault(FaultKind.UNMAPPED, pos, why="no DMA_MAP covers it")
                if m.flags & need != need:
                    raise DmaFault(FaultKind.PERMISSION, pos, why=f"{m!r} lacks flags {need}")
                pos = m.end


# The fault report: the first bytes of the faulting access, in its direction.  Four bytes, the
# smallest access every MMIO region takes: an IOVA the guest's IOMMU does map but QEMU never
# DMA_MAPped (MMIO outside a message window) receives at most these (docs/gpu-device.md).
REPORT_BYTES = 4
REPORT_RATE = 10.0        # fault reports per second, sustained
REPORT_BURST = 10         # reports sent back to back before the rate applies
SUMMARY_INTERVAL = 10.0   # seconds between two log lines about fault reports


class FaultReports:
    """Which unmapped-DMA faults go to the client, and the log lines about them.

    A token bucket: ``REPORT_BURST`` reports at once, then ``REPORT_RATE`` per
    second; a fault beyond that stays local (the device halts all the same)
    and is counted as suppressed.  The log gets one line for the first fault,
    one for the first fault suppressed (the rate limit bites: a log reader
    knows it at once, not at the next summary), and then at most one summary
    per ``SUMMARY_INTERVAL``: a guest that
    sprays bad IOVAs floods neither QEMU (its vIOMMU, the guest's fault log)
    nor the device's log.  Thread-safe; one per device, kept across clients.
    """

    def __init__(self, rate: float = REPORT_RATE, burst: int = REPORT_BURST,
                 interval: float = SUMMARY_INTERVAL, clock: Callable[[], float] = time.monotonic):
        if rate <= 0 or burst < 1:
            raise ValueError(f"fault report rate {rate}/s, burst {burst}: both must be positive")
        self.rate, self.burst, self.interval, self.clock = rate, burst, interval, clock
        self.sent = 0         # reports sent to the client
        self.suppressed = 0   # faults kept local by the rate limit
        self.served = 0       # reports the client served (its IOMMU maps the IOVA: MMIO)
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._stamp = clock()
        self._logged = (0, 0)  # (sent, suppressed) at the last log line
        self._log_at = None    # when the next summary is due (None: before the first fault)

    def admit(self, iova: int, write: bool) -> bool:
        """Whether the fault at ``iova`` goes to the client; counts it either way."""
        with self._lock:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            admitted = self._tokens >= 1
            if admitted:
                self._tokens -= 1
                self.sent += 1
            else:
                self.suppressed += 1
                if self.suppressed == 1:
                    log.warning("unmapped DMA faults beyond %g/s (burst %d) now stay local: "
                                "not reported to the client", self.rate, self.burst)
            self._log(now, iova, write)
            return admitted

    def count_served(self) -> None:
        """The client served a report: its IOMMU maps an IOVA it never DMA_MAPped (MMIO)."""
        with self._lock:
            self.served += 1

    def _log(self, now: float, iova: int, write: bool) -> None:
        if self._log_at is None:
            log.warning("DMA %s to unmapped IOVA %#x: reported to the client (its IOMMU logs the "
                        "fault); further reports at most %g/s, summarised every %g s",
                        "write" if write else "read", iova, self.rate, self.interval)
        elif now >= self._log_at:
            log.warning(self.summary(since_last=True))
        else:
            return
        self._logged = (self.sent, self.suppressed)
        self._log_at = now + self.interval

    def summary(self, since_last: bool = False) -> str:
        """One line: reports sent and faults suppressed (in total, or since the last line)."""
        sent, suppressed = self.sent, self.suppressed
        if since_last:
            sent, suppressed = sent - self._logged[0], suppressed - self._logged[1]
        span = "since the last summary" if since_last else "in total"
        return (f"unmapped DMA faults {span}: {sent} reported to the client, {suppressed} "
                f"suppressed by the rate limit ({self.rate:g}/s, burst {self.burst})")


class MessagePath(Protocol):
    """What the connection offers for IOVAs without an fd: it splits the range
    into DMA_WRITE / DMA_READ messages itself and raises DmaFault (with
    ``done``) or DmaAborted.  ``stale()`` true means the device dropped the
    work: no further message may be sent for it.  ``unchecked``: send even though
    no DMA_MAP covers the range (the device's message window)."""

    def dma_write(self, iova: int, data: memoryview, stale: Callable[[], bool], *,
                  unchecked: bool = False) -> None: ...
    def dma_read(self, iova: int, into: memoryview, stale: Callable[[], bool], *,
                 unchecked: bool = False) -> None: ...
    def abort_transfers(self) -> None: ...

    @property
    def closed(self) -> bool: ...


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
                 gate: threading.Lock | None = None, peers=None,
                 peer_enabled: Callable[[], bool] = lambda: True,
                 message_window: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 fault_reports: FaultReports | None = None):
        """``fault_reports``: send unmapped-DMA faults to the client, rate limited
        (None: keep them local, nothing is sent)."""
        self.table = table
        self.fault_reports = fault_reports
        self.messages = messages
        self.gate = gate if gate is not None else threading.Lock()
        self.peers = peers  # peer.PeerSet or None: peer memories we may prove mappings into
        self.peer_enabled = peer_enabled
        # (base, size): IOVAs the device's driver declared peer MMIO.  QEMU sends no DMA_MAP
        # for an IOVA that maps MMIO ("iommu map to non memory area"), so a transfer wholly
        # inside the window skips the table and goes as messages, which the client
        # translates through its IOMMU (and refuses when nothing is mapped there).
        self.message_window = message_window
        self.window_writes = 0  # DMA_WRITE messages sent for the window
        self.window_reads = 0
        self.direct_bytes = 0
        self.message_bytes = 0
        self.peer_bytes = 0  # moved by the peer fast path
        self.probes = 0  # proofs attempted
        self.proofs = 0  # proofs that held
        self._hint = None  # (peer, iova, offset) of the last proof: where the next piece likely is

    def write(self, iova: int, data, stale: Callable[[], bool] = _never) -> None:
        """Device -> host memory."""
        self._transfer(iova, memoryview(data).cast("B"), wire.DMA_MAP_FLAG_WRITE, stale)

    def read(self, iova: int, into, stale: Callable[[], bool] = _never) -> None:
        """Host memory -> device."""
        self._transfer(iova, memoryview(into).cast("B"), wire.DMA_MAP_FLAG_READ, stale)

    @property
    def closed(self) -> bool:
        """The client is going away: no DMA can succeed any more."""
        return self.messages is not None and self.messages.closed

    def abort_transfers(self) -> None:
        """Fail every message transfer in flight (the device dropped its work)."""
        if self.messages is not None:
            self.messages.abort_transfers()

    def _transfer(self, iova: int, buf: memoryview, need: int, stale) -> None:
        base, size = self.message_window()
        if size and base <= iova and iova + len(buf) <= base + size:
            self._window_transfer(iova, buf, need, stale)
            return
        # like an IOMMU: a range not fully mapped with the access needed faults
        # before a byte moves; the client hears of it only as the fault's report
        try:
            self.table.check(iova, len(buf), need)
        except DmaFault as fault:
            self._report_unmapped(fault, iova, buf, need, stale)
            raise
        done = [0]
        try:
            self._move(iova, buf, need, stale, done)
        except DmaFault as fault:
            fault.done = done[0]
            self._report_unmapped(fault, iova, buf, need, stale)
            raise

    def _report_unmapped(self, fault: DmaFault, iova: int, buf: memoryview, need: int,
                         stale) -> None:
        """Send the client the access of the transfer ``iova``/``buf`` that faulted UNMAPPED
        (its first REPORT_BYTES from the fault's IOVA), so its IOMMU sees it, if the rate
        limit lets it.  The device faults whatever the answer; a client gone mid-report
        turns the fault into CLOSED."""
        at = fault.addr - iova
        piece = buf[at:at + REPORT_BYTES] if 0 <= at < len(buf) else buf[:0]
        if (fault.kind is not FaultKind.UNMAPPED or self.fault_reports is None
                or self.messages is None or not piece or fault.addr + len(piece) > IOVA_LIMIT):
            return
        write = need == wire.DMA_MAP_FLAG_WRITE
        if not self.fault_reports.admit(fault.addr, write):
            return
        with self.gate:
            if stale():
                raise DmaAborted()
        try:
            if write:
                self.messages.dma_write(fault.addr, piece, stale, unchecked=True)
            else:  # what comes back is thrown away: the device never takes it
                self.messages.dma_read(fault.addr, memoryview(bytearray(len(piece))), stale,
                                       unchecked=True)
        except DmaFault as answer:
            if answer.kind is FaultKind.CLOSED:
                raise
            return  # refused (ENODEV: the vIOMMU has no translation) or unanswered: as expected
        self.fault_reports.count_served()

    def _window_transfer(self, iova: int, buf: memoryview, need: int, stale) -> None:
        """A transfer inside the message window: DMA_READ/DMA_WRITE messages, no table."""
        if self.messages is None:
            raise DmaFault(FaultKind.CLOSED, iova, errno.ENOTCONN, "no client connected")
        with self.gate:
            if stale():
                raise DmaAborted()
        if need == wire.DMA_MAP_FLAG_WRITE:
            self.window_writes += 1
            self.messages.dma_write(iova, buf, stale, unchecked=True)
        else:
            self.window_reads += 1
            self.messages.dma_read(iova, buf, stale, unchecked=True)
        self.message_bytes += len(buf)

    def _prove(self, m: Mapping, at: int, room: int, stale):
        """Proof that mapping ``m`` is backed by a peer's memory, or None.

        Writes a fresh random nonce through the IOVA (DMA_WRITE messages: the
        client translates them through its IOMMU) at the first and the last
        NONCE_SIZE bytes of [at, at+room) -- bytes this transfer overwrites
        anyway -- and looks for both in each peer's memory at offsets that
        fit: page-aligned start of ``m``, all of ``m`` inside the peer memory,
        the two nonces ``room - NONCE_SIZE`` apart.  Returns (peer, offset of
        m.iova in the peer's memory)."""
        self.probes += 1
        first, last = at, at + room - NONCE_SIZE
        n1, n2 = os.urandom(NONCE_SIZE), os.urandom(NONCE_SIZE)
        self.messages.dma_write(first, memoryview(n1), stale)
        self.messages.dma_write(last, memoryview(n2), stale)
        rel1, rel2 = first - m.iova, last - m.iova

        def holds(peer, o: int) -> bool:
            return (o >= 0 and o % PEER_PAGE == 0 and o + m.size <= peer.size
                    and peer.view[o + rel1:o + rel1 + NONCE_SIZE] == n1
                    and peer.view[o + rel2:o + rel2 + NONCE_SIZE] == n2)

        peers = self.peers.views()
        if self._hint is not None:  # the next piece of the same mapping, most likely
            hpeer, hiova, hoff = self._hint
            guess = hoff + (m.iova - hiova)
            if any(p is hpeer for p in peers) and holds(hpeer, guess):
                return hpeer, guess
            if hpeer.retired:
                self._hint = None   # holds no retired peer's memory
        for peer in peers:
            idx = peer.mm.find(n1)
            while idx != -1:
                if holds(peer, idx - rel1):
                    return peer, idx - rel1
                idx = peer.mm.find(n1, idx + 1)
        return None

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
                    m = self.table.find(at)
                    if m is None:  # unmapped since check(): a concurrent DMA_UNMAP
                        raise DmaFault(FaultKind.UNMAPPED, at, why="unmapped during transfer")
                    if m.flags & need != need:
                        raise DmaFault(FaultKind.PERMISSION, at, why="re-mapped without access")
                    room = min(length - pos, m.end - at)
                    if m.direct:
                        n = min(room, DIRECT_CHUNK)
                        off = m.file_offset + (at - m.iova)
                        try:
                            if to_host:
                                moved = m.file.write(off, buf[pos:pos + n])
                            else:
                                moved = m.file.read(off, buf[pos:pos + n])
                        except OSError as exc:
                            raise DmaFault(FaultKind.IO, at, exc.errno or errno.EIO,
                                           f"file access failed: {exc.strerror}") from None
                        self.direct_bytes += moved
                        if moved < n:  # the client's file ends early (truncated)
                            pos += moved
                            done[0] = pos
                            raise DmaFault(FaultKind.IO, iova + pos, errno.EFAULT,
                                           "the client's file is shorter than its mapping")
                        pos += n
                        done[0] = pos
                        continue
                    if m.peer is not None and self.peer_enabled():
                        n = min(room, DIRECT_CHUNK)
                        off = m.peer_offset + (at - m.iova)
                        peer = m.peer
                        with peer.lock:   # not retired while it copies
                            if not peer.retired:
                                if to_host:
                                    peer.view[off:off + n] = buf[pos:pos + n]
                                else:
                                    buf[pos:pos + n] = peer.view[off:off + n]
                        if peer.retired:   # its owner is gone: the proof with it
                            m.peer, m.probed = None, False
                        else:
                            self.peer_bytes += n
                            pos += n
                            done[0] = pos
                            continue
            # message path, outside the locks: the replies come via the reader thread
            if self.messages is None:
                raise DmaFault(FaultKind.CLOSED, at, errno.ENOTCONN, "no client connected")
            if (to_host and self.peers and not m.probed and m.peer is None
                    and room >= 2 * NONCE_SIZE and self.peer_enabled()):
                try:
                    proof = self._prove(m, at, room, stale)
                except DmaFault as fault:
                    done[0] = pos + fault.done
                    raise
                with self.table.lock:
                    if self.table.find(at) is m and m.file is None:  # not unmapped meanwhile
                        if proof is None:
                            m.probed = True
                        else:
                            m.peer, m.peer_offset = proof
                            self.proofs += 1
                            self._hint = (proof[0], m.iova, proof[1])
                            continue  # the fast path takes it from here
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
