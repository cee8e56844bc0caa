"""In the guest: peer-to-peer DMA -- one GPU's engine writes straight into another GPU's VRAM.

    with PeerPair(pick_bdfs(None, None), "type1") as pair:
        copy = pair.copy(0, 1, 1 << 20, seed=7)

All GPUs join ONE IOMMU context: a type1 container (``VFIO_IOMMU_MAP_DMA`` of
each GPU's BAR2 mmap) or one iommufd IOAS (a BAR mmap is VM_PFNMAP, which
``IOMMU_IOAS_MAP`` cannot pin: the BAR goes in as a VFIO dma-buf,
``VFIO_DEVICE_FEATURE_DMA_BUF`` + ``IOMMU_IOAS_MAP_FILE``, where the kernel has
CONFIG_VFIO_PCI_DMABUF).  So each GPU reaches the others' VRAM at an IOVA.
``--from`` GPU fills its VRAM, its engine copies VRAM -> IOVA(peer BAR2), and
the bytes are checked through both BAR mmaps; then the other way round.

Without ``--to``, A (``--from``, default: the first GPU that shares a PCIe switch
with another) is paired with every peer the VM has: on the ``p2p`` topology B
behind the same switch and C on a root port of its own, so both the "behind a
switch" and the "through the root complex" path are taken; each copy says
which (read from the PCI hierarchy in sysfs).

The command and the bench's guest half are ``vfio_cxl.guest.cmd.p2p``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import time

from ..devices.gpu import regs
from ..devices.gpu.regs import Op
from .drivers.gpu import GpuDriver, GpuError, Transfer
from .vfio import Container, DmaMapping, IommufdContext, find_pci_devices, iommu_group
from .vfio.bind import modprobe
from .vfio.errors import DmaMapError, describe_errno
from .vfio.iommufd import DmaBufError, export_dma_buf

__all__ = ["PeerPair", "pick_bdfs", "map_peer_bar", "open_context", "join_context", "open_container", "route", "P2pError",
           "CONTROL_IOVAS", "PEER_BAR_IOVA", "PEER_BAR_STRIDE", "BACKENDS"]

# IOVA layout in the shared container (docs/gpu-device.md, "P2P"): each GPU's
# control area at its own IOVA, the peer BARs high above guest-RAM buffers.
CONTROL_IOVAS = (0x0010_0000, 0x0020_0000, 0x0030_0000, 0x0040_0000)
PEER_BAR_IOVA = 0x10_0000_0000           # BAR2 of GPU i at PEER_BAR_IOVA + i * PEER_BAR_STRIDE
PEER_BAR_STRIDE = 0x1_0000_0000
BACKENDS = ("type1", "iommufd")
SYS_PCI = "/sys/bus/pci/devices"
PAGE = 4096


class P2pError(GpuError):
    """Peer-to-peer set-up or verification failed."""


def open_container() -> Container:
    """The shared container; vfio-pci loaded first (it brings /dev/vfio/vfio)."""
    if not os.path.exists("/dev/vfio/vfio"):
        modprobe("vfio-pci")
    return Container.open()


def open_context(backend: str):
    """One IOMMU context for all the GPUs: a type1 container or an iommufd IOAS."""
    if backend not in BACKENDS:
        raise P2pError(f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    if backend == "type1":
        return open_container()
    if not os.path.exists("/dev/vfio/vfio"):
        modprobe("vfio-pci")      # vfio-pci first: a GPU gets its cdev when it binds
    return IommufdContext.open()


def join_context(stack: contextlib.ExitStack, backend: str) -> tuple[object, dict]:
    """A new shared context (``open_context``), closed by ``stack``, and the keyword argument
    a device's ``open`` takes to join it (``container=`` on type1, ``ioas=`` on iommufd)."""
    context = open_context(backend)
    stack.callback(context.close)
    return context, ({"container": context} if backend == "type1" else {"ioas": context})


def route(a: str, b: str, sys_pci: str = SYS_PCI) -> dict:
    """How DMA from ``a`` reaches ``b`` in the PCI hierarchy (sysfs device paths):
    through a bridge below the root complex (a PCIe switch) or through the root complex."""
    paths = [os.path.realpath(os.path.join(sys_pci, bdf)).split(os.sep) for bdf in (a, b)]
    common = os.sep.join(os.path.commonprefix(paths)).rstrip(os.sep)
    last = os.path.basename(common)
    if last.startswith("pci"):        # pci0000:00: the host bridge, i.e. the root complex
        return {"kind": "root complex", "via": last,
                "path": f"through the root complex ({last}): each GPU on its own root port"}
    return {"kind": "switch", "via": last,
            "path": f"behind the PCIe switch at {last}: not through the root complex"}


