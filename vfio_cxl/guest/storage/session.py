"""The cuFile-shaped API: NVMe namespaces read into and written from GPU VRAM.

    with StorageSession.open(nvme_bdf, gpu_bdf, mode="p2p") as s:     # or mode="compat"
        fh = s.handle_register(nsid=1)                  # cuFileHandleRegister
        buf = s.buf_register(0, 16 << 20)               # cuFileBufRegister(devPtr, len): a VRAM range
        n = s.read(fh, buf, 1 << 20, file_offset=0, buf_offset=0)     # cuFileRead -> bytes
        batch = s.batch_submit([IoParams("read", fh, buf, 4096, 0, 0), ...])
        events = batch.poll(timeout=10)                 # cuFileBatchIOGetStatus

Both devices share one IOMMU context, so one set of IOVAs means the same to both:

* ``p2p``: the GPU's BAR2 (its VRAM) is DMA-mapped into the context at ``VRAM_IOVA``; the NVMe's
  data pointers point at ``VRAM_IOVA + offset``.  QEMU carries the controller's DMA into the
  BAR through its bounce buffer (``x-max-bounce-buffer-size``: the topology's ``bounce_buffer``).
* ``compat``: the controller reads into a guest-RAM buffer (``BOUNCE`` bytes at a time), then
  the GPU copies it into VRAM with a HOST_TO_VRAM descriptor (writes: VRAM_TO_HOST, then the
  NVMe write).
* ``cmb``: the controller reads into its own Controller Memory Buffer (NVMe 1.4 CMBMSC: the CMB
  answers at controller address ``CMB_IOVA``, so a data pointer there is served inside the
  controller, with no DMA), then the GPU copies CMB -> VRAM peer to peer: the NVMe's BAR2 is
  mapped for the GPU at ``CMB_IOVA`` and the GPU's message window covers it, so its reads go to
  QEMU as DMA_READ messages translated by the vIOMMU (writes: VRAM -> CMB, then the NVMe write).
  Neither guest RAM nor the CPU touches a byte; the CMB's size bounds a staging step.

``stats`` says which path the bytes took and how many: ``p2p_bytes`` (through QEMU's bounce
buffer into or out of the BAR), ``bounced_bytes`` (through guest RAM), ``cmb_bytes`` (staged in
the controller's CMB), NVMe commands and GPU copies.  Alignment rules: ``file_offset`` and ``size`` are whole blocks of the namespace,
``buf_offset`` a multiple of 4 (NVMe data pointers are dword aligned).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from ...devices.gpu import regs
from ...devices.gpu.regs import Op
from ..drivers.nvme import IoOp, NvmeController, NvmeError
from ..drivers.gpu import GpuDriver, Transfer
from ..p2p import PEER_BAR_IOVA, join_context, map_peer_bar
from ..vfio.errors import VfioError

VRAM_IOVA = PEER_BAR_IOVA          # the GPU's BAR2, as the NVMe reaches it
DOORBELL_IOVA = 0x20_0000_0000     # the NVMe's BAR0, as the GPU reaches it (GPU-initiated I/O)
CMB_IOVA = 0x20_0100_0000          # the NVMe's CMB: its controller address (CMBMSC.CBA) and, for the GPU, an IOVA
BOUNCE = 4 << 20                   # compat mode's guest-RAM buffer
MODES = ("p2p", "compat", "cmb")


class StorageError(VfioError):
    """A storage call was given something it cannot do; the message names the rule."""


@dataclass(frozen=True)
class FileHandle:
    nsid: int
    size: int
    block_size: int


@dataclass(frozen=True)
class GpuBuffer:
    offset: int                    # in VRAM
    length: int


@dataclass
class IoParams:
    op: str                        # "read" | "write"
    fh: FileHandle
    buf: GpuBuffer
    size: int
    file_offset: int
    buf_offset: int
    cookie: object = None


@dataclass
class Batch:
    """Requests of one ``batch_submit``; ``poll`` reaps, ``events`` holds (cookie, status, bytes)."""

    session: "StorageSession"
    pending: dict = field(default_factory=dict)      # request -> (index, params)
    events: list = field(default_factory=list)
    failed: list = field(default_factory=list)       # pieces failed (status, what)
    _sizes: dict = field(default_factory=dict)       # index -> bytes still owed

    def poll(self, timeout: float = 10.0) -> list[tuple]:
        """Wait until every request of the batch completed (or failed); -> [(cookie, status, bytes)]
        with status "ok" or the error's text; a controller that dies fails them all at once."""
        s = self.session
        if not self.pending:
            return self.events           # all reaped (also after the session closed)
        s._require_open("poll a batch")
        queue = s.nvme.queues[1]
        try:
            while self.pending:
                s.nvme.wait(queue, [next(iter(self.pending))], timeout)
                self._settle()
        except NvmeError as err:
            for req, (index, params) in list(self.pending.items()):
                self.pending.pop(req)
                self._finish(index, params, req.extra.get("error") or err.what)
        return self.events

    def _settle(self) -> None:
        for req in [r for r in self.pending if r.completion is not None]:
            index, params = self.pending.pop(req)
            ok = req.completion.ok
            self._finish(index, params, "ok" if ok else f"NVMe status {req.completion.status:#x}",
                         req.extra["length"] if ok else 0)

    def _finish(self, index: int, params: IoParams, status: str, moved: int = 0) -> None:
        owed = self._sizes[index]
        if status != "ok":
            self.failed.append((index, status))
        owed[0] -= 1
        owed[1] += moved
        if owed[0] == 0:
            bad = [st for i, st in self.failed if i == index]
            self.events.append((params.cookie, bad[0] if bad else "ok", owed[1]))


