"""RDMA-shaped writes between two hosts' VRAM over the userspace igb driver.

    ep = RdmaEndpoint(nic)          # nic and gpu in one IOMMU context; NicSession.endpoint() also
                                    # watches the GPU's release request (docs/nic.md)
    mr = ep.reg_mr(gpu, vram_offset=0, length=16 << 20, access=Access.REMOTE_WRITE)
    # responder (host1): mr.key goes to the peer out of band; then, per write
    done = ep.serve(timeout=60)                               # -> Completion (imm, bytes, frames)
    # requester (host0), its own region as the source
    src = ep.reg_mr(gpu, 0, 16 << 20)
    ep.write(src, 0, 16 << 20, remote_key, 0, to=peer_nic_mac, imm=7)

What ``ibv_reg_dmabuf_mr`` and ``IBV_WR_RDMA_WRITE_WITH_IMM`` do, in the lab's terms
(docs/nic.md, "RDMA-shaped writes").  A registration maps a VRAM range of a GPU into the
NIC's IOMMU context, in a 4 GiB IOVA window of its own (the rest of the window stays
unmapped), and returns a key that names its slot and the slot's generation: a key of a
registration since freed, or of an earlier one in the same slot, is refused by name.

A write goes in MTU-sized frames of a raw Ethernet type (``ETHERTYPE``): a 64-byte header
(the Ethernet header, then key, write id, sequence, region offset, length, immediate), then
at most ``MTU`` payload bytes the sender's TX descriptor reads straight from its BAR2.  The
receiver places each payload with no CPU copy by posting, on an in-order link, one RX
descriptor per frame at the VRAM address that frame's payload belongs at: header split
always at 64 bytes (a non-IP frame is split at exactly BSIZEHEADER), header to guest RAM,
payload to the descriptor's ``pkt_addr``.  It posts descriptors only for a write it accepted
(its key, bounds and access checked on the write request), grants the sender as many frames
as it posted, and checks every frame's header against the write and its registrations before
the frame counts; a frame that fails ends the write with an error.  Its payload has landed
already, but only at an address the receiver posted for that write: inside the registered
range by construction.  ``placement="bounce"`` is the reference: the sender reads VRAM
through its BAR2 into frames, the receiver takes whole frames into guest RAM and writes the
payloads into VRAM through its BAR2, every byte counted.
"""

from __future__ import annotations

import enum
import mmap
import random
import secrets
import struct
import time
from dataclasses import dataclass

from ..drivers.igb import IgbDevice, IgbError, IgbTimeout
from ..drivers.igb import spec
from ..p2p import map_peer_bar
from ..vfio.errors import VfioError

ETHERTYPE = 0x88B5                  # IEEE 802 local experimental: these frames are no one else's
MTU = 1024                          # payload bytes per frame: one 1 KiB packet buffer (BSIZEPACKET)
HEADER = 64                         # wire header, Ethernet included: one BSIZEHEADER unit
ETH_HEADER = 14
_WIRE = struct.Struct("!BBHIIIQII")  # op, status, 0, key, write id, seq, offset, length, imm
MR_IOVA = 0x20_0000_0000            # registration slot s at MR_IOVA + s * MR_WINDOW
MR_WINDOW = 1 << 32
MAX_REGIONS = 16
HEADER_IOVA = 0x1000_0000           # the receiver's header buffers (above devmem's windows)
PAGE = 4096
GRANT_BATCH = 32                    # descriptors posted before the receiver grants them
# QEMU's igb takes a frame only if the free descriptors' packet buffers could hold all of it,
# header included (igb_core.c igb_has_rxbufs: total_size <= free * BSIZEPACKET), though header
# split puts the header elsewhere: a 1088-byte frame needs a second descriptor posted behind its
# own.  The receiver grants a frame only once a descriptor follows it, and behind a write's last
# frame posts a guard whose buffers are guest RAM (GUARD_IOVA), taken back when the write ends.
GUARD_IOVA = HEADER_IOVA + 0x0100_0000   # above the header buffers (a ring's worth, at most 256 KiB)
# The responder looks at its ring again after this long with no interrupt, as Linux's igb
# watchdog (igb_watchdog_task) fires the queues' vectors every 2 s: a lost interrupt costs that.
RX_WATCHDOG = 2.0
DATA_MAC = bytes.fromhex("020000000201")   # the receiver steers this MAC to its data queue
PATTERN_BLOCK = 4096