def map_peer_bar(initiator: GpuDriver, peer: GpuDriver, iova: int, size: int | None = None,
                 region: int = regs.BAR_VRAM, notes: dict | None = None, offset: int = 0) -> DmaMapping:
    """DMA-map ``peer``'s BAR2 (its VRAM) at ``iova`` so ``initiator`` can reach it: ``size``
    bytes from ``offset`` (a whole page; default: the whole BAR from 0).  Both
    must share one IOMMU context.  type1: ``VFIO_IOMMU_MAP_DMA`` of the BAR's VFIO mmap.
    iommufd: ``IOMMU_IOAS_MAP`` of that mmap first; when the kernel refuses (it pins
    pages; a BAR mmap is VM_PFNMAP), the BAR as a dma-buf (``VFIO_DEVICE_FEATURE_DMA_BUF``)
    mapped with ``IOMMU_IOAS_MAP_FILE``.  What the kernel said goes into ``notes``.

    Clear errors, nothing left mapped: a peer in another context, a BAR that is not
    mmappable, a range beyond the BAR, a kernel that refuses every route."""
    notes = {} if notes is None else notes
    shared = initiator.device.iommu
    if shared is None or shared is not peer.device.iommu:
        raise P2pError(f"{peer.device.bdf} is not in the same VFIO container (or iommufd IOAS) as "
                       f"{initiator.device.bdf}: a mapping made in the peer's context is invisible to the "
                       "initiator's IOMMU context",
                       "open both GPUs with GpuDriver.open(bdf, container=shared) (or ioas=shared)")
    bar = peer.device.region(region)   # VFIO region index: BARn is n
    if offset % PAGE or not 0 <= offset < bar.size:
        raise P2pError(f"offset {offset:#x} into {peer.device.bdf}'s {bar.name} ({bar.size:#x} bytes)",
                       f"map from a multiple of {PAGE} inside the BAR")
    size = bar.size - offset if size is None else size
    if not 0 < size <= bar.size - offset:
        raise P2pError(f"size {size:#x} at offset {offset:#x} is beyond {peer.device.bdf}'s {bar.name} "
                       f"({bar.size:#x} bytes)", f"map at most {bar.size - offset:#x} bytes from there")
    mm = bar.mmap_object()   # RegionError if the BAR cannot be mmapped
    view = memoryview(mm)[offset:offset + size]
    what = f"map BAR{region} of {peer.device.bdf} at {iova:#x}"
    ioctl = "VFIO_IOMMU_MAP_DMA" if isinstance(shared, Container) else "IOMMU_IOAS_MAP"
    t0 = time.perf_counter()
    try:
        mapping = initiator.device.map_dma(view, iova)
        notes[what] = (f"{ioctl} of the BAR mmap accepted: {size >> 10} KiB in "
                       f"{(time.perf_counter() - t0) * 1e3:.0f} ms")
        return mapping
    except DmaMapError as err:
        view.release()
        if not isinstance(shared, IommufdContext) or err.errno is None:
            raise
        why = ": iommufd pins pages, and a BAR mmap (VM_PFNMAP) has none" if err.errno == errno.EFAULT else ""
        refused = f"{ioctl} of the BAR mmap refused ({describe_errno(err.errno)}{why})"
        notes[what] = refused
    except BaseException:
        view.release()
        raise
    return _map_bar_dma_buf(shared, peer, region, iova, size, notes, what, refused, offset)


