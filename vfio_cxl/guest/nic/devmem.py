"""devmem-shaped receive: an RX queue whose payloads land in GPU VRAM, headers in guest RAM.

    rx = DevmemReceiver(nic)                                  # nic and gpu in one IOMMU context
    b = rx.bind_rx(1, gpu, vram_offset=0, length=1 << 20)     # netlink bind-rx: a dma-buf to a queue
    nic.steer(mac, 1)                                         # the flow's frames to that queue only
    for f in rx.recv(b, count=8, timeout=1.0):                # recvmsg + SCM_DEVMEM_DMABUF
        f.header, [(frag.vram_offset, frag.size, frag.token) for frag in f.fragments]
    rx.dontneed([frag.token for f in frames for frag in f.fragments])   # SO_DEVMEM_DONTNEED
    rx.unbind(b)

Linux's devmem TCP (Documentation/networking/devmem.rst) in the lab's terms: ``bind_rx``
maps the VRAM range (the GPU's BAR2, ``p2p.map_peer_bar``: VFIO_IOMMU_MAP_DMA of the BAR's
mmap on type1, a VFIO dma-buf and IOMMU_IOAS_MAP_FILE on iommufd) into the NIC's IOMMU
context, carves it into chunks of the queue's packet-buffer size, and posts each chunk as a
descriptor's ``pkt_addr`` with a header buffer in guest RAM as its ``hdr_addr`` (SRRCTL header
split always).  A chunk the device filled is handed out as a fragment with a token; it is
posted again only after ``dontneed`` returned that token, so the device never overwrites
bytes the user still reads.  A frame whose split did not fall on a header boundary (SPH = 0,
or HBO: the headers were longer than the header buffer) still lands split, at the header
buffer's size: its fragments say ``linear`` (the header bytes are the frame's first bytes,
not its protocol headers).  A frame longer than one chunk has one fragment per chunk.
"""

from __future__ import annotations

import mmap
import time
from collections import deque
from dataclasses import dataclass, field

from ..drivers.igb import IgbDevice, IgbError
from ..drivers.igb import spec
from ..p2p import PEER_BAR_IOVA, map_peer_bar

VRAM_IOVA = PEER_BAR_IOVA           # VRAM offset o is IOVA VRAM_IOVA + o for the NIC
HEADER_IOVA = 0x0800_0000           # each binding's header buffers: HEADER_IOVA + queue * HEADER_WINDOW
HEADER_WINDOW = 0x0100_0000
PAGE = 4096
DEFAULT_CHUNK = 4096
DEFAULT_HEADER = 128


class DevmemError(IgbError):
    """A devmem call was given something it cannot do; the message names the rule."""


class ChunkPool:
    """A VRAM range carved into ``count`` chunks of ``chunk`` bytes, each free (ours to post),
    posted (the device's) or held (the user's, until ``dontneed``)."""

    def __init__(self, vram_offset: int, length: int, chunk: int):
        if chunk <= 0 or length < chunk or length % chunk:
            raise DevmemError(f"{length} bytes of VRAM in {chunk}-byte chunks",
                              "bind a whole number of chunks (at least one)")
        self.vram_offset, self.length, self.chunk = vram_offset, length, chunk
        self.count = length // chunk
        self.free: deque[int] = deque(range(self.count))
        self.posted: set[int] = set()
        self.held: set[int] = set()

    def offset(self, index: int) -> int:
        """Chunk ``index``'s VRAM offset."""
        return self.vram_offset + index * self.chunk

    def take(self, most: int) -> list[int]:
        """Up to ``most`` free chunks, now posted."""
        taken = [self.free.popleft() for _ in range(min(most, len(self.free)))]
        self.posted.update(taken)
        return taken

    def _move(self, index: int, source: set[int], state: str) -> None:
        if index not in source:
            raise DevmemError(f"chunk {index} is not {state}", "a chunk moves free -> posted -> held -> free")
        source.remove(index)

    def land(self, index: int) -> None:
        """The device filled posted chunk ``index``: the user holds it now."""
        self._move(index, self.posted, "posted")
        self.held.add(index)

    def recycle(self, index: int) -> None:
        """Posted chunk ``index`` came back unused (a frame that fit its header buffer)."""
        self._move(index, self.posted, "posted")
        self.free.append(index)

    def release(self, index: int) -> None:
        """The user returned held chunk ``index`` (dontneed): free to post again."""
        self._move(index, self.held, "held")
        self.free.append(index)

    def unpost(self, indices: list[int]) -> None:
        """The queue was torn down: chunks still posted are free (nothing will write them)."""
        for index in indices:
            self.recycle(index)