class RdmaError(IgbError):
    """An RDMA-shaped call was refused or failed; the message names the rule and the fix."""


class PeerLost(RdmaError, IgbTimeout):
    """A write's peer went silent mid-transfer (its lab or its responder gone): the message
    names the peer and what it last acknowledged."""


class WriteFailed(RdmaError):
    """A write the responder accepted ended before every frame was placed; ``status`` says why."""

    def __init__(self, status: "Status", what: str):
        super().__init__(what, REFUSALS[status][1])
        self.status = status


class Op(enum.IntEnum):
    REQUEST = 1         # requester -> responder: key, offset, length, imm of a write
    GRANT = 2           # responder -> requester: frames [0, seq) may be sent, [0, length) are placed
    DATA = 3            # one frame of payload
    DONE = 4            # responder -> requester: every frame placed (imm echoed)
    NAK = 5             # responder -> requester: refused (status says why)


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_KEY = 1
    STALE_KEY = 2
    FREED = 3
    OUT_OF_RANGE = 4
    ACCESS = 5
    BAD_FRAME = 6
    TIMEOUT = 7


REFUSALS = {
    Status.UNKNOWN_KEY: ("the key names no registration of the responder", "use the key reg_mr returned there"),
    Status.STALE_KEY: ("the key is of an earlier registration: its slot was registered again since",
                       "use the region's current key"),
    Status.FREED: ("the key's region was freed (dereg_mr)", "register the range again and use its new key"),
    Status.OUT_OF_RANGE: ("remote_offset + length is beyond the registered region",
                          "write inside [0, region length)"),
    Status.ACCESS: ("the region was not registered with Access.REMOTE_WRITE", "register it with REMOTE_WRITE"),
    Status.BAD_FRAME: ("a frame did not match the write (key, write id, sequence, offset or size)",
                       "send the frames of a write in order, as granted"),
    Status.TIMEOUT: ("the write's frames stopped coming", "is the requester alive? (its link up?)"),
}


class Access(enum.IntFlag):
    """As ibverbs' IBV_ACCESS_*: a source needs none; a write's target needs REMOTE_WRITE."""
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2


# -- the wire header ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Header:
    op: Op
    key: int = 0
    write_id: int = 0
    seq: int = 0            # DATA: the frame's number; GRANT: frames granted so far (DONE, NAK: placed)
    offset: int = 0         # region offset: the write's (REQUEST) or this frame's payload's (DATA);
                            # GRANT: the MAC to send the data to (the responder's data queue)
    length: int = 0         # the write's bytes (REQUEST, DONE) or this frame's payload bytes (DATA);
                            # GRANT: the frames placed so far (the acknowledgement)
    imm: int = 0
    status: Status = Status.OK

    def pack(self, dst: bytes, src: bytes) -> bytes:
        """The 64 wire bytes: Ethernet header to ``dst`` from ``src``, the fields, zeros."""
        body = _WIRE.pack(self.op, self.status, 0, self.key, self.write_id, self.seq, self.offset,
                          self.length, self.imm)
        return (dst + src + ETHERTYPE.to_bytes(2, "big") + body).ljust(HEADER, b"\0")


def unpack_header(data: bytes) -> Header | None:
    """The header of a frame of ours (its first 64 bytes); None for any other frame."""
    if len(data) < HEADER or int.from_bytes(data[12:14], "big") != ETHERTYPE:
        return None
    op, status, _, key, write_id, seq, offset, length, imm = _WIRE.unpack_from(data, ETH_HEADER)
    try:
        return Header(Op(op), key, write_id, seq, offset, length, imm, Status(status))
    except ValueError:
        return None