def _map_bar_dma_buf(ctx: IommufdContext, peer: GpuDriver, region: int, iova: int, size: int,
                     notes: dict, what: str, refused: str, offset: int = 0) -> DmaMapping:
    """The iommufd route for a BAR: export it as a dma-buf, map that with IOMMU_IOAS_MAP_FILE."""
    fix = ("use the type1 backend (--backend type1: VFIO_IOMMU_MAP_DMA maps a BAR mmap), or a kernel "
           "with CONFIG_VFIO_PCI_DMABUF=y")

    def refusal(step: str) -> P2pError:
        notes[what] = f"{refused}; {step}"
        error = P2pError(f"iommufd cannot map {peer.device.bdf}'s BAR{region}: {notes[what]}", fix)
        error.kernel = dict(notes)
        return error

    t0 = time.perf_counter()
    try:
        fd = export_dma_buf(peer.device.device.fd, peer.device.bdf, region, offset, size)
    except DmaBufError as err:
        raise refusal(f"VFIO_DEVICE_FEATURE_DMA_BUF refused ({err.what})") from None
    try:
        mapping = ctx.map_file(fd, 0, size, iova)
    except DmaMapError as err:
        raise refusal(f"dma-buf exported, IOMMU_IOAS_MAP_FILE refused ({err.what})") from None
    finally:
        os.close(fd)     # the IOAS holds its own reference on the dma-buf
    notes[what] = (f"{refused}; VFIO_DEVICE_FEATURE_DMA_BUF + IOMMU_IOAS_MAP_FILE accepted: "
                   f"{size >> 10} KiB in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    return mapping


class PeerPair:
    """Two or more GPUs in one IOMMU context (``backend``: a type1 container or an iommufd
    IOAS), each BAR2 DMA-mapped for all the others.  Context manager.

    ``groups``: the IOMMU group of each GPU; ``kernel``: what the kernel accepted (or,
    on a P2pError, refused: ``err.kernel``) for each BAR mapping."""

    def __init__(self, bdfs: tuple[str, ...], backend: str = "type1"):
        if not 2 <= len(bdfs) <= len(CONTROL_IOVAS):
            raise P2pError(f"{len(bdfs)} GPUs given", f"give 2 to {len(CONTROL_IOVAS)}")
        self.bdfs = tuple(bdfs)
        self.backend = backend
        self.groups = {bdf: iommu_group(bdf) for bdf in bdfs}
        self.kernel: dict[str, str] = {}
        self._stack = contextlib.ExitStack()
        with self._stack as stack:
            self.context = open_context(backend)
            self.container = self.context if backend == "type1" else None
            stack.callback(self.context.close)   # iommufd: unmaps, destroys the IOAS once the devices are gone
            shared = {"container": self.context} if backend == "type1" else {"ioas": self.context}
            self.gpus = []
            for bdf, control in zip(bdfs, CONTROL_IOVAS):
                gpu = GpuDriver.open(bdf, control_iova=control, **shared)
                stack.callback(gpu.close)
                self.gpus.append(gpu)
            # type1: the container's mappings go before the devices leave it
            stack.callback(self.context.unmap_all)
            self.bar_iovas = []
            for i, gpu in enumerate(self.gpus):
                iova = PEER_BAR_IOVA + i * PEER_BAR_STRIDE
                try:
                    map_peer_bar(self.gpus[i - 1], gpu, iova, notes=self.kernel)
                except P2pError as err:
                    err.groups = self.groups
                    raise
                self.bar_iovas.append(iova)
            self._stack = stack.pop_all()

    def copy(self, src: int, dst: int, length: int, *, seed: int, fast: bool = True,
             pull: bool = False) -> dict:
        """GPU ``src`` fills VRAM[0:length] with PRNG(seed), its engine copies it into GPU
        ``dst``'s VRAM through the IOVA; every byte checked through both BAR mmaps.
        ``pull``: the other way -- GPU ``dst``'s VRAM holds the bytes and GPU ``src``'s
        engine reads them through the IOVA into its own VRAM (HOST_TO_VRAM; on the
        message path these are DMA_READ messages that QEMU answers)."""
        a, b = self.gpus[src], self.gpus[dst]
        if src == dst:
            raise P2pError(f"a copy from {a.device.bdf} to itself", "name two different GPUs")
        if not 0 < length <= min(a.vram_size, b.vram_size):
            raise P2pError(f"size {length} is beyond the VRAM/BAR2 ({min(a.vram_size, b.vram_size)} bytes)",
                           "use a smaller --size")
        a.bar0.write32(regs.REG_P2P_CONTROL, 0 if fast else regs.P2P_FAST_DISABLE)
        holder, receiver = (b, a) if pull else (a, b)
        holder.run([Transfer(Op.FILL_PRNG, src=seed, dst=0, length=length)])
        receiver.vram.view(0, length)[:] = bytes(length)   # stale bytes cannot pass the check
        kib0 = a.bar0.read32(regs.REG_P2P_PEER_KIB)
        t0 = time.perf_counter()
        if pull:
            op = Transfer(Op.HOST_TO_VRAM, src=self.bar_iovas[dst], dst=0, length=length)
        else:
            op = Transfer(Op.VRAM_TO_HOST, src=0, dst=self.bar_iovas[dst], length=length)
        (done,) = a.run([op], timeout=120)
        seconds = time.perf_counter() - t0
        peer_kib = (a.bar0.read32(regs.REG_P2P_PEER_KIB) - kib0) & 0xFFFFFFFF
        a.bar0.write32(regs.REG_P2P_CONTROL, 0)
        want = hashlib.sha256(regs.prng_bytes(seed, length)).hexdigest()
        got_a = hashlib.sha256(a.vram.view(0, length)).hexdigest()
        got_b = hashlib.sha256(b.vram.view(0, length)).hexdigest()
        return {"from": holder.device.bdf, "to": receiver.device.bdf, "initiator": a.device.bdf,
                "size": length, "bytes": done["bytes_done"],
                "match": want == got_a == got_b, "sha256": got_b,
                "route": route(a.device.bdf, b.device.bdf), "backend": self.backend,
                "path": "peer fast path" if peer_kib * 1024 >= length - 4096 else "message path",
                "peer_kib": peer_kib, "seconds": seconds, "mb_per_s": length / seconds / 1e6,
                # the engine's own time for the descriptor (completion record), without the
                # doorbell and the interrupt delivery through TCG
                "device_mb_per_s": length / max(done["duration_ns"], 1) * 1e3}

    def stream(self, src: int, dst: int, length: int, count: int, *, seed: int) -> dict:
        """Bandwidth as GPU benchmarks measure it (CUDA's p2pBandwidthLatencyTest queues its
        copies and waits once): GPU ``src`` copies VRAM[0:length] into ``count`` consecutive
        slots of GPU ``dst``'s VRAM, ``count`` descriptors in one submission with the
        interrupt on the last; timed from the doorbell to that MSI-X, every slot checked."""
        a, b = self.gpus[src], self.gpus[dst]
        if not 0 < length * count <= b.vram_size or length > a.vram_size:
            raise P2pError(f"{count} x {length} bytes do not fit GPU {b.device.bdf}'s VRAM "
                           f"({b.vram_size} bytes)", "pass a smaller length or count")
        a.bar0.write32(regs.REG_P2P_CONTROL, 0)
        a.run([Transfer(Op.FILL_PRNG, src=seed, dst=0, length=length)])
        b.vram.view(0, length * count)[:] = bytes(length * count)   # stale bytes cannot pass the check
        kib0 = a.bar0.read32(regs.REG_P2P_PEER_KIB)
        t0 = time.perf_counter()
        done = a.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=self.bar_iovas[dst] + k * length, length=length)
                      for k in range(count)], timeout=120)
        seconds = time.perf_counter() - t0
        peer_kib = (a.bar0.read32(regs.REG_P2P_PEER_KIB) - kib0) & 0xFFFFFFFF
        want = hashlib.sha256(regs.prng_bytes(seed, length)).hexdigest()
        match = all(hashlib.sha256(b.vram.view(k * length, length)).hexdigest() == want for k in range(count))
        total = length * count
        return {"from": a.device.bdf, "to": b.device.bdf, "size": length, "count": count, "match": match,
                "route": route(a.device.bdf, b.device.bdf), "backend": self.backend,
                "path": "peer fast path" if peer_kib * 1024 >= total - 4096 else "message path",
                "seconds": seconds, "mb_per_s": total / seconds / 1e6,
                "device_mb_per_s": total / max(sum(d["duration_ns"] for d in done), 1) * 1e3}

    def close(self) -> None:
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.close()

    def __enter__(self) -> "PeerPair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pick_bdfs(from_bdf: str | None, to_bdf: str | None) -> tuple[str, ...]:
    """(A, peers...): ``--from`` (default: the first GPU that shares a PCIe switch with
    another, else the first) and ``--to``, or without it every other GPU, the one behind
    A's switch first."""
    found = find_pci_devices(regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID)
    if from_bdf is None:
        from_bdf = next((a for a in found if any(route(a, b)["kind"] == "switch" for b in found if b != a)),
                        found[0] if found else None)
    peers = [to_bdf] if to_bdf else sorted((b for b in found if b != from_bdf),
                                           key=lambda b: route(from_bdf, b)["kind"] != "switch")
    if not from_bdf or not peers:
        raise P2pError(f"peer-to-peer DMA needs two GPUs; this VM has {len(found)} ({', '.join(found) or 'none'})",
                       "boot the p2p topology: vfio-cxl vm up p2p")
    if from_bdf in peers:
        raise P2pError(f"--from and --to are both {from_bdf}", "name two different GPUs")
    return (from_bdf, *peers[:len(CONTROL_IOVAS) - 1])