class TokenTable:
    """Tokens for fragments handed out: each names (binding, chunk) until ``redeem`` returns it."""

    def __init__(self):
        self._next = 1
        self._out: dict[int, tuple[object, int]] = {}
        self._unbound: dict[int, str] = {}

    def issue(self, binding: object, index: int) -> int:
        token, self._next = self._next, self._next + 1
        self._out[token] = (binding, index)
        return token

    def redeem(self, tokens: list[int]) -> list[tuple[object, int]]:
        """(binding, chunk) of each token, all checked before any is taken: a token returned
        twice, never handed out, or of a binding since unbound is a DevmemError."""
        seen: set[int] = set()
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool):
                raise DevmemError(f"token {t!r} is not an int", "pass the fragments' tokens")
            if t in seen:
                raise DevmemError(f"token {t} is given twice in one call", "return each token once")
            seen.add(t)
            if t in self._unbound:
                raise DevmemError(f"token {t} belongs to {self._unbound[t]}, which was unbound: its chunks "
                                  "went back with it", "drop tokens of an unbound binding")
            if t not in self._out:
                if 0 < t < self._next:
                    raise DevmemError(f"token {t} was already returned", "return each token once")
                raise DevmemError(f"token {t} was never handed out", "pass tokens from recv()'s fragments")
        return [self._out.pop(t) for t in tokens]

    def drop(self, binding: object, name: str) -> list[int]:
        """Forget ``binding``'s outstanding tokens (it is being unbound); their chunks."""
        gone = [t for t, (b, _) in self._out.items() if b is binding]
        chunks = []
        for t in gone:
            chunks.append(self._out.pop(t)[1])
            self._unbound[t] = name
        return chunks

    @property
    def outstanding(self) -> int:
        return len(self._out)


@dataclass(eq=False)
class RxBinding:
    """A VRAM range of ``gpu`` bound to RX ``queue``: ``pool`` its chunks, ``iova`` where the
    NIC reaches ``vram_offset``."""

    queue: int
    gpu: object
    vram_offset: int
    length: int
    header_buffer: int
    pool: ChunkPool
    iova: int
    vram_mapping: object
    headers: mmap.mmap
    header_mapping: object
    partial: list = field(default_factory=list)     # fragments of a frame whose EOP has not come
    header: bytes | None = None
    split: bool = False
    bound: bool = True

    @property
    def name(self) -> str:
        return f"the binding of VRAM [{self.vram_offset:#x}, {self.vram_offset + self.length:#x}) to queue {self.queue}"


@dataclass(frozen=True)
class Fragment:
    binding: RxBinding
    vram_offset: int
    size: int
    token: int
    linear: bool            # the split did not fall on a header boundary (SPH = 0 or HBO)


@dataclass(frozen=True)
class DevmemFrame:
    header: bytes           # in guest RAM: the protocol headers (or the first bytes, when linear)
    fragments: tuple[Fragment, ...]
    split: bool             # SPH set and no HBO: header and payload separated at the L5 (or L4) offset

    @property
    def payload_size(self) -> int:
        return sum(f.size for f in self.fragments)