def source_mac(frame: bytes) -> bytes:
    return bytes(frame[6:12])


# -- keys --------------------------------------------------------------------------------------

@dataclass(eq=False)
class MemoryRegion:
    """A registered VRAM range: ``key`` names it to both ends (lkey = rkey), ``iova`` is where
    the NIC reaches its first byte."""

    key: int
    gpu: object
    vram_offset: int
    length: int
    access: Access
    iova: int
    mapping: object = None
    live: bool = True

    @property
    def slot(self) -> int:
        return self.key & 0xFF

    @property
    def name(self) -> str:
        return f"region {self.key:#x} (VRAM [{self.vram_offset:#x}, {self.vram_offset + self.length:#x}))"


class KeyTable:
    """Registration slots with generations: key = generation << 8 | slot.  A slot's next
    registration has the next generation, so a key outlives nothing it named."""

    def __init__(self, slots: int = MAX_REGIONS):
        self.generation = [0] * slots
        self.regions: list[MemoryRegion | None] = [None] * slots

    def allocate(self) -> int:
        """A free slot's next key (the slot is not taken until ``insert``)."""
        slot = next((s for s, r in enumerate(self.regions) if r is None), None)
        if slot is None:
            raise RdmaError(f"all {len(self.regions)} registration slots are in use", "dereg_mr a region first")
        return (self.generation[slot] + 1) << 8 | slot

    def insert(self, region: MemoryRegion) -> None:
        self.generation[region.slot] = region.key >> 8
        self.regions[region.slot] = region

    def check(self, key: int) -> Status:
        """What ``key`` names: OK, or why it is refused."""
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            return Status.UNKNOWN_KEY
        slot, generation = key & 0xFF, key >> 8
        if slot >= len(self.regions) or not 0 < generation <= self.generation[slot]:
            return Status.UNKNOWN_KEY
        if generation < self.generation[slot]:
            return Status.STALE_KEY
        return Status.OK if self.regions[slot] is not None else Status.FREED

    def lookup(self, key: int) -> MemoryRegion:
        """The live region of ``key``; an RdmaError naming why not."""
        status = self.check(key)
        if status is not Status.OK:
            raise refusal(status, f"key {key!r}")
        return self.regions[key & 0xFF]

    def remove(self, region: MemoryRegion) -> None:
        if self.regions[region.slot] is region:
            self.regions[region.slot] = None

    def live(self) -> list[MemoryRegion]:
        return [r for r in self.regions if r is not None]


def refusal(status: Status, subject: str) -> RdmaError:
    what, fix = REFUSALS[status]
    return RdmaError(f"{subject}: {what}", fix)


def check_range(region: MemoryRegion, offset: int, length: int) -> Status:
    """OK when [offset, offset + length) is a non-empty range inside ``region``."""
    if length <= 0 or offset < 0 or offset + length > region.length:
        return Status.OUT_OF_RANGE
    return Status.OK


# -- planning ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class FramePlan:
    seq: int
    offset: int             # region offset of the payload
    size: int


def plan_frames(offset: int, length: int, mtu: int = MTU) -> list[FramePlan]:
    """The frames of a write of ``length`` bytes at region ``offset``: ``mtu`` bytes each, the
    last one shorter; frame k's payload goes at ``offset + k * mtu``."""
    if length <= 0 or mtu <= 0:
        raise RdmaError(f"a write of {length} bytes in {mtu}-byte frames", "write at least one byte")
    return [FramePlan(k, offset + at, min(mtu, length - at)) for k, at in enumerate(range(0, length, mtu))]


