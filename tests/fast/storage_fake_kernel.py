"""A fake VFIO kernel with a GPU and an NVMe controller, for ``StorageSession`` without a VM.

What is real: the library's whole VFIO stack (``Container``, ``Group``, ``IommufdContext``,
``VfioPciDevice``, regions, eventfds, DMA bookkeeping) and the GPU's driver (``GpuDriver``), on
real fds: /dev/vfio is a directory of plain files, each device fd a real file whose regions
(config space, BARs) are ranges of it, so fds, mmaps of BARs and eventfds show in
/proc/self/fd and /proc/self/maps.  Both backends: type1 (the container and the groups) and
iommufd (/dev/iommu, and each device's cdev, /dev/vfio/devices/vfioN, a link to its file).
The ioctls are answered here (the container's by ``FakeType1``, the IOAS's by ``FakeIommufd``).  The NVMe controller is a
stand-in (``StandInNvme``: the calls a session makes, over a real ``VfioPciDevice``), since its
admin queue cannot run on a plain file.

The kernel's rules that make a leak visible: a VFIO group node opens once (``EBUSY``), and stays
open while anything holds it -- its own fd, an fd of one of its devices, or an mmap of a device's
region (each holds a reference on the group's file); a device cdev binds once at a time
(``EINVAL`` while an fd bound earlier is open), and an IOAS is not destroyed while a device is
attached to it.  ``FakeKernel.install`` makes the library's ``Group.open`` see the first
rule; ``holdings()`` is what the process holds of this kernel.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from functools import partial
from types import SimpleNamespace

from test_vfio_bind import FakeSysfs
from test_vfio_dma import FakeType1
from test_vfio_iommufd import FakeIommufd

from vfio_cxl.devices.gpu import regs
from vfio_cxl.guest import p2p as p2p_module
from vfio_cxl.guest.drivers import gpu as gpu_module
from vfio_cxl.guest.drivers.nvme.controller import DATA_IOVA
from vfio_cxl.guest.drivers.nvme.errors import NvmeError
from vfio_cxl.guest.drivers.nvme.spec import Cap, CmbInfo, NamespaceInfo
from vfio_cxl.guest.storage import session as session_module
from vfio_cxl.guest.vfio import group as group_module
from vfio_cxl.guest.vfio import uapi
from vfio_cxl.guest.vfio import uapi_iommufd
from vfio_cxl.guest.vfio.container import Container
from vfio_cxl.guest.vfio.iommufd import IommufdContext
from vfio_cxl.guest.vfio.pci import VfioPciDevice
from vfio_cxl.guest.vfio.uapi import ffi

GPU, NVME = "0000:03:00.0", "0000:04:00.0"
GROUPS = {GPU: 5, NVME: 6}
CDEVS = {GPU: "vfio0", NVME: "vfio1"}
VRAM = 8 << 20
BLOCK = 512
NAMESPACE = 256 << 20             # namespace 1, as the lab's nvme0 (an anonymous mmap: pages as touched)
CONFIG = uapi.VFIO_PCI_CONFIG_REGION_INDEX
# region index -> (offset in the device file, size); page-aligned, so BARs can be mmapped
CMB = 1 << 20
LAYOUT = {GPU: {CONFIG: (0, 0x100), 0: (0x1000, regs.REGS_SIZE), 2: (0x10_0000, VRAM)},
          NVME: {CONFIG: (0, 0x100), 0: (0x4000, 0x4000), 2: (0x10_0000, CMB)}}
MMAPPABLE = {0, 2}
CMBSZ = 1 | 1 << 2 | 1 << 3 | 1 << 4 | 2 << 8 | (CMB >> 20) << 12   # SQS, LISTS, RDS, WDS; SZU 1 MiB
# the ioctls a device cdev takes for its iommufd (the rest are the device's own)
IOMMUFD_DEVICE_IOCTLS = (uapi_iommufd.VFIO_DEVICE_BIND_IOMMUFD, uapi_iommufd.VFIO_DEVICE_ATTACH_IOMMUFD_PT,
                         uapi_iommufd.VFIO_DEVICE_DETACH_IOMMUFD_PT)
NVME_CAP = 0x7FF | 1 << 16 | 0xF << 24 | 1 << 37 | 1 << 57   # MQES 2047, CQR, TO, CSS NVM, DSTRD 0, CMBS


class FakeKernel:
    def __init__(self, tmp_path):
        self.root = tmp_path
        self.dev_vfio = tmp_path / "dev-vfio"
        self.dev_vfio.mkdir()
        (self.dev_vfio / "vfio").write_bytes(b"")
        for number in GROUPS.values():
            (self.dev_vfio / str(number)).write_bytes(b"")
        self.sysfs = FakeSysfs(tmp_path / "sys")
        self.sysfs.add_device(GPU, ids=(regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID), driver="vfio-pci",
                              group=GROUPS[GPU])
        self.sysfs.add_device(NVME, driver="vfio-pci", group=GROUPS[NVME])
        self.files = {GPU: tmp_path / "gpu-device", NVME: tmp_path / "nvme-device"}
        self.dev_iommu = tmp_path / "iommu"
        self.dev_iommu.write_bytes(b"")
        (self.dev_vfio / "devices").mkdir()
        for bdf, cdev in CDEVS.items():       # each device's cdev: sysfs names it, /dev links to its file
            (self.sysfs.pci / "devices" / bdf / "vfio-dev" / cdev).mkdir(parents=True)
            (self.dev_vfio / "devices" / cdev).symlink_to(self.files[bdf])
        with open(self.files[GPU], "wb") as f:
            f.truncate(LAYOUT[GPU][2][0] + VRAM)
            base = LAYOUT[GPU][0][0]
            for reg, value in ((regs.REG_ID, regs.ID_MAGIC), (regs.REG_VERSION, regs.DEVICE_VERSION),
                               (regs.REG_VRAM_SIZE_LO, VRAM), (regs.REG_STATUS, regs.STATUS_ENABLED)):
                f.seek(base + reg)
                f.write(struct.pack("<I", value))
        with open(self.files[NVME], "wb") as f:
            f.truncate(LAYOUT[NVME][2][0] + CMB)
        self.type1 = FakeType1()
        self.iommufd = LiveIommufd()
        self.disk = mmap.mmap(-1, NAMESPACE)       # namespace 1's bytes
        self.nvme: StandInNvme | None = None       # the controller a session opened last
        self.attached: dict[int, int] = {}          # group number -> container fd
        self.refuse_map: set[int] = set()           # IOVAs whose MAP_DMA the "kernel" refuses
        self.refuse_nvme_open = False               # the NVMe controller fails its bring-up

    # -- what the process holds of this kernel ---------------------------------------------
    def _ours(self, path: str) -> bool:
        return path.startswith(str(self.root))

    def holdings(self) -> dict[str, list[str]]:
        """This process's fds onto the fake /dev/vfio nodes and device files, and its mmaps of
        device files (a BAR mapping holds the device, so the group, as an fd does)."""
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if self._ours(target):
                fds.append(os.path.relpath(target, self.root))
        with open("/proc/self/maps") as f:
            maps = [os.path.relpath(line.split(None, 5)[5].strip(), self.root)
                    for line in f if len(line.split(None, 5)) == 6 and self._ours(line.split(None, 5)[5].strip())]
        return {"fds": sorted(fds), "mmaps": sorted(maps)}

    def group_busy(self, number: int) -> list[str]:
        """What holds group ``number`` open: its node, a device fd or a device mmap of the group."""
        mine = {str(number)} | {os.path.basename(self.files[bdf]) for bdf, g in GROUPS.items() if g == number}
        held = self.holdings()
        return [p for p in held["fds"] + held["mmaps"] if os.path.basename(p) in mine]

    # -- the single-open rule of a group node ------------------------------------------------
    def _open(self, path, flags, *args):
        path = os.fspath(path)
        if os.path.dirname(path) == str(self.dev_vfio) and os.path.basename(path).isdigit():
            if self.group_busy(int(os.path.basename(path))):
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)
        return os.open(path, flags, *args)

    def install(self, monkeypatch) -> None:
        """The session opens its devices and context here instead of the real /dev/vfio."""
        opener = partial(VfioPciDevice.open, sysfs=self.sysfs, dev_vfio=str(self.dev_vfio), ioctl=self)
        monkeypatch.setattr(gpu_module, "VfioPciDevice", SimpleNamespace(open=opener))
        monkeypatch.setattr(session_module, "NvmeController",
                            SimpleNamespace(open=partial(StandInNvme.open, opener, self)))
        monkeypatch.setattr(p2p_module, "open_context", self.open_context)   # join_context's, which the session calls
        monkeypatch.setattr(group_module, "os", _OsWithGroupRule(self))

    def open_context(self, backend: str):
        """``p2p.open_context`` on this kernel: its container, or its /dev/iommu with an IOAS."""
        if backend == "iommufd":
            return IommufdContext.open(str(self.dev_iommu), ioctl=self)
        return Container.open(str(self.dev_vfio / "vfio"), ioctl=self)

    def dma_mapped(self) -> dict:
        """IOVA -> what the kernel maps there, in the container and the IOAS together."""
        return {**self.type1.mapped, **self.iommufd.mapped}

    # -- ioctls --------------------------------------------------------------------------------
    def _kind(self, fd: int) -> str:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))

    def _refuse_map(self, request, arg) -> None:
        if request == uapi.VFIO_IOMMU_MAP_DMA:
            iova = ffi.cast("struct vfio_iommu_type1_dma_map *", arg).iova
        elif request == uapi_iommufd.IOMMU_IOAS_MAP:
            iova = uapi_iommufd.ffi.cast("struct iommu_ioas_map *", arg).iova
        else:
            return
        if iova in self.refuse_map:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    def __call__(self, fd, request, arg=None):
        kind = self._kind(fd)
        self._refuse_map(request, arg)
        if kind == "vfio":
            if request == uapi.VFIO_SET_IOMMU:
                assert fd in self.attached.values(), "SET_IOMMU before a group is attached"
            return self.type1(fd, request, arg)
        if kind == self.dev_iommu.name:
            return self.iommufd(fd, request, arg)
        if kind.isdigit():
            return self._group(int(kind), request, arg)
        bdf = next(b for b, path in self.files.items() if path.name == kind)
        if request in IOMMUFD_DEVICE_IOCTLS:
            return self.iommufd(fd, request, arg)
        return self._device(bdf, request, arg)

    def _group(self, number, request, arg):
        if request == uapi.VFIO_GROUP_GET_STATUS:
            status = ffi.cast("struct vfio_group_status *", arg)
            status.flags = uapi.VFIO_GROUP_FLAGS_VIABLE | (uapi.VFIO_GROUP_FLAGS_CONTAINER_SET
                                                           if number in self.attached else 0)
            return 0
        if request == uapi.VFIO_GROUP_SET_CONTAINER:
            self.attached[number] = ffi.cast("int32_t *", arg)[0]
            return 0
        if request == uapi.VFIO_GROUP_UNSET_CONTAINER:
            self.attached.pop(number)
            return 0
        if request == uapi.VFIO_GROUP_GET_DEVICE_FD:
            bdf = arg.decode()
            assert GROUPS[bdf] == number
            return os.open(self.files[bdf], os.O_RDWR | os.O_CLOEXEC)
        raise OSError(errno.ENOTTY, "unexpected group ioctl")

    def _device(self, bdf, request, arg):
        if request == uapi.VFIO_DEVICE_GET_INFO:
            info = ffi.cast("struct vfio_device_info *", arg)
            info.flags = uapi.VFIO_DEVICE_FLAGS_PCI | uapi.VFIO_DEVICE_FLAGS_RESET
            info.num_regions, info.num_irqs = uapi.VFIO_PCI_NUM_REGIONS, uapi.VFIO_PCI_NUM_IRQS
            return 0
        if request == uapi.VFIO_DEVICE_GET_REGION_INFO:
            info = ffi.cast("struct vfio_region_info *", arg)
            offset, size = LAYOUT[bdf].get(info.index, (0, 0))
            info.flags = (uapi.VFIO_REGION_INFO_FLAG_READ | uapi.VFIO_REGION_INFO_FLAG_WRITE
                          | (uapi.VFIO_REGION_INFO_FLAG_MMAP if info.index in MMAPPABLE else 0)) if size else 0
            info.size, info.offset, info.cap_offset = size, offset, 0
            return 0
        if request == uapi.VFIO_DEVICE_GET_IRQ_INFO:
            info = ffi.cast("struct vfio_irq_info *", arg)
            info.flags = uapi.VFIO_IRQ_INFO_EVENTFD
            info.count = {uapi.VFIO_PCI_MSIX_IRQ_INDEX: regs.MSIX_VECTORS, uapi.VFIO_PCI_REQ_IRQ_INDEX: 1}.get(
                info.index, 0)
            return 0
        if request in (uapi.VFIO_DEVICE_SET_IRQS, uapi.VFIO_DEVICE_RESET):
            return 0
        raise OSError(errno.ENOTTY, "unexpected device ioctl")


class LiveIommufd(FakeIommufd):
    """``FakeIommufd`` with the kernel's view of a device fd's life: closing a cdev unbinds it
    from the iommufd (and detaches it), so only fds still open count as bound or attached; a
    device binds once at a time (EINVAL while an fd bound earlier is still open: vfio_df_open), and
    IOMMU_DESTROY of an IOAS fails (EBUSY) while a device bound to its iommufd is attached.
    (The IOVA bookkeeping, ``mapped``, is one for all: a test maps in one IOAS at a time.)"""

    def __init__(self):
        super().__init__()
        self.bound_files: dict[int, str] = {}     # bound fd -> the device file it was open on
        self.bound_to: dict[int, int] = {}        # bound fd -> the iommufd's fd

    @staticmethod
    def _target(fd: int) -> str | None:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None

    def _forget_closed(self) -> None:
        for fd, target in list(self.bound_files.items()):
            if self._target(fd) != target:        # closed (its number maybe reused since)
                del self.bound_files[fd]
                self.bound_to.pop(fd, None)
                self.bound.discard(fd)
                self.attached.pop(fd, None)

    def __call__(self, fd, request, arg=None):
        self._forget_closed()
        if request == uapi_iommufd.VFIO_DEVICE_BIND_IOMMUFD:
            target = self._target(fd)
            if target in self.bound_files.values():
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            self.bound_files[fd] = target
            self.bound_to[fd] = uapi_iommufd.ffi.cast("struct vfio_device_bind_iommufd *", arg).iommufd
        if request == uapi_iommufd.IOMMU_DESTROY:
            if any(self.bound_to.get(device) == fd for device in self.attached):
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
            self.destroyed.append(uapi_iommufd.ffi.cast("struct iommu_destroy *", arg).id)
            return 0
        return super().__call__(fd, request, arg)


class StandInGpuEngine:
    """The GPU's engine for NVME_IO descriptors (``GpuDriver.submit``/``wait`` while installed),
    doing what the lab GPU and QEMU's nvme do together: each request of the descriptor's list
    moves its blocks between namespace 1 of the NVMe stand-in and the IOVA it names (through
    the shared IOMMU context's mappings), its status becomes 0, and the queue's position is
    written back into the queue block.  Other descriptors are not modelled."""

    def __init__(self, kernel: FakeKernel):
        self.kernel = kernel
        self.done: dict[int, dict] = {}           # ring index -> its completion

    def install(self, monkeypatch) -> None:
        # functions, so that the driver's ``gpu.submit(...)`` passes the GpuDriver as ``gpu``
        monkeypatch.setattr(gpu_module.GpuDriver, "submit", lambda gpu, transfers: self.submit(gpu, transfers))
        monkeypatch.setattr(gpu_module.GpuDriver, "wait", lambda gpu, indices, timeout=10: self.wait(indices))

    def submit(self, gpu, transfers) -> list[int]:
        indices = []
        for t in transfers:
            assert t.op == regs.Op.NVME_IO, f"the engine stand-in runs NVME_IO only, not {t.op!r}"
            index = len(self.done)
            self.done[index] = {"bytes_done": self._nvme_io(gpu, t.src, t.dst, t.length), "duration_ns": 1}
            indices.append(index)
        return indices

    def wait(self, indices) -> list[dict]:
        return [self.done.pop(i) for i in indices]

    def _nvme_io(self, gpu, block_off: int, requests_off: int, count: int) -> int:
        queue = list(regs.NVME_QUEUE.unpack(gpu.vram_read(block_off, regs.NVME_QUEUE_SIZE)))
        entries, nsid, sq_tail, phase, lba_shift = queue[4], queue[6], queue[7], queue[9], queue[10]
        moved = 0
        for i in range(count):
            at = requests_off + i * regs.NVME_REQUEST_SIZE
            opcode, flags, _status, length, slba, iova, r, lat = regs.NVME_REQUEST.unpack(
                gpu.vram_read(at, regs.NVME_REQUEST_SIZE))
            self.kernel.nvme._io(nsid, slba << lba_shift, iova, length, read=opcode == 0x02)
            gpu.vram_write(at, regs.NVME_REQUEST.pack(opcode, flags, 0, length, slba, iova, r, lat))
            moved += length
        tail = sq_tail + count
        queue[7], queue[8], queue[9] = tail % entries, tail % entries, phase ^ (tail // entries & 1)
        gpu.vram_write(block_off, regs.NVME_QUEUE.pack(*queue))
        return moved


class _OsWithGroupRule:
    """``os`` for the group module: ``open`` of a group node follows the kernel's single-open rule."""

    def __init__(self, kernel: FakeKernel):
        self.open = kernel._open

    def __getattr__(self, name):
        return getattr(os, name)


class StandInNvme:
    """The NVMe controller calls a ``StorageSession`` and a ``GpuQueue`` make, over a real
    ``VfioPciDevice`` (so its group, device fd and BAR0 mmap are real).  I/O copies between the
    namespace's bytes and whatever the IOVA is mapped to in the shared context, as the
    controller's DMA through the IOMMU would; after ``shutdown`` its queues are gone (as the real
    driver's are)."""

    def __init__(self, device: VfioPciDevice, kernel: FakeKernel, *, spare_queues: int = 0, **_):
        self.device, self.kernel, self.bdf = device, kernel, device.bdf
        self.bar0 = device.bar(0)
        self.bar0.read32(0)                      # the BAR mmapped, as the real driver's is
        self.cap = Cap.decode(NVME_CAP)
        self.failed = None
        self.io_queues, self.spare_queues = 1, spare_queues
        self.queues = {0: "admin", 1: "io"}
        self.namespaces = {1: NamespaceInfo(1, NAMESPACE // BLOCK, NAMESPACE // BLOCK, BLOCK)}
        self.max_transfer = 512 << 10
        self.disk = kernel.disk                  # the namespace outlives a session, as a real one does
        kernel.nvme = self
        self.cmb = self.cmb_base = None
        self.buffers: list = []                  # dma_buffer()'s mappings of guest RAM
        self.created: list[int] = []
        self.refuse_create = False

    @classmethod
    def open(cls, opener, kernel, bdf, *, container=None, ioas=None, **kwargs) -> "StandInNvme":
        if kernel.refuse_nvme_open:
            raise NvmeError(f"{bdf}: the controller does not come ready", "the test said so")
        device = opener(bdf, container=container, ioas=ioas)
        try:
            return cls(device, kernel, **kwargs)
        except BaseException:
            device.close()
            raise

    def namespace(self, nsid: int) -> NamespaceInfo:
        if nsid not in self.namespaces:
            raise NvmeError(f"{self.bdf} has no active namespace {nsid}", "use 1")
        return self.namespaces[nsid]

    def check_range(self, nsid: int, offset: int, length: int) -> NamespaceInfo:
        ns = self.namespace(nsid)
        if length <= 0 or offset % BLOCK or length % BLOCK or offset + length > ns.size:
            raise NvmeError(f"[{offset:#x}, {offset + length:#x}) is not whole blocks inside namespace {nsid}",
                            f"use multiples of {BLOCK} below {ns.size:#x}")
        return ns

    def _memory(self, iova: int, length: int) -> memoryview:
        for m in self.device.mappings:
            if m.iova <= iova and iova + length <= m.iova + m.size:
                return memoryview(m.buffer).cast("B")[iova - m.iova:iova - m.iova + length]
        raise NvmeError(f"DMA to unmapped IOVA {iova:#x}", "map it")

    def _io(self, nsid, offset, iova, length, read: bool) -> int:
        self.queues[1]                           # as the real driver: KeyError once shut down
        self.check_range(nsid, offset, length)
        with self._memory(iova, length) as memory:
            if read:
                memory[:] = self.disk[offset:offset + length]
            else:
                self.disk[offset:offset + length] = memory
        return -(-length // self.max_transfer)

    def read(self, nsid, offset, iova, length, **_) -> int:
        return self._io(nsid, offset, iova, length, True)

    def write(self, nsid, offset, iova, length, **_) -> int:
        return self._io(nsid, offset, iova, length, False)

    def dma_buffer(self, size: int) -> SimpleNamespace:
        """``size`` bytes of guest RAM mapped for the controller (compat mode's bounce buffer),
        released by ``close`` as the real driver's are."""
        mem = mmap.mmap(-1, size)
        mapping = self.device.map_dma(mem, DATA_IOVA + sum(b.size for b in self.buffers))
        buf = SimpleNamespace(mem=mem, mapping=mapping, iova=mapping.iova, size=size)
        self.buffers.append(buf)
        return buf

    def enable_cmb(self, base: int) -> CmbInfo:
        """The CMB on at controller address ``base``: all of BAR2 (cmb mode)."""
        self.cmb, self.cmb_base = CmbInfo.decode(2, CMBSZ), base
        return self.cmb

    def create_io_queue(self, qid, queue, **_):
        if self.refuse_create:
            raise NvmeError(f"create CQ {qid} failed: Invalid Queue Identifier", "the test said so")
        # QEMU's nvme (nvme_create_cq/sq): a physically contiguous queue starts on a page
        for what, iova in (("CQ", queue.cq_iova), ("SQ", queue.sq_iova)):
            if iova % 4096:
                raise NvmeError(f"{self.bdf}: create {what} {qid} failed: PRP Offset Invalid (SCT 0x0 SC 0x13)",
                                f"queue at IOVA {iova:#x}: start it on a 4 KiB page")
        self.queues[qid] = queue
        self.created.append(qid)
        return queue

    def delete_io_queue(self, qid) -> None:
        self.queues.pop(qid, None)

    def shutdown(self) -> None:
        self.failed = self.failed or "was shut down"
        self.queues = {}

    def close(self) -> None:
        try:
            self.shutdown()
            for buf in self.buffers:
                buf.mapping.close()
            self.buffers.clear()
        finally:
            self.device.close()