class DevmemReceiver:
    """devmem-shaped receive over ``nic``: bindings of GPU VRAM to its RX queues.  ``watch``
    (a ReleaseWatch, NicSession's): looked at in every call and after every wait, so a GPU
    the host released ends the call with GpuReleased."""

    def __init__(self, nic: IgbDevice, watch=None):
        self.nic, self.watch = nic, watch
        self.bindings: dict[int, RxBinding] = {}
        self.tokens = TokenTable()

    def _look(self) -> None:
        """GpuReleased if the watched GPU was released by the host (its bindings torn down)."""
        if self.watch is not None:
            self.watch.check()

    def bind_rx(self, queue: int, gpu, vram_offset: int, length: int, *, chunk: int = DEFAULT_CHUNK,
                header_buffer: int = DEFAULT_HEADER, notes: dict | None = None) -> RxBinding:
        """Bind VRAM [vram_offset, vram_offset + length) of ``gpu`` (in the NIC's IOMMU context)
        to RX ``queue``: mapped for the NIC, carved into ``chunk``-byte payload buffers, as
        many posted as the ring holds, headers into guest RAM (``header_buffer`` bytes each)."""
        self._look()
        self._check_bind(queue, gpu, vram_offset, length, chunk, header_buffer)
        pool = ChunkPool(vram_offset, length, chunk)
        iova = VRAM_IOVA + vram_offset
        vram_mapping = map_peer_bar(self.nic, gpu, iova, size=length, offset=vram_offset, notes=notes)
        try:
            headers = mmap.mmap(-1, -(-pool.count * header_buffer // PAGE) * PAGE)
            try:
                header_mapping = self.nic.device.map_dma(headers, HEADER_IOVA + queue * HEADER_WINDOW)
            except BaseException:
                headers.close()
                raise
        except BaseException:
            vram_mapping.close()
            raise
        binding = RxBinding(queue, gpu, vram_offset, length, header_buffer, pool, iova, vram_mapping,
                            headers, header_mapping)
        self.nic.configure_external_rx(queue, chunk, header_buffer)
        self.bindings[queue] = binding
        self._replenish(binding)
        return binding

    def _check_bind(self, queue: int, gpu, vram_offset: int, length: int, chunk: int, header_buffer: int) -> None:
        if queue == 0:
            raise DevmemError("binding VRAM to queue 0: it takes the NIC's own and broadcast traffic",
                              f"bind a queue from 1 to {self.nic.queue_count - 1} and steer the flow's MAC there")
        self.nic.rx_queue(queue)
        if queue in self.bindings:
            raise DevmemError(f"queue {queue} is bound already ({self.bindings[queue].name})", "unbind it first")
        if vram_offset < 0 or vram_offset % PAGE:
            raise DevmemError(f"VRAM offset {vram_offset:#x}", f"bind from a multiple of {PAGE}")
        if length <= 0 or vram_offset + length > gpu.vram_size:
            raise DevmemError(f"VRAM [{vram_offset:#x}, {vram_offset + length:#x}) is outside the GPU's "
                              f"{gpu.vram_size:#x} bytes", "bind a range inside VRAM")
        if chunk % spec.SRRCTL_BSIZEPACKET_UNIT or not 0 < chunk <= spec.MAX_PACKET_BUFFER:
            raise DevmemError(f"a {chunk}-byte chunk: the NIC's packet buffers are whole KiB up to "
                              f"{spec.MAX_PACKET_BUFFER}", "use e.g. 4096")
        if header_buffer % spec.SRRCTL_BSIZEHEADER_UNIT or not 0 < header_buffer <= spec.MAX_HEADER_BUFFER:
            raise DevmemError(f"a {header_buffer}-byte header buffer: BSIZEHEADER is 64-byte units up to "
                              f"{spec.MAX_HEADER_BUFFER}", "use e.g. 128")
        if length // chunk * header_buffer > HEADER_WINDOW:
            raise DevmemError(f"{length // chunk} chunks need {length // chunk * header_buffer} bytes of header "
                              f"buffers, the window holds {HEADER_WINDOW}", "bind fewer, larger chunks")
        for other in self.bindings.values():
            if other.gpu is gpu and vram_offset < other.vram_offset + other.length and \
                    other.vram_offset < vram_offset + length:
                raise DevmemError(f"VRAM [{vram_offset:#x}, {vram_offset + length:#x}) overlaps {other.name}",
                                  "bind a range of its own")

    def _binding(self, binding: RxBinding) -> RxBinding:
        if not binding.bound or self.bindings.get(binding.queue) is not binding:
            raise DevmemError(f"{binding.name} was unbound", "bind the range again")
        return binding

    def _replenish(self, b: RxBinding) -> None:
        """Post free chunks while the ring has room (one tail write)."""
        ring = self.nic.rx[b.queue].ring
        chunks = b.pool.take(ring.free)
        posted = self.nic.post_rx(b.queue, [(b.iova + i * b.pool.chunk,
                                             b.header_mapping.iova + i * b.header_buffer, i) for i in chunks])
        assert posted == len(chunks), "the ring had room for what take() gave"

    def recv(self, binding: RxBinding, count: int = 1, timeout: float = 1.0) -> list[DevmemFrame]:
        """Up to ``count`` frames, waiting ``timeout`` seconds at most; [] if none came (a
        queue without free chunks receives nothing: the device drops what is steered there)."""
        self._look()
        b = self._binding(binding)
        deadline = time.monotonic() + timeout
        frames: list[DevmemFrame] = []
        while len(frames) < count:
            self._look()                               # each round: frames may keep coming
            frames += self._reap(b, count - len(frames))
            if len(frames) < count and not self.nic.wait_rx(b.queue, deadline):
                self._look()                           # a release request also ends the wait
                frames += self._reap(b, count - len(frames))
                break
        return frames

    def _reap(self, b: RxBinding, most: int) -> list[DevmemFrame]:
        frames = []
        for index, c in self.nic.reap_rx(b.queue, frames=most):
            if b.header is None:                       # the first descriptor of a frame has its header
                start = index * b.header_buffer
                b.header = bytes(b.headers[start:start + min(c.hdr_len, b.header_buffer)])
                b.split = c.split
            if c.length:
                b.pool.land(index)
                b.partial.append(Fragment(b, b.pool.offset(index), c.length, self.tokens.issue(b, index),
                                          not b.split))
            else:
                b.pool.recycle(index)                  # nothing landed in VRAM: post it again
            if c.eop:
                frames.append(DevmemFrame(b.header, tuple(b.partial), b.split))
                b.partial, b.header = [], None
        self._replenish(b)
        return frames

    def read(self, fragment: Fragment) -> bytes:
        """A fragment's bytes, read back from VRAM through the GPU's BAR2 (the check; the
        devmem path itself copies nothing)."""
        self._look()
        b = self._binding(fragment.binding)
        return bytes(b.gpu.vram.view(fragment.vram_offset, fragment.size))

    def dontneed(self, tokens: list[int]) -> int:
        """Return the chunks of ``tokens`` (all checked first), then post them again; -> how many."""
        self._look()
        returned = self.tokens.redeem(list(tokens))
        for binding, index in returned:
            binding.pool.release(index)
        for binding in {id(b): b for b, _ in returned}.values():
            self._replenish(binding)
        return len(returned)

    def unbind(self, binding: RxBinding) -> None:
        """Stop the queue (nothing more lands), take back its descriptors, void its tokens,
        unmap the VRAM range and the header buffers."""
        self._look()
        self._unbind(self._binding(binding))

    def _unbind(self, b: RxBinding) -> None:
        b.bound = False
        del self.bindings[b.queue]
        try:
            b.pool.unpost(self.nic.take_back_rx(b.queue))
            for index in self.tokens.drop(b, b.name):
                b.pool.release(index)
        finally:
            b.vram_mapping.close()
            b.header_mapping.close()
            b.headers.close()

    def drop_gpu(self, gpu) -> None:
        """The host released ``gpu``: unbind each of its bindings (queue stopped, descriptors
        taken back, then its VRAM unmapped), each step run, the first failure raised at the end."""
        self._unbind_all([b for b in self.bindings.values() if b.gpu is gpu])

    def close(self) -> None:
        """Unbind every binding (each step runs; the first failure is raised at the end)."""
        self._unbind_all(list(self.bindings.values()))

    def _unbind_all(self, bindings: list[RxBinding]) -> None:
        error = None
        for b in bindings:
            try:
                self._unbind(b)
            except Exception as err:
                error = error or err
        if error is not None:
            raise error