def frame_problem(h: Header | None, plan: FramePlan, key: int, write_id: int, landed: int) -> str | None:
    """Why a received frame is not ``plan``'s frame of the write (None: it is)."""
    if h is None or h.op is not Op.DATA:
        return "not a data frame of this protocol"
    if (h.key, h.write_id) != (key, write_id):
        return f"key {h.key:#x} write {h.write_id}, expected key {key:#x} write {write_id}"
    if (h.seq, h.offset, h.length) != (plan.seq, plan.offset, plan.size):
        return (f"frame {h.seq} at offset {h.offset:#x} of {h.length} bytes, expected frame {plan.seq} at "
                f"{plan.offset:#x} of {plan.size}")
    if landed != plan.size:
        return f"{landed} payload bytes landed, the header says {plan.size}"
    return None


def pattern(seed: int, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of an endless seeded pattern: 4 KiB blocks, block i
    ``Random((seed, i))``, so any range is checked without the rest."""
    first, last = offset // PATTERN_BLOCK, (offset + length - 1) // PATTERN_BLOCK
    blob = b"".join(random.Random(seed << 40 | i).randbytes(PATTERN_BLOCK) for i in range(first, last + 1))
    start = offset - first * PATTERN_BLOCK
    return blob[start:start + length]


# -- the endpoint ------------------------------------------------------------------------------

@dataclass
class Completion:
    """One write as the responder saw it: placed whole (``status`` OK) or refused."""

    write_id: int
    key: int
    offset: int
    length: int
    imm: int
    frames: int
    status: Status
    error: str | None
    seconds: float
    cpu_seconds: float


@dataclass
class WriteResult:
    write_id: int
    length: int
    frames: int
    imm: int
    seconds: float
    cpu_seconds: float


@dataclass
class _Write:
    request: Header
    peer: bytes
    region: MemoryRegion
    plan: list[FramePlan]
    posted: int = 0
    landed: int = 0
    granted: int = 0
    guarded: bool = False      # the guard descriptor is posted behind the last frame


class RdmaEndpoint:
    """Both ends of RDMA-shaped writes over ``nic`` (opened with at least ``queue + 1``
    queues): control frames on queue 0 (guest RAM), payloads on ``queue``, whose MAC
    ``data_mac`` is steered there.  ``placement``: ``zero-copy`` (payloads DMA'd from and into
    VRAM) or ``bounce`` (through guest RAM, copied by the CPU through BAR2).  ``first_write_id``:
    where this endpoint's write ids start (default: at random, so that no frame of an earlier
    process's write is taken for one of this one's).  ``watch`` (a ReleaseWatch, NicSession's
    ``endpoint()``): looked at in every call and after every wait, so a GPU the host released
    ends the call with GpuReleased."""

    PLACEMENTS = ("zero-copy", "bounce")

    def __init__(self, nic: IgbDevice, queue: int = 1, placement: str = "zero-copy", data_mac: bytes = DATA_MAC,
                 *, first_write_id: int | None = None, watch=None):
        if placement not in self.PLACEMENTS:
            raise RdmaError(f"placement {placement!r}", f"pick one of {', '.join(self.PLACEMENTS)}")
        if queue == 0:
            raise RdmaError("payloads on queue 0, the control queue", "use queue 1 or above")
        nic.rx_queue(queue)
        self.nic, self.queue, self.placement, self.data_mac = nic, queue, placement, data_mac
        self.watch = watch
        self.keys = KeyTable()
        self.counts = dict.fromkeys(("payload_bytes_copied", "header_bytes_copied", "frames_sent",
                                     "frames_received"), 0)
        # Write ids start where no earlier process's do: a frame of an earlier write can still
        # arrive (QEMU's link holds frames while a NIC has no buffer posted, e.g. between two
        # commands), and a new writer counting from 1 took its DONE or GRANT for its own.
        self._next_write = first_write_id or secrets.randbelow(1 << 30) + 1
        self._headers = self._header_mapping = self._guard = self._guard_mapping = None
        nic.steer(data_mac, queue)
        if placement == "zero-copy":
            self._headers = mmap.mmap(-1, nic.entries * HEADER)
            self._header_mapping = nic.device.map_dma(self._headers, HEADER_IOVA)
            self._guard = mmap.mmap(-1, 2 * PAGE)       # the guard's header buffer, then its packet buffer
            self._guard_mapping = nic.device.map_dma(self._guard, GUARD_IOVA)
            nic.configure_external_rx(queue, MTU, HEADER)

    def _look(self) -> None:
        """GpuReleased if the watched GPU was released by the host (its regions torn down)."""
        if self.watch is not None:
            self.watch.check()

    # -- registration ----------------------------------------------------------------------

    def reg_mr(self, gpu, vram_offset: int, length: int, access: Access = Access(0), *,
               notes: dict | None = None) -> MemoryRegion:
        """Register VRAM [vram_offset, vram_offset + length) of ``gpu`` (whole pages, inside
        VRAM): mapped for the NIC in a window of its own; -> the region, ``.key`` its key."""
        self._look()
        access = self._check_access(access)
        if vram_offset < 0 or vram_offset % PAGE or length <= 0 or length % PAGE:
            raise RdmaError(f"VRAM offset {vram_offset:#x}, length {length:#x}",
                            f"register whole pages: both multiples of {PAGE}, the length above 0")
        if vram_offset + length > gpu.vram_size:
            raise RdmaError(f"VRAM [{vram_offset:#x}, {vram_offset + length:#x}) is outside the GPU's "
                            f"{gpu.vram_size:#x} bytes", "register a range inside VRAM")
        key = self.keys.allocate()
        iova = MR_IOVA + (key & 0xFF) * MR_WINDOW
        mapping = map_peer_bar(self.nic, gpu, iova, size=length, offset=vram_offset, notes=notes)
        region = MemoryRegion(key, gpu, vram_offset, length, access, iova, mapping)
        self.keys.insert(region)
        return region

    @staticmethod
    def _check_access(access) -> Access:
        known = int(Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        if not isinstance(access, int) or isinstance(access, bool) or access < 0 or int(access) & ~known:
            raise RdmaError(f"access {access!r}", "combine Access.LOCAL_WRITE and Access.REMOTE_WRITE (or none)")
        return Access(access)

    def dereg_mr(self, region: MemoryRegion) -> None:
        """Free ``region``: its key is refused from now on, its mapping removed."""
        self.keys.lookup(region.key)
        self.keys.remove(region)
        region.live = False
        region.mapping.close()

    # -- requester -------------------------------------------------------------------------

    def write(self, local: MemoryRegion, offset: int, length: int, remote_key: int, remote_offset: int, *,
              to: bytes, imm: int = 0, timeout: float = 30.0) -> WriteResult:
        """Write [offset, offset + length) of ``local`` at ``remote_offset`` of the peer's
        region ``remote_key`` (the peer's NIC MAC ``to``); returns when the peer reported every
        frame placed, with its immediate.  A refusal is an RdmaError naming why; ``timeout``:
        seconds the peer may stay silent: then PeerLost, naming the peer and what it last
        acknowledged (a GRANT says how many frames were placed)."""
        self._look()
        region = self.keys.lookup(local.key)
        if check_range(region, offset, length) is not Status.OK:
            raise RdmaError(f"a write of {length} bytes from offset {offset:#x} of {region.name} "
                            f"({region.length:#x} bytes)", "write from inside the local region")
        if not 0 <= remote_offset < 1 << 64 or not 0 <= imm < 1 << 32 or not 0 <= remote_key < 1 << 32:
            raise RdmaError(f"remote_offset {remote_offset}, remote_key {remote_key}, imm {imm}",
                            "a 64-bit offset, a 32-bit key and a 32-bit immediate")
        write_id, self._next_write = self._next_write, self._next_write + 1
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_frames(remote_offset, length)
        request = Header(Op.REQUEST, remote_key, write_id, len(plan), remote_offset, length, imm)
        self.nic.send([request.pack(to, self.nic.mac)])
        sent = granted = acked = 0
        while True:
            if granted:
                what, fix = self._silence(write_id, to, plan, sent, granted, acked)
            else:
                what = f"write {write_id} to {spec.format_mac(to)}: no answer from the peer"
                fix = "is the peer serving (vfio-cxl nic rdma-recv) and the link up?"
            try:
                h, _ = self._next_control(lambda h: h.write_id == write_id and h.op is not Op.DATA, timeout,
                                          what, fix, PeerLost if granted else IgbTimeout)
            except PeerLost as err:
                raise PeerLost(f"{err.what} ({self.nic_report()})", err.fix) from None
            if h.op is Op.GRANT:
                granted, acked = max(granted, h.seq), max(acked, min(h.length, h.seq))
            if h.op is Op.NAK:
                raise refusal(h.status, f"the peer refused write {write_id} (key {remote_key:#x}, "
                                        f"offset {remote_offset:#x}, {length} bytes)")
            if h.op is Op.DONE:
                return WriteResult(write_id, length, sent, h.imm, time.perf_counter() - t0,
                                   time.process_time() - c0)
            if h.op is Op.GRANT and h.seq > sent:
                self._send_data(region, offset - remote_offset, plan[sent:h.seq], remote_key, write_id,
                                h.offset.to_bytes(6, "big"))
                sent = h.seq

    def nic_report(self) -> str:
        """What this end's NIC saw, for an error about frames that stopped coming: its data
        queue's ring (device and driver) and its frame counters since open -- frames the peer
        sent and this NIC never took (RXO, missed) against frames lost on the way.  A NIC that
        cannot be read says so: the error it goes into stays the error."""
        try:
            ring = self.nic.rx_ring_state(self.queue)
            stats = self.nic.stats()
        except (OSError, VfioError) as err:
            return f"this NIC could not be read: {err}"
        return (f"this NIC: data queue {self.queue} head {ring['head']} tail {ring['tail']} (driver: oldest "
                f"{ring['driver_clean']}, {ring['posted']} posted, oldest written back {ring['oldest_done']}); "
                + ", ".join(f"{name} {stats[name]}" for name in ("gprc", "gptc", "mpc", "rnbc", "rx_overrun_events"))
                + f"; frames of ours sent {self.counts['frames_sent']}, received {self.counts['frames_received']}")

    @staticmethod
    def _silence(write_id: int, to: bytes, plan: list[FramePlan], sent: int, granted: int,
                 acked: int) -> tuple[str, str]:
        """What a peer silent mid-write is told as: the peer, what it acknowledged placed."""
        start = plan[0].offset
        reached = plan[acked].offset if acked < len(plan) else plan[-1].offset + plan[-1].size
        return (f"write {write_id} to {spec.format_mac(to)}: the peer went silent mid-transfer; it last "
                f"acknowledged {acked} of {len(plan)} frames placed (remote offsets [{start:#x}, {reached:#x})), "
                f"granted {granted}, {sent} sent: no answer",
                "is the peer's lab up and its responder serving (vfio-cxl nic rdma-recv)? The write is "
                f"incomplete there: write again from offset {reached:#x} once it serves")

    def _send_data(self, region: MemoryRegion, delta: int, frames: list[FramePlan], key: int, write_id: int,
                   dst: bytes) -> None:
        """``frames`` of a write, each payload from region offset ``f.offset + delta``."""
        headers = [Header(Op.DATA, key, write_id, f.seq, f.offset, f.size).pack(dst, self.nic.mac) for f in frames]
        if self.placement == "zero-copy":
            self.nic.send_gather([(h, region.iova + f.offset + delta, f.size) for h, f in zip(headers, frames)])
        else:
            payloads = [region.gpu.vram.read(region.vram_offset + f.offset + delta, f.size) for f in frames]
            self.counts["payload_bytes_copied"] += 2 * sum(map(len, payloads))    # BAR2 read, TX buffer
            self.nic.send([h + p for h, p in zip(headers, payloads)])
        self.counts["frames_sent"] += len(frames)

    def _next_control(self, wanted, timeout: float, what: str, fix: str,
                      error: type[IgbTimeout] = IgbTimeout) -> tuple[Header, bytes]:
        """The next frame on queue 0 whose header ``wanted`` accepts, and its source MAC (other
        frames are dropped); ``error`` ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            got = self.nic.recv(0, 1, left) if left > 0 else []
            self._look()                # a release request also ends the wait
            if not got and time.monotonic() >= deadline:
                raise error(f"{what} within {timeout:g} s", fix)
            if not got:
                continue
            h = unpack_header(got[0])
            if h is not None and wanted(h):
                return h, source_mac(got[0])

    # -- responder -------------------------------------------------------------------------

    def serve(self, timeout: float = 30.0) -> Completion:
        """Take the next write request (waiting ``timeout`` s at most), place its frames,
        answer DONE (or NAK) -> what happened.  A write whose frames stop coming for
        ``timeout`` s fails (TIMEOUT), naming the writer and the offset its frames reached."""
        self._look()
        request, peer = self._next_control(lambda h: h.op is Op.REQUEST, timeout, "no write request",
                                           "start the writer (vfio-cxl nic rdma-write)")
        t0, c0 = time.perf_counter(), time.process_time()
        status, error, frames = self._accept(request), None, 0
        if status is Status.OK:
            w = _Write(request, peer, self.keys.lookup(request.key), plan_frames(request.offset, request.length))
            try:
                self._place(w, timeout)
            except WriteFailed as err:
                status, error = err.status, str(err)
            finally:
                self._take_back_posted()     # the guard, or a failed write's descriptors: nothing lands later
            frames = w.landed
        else:
            error = str(refusal(status, f"write {request.write_id} (key {request.key:#x}, offset "
                                        f"{request.offset:#x}, {request.length} bytes)"))
        op = Op.DONE if status is Status.OK else Op.NAK
        self.nic.send([Header(op, request.key, request.write_id, frames, request.offset, request.length,
                              request.imm, status).pack(peer, self.nic.mac)])
        return Completion(request.write_id, request.key, request.offset, request.length, request.imm, frames,
                          status, error, time.perf_counter() - t0, time.process_time() - c0)

    def _accept(self, request: Header) -> Status:
        """OK, or why the write is refused: the key, the range, the access."""
        status = self.keys.check(request.key)
        if status is not Status.OK:
            return status
        region = self.keys.lookup(request.key)
        if check_range(region, request.offset, request.length) is not Status.OK:
            return Status.OUT_OF_RANGE
        return Status.OK if region.access & Access.REMOTE_WRITE else Status.ACCESS

    def _place(self, w: _Write, timeout: float) -> None:
        """Every frame of ``w`` into its place, granting as descriptors are posted."""
        deadline = time.monotonic() + timeout
        self._post(w)
        while w.landed < len(w.plan):
            self._look()                # each round, and after each wait (a release request ends it)
            if self._reap(w):
                self._post(w)
                deadline = time.monotonic() + timeout
            elif time.monotonic() >= deadline:
                reached = w.plan[w.landed].offset
                raise WriteFailed(Status.TIMEOUT, f"write {w.request.write_id} from {spec.format_mac(w.peer)}: "
                                                  f"{w.landed} of {len(w.plan)} frames came (region offsets "
                                                  f"[{w.plan[0].offset:#x}, {reached:#x}) placed), then none "
                                                  f"for {timeout:g} s: the writer is gone ({self.nic_report()})")
            else:   # at most a watchdog period: a lost interrupt costs that, not the write
                self.nic.wait_rx(self.queue, min(deadline, time.monotonic() + RX_WATCHDOG))

    def _post(self, w: _Write) -> None:
        """Zero-copy: post descriptors for the next frames, each at its payload's address;
        bounce: the queue's guest-RAM buffers are posted already.  Grant what is posted."""
        if self.placement == "zero-copy":
            room = self.nic.rx[self.queue].ring.free
            frames = w.plan[w.posted:w.posted + room]
            self.nic.post_rx(self.queue, [(w.region.iova + f.offset, HEADER_IOVA + f.seq % self.nic.entries * HEADER, f)
                                          for f in frames])
            w.posted += len(frames)
            if w.posted == len(w.plan) and not w.guarded and self.nic.rx[self.queue].ring.free:
                w.guarded = self.nic.post_rx(self.queue, [(GUARD_IOVA + PAGE, GUARD_IOVA, None)]) == 1
            grantable = w.posted if w.guarded else w.posted - 1     # each granted frame has a successor
        else:
            grantable = w.posted = min(len(w.plan), w.landed + self.nic.rx[self.queue].ring.posted)
        waiting = w.landed == w.granted         # the requester sent all it may: it waits for this grant
        if grantable > w.granted and (waiting or grantable - w.granted >= GRANT_BATCH or grantable == len(w.plan)):
            grant = Header(Op.GRANT, w.request.key, w.request.write_id, grantable, int.from_bytes(self.data_mac, "big"),
                           w.landed)
            self.nic.send([grant.pack(w.peer, self.nic.mac)])
            w.granted = grantable

    def _reap(self, w: _Write) -> int:
        """Check every frame that landed since the last look; -> how many."""
        if self.placement == "zero-copy":
            done = self.nic.reap_rx(self.queue)
            for plan, c in done:
                if plan is None:       # the guard took a frame: one more than the write has
                    raise WriteFailed(Status.BAD_FRAME, f"write {w.request.write_id}: a frame beyond its "
                                                        f"{len(w.plan)} (it landed in guest RAM, not VRAM)")
                at = plan.seq % self.nic.entries * HEADER
                header = bytes(self._headers[at:at + HEADER])
                self.counts["header_bytes_copied"] += HEADER
                self._land(w, plan, unpack_header(header), c.length if c.eop and not c.error else -1)
            return len(done)
        frames = self.nic.recv(self.queue, len(w.plan) - w.landed, 0)
        for frame in frames:
            plan = w.plan[w.landed]
            h = unpack_header(frame)
            self._land(w, plan, h, len(frame) - HEADER)
            w.region.gpu.vram.write(w.region.vram_offset + plan.offset, frame[HEADER:])
            self.counts["payload_bytes_copied"] += 2 * plan.size     # out of the RX buffer, into BAR2
        return len(frames)

    def _land(self, w: _Write, plan: FramePlan, h: Header | None, landed: int) -> None:
        problem = frame_problem(h, plan, w.request.key, w.request.write_id, landed)
        if problem is None and self.keys.check(w.request.key) is not Status.OK:
            problem = f"its region was freed meanwhile ({self.keys.check(w.request.key).name})"
        if problem is not None:
            raise WriteFailed(Status.BAD_FRAME, f"write {w.request.write_id}, frame {plan.seq}: {problem}")
        w.landed += 1
        self.counts["frames_received"] += 1

    def _take_back_posted(self, enable: bool = True) -> None:
        """A write ended: take back what is still posted for it (zero-copy: the guard, or a
        failed write's descriptors), so nothing more lands; the queue stays enabled, empty,
        for the next write unless ``enable`` is false (or the GPU was released: it stays off)."""
        if self.placement == "zero-copy":
            released = self.watch is not None and self.watch.released
            self.nic.take_back_rx(self.queue, enable=enable and not released)

    def drop_gpu(self, gpu) -> None:
        """The host released ``gpu``: the data queue stopped and emptied (zero-copy: its
        descriptors point into VRAM), then every region of ``gpu`` freed (unmapped)."""
        self._take_back_posted(enable=False)
        for region in self.keys.live():
            if region.gpu is gpu:
                self.dereg_mr(region)

    def close(self) -> None:
        """Stop the data queue (zero-copy), free every region, unmap the header buffers."""
        self._take_back_posted(enable=False)
        for region in self.keys.live():
            self.dereg_mr(region)
        if self._header_mapping is not None:
            self._header_mapping.close()
            self._headers.close()
            self._guard_mapping.close()
            self._guard.close()
            self._header_mapping = self._headers = self._guard_mapping = self._guard = None

