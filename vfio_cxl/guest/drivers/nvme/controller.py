"""An NVMe controller driven from guest userspace through VFIO: bring-up, queues, I/O, reset.

    with NvmeController.open("0000:04:00.0") as nvme:           # type1 or iommufd, as VFIO picks
        ns = nvme.namespaces[1]
        buf = nvme.dma_buffer(1 << 20)                           # guest RAM mapped for the controller
        nvme.write(1, 0, buf.iova, 1 << 20)                      # bytes; whole blocks
        nvme.read(1, 0, buf.iova, 1 << 20)

Bring-up is one verb per step, which ``bring_up`` (run by ``open``, and by ``reset`` again) calls
in order: ``disable`` (CC.EN = 0, wait for CSTS.RDY = 0 within CAP.TO), ``configure_admin_queue``
(AQA, ASQ, ACQ), ``enable`` (CC.EN = 1 with 4 KiB pages and 64/16-byte entries), ``wait_ready``
(CSTS.RDY = 1), ``identify_controller``, ``identify_namespaces`` (the active namespace list and
each namespace), ``set_queue_count`` (Set Features Number of Queues), ``create_io_queues`` (each
I/O completion queue, then its submission queue), and ``enable_cmb`` again after a reset.  Open
with ``bring_up=False`` to run the steps one at a time.  Completions are polled (CQ IEN = 0) or
signalled by MSI-X (vector q for queue q, 0 for the admin queue) on eventfds; what a command
becomes on a queue (data pointer, entry, completion) is ``rq.py``'s.

Every wait has a deadline and looks at CSTS on the way: Controller Fatal Status, or a controller
that reads all ones (gone), fails every outstanding request with ``NvmeFatalError`` at once; so
does the kernel's release request (VFIO_PCI_REQ_IRQ_INDEX: the device is being hot-removed),
after which the queues are torn down and the owner closes the controller (``NvmeRemovedError``);
``reset()`` brings the controller back with its queues empty.  Data pointers are PRPs, or SGLs on
I/O commands when asked (``sgl=True``) and the controller supports them; each request builds its
PRP list or SGL segment in a page of its own (``tracker.RequestTracker``).
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass
from pathlib import Path

from ...vfio import DmaMapping, VfioPciDevice, uapi
from ...vfio.errors import InterruptTimeout
from ...vfio.interrupts import wait_readable
from . import prp as dptr
from . import rq
from .errors import NvmeError, NvmeFatalError, NvmeRemovedError, NvmeTimeout
from .iova import IovaWindow
from .queue import QueuePair
from .spec import (CMBMSC_CMSE, CMBMSC_CRE, CMBSTS_CBAI, REG_CMBLOC, REG_CMBMSC, REG_CMBSTS, REG_CMBSZ,
                   CmbInfo)
from .spec import (CC_CSS_NVM, CC_EN, CC_IOCQES_SHIFT, CC_IOSQES_SHIFT, CC_MPS_SHIFT, CSTS_CFS, CSTS_RDY,
                   CQE_SIZE, FEAT_NUMBER_OF_QUEUES, PAGE, REG_ACQ, REG_AQA, REG_ASQ, REG_CAP,
                   REG_CC, REG_CSTS, REG_VS, SQE_SIZE, SQES_LOG2, CQES_LOG2, AdminOp, Cap, Cns, ControllerInfo,
                   IoOp, NamespaceInfo, pack_sqe)
from .tracker import Request, RequestTracker

PCI_COMMAND = 0x04
PCI_COMMAND_MEMORY = 0x2
PCI_COMMAND_MASTER = 0x4
PCI_CLASS_NVME = 0x010802

ADMIN_ENTRIES = 32
ADMIN_TIMEOUT = 5.0           # seconds, per admin command
IO_TIMEOUT = 10.0             # seconds, per I/O command
CONTROL_IOVA = 0x0100_0000    # queues, identify page, request pages (below the GPU's areas)
DATA_IOVA = 0x2000_0000       # dma_buffer(): guest RAM for data
DATA_WINDOW = 0x2000_0000     # 512 MiB of IOVA space for it
ALL_ONES = 0xFFFFFFFF


def find_controllers(sysfs_root: str = "/sys") -> list[str]:
    """BDFs of the NVMe controllers (PCI class 01:08:02) in this VM."""
    found = []
    for dev in sorted(Path(sysfs_root, "bus/pci/devices").glob("*")):
        try:
            if int((dev / "class").read_text(), 16) == PCI_CLASS_NVME:
                found.append(dev.name)
        except (OSError, ValueError):
            continue
    return found


@dataclass
class DmaBuffer:
    """Guest RAM the controller reaches at ``iova`` (``mem`` is the process's view)."""

    mem: mmap.mmap
    mapping: DmaMapping
    iova: int
    size: int


class NvmeController:
    def __init__(self, device: VfioPciDevice, *, io_queues: int = 1, queue_entries: int = 128,
                 interrupts: bool = False, control_iova: int = CONTROL_IOVA, data_iova: int = DATA_IOVA,
                 data_window: int = DATA_WINDOW, spare_queues: int = 0, bring_up: bool = True):
        """Take ``device`` (an NVMe function): memory decoding and bus mastering on, CAP read and
        checked, the control mapping made, MSI-X vectors and the release request registered;
        then ``bring_up()``, unless ``bring_up`` is False (the caller runs the steps)."""
        self.device = device
        self.bdf = device.bdf
        self.failed: str | None = None          # why the controller is unusable until reset()
        self.queues: dict[int, QueuePair] = {}
        self.vectors = None
        self.request = None                 # the kernel's release request, on an eventfd
        self._buffers: list[DmaBuffer] = []
        self.io_queues = io_queues          # the driver's own I/O queues: qid 1..io_queues
        self.spare_queues = spare_queues    # granted by Set Features, created by their owner (create_io_queue)
        self.cmb: CmbInfo | None = None     # the Controller Memory Buffer, once enable_cmb() turned it on
        self.cmb_base: int | None = None    # the controller address (CMBMSC.CBA) data pointers use for it
        self.admin: QueuePair | None = None        # configure_admin_queue()
        self.info: ControllerInfo | None = None    # identify_controller()
        self.max_transfer = 0                      # bytes per command, from MDTS: identify_controller()
        self.namespaces: dict[int, NamespaceInfo] = {}   # identify_namespaces()
        command = device.config.read16(PCI_COMMAND)
        device.config.write16(PCI_COMMAND, command | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER)
        self.bar0 = device.bar(0)
        self.cap = Cap.decode(self.bar0.read32(REG_CAP) | self.bar0.read32(REG_CAP + 4) << 32)
        self.version = self.bar0.read32(REG_VS)
        if not self.cap.css_nvm:
            raise NvmeError(f"{self.bdf}: the controller does not support the NVM command set (CAP.CSS)",
                            "use an NVMe I/O controller")
        if self.cap.mpsmin > PAGE:
            raise NvmeError(f"{self.bdf}: the controller's smallest page is {self.cap.mpsmin} bytes",
                            f"this driver uses {PAGE}-byte pages")
        self.queue_entries = queue_entries
        if queue_entries < 2:
            raise NvmeError(f"an I/O queue of {queue_entries} entries", "use at least 2 (one stays empty)")
        if queue_entries > self.cap.max_entries:
            raise NvmeError(f"an I/O queue of {queue_entries} entries: the controller allows "
                            f"{self.cap.max_entries} (CAP.MQES + 1)",
                            f"use at most {self.cap.max_entries} entries (queue depth {self.cap.max_entries - 1})")
        # Control memory, one mapping: admin SQ, CQ, identify page, admin request pages, then per
        # I/O queue its SQ, CQ and request pages.
        self._layout = _Layout(io_queues, self.queue_entries)
        self._control = mmap.mmap(-1, self._layout.size)
        self._control_view = memoryview(self._control)
        self.control_iova = control_iova
        self._control_dma = device.map_dma(self._control, control_iova)
        self.data_window = IovaWindow(data_iova, data_window)
        try:
            if interrupts:
                count = device.irq_info(uapi.VFIO_PCI_MSIX_IRQ_INDEX).count
                if count < 1 + io_queues:
                    raise NvmeError(f"{self.bdf}: {count} MSI-X vectors for {io_queues} I/O queues + admin",
                                    f"use at most {max(count - 1, 0)} I/O queues, or polled completions")
                self.vectors = device.msix(1 + io_queues)
            self.request = device.release_request()
            if bring_up:
                self.bring_up()
        except BaseException:   # nothing left behind in a caller-owned IOMMU context either
            if self.request is not None:
                self.request.close()
            if self.vectors is not None:
                self.vectors.close()
            self._control_dma.close()
            raise

    # -- opening and closing -------------------------------------------------

    def release_requested(self) -> bool:
        """The kernel asked for the device back since last asked (non-blocking)."""
        return self.request is not None and self.request.pending(0) > 0

    @classmethod
    def open(cls, bdf: str, *, backend: str | None = None, container=None, ioas=None, **kwargs) -> "NvmeController":
        device = VfioPciDevice.open(bdf, backend=backend, container=container, ioas=ioas)
        try:
            return cls(device, **kwargs)
        except BaseException:
            device.close()
            raise

    def shutdown(self) -> None:
        """Delete the I/O queues and disable the controller (best effort when it failed): after
        this it DMAs no more, so its mappings can go.  ``close`` does it first if not done."""
        if self.failed is None and self.device.device is not None:
            try:
                for qid in sorted(self.queues, reverse=True):
                    if qid:
                        self._admin(AdminOp.DELETE_SQ, cdw10=qid, what=f"delete SQ {qid}")
                        self._admin(AdminOp.DELETE_CQ, cdw10=qid, what=f"delete CQ {qid}")
                self.disable()
                if self.cmb_base is not None:      # the CMB off, as at power-on
                    self.bar0.write32(REG_CMBMSC, 0)
            except NvmeError:
                pass
        self.failed = self.failed or "was shut down"
        self.queues = {}

    def close(self) -> None:
        """``shutdown``, then release interrupts, mappings and the device."""
        try:
            self.shutdown()
            for buf in self._buffers:
                buf.mapping.close()
            self._buffers.clear()
            if self.vectors is not None:
                self.vectors.close()
                self.vectors = None
            if self.request is not None:
                self.request.close()
                self.request = None
            self._control_dma.close()
        finally:
            self.device.close()

    def __enter__(self) -> "NvmeController":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- bring-up, one verb per step -----------------------------------------------------------
    #
    # ``bring_up`` runs them in order; a caller may instead run them one at a time, in the same
    # order, after opening with bring_up=False (libvfn: nvme_configure_adminq, nvme_enable,
    # nvme_wait_rdy; SPDK's nvme_ctrlr states from DISABLE to READY, then IDENTIFY ... SET_NUM_QUEUES).

    def bring_up(self) -> None:
        """Every bring-up step, in order: what ``open`` runs, and ``reset`` again."""
        self.disable()
        self.configure_admin_queue()
        self.enable()
        self.wait_ready()
        self.identify_controller()
        self.identify_namespaces()
        self.set_queue_count()
        self.create_io_queues()
        if self.cmb_base is not None:          # a reset: the CMB comes back at the same address
            self.enable_cmb(self.cmb_base)

    def disable(self) -> None:
        """CC.EN = 0, then wait for CSTS.RDY = 0 within CAP.TO (nothing to do if already so).
        The controller deletes every queue: what was outstanding is the caller's to fail."""
        cc = self.bar0.read32(REG_CC)
        if cc & CC_EN or self._csts() & CSTS_RDY:
            self.bar0.write32(REG_CC, cc & ~CC_EN)
            self._wait_ready(False, "CC.EN = 0")

    def configure_admin_queue(self) -> QueuePair:
        """The admin SQ and CQ (ADMIN_ENTRIES each, empty) in the control mapping, and AQA, ASQ,
        ACQ pointing at them; the controller must be disabled (``disable``)."""
        if self.bar0.read32(REG_CC) & CC_EN:
            raise NvmeError(f"{self.bdf}: the admin queue registers are set while the controller is enabled "
                            "(CC.EN = 1)", "disable() it first")
        lay = self._layout
        self.admin = self._queue(0, ADMIN_ENTRIES, lay.admin_sq, lay.admin_cq, lay.admin_pages, ADMIN_ENTRIES - 1,
                                 0 if self.vectors else None)
        self.queues = {0: self.admin}
        self.bar0.write32(REG_AQA, (ADMIN_ENTRIES - 1) << 16 | (ADMIN_ENTRIES - 1))
        for reg, queue_iova in ((REG_ASQ, self.admin.sq_iova), (REG_ACQ, self.admin.cq_iova)):
            self.bar0.write32(reg, queue_iova & ALL_ONES)
            self.bar0.write32(reg + 4, queue_iova >> 32)
        return self.admin

    def enable(self) -> None:
        """CC.EN = 1 with the NVM command set, 4 KiB pages and 64/16-byte queue entries; the
        controller becomes ready later (``wait_ready``)."""
        if self.admin is None:
            raise NvmeError(f"{self.bdf}: enabling a controller with no admin queue",
                            "configure_admin_queue() first (after disable())")
        self.bar0.write32(REG_CC, CC_EN | CC_CSS_NVM | 0 << CC_MPS_SHIFT | SQES_LOG2 << CC_IOSQES_SHIFT
                          | CQES_LOG2 << CC_IOCQES_SHIFT)

    def wait_ready(self) -> None:
        """Until CSTS.RDY = 1 within CAP.TO; then the admin queue takes commands."""
        self._wait_ready(True, "CC.EN = 1")
        self.failed = None

    def identify_controller(self) -> ControllerInfo:
        """Identify Controller: ``info``, and ``max_transfer`` (MDTS, at most one PRP list page)."""
        self.info = ControllerInfo.decode(self.identify(Cns.CONTROLLER), self.cap.mpsmin)
        self.max_transfer = min(self.info.mdts or dptr.MAX_PRP_BYTES, dptr.MAX_PRP_BYTES)
        return self.info

    def identify_namespaces(self) -> dict[int, NamespaceInfo]:
        """The active namespace list, then Identify Namespace of each: ``namespaces``."""
        nsids = [n for n in _u32s(self.identify(Cns.ACTIVE_NSIDS)) if n]
        self.namespaces = {n: NamespaceInfo.decode(n, self.identify(Cns.NAMESPACE, nsid=n)) for n in nsids}
        return self.namespaces

    def set_queue_count(self) -> int:
        """Set Features Number of Queues for the driver's I/O queues plus ``spare_queues``;
        how many I/O queue pairs the controller granted (raises if fewer than asked)."""
        want = self.io_queues + self.spare_queues
        got = self._admin(AdminOp.SET_FEATURES, cdw10=FEAT_NUMBER_OF_QUEUES, cdw11=(want - 1) << 16 | (want - 1),
                          what="Set Features Number of Queues").result
        granted = min((got & 0xFFFF) + 1, (got >> 16) + 1)
        if granted < want:
            raise NvmeError(f"{self.bdf}: the controller grants {granted} I/O queue pairs, {want} asked for",
                            f"open it with io_queues={granted} or fewer")
        return granted

    def create_io_queues(self) -> None:
        """The driver's own I/O queue pairs, qid 1..io_queues, each CQ then SQ (``create_io_queue``)."""
        for qid in range(1, self.io_queues + 1):
            sq, cq, pages = self._layout.io(qid)
            self.create_io_queue(qid, self._queue(qid, self.queue_entries, sq, cq, pages, self.queue_entries - 1,
                                                  qid if self.vectors else None))

    def _csts(self) -> int:
        return self.bar0.read32(REG_CSTS)

    def _wait_ready(self, ready: bool, why: str) -> None:
        deadline = time.monotonic() + max(self.cap.timeout_ms / 1000, 0.5)
        while True:
            csts = self._csts()
            if csts == ALL_ONES:
                raise self._fatal("reads all ones: it is gone (hot-removed?)")
            if ready and csts & CSTS_CFS:
                raise self._fatal("reports Controller Fatal Status (CSTS.CFS) while enabling")
            if bool(csts & CSTS_RDY) == ready:
                return
            if time.monotonic() > deadline:
                raise NvmeTimeout(f"{self.bdf}: CSTS.RDY did not become {int(ready)} within CAP.TO "
                                  f"({self.cap.timeout_ms} ms) after {why}",
                                  "the controller is stuck: reset the PCI function (vfio-cxl nvme ... again)")
            time.sleep(0.001)   # the spec's own handshake: CC write, then CSTS.RDY within CAP.TO

    def enable_cmb(self, base: int) -> CmbInfo:
        """Turn the Controller Memory Buffer on (NVMe 1.4 CMBMSC): CRE makes CMBLOC/CMBSZ
        readable, CMSE with CBA = ``base`` makes the controller serve every data pointer (and
        queue address) in [base, base + size) from the CMB itself, with no DMA and no IOMMU
        translation.  ``base`` is a controller address of our choosing: pick one that no IOVA
        the controller must reach overlaps.  Raises if the controller has no CMB."""
        if not self.cap.cmbs:
            raise NvmeError(f"{self.bdf} has no Controller Memory Buffer (CAP.CMBS = 0)",
                            "use a controller with one (topology: cmb = \"4M\" on the [[vm.nvme]])")
        if base % PAGE:
            raise NvmeError(f"CMB base address {base:#x} is not 4 KiB aligned", "CMBMSC.CBA holds bits 63:12")
        self.bar0.write32(REG_CMBMSC + 4, base >> 32)           # the high half first: the low write acts
        self.bar0.write32(REG_CMBMSC, (base & ALL_ONES) | CMBMSC_CRE | CMBMSC_CMSE)
        if self.bar0.read32(REG_CMBSTS) & CMBSTS_CBAI:
            raise NvmeError(f"{self.bdf} refused CMB base address {base:#x} (CMBSTS.CBAI)",
                            "choose a base address whose range does not wrap")
        info = CmbInfo.decode(self.bar0.read32(REG_CMBLOC), self.bar0.read32(REG_CMBSZ))
        if info.size == 0:
            raise NvmeError(f"{self.bdf}: CMBSZ reads 0 after CMBMSC.CRE = 1", "the controller's CMB is unusable")
        self.cmb, self.cmb_base = info, base
        return info

    def _queue(self, qid: int, entries: int, sq: int, cq: int, pages: int, depth: int, vector) -> QueuePair:
        view = self._control_view
        tracker = RequestTracker(depth, view[pages:pages + depth * PAGE], self.control_iova + pages)
        return QueuePair(qid, entries, view[sq:sq + entries * SQE_SIZE], self.control_iova + sq,
                         view[cq:cq + entries * CQE_SIZE], self.control_iova + cq,
                         self._doorbell(self.cap.sq_doorbell(qid)), self._doorbell(self.cap.cq_doorbell(qid)),
                         tracker, vector)

    def _doorbell(self, offset: int):
        bar0 = self.bar0
        return lambda value: bar0.write32(offset, value)

    def create_io_queue(self, qid: int, queue: QueuePair, *, cq_contiguous: bool = True) -> QueuePair:
        """Create I/O CQ ``qid`` then SQ ``qid`` over ``queue``'s memory (the CPU's queues, or
        queues in a peer's memory for GPU-initiated I/O)."""
        queue.clear()
        ien = 0 if queue.vector is None else 1
        iv = queue.vector or 0
        self._admin(AdminOp.CREATE_CQ, cdw10=(queue.entries - 1) << 16 | qid, cdw11=iv << 16 | ien << 1 | 1,
                    prp1=queue.cq_iova, what=f"create CQ {qid}")
        self._admin(AdminOp.CREATE_SQ, cdw10=(queue.entries - 1) << 16 | qid, cdw11=qid << 16 | 1,
                    prp1=queue.sq_iova, what=f"create SQ {qid}")
        self.queues[qid] = queue
        return queue

    def delete_io_queue(self, qid: int) -> None:
        self._admin(AdminOp.DELETE_SQ, cdw10=qid, what=f"delete SQ {qid}")
        self._admin(AdminOp.DELETE_CQ, cdw10=qid, what=f"delete CQ {qid}")
        self.queues.pop(qid, None)

    # -- admin commands --------------------------------------------------------------

    def identify(self, cns: int, nsid: int = 0) -> bytes:
        """The 4 KiB an Identify of ``cns`` returns (into the request's own page)."""
        req = self._admin_request(f"Identify CNS {cns}", AdminOp.IDENTIFY)
        try:
            req.page[:] = bytes(PAGE)
            rq.submit(self.admin, req, pack_sqe(AdminOp.IDENTIFY, req.cid, nsid, dptr=(req.page_iova, 0),
                                                cdw10=cns))
        except BaseException:
            self.admin.tracker.cancel(req)
            raise
        self._run_admin(req)
        return bytes(req.page)

    def _admin(self, op: AdminOp, *, cdw10: int = 0, cdw11: int = 0, prp1: int = 0, nsid: int = 0, what: str):
        req = self._admin_request(what, op)
        rq.submit(self.admin, req, pack_sqe(op, req.cid, nsid, dptr=(prp1, 0), cdw10=cdw10, cdw11=cdw11))
        self._run_admin(req)
        return req.completion

    def _admin_request(self, what: str, op: AdminOp) -> Request:
        if self.admin is None:
            raise NvmeError(f"{self.bdf}: {what} before the admin queue exists",
                            "bring the controller up first: bring_up(), or disable(), configure_admin_queue(), "
                            "enable(), wait_ready()")
        return self.admin.tracker.alloc(what, op)

    def _run_admin(self, req: Request) -> None:
        self.admin.ring()
        self.wait(self.admin, [req], ADMIN_TIMEOUT)
        rq.check(self.bdf, req)

    # -- I/O ------------------------------------------------------------------------------

    def namespace(self, nsid: int) -> NamespaceInfo:
        ns = self.namespaces.get(nsid)
        if ns is None:
            raise NvmeError(f"{self.bdf} has no active namespace {nsid}",
                            f"use one of: {', '.join(map(str, self.namespaces)) or '(none)'}")
        return ns

    def check_range(self, nsid: int, offset: int, length: int) -> NamespaceInfo:
        """The namespace, if [offset, offset + length) is whole blocks inside it; else why not."""
        ns = self.namespace(nsid)
        if length <= 0:
            raise NvmeError(f"a transfer of {length} bytes", f"transfer whole {ns.block_size}-byte blocks")
        if offset % ns.block_size or length % ns.block_size:
            raise NvmeError(f"offset {offset:#x} / length {length:#x} are not whole blocks of namespace {nsid}",
                            f"NVMe moves whole logical blocks: make offset and length multiples of "
                            f"{ns.block_size} bytes")
        if offset + length > ns.size:
            raise NvmeError(f"[{offset:#x}, {offset + length:#x}) runs past the end of namespace {nsid} "
                            f"({ns.size:#x} bytes)", f"stay below {ns.size:#x}")
        return ns

    def submit_rw(self, queue: QueuePair, op: IoOp, nsid: int, offset: int, length: int, iova: int | None = None,
                  *, segments: list[tuple[int, int]] | None = None, sgl: bool = False, tag=None) -> Request:
        """Push one Read or Write of ``length`` bytes at byte ``offset`` of the namespace, data at
        ``iova`` (contiguous) or ``segments`` (SGL); not rung yet."""
        self._require_alive()
        ns = self.check_range(nsid, offset, length)
        if length > self.max_transfer:
            raise NvmeError(f"a {length}-byte command is over the controller's limit of {self.max_transfer} "
                            "bytes (MDTS)", "split it (read()/write() do that)")
        if segments is not None:
            sgl = True
            if sum(n for _, n in segments) != length:
                raise NvmeError(f"SGL segments of {sum(n for _, n in segments)} bytes for {length}",
                                "make the segments add up to the transfer length")
        else:
            segments = [(iova, length)]
        if sgl and not self.info.sgl_supported:
            raise NvmeError(f"{self.bdf} does not support SGLs (Identify Controller SGLS = 0)", "use PRPs")
        what = f"{op.name.lower()} nsid {nsid} bytes [{offset:#x}, {offset + length:#x})"
        req = queue.tracker.alloc(what, op, tag)
        try:
            pointer, psdt = rq.data_pointer(req, segments, sgl)
            rq.submit(queue, req, rq.rw_command(op, req, nsid, ns.block_size, offset, length, pointer, psdt))
        except BaseException:
            queue.tracker.cancel(req)
            raise
        req.extra["length"] = length
        return req

    def submit_flush(self, queue: QueuePair, nsid: int) -> Request:
        self._require_alive()
        self.namespace(nsid)
        req = queue.tracker.alloc(f"flush nsid {nsid}", IoOp.FLUSH)
        rq.submit(queue, req, pack_sqe(IoOp.FLUSH, req.cid, nsid))
        return req

    def reap(self, queue: QueuePair) -> list[Request]:
        """The requests that completed since last asked (their ``completion`` set; errors included)."""
        return rq.reap(queue)

    def wait(self, queue: QueuePair, reqs: list[Request], timeout: float = IO_TIMEOUT) -> None:
        """Until every request in ``reqs`` has completed (rung before), or one of: the deadline
        (``NvmeTimeout``), fatal status or a controller gone (``NvmeFatalError``; all fail).

        The controller's registers are read only when nothing came: after every 256 empty polls,
        or, with MSI-X, when the vector stayed quiet for a while (0.2 s).  A register access is
        an MMIO exit that waits for QEMU's global lock, which the controller holds while it moves
        data: checking CSTS at every completion would charge that wait to this process.  The CQ
        head doorbell is rung when the queue has nothing outstanding (``flush``), or earlier when
        half the CQ is consumed (``QueuePair.reap``), for the same reason."""
        deadline = time.monotonic() + timeout
        spins = 0
        while any(r.completion is None for r in reqs):
            if self.failed:
                raise NvmeFatalError(f"{self.bdf}: {self.failed}", "reset the controller (NvmeController.reset())")
            dropped = next((r for r in reqs if "error" in r.extra), None)
            if dropped is not None:   # its queue was torn down under it (reset, fatal status)
                raise NvmeFatalError(f"{self.bdf}: {dropped.what}: {dropped.extra['error']}",
                                     "submit it again on the reset controller")
            if self.reap(queue):
                continue
            if time.monotonic() > deadline:
                self._check_alive()   # a controller that died says so rather than timing out
                late = next(r for r in reqs if r.completion is None)
                raise NvmeTimeout(f"{self.bdf}: {late.what} (CID {late.cid:#x}, queue {queue.qid}) did not "
                                  f"complete within {timeout:g} s", "reset the controller (reset())")
            spins += 1
            if queue.vector is not None and self.vectors is not None:
                if self._sleep(queue.vector, min(0.2, max(deadline - time.monotonic(), 0))):
                    continue          # the vector fired: reap it, no register read
                spins = 256
            if spins >= 256:          # nothing came for a while: is the controller still alive?
                spins = 0
                self._check_alive()
        if queue.tracker is None or queue.tracker.outstanding == 0:
            queue.flush()             # the queue is idle: the CQ head doorbell costs no wait now

    def _check_alive(self) -> None:
        """Raise if the release request fired or the controller is gone, fatal or disabled."""
        if self.release_requested():
            raise self._removed()
        csts = self._csts()
        if csts == ALL_ONES:
            raise self._fatal("reads all ones: it is gone (hot-removed?)")
        if csts & CSTS_CFS:
            raise self._fatal("reports Controller Fatal Status (CSTS.CFS)")
        if not csts & CSTS_RDY:
            raise self._fatal("is no longer ready (CSTS.RDY = 0): it was reset or disabled")

    def _sleep(self, vector: int, timeout: float) -> bool:
        """Until queue ``vector``'s MSI-X or the kernel's release request fires, ``timeout`` at most;
        whether the vector fired (False: timed out, or only the release request came)."""
        if self.request is None:
            try:
                self.vectors.wait(vector, timeout)
            except InterruptTimeout:
                return False
            return True
        wait_readable((self.vectors.eventfds[vector], *self.request.eventfds), timeout)
        # consumed: the CQ is reaped next either way; a release request stays readable until
        # _check_alive reads it, so the next sleep returns at once with the vector quiet
        return self.vectors.pending(vector) > 0

    def io(self, op: IoOp, nsid: int, offset: int, iova: int, length: int, *, qid: int = 1, sgl: bool = False,
           depth: int | None = None, timeout: float = IO_TIMEOUT) -> int:
        """Move ``length`` bytes between namespace bytes at ``offset`` and ``iova`` in pieces of at
        most MDTS, ``depth`` of them in flight (default: the queue's), one doorbell per batch.
        Returns how many commands it took; the first error raises once the batch drained."""
        self.check_range(nsid, offset, length)
        queue = self.queues[qid]
        depth = min(depth or queue.tracker.depth, queue.tracker.depth)
        pieces = rq.pieces(length, self.max_transfer)
        inflight: list[Request] = []
        error = None
        while pieces or inflight:
            while pieces and len(inflight) < depth:
                o, n = pieces.pop(0)
                inflight.append(self.submit_rw(queue, op, nsid, offset + o, n, iova + o, sgl=sgl))
            queue.ring()
            self.wait(queue, inflight[:1], timeout)
            for req in [r for r in inflight if r.completion is not None]:
                inflight.remove(req)
                if not req.completion.ok and error is None:
                    error, pieces = req, []
        if error is not None:
            rq.check(self.bdf, error)
        return -(-length // self.max_transfer)

    def read(self, nsid: int, offset: int, iova: int, length: int, **kw) -> int:
        return self.io(IoOp.READ, nsid, offset, iova, length, **kw)

    def write(self, nsid: int, offset: int, iova: int, length: int, **kw) -> int:
        return self.io(IoOp.WRITE, nsid, offset, iova, length, **kw)

    def flush(self, nsid: int, qid: int = 1) -> None:
        queue = self.queues[qid]
        req = self.submit_flush(queue, nsid)
        queue.ring()
        self.wait(queue, [req], IO_TIMEOUT)
        rq.check(self.bdf, req)

    # -- memory -------------------------------------------------------------------------------

    def dma_buffer(self, size: int) -> DmaBuffer:
        """``size`` bytes of guest RAM mapped for the controller (freed by ``free`` or ``close``)."""
        size = -(-size // PAGE) * PAGE
        iova = self.data_window.alloc(size)
        mem = mmap.mmap(-1, size)
        try:
            mapping = self.device.map_dma(mem, iova)
        except BaseException:
            self.data_window.free(iova, size)
            mem.close()
            raise
        buf = DmaBuffer(mem, mapping, iova, size)
        self._buffers.append(buf)
        return buf

    def free(self, buf: DmaBuffer) -> None:
        buf.mapping.close()
        self._buffers.remove(buf)
        self.data_window.free(buf.iova, buf.size)

    # -- failure and reset ---------------------------------------------------------------------

    def _require_alive(self) -> None:
        if self.failed:
            raise NvmeFatalError(f"{self.bdf}: {self.failed}", "reset the controller (NvmeController.reset())")

    def _fatal(self, why: str) -> NvmeFatalError:
        """Mark the controller failed; every outstanding request fails with the returned error."""
        self.failed = f"the controller {why}"
        for queue in self.queues.values():
            for req in queue.tracker.drain():
                req.extra["error"] = self.failed
        return NvmeFatalError(f"{self.bdf}: {self.failed}", "reset the controller (NvmeController.reset())")

    def _removed(self) -> NvmeRemovedError:
        """The kernel wants the device back: stop its DMA (CC.EN = 0 deletes every queue), fail
        what is outstanding, and say so; the owner closes the controller (fds, mappings)."""
        why = ("is being removed from this VM (the kernel's VFIO release request): its queues were "
               "torn down and every outstanding request failed")
        try:
            if self._csts() != ALL_ONES:
                self.disable()
        except NvmeError:
            pass                                # gone already: nothing left to stop
        self._fatal(why)
        self.queues = {}
        return NvmeRemovedError(f"{self.bdf}: {self.failed}",
                                "close the controller so the removal can finish, then use another one")

    def reset(self) -> None:
        """Controller reset (CC.EN 1 -> 0 -> 1): requests still outstanding fail with
        ``NvmeFatalError``; the admin and the driver's I/O queues come back empty, as at open.
        Queues made with ``create_io_queue`` are gone: their owner creates them again."""
        for queue in self.queues.values():
            for req in queue.tracker.drain():
                req.extra["error"] = "the controller was reset under the request"
        self.bring_up()

    def describe(self) -> dict:
        i = self.info
        return {"bdf": self.bdf, "serial": i.serial, "model": i.model, "firmware": i.firmware,
                "version": f"{self.version >> 16}.{self.version >> 8 & 0xFF}.{self.version & 0xFF}",
                "cntlid": i.cntlid, "mdts": self.max_transfer, "sgl": i.sgl_supported,
                "shadow_doorbells": i.doorbell_buffer_config, "max_queue_entries": self.cap.max_entries,
                "doorbell_stride": 4 << self.cap.dstrd, "timeout_ms": self.cap.timeout_ms,
                "io_queues": len(self.queues) - 1, "queue_entries": self.queue_entries,
                "completions": "msix" if self.vectors else "polled", "vfio_backend": self.device.backend,
                "namespaces": [{"nsid": n.nsid, "blocks": n.blocks, "block_size": n.block_size, "size": n.size}
                               for n in self.namespaces.values()]}


class _Layout:
    """Offsets in the control mapping: admin SQ, CQ and request pages, then each I/O queue's."""

    def __init__(self, io_queues: int, entries: int):
        def pages(n: int) -> int:
            return -(-n // PAGE) * PAGE
        self.admin_sq = 0
        self.admin_cq = pages(ADMIN_ENTRIES * SQE_SIZE)
        self.admin_pages = self.admin_cq + pages(ADMIN_ENTRIES * CQE_SIZE)
        at = self.admin_pages + (ADMIN_ENTRIES - 1) * PAGE
        self._io = {}
        for qid in range(1, io_queues + 1):
            sq, cq = at, at + pages(entries * SQE_SIZE)
            at = cq + pages(entries * CQE_SIZE)
            self._io[qid] = (sq, cq, at)
            at += (entries - 1) * PAGE
        self.size = at

    def io(self, qid: int) -> tuple[int, int, int]:
        return self._io[qid]


def _u32s(data: bytes) -> list[int]:
    return [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]