class StorageSession:
    def __init__(self, nvme: NvmeController, gpu: GpuDriver, context, mode: str, backend: str,
                 stack: contextlib.ExitStack):
        self.nvme, self.gpu, self.context, self.mode, self.backend = nvme, gpu, context, mode, backend
        self.bdfs = (nvme.bdf, gpu.device.bdf)
        self._stack = stack              # closes the devices and the context (``close``)
        self._queues: list = []          # GPU queues open on this session (gpu_initiated.GpuQueue)
        self.closed = False
        self.vram_mapping = None
        self.bounce = None
        self.cmb_mapping = None
        self.cmb_claims: dict[int, int] = {}   # CMB IOVA -> bytes held by a GPU queue's SQ (the top of the CMB)
        self.window: str | None = None   # what the GPU's message window covers: "cmb", "doorbells"; None: unknown
        self.kernel: dict[str, str] = {}
        self.stats = {"p2p_bytes": 0, "bounced_bytes": 0, "cmb_bytes": 0, "commands": 0, "gpu_copies": 0}

    @classmethod
    def open(cls, nvme_bdf: str, gpu_bdf: str, *, mode: str = "p2p", backend: str = "type1",
             queue_entries: int = 128, interrupts: bool = True, spare_queues: int = 1) -> "StorageSession":
        if mode not in MODES:
            raise StorageError(f"unknown mode {mode!r}", f"use one of {', '.join(MODES)}")
        with contextlib.ExitStack() as stack:
            context, shared = join_context(stack, backend)
            gpu = GpuDriver.open(gpu_bdf, **shared)
            stack.callback(gpu.close)
            nvme = NvmeController.open(nvme_bdf, queue_entries=queue_entries, interrupts=interrupts,
                                       spare_queues=spare_queues, **shared)
            stack.callback(nvme.close)
            stack.callback(context.unmap_all)   # type1: mappings go before the devices leave
            self = cls(nvme, gpu, context, mode, backend, stack.pop_all())   # the session owns them now
        try:
            if mode == "p2p":
                self.map_vram()
            elif mode == "cmb":
                self.map_cmb()
            else:
                self.bounce = nvme.dma_buffer(BOUNCE)
        except BaseException as error:     # a half-open session: released as a whole one is
            try:
                self.close()
            except Exception as also:
                error.add_note(f"closing the half-open session also failed: {also}")
            raise
        return self

    def map_vram(self) -> None:
        """The GPU's BAR2 into the shared IOMMU context at VRAM_IOVA (the NVMe may DMA there)."""
        self._require_open("map VRAM for the NVMe")
        if self.vram_mapping is None:
            self.vram_mapping = map_peer_bar(self.nvme, self.gpu, VRAM_IOVA, notes=self.kernel)

    def map_cmb(self) -> None:
        """The NVMe's CMB on (controller address ``CMB_IOVA``), its BAR mapped for the GPU at the
        same IOVA, and the GPU's message window over it."""
        self._require_open("map the CMB for the GPU")
        if self.cmb_mapping is None:
            cmb = self.nvme.enable_cmb(CMB_IOVA)
            if not (cmb.rds and cmb.wds):
                raise StorageError(f"{self.nvme.bdf}'s CMB does not take read and write data (CMBSZ RDS "
                                   f"{int(cmb.rds)}, WDS {int(cmb.wds)})", "use p2p or compat mode")
            self.cmb_mapping = map_peer_bar(self.gpu, self.nvme, CMB_IOVA - cmb.offset, region=cmb.bir,
                                            size=cmb.offset + cmb.size, notes=self.kernel)
        self.set_cmb_window()

    def _cmb(self, action: str):
        """The NVMe's CMB (``CmbInfo``), once this open session turned it on; else StorageError."""
        self._require_open(action)
        if self.nvme.cmb is None:
            raise StorageError(f"cannot {action}: {self.nvme.bdf}'s CMB is not on in this {self.mode} session",
                               "open the session with mode=\"cmb\", or call map_cmb() first")
        return self.nvme.cmb

    @property
    def cmb_staging(self) -> int:
        """Bytes of the CMB the staging path may use: all but what SQs hold at its top."""
        return self._cmb("size the CMB's staging area").size - sum(self.cmb_claims.values())

    def claim_cmb(self, size: int) -> int:
        """``size`` bytes at the top of the CMB for an SQ; -> their IOVA (= controller address)."""
        self._cmb("claim CMB space for a queue")
        if size > self.cmb_staging - 4096:
            raise StorageError(f"{size} bytes of the CMB for a queue, {self.cmb_staging} left",
                               "use a smaller queue or a larger CMB (topology: cmb)")
        iova = CMB_IOVA + self.cmb_staging - size
        self.cmb_claims[iova] = size
        return iova

    def release_cmb(self, iova: int) -> None:
        self.cmb_claims.pop(iova, None)

    def set_cmb_window(self) -> None:
        """The GPU's message window over the CMB (again after a GPU reset, which clears it)."""
        self.set_window(CMB_IOVA, self._cmb("set the GPU's message window over the CMB").size, "cmb")

    def set_window(self, base: int, size: int, what: str) -> None:
        """The GPU's message window over [base, base + size) (one window: the CMB or the doorbells)."""
        self._require_open("set the GPU's message window")
        bar0 = self.gpu.bar0
        bar0.write32(regs.REG_MSGWIN_BASE_LO, base & 0xFFFFFFFF)
        bar0.write32(regs.REG_MSGWIN_BASE_HI, base >> 32)
        bar0.write32(regs.REG_MSGWIN_SIZE_LO, size & 0xFFFFFFFF)
        bar0.write32(regs.REG_MSGWIN_SIZE_HI, size >> 32)
        self.window = what

    def unmap_vram(self) -> None:
        if self.vram_mapping is not None:
            self.vram_mapping.close()
            self.vram_mapping = None

    def _unmap_cmb(self) -> None:
        if self.cmb_mapping is not None:
            self.cmb_mapping.close()
            self.cmb_mapping = None

    def close(self) -> None:
        """Release everything the session opened, in this order: its GPU queues (their NVMe
        queues deleted, their views of VRAM and the doorbell mapping let go), the controller
        stopped (I/O queues deleted, disabled: it DMAs no more), the VRAM and CMB mappings, every
        other mapping of the context, the NVMe and the GPU (interrupts, BAR mmaps, device fds,
        their VFIO groups), then the context (the container or the iommufd).  Every step runs
        even if an earlier one failed, and the failure is raised once all have run.  Safe to
        call again; the session refuses work after (StorageError)."""
        if self.closed:
            return
        self.closed = True
        stack, self._stack = self._stack, contextlib.ExitStack()
        with stack:                               # runs the newest first
            stack.callback(self._unmap_cmb)
            stack.callback(self.unmap_vram)
            stack.callback(self.nvme.shutdown)
            for queue in list(self._queues):
                stack.callback(queue.close)

    def _require_open(self, action: str) -> None:
        if self.closed:
            nvme, gpu = self.bdfs
            raise StorageError(f"cannot {action}: the storage session of NVMe {nvme} and GPU {gpu} is closed "
                               "(its devices were released when it closed)",
                               f"open a new one, StorageSession.open({nvme!r}, {gpu!r}), and do the I/O "
                               "inside its with block")

    def __enter__(self) -> "StorageSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- registration ------------------------------------------------------------
    def handle_register(self, nsid: int = 1) -> FileHandle:
        self._require_open("register a file handle")
        ns = self.nvme.namespace(nsid)
        return FileHandle(nsid, ns.size, ns.block_size)

    def buf_register(self, offset: int, length: int) -> GpuBuffer:
        self._require_open("register a VRAM buffer")
        if length <= 0 or offset < 0 or offset + length > self.gpu.vram_size:
            raise StorageError(f"VRAM buffer [{offset:#x}, {offset + length:#x}) is outside the GPU's "
                               f"{self.gpu.vram_size:#x} bytes of VRAM", "register a range inside VRAM")
        if offset % 4:
            raise StorageError(f"VRAM buffer offset {offset:#x} is not 4-byte aligned",
                               "NVMe data pointers are dword aligned: register at a multiple of 4 (a page is best)")
        return GpuBuffer(offset, length)

    def _check(self, fh: FileHandle, buf: GpuBuffer, size: int, file_offset: int, buf_offset: int) -> int:
        if not isinstance(buf, GpuBuffer):
            raise StorageError(f"{buf!r} is not a registered VRAM buffer", "register it with buf_register()")
        if buf_offset < 0 or buf_offset + size > buf.length:
            raise StorageError(f"{size} bytes at buf_offset {buf_offset:#x} do not fit the registered "
                               f"{buf.length:#x}-byte buffer", "register a larger buffer or move less")
        if (buf.offset + buf_offset) % 4:
            raise StorageError(f"buf_offset {buf_offset:#x} is not 4-byte aligned",
                               "NVMe data pointers are dword aligned: use a multiple of 4")
        self.nvme.check_range(fh.nsid, file_offset, size)   # whole blocks, inside the namespace
        return buf.offset + buf_offset

    # -- I/O -------------------------------------------------------------------------------
    def read(self, fh: FileHandle, buf: GpuBuffer, size: int, file_offset: int = 0, buf_offset: int = 0) -> int:
        """``size`` bytes of the namespace at ``file_offset`` into the buffer at ``buf_offset``;
        -> the bytes read (all of ``size``: an error raises)."""
        self._require_open("read")
        vram = self._check(fh, buf, size, file_offset, buf_offset)
        if self.mode == "p2p":
            self.stats["commands"] += self.nvme.read(fh.nsid, file_offset, VRAM_IOVA + vram, size)
            self.stats["p2p_bytes"] += size
            return size
        if self.mode == "cmb":
            for done in range(0, size, self.cmb_staging):
                n = min(self.cmb_staging, size - done)
                self.stats["commands"] += self.nvme.read(fh.nsid, file_offset + done, CMB_IOVA, n, sgl=True)
                self.gpu_copy(Transfer(Op.HOST_TO_VRAM, src=CMB_IOVA, dst=vram + done, length=n))
                self.stats["cmb_bytes"] += n
            return size
        for done in range(0, size, BOUNCE):
            n = min(BOUNCE, size - done)
            self.stats["commands"] += self.nvme.read(fh.nsid, file_offset + done, self.bounce.iova, n)
            self.gpu.run([Transfer(Op.HOST_TO_VRAM, src=self.bounce.iova, dst=vram + done, length=n)])
            self.stats["bounced_bytes"] += n
            self.stats["gpu_copies"] += 1
        return size

    def write(self, fh: FileHandle, buf: GpuBuffer, size: int, file_offset: int = 0, buf_offset: int = 0) -> int:
        """``size`` bytes of the buffer at ``buf_offset`` into the namespace at ``file_offset``;
        -> the bytes written."""
        self._require_open("write")
        vram = self._check(fh, buf, size, file_offset, buf_offset)
        if self.mode == "p2p":
            self.stats["commands"] += self.nvme.write(fh.nsid, file_offset, VRAM_IOVA + vram, size)
            self.stats["p2p_bytes"] += size
            return size
        if self.mode == "cmb":
            for done in range(0, size, self.cmb_staging):
                n = min(self.cmb_staging, size - done)
                self.gpu_copy(Transfer(Op.VRAM_TO_HOST, src=vram + done, dst=CMB_IOVA, length=n))
                self.stats["commands"] += self.nvme.write(fh.nsid, file_offset + done, CMB_IOVA, n, sgl=True)
                self.stats["cmb_bytes"] += n
            return size
        for done in range(0, size, BOUNCE):
            n = min(BOUNCE, size - done)
            self.gpu.run([Transfer(Op.VRAM_TO_HOST, src=vram + done, dst=self.bounce.iova, length=n)])
            self.stats["commands"] += self.nvme.write(fh.nsid, file_offset + done, self.bounce.iova, n)
            self.stats["bounced_bytes"] += n
            self.stats["gpu_copies"] += 1
        return size

    def gpu_copy(self, *transfers: Transfer, timeout: float = 60) -> list[dict]:
        """GPU copies to or from the CMB (the window set over it first if it is not); a failed
        copy resets the GPU, which clears the window."""
        self._require_open("copy with the GPU")
        if self.window not in ("cmb", "doorbells+cmb"):
            self.set_cmb_window()
        try:
            return self.gpu.run(list(transfers), timeout=timeout)
        except BaseException:
            self.window = None
            raise
        finally:
            self.stats["gpu_copies"] += len(transfers)

    def batch_submit(self, params: list[IoParams]) -> Batch:
        """p2p: every request's NVMe commands on the queue, one doorbell, reaped by ``poll``.
        compat, cmb: each request runs through the bounce buffer (or the CMB) now; ``poll``
        returns the results."""
        self._require_open("submit a batch")
        batch = Batch(self)
        queue = self.nvme.queues[1]
        checked = [self._check(p.fh, p.buf, p.size, p.file_offset, p.buf_offset) for p in params]
        if self.mode in ("compat", "cmb"):
            for i, p in enumerate(params):
                batch._sizes[i] = [1, 0]
                try:
                    n = (self.read if p.op == "read" else self.write)(p.fh, p.buf, p.size, p.file_offset,
                                                                      p.buf_offset)
                    batch._finish(i, p, "ok", n)
                except VfioError as err:
                    batch._finish(i, p, err.what)
            return batch
        step = self.nvme.max_transfer
        pieces = [(i, p, o) for i, p in enumerate(params) for o in range(0, p.size, step)]
        if len(pieces) > queue.tracker.free:
            raise StorageError(f"a batch of {len(pieces)} NVMe commands, the queue has room for "
                               f"{queue.tracker.free}", f"submit at most {queue.tracker.depth} commands "
                               f"(requests of up to {step} bytes each) per batch")
        for i, p, o in pieces:
            batch._sizes.setdefault(i, [0, 0])[0] += 1
            op = IoOp.READ if p.op == "read" else IoOp.WRITE
            req = self.nvme.submit_rw(queue, op, p.fh.nsid, p.file_offset + o, min(step, p.size - o),
                                      VRAM_IOVA + checked[i] + o)
            batch.pending[req] = (i, p)
            self.stats["commands"] += 1
            self.stats["p2p_bytes"] += min(step, p.size - o)
        queue.ring()
        return batch
