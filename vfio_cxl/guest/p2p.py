"""In the guest: peer-to-peer DMA -- one GPU's engine writes straight into another GPU's VRAM.

    python3 -m vfio_cxl.guest.p2p [--from BDF] [--to BDF] [--size N] [--json]
                                  [--backend type1|iommufd] [--bench] [--path auto|message]

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

``run()`` and ``main()`` are the entry points a guest ``vfio-cxl gpu p2p``
command hooks into.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import sys
import time

from ..devices.gpu import regs
from ..devices.gpu.regs import Op
from .gpu_driver import GpuDriver, GpuError, Transfer
from .vfio import Container, DmaMapping, IommufdContext, find_pci_devices, iommu_group
from .vfio import uapi
from .vfio.bind import modprobe
from .vfio.errors import DmaMapError, VfioError, describe_errno
from .vfio.iommufd import DmaBufError, export_dma_buf

# IOVA layout in the shared container (docs/gpu-device.md, "P2P"): each GPU's
# control area at its own IOVA, the peer BARs high above guest-RAM buffers.
CONTROL_IOVAS = (0x0010_0000, 0x0020_0000, 0x0030_0000, 0x0040_0000)
PEER_BAR_IOVA = 0x10_0000_0000           # BAR2 of GPU i at PEER_BAR_IOVA + i * PEER_BAR_STRIDE
PEER_BAR_STRIDE = 0x1_0000_0000
BOUNCE_IOVA = 0x0800_0000                 # guest RAM (the bounce path in the bench)
STREAM_COPIES = 4                         # descriptors per submission in the streamed bench row
SEEDS = (0xA11CE, 0xB0B)
BACKENDS = ("type1", "iommufd")
SYS_PCI = "/sys/bus/pci/devices"


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
                 region: int = regs.BAR_VRAM, notes: dict | None = None) -> DmaMapping:
    """DMA-map ``peer``'s BAR2 (its VRAM) at ``iova`` so ``initiator`` can reach it.  Both
    must share one IOMMU context.  type1: ``VFIO_IOMMU_MAP_DMA`` of the BAR's VFIO mmap.
    iommufd: ``IOMMU_IOAS_MAP`` of that mmap first; when the kernel refuses (it pins
    pages; a BAR mmap is VM_PFNMAP), the BAR as a dma-buf (``VFIO_DEVICE_FEATURE_DMA_BUF``)
    mapped with ``IOMMU_IOAS_MAP_FILE``.  What the kernel said goes into ``notes``.

    Clear errors, nothing left mapped: a peer in another context, a BAR that is not
    mmappable, a size beyond the BAR, a kernel that refuses every route."""
    notes = {} if notes is None else notes
    shared = initiator.device.iommu
    if shared is None or shared is not peer.device.iommu:
        raise P2pError(f"{peer.device.bdf} is not in the same VFIO container (or iommufd IOAS) as "
                       f"{initiator.device.bdf}: a mapping made in the peer's context is invisible to the "
                       "initiator's IOMMU context",
                       "open both GPUs with GpuDriver.open(bdf, container=shared) (or ioas=shared)")
    bar = peer.device.region(region)   # VFIO region index: BARn is n
    size = bar.size if size is None else size
    if not 0 < size <= bar.size:
        raise P2pError(f"size {size:#x} is beyond {peer.device.bdf}'s {bar.name} ({bar.size:#x} bytes)",
                       f"map at most {bar.size:#x} bytes")
    mm = bar.mmap_object()   # RegionError if the BAR cannot be mmapped
    view = memoryview(mm)[:size]
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
    return _map_bar_dma_buf(shared, peer, region, iova, size, notes, what, refused)


def _map_bar_dma_buf(ctx: IommufdContext, peer: GpuDriver, region: int, iova: int, size: int,
                     notes: dict, what: str, refused: str) -> DmaMapping:
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
        fd = export_dma_buf(peer.device.device.fd, peer.device.bdf, region, 0, size)
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


def run(from_bdf: str | None = None, to_bdf: str | None = None, size: int = 1 << 20,
        both_ways: bool = True, fast: bool = True, backend: str = "type1",
        pull: bool = False) -> dict:
    """A -> each peer (and back), every byte checked; the IOMMU groups, the route each copy
    took, and what the kernel did.  ``pull``: A's engine reads the peer's VRAM instead
    (and the peer's reads A's)."""
    bdfs = pick_bdfs(from_bdf, to_bdf)
    with PeerPair(bdfs, backend) as pair:
        copies = []
        for peer in range(1, len(bdfs)):
            copies.append(pair.copy(0, peer, size, seed=SEEDS[0] + peer, fast=fast, pull=pull))
            if both_ways:
                copies.append(pair.copy(peer, 0, size, seed=SEEDS[1] + peer, fast=fast, pull=pull))
        return {"backend": backend, "groups": pair.groups, "kernel": pair.kernel, "copies": copies,
                "match": all(c["match"] for c in copies)}


def bench(from_bdf: str | None = None, to_bdf: str | None = None, size: int = 16 << 20,
          runs: int = 3, backend: str = "type1") -> dict:
    """Every guest-side figure of `scripts/bench p2p`, in one session (best of ``runs``):
    the fast path to each peer (``p2p_fast`` behind a switch when there is one,
    ``p2p_fast_root_complex`` through the root complex), the message path, the bounce
    through guest RAM and a CPU copy between the two BAR mmaps (to the first peer)."""
    import mmap
    bdfs = pick_bdfs(from_bdf, to_bdf)
    out = {}
    best = lambda runs: max(runs, key=lambda r: r["mb_per_s"])   # noqa: E731
    with PeerPair(bdfs, backend) as pair:
        for peer in range(1, len(bdfs)):
            pair.copy(0, peer, size, seed=1)              # warm-up: proofs made here
            figure = best([pair.copy(0, peer, size, seed=2 + i) for i in range(runs)])
            key = "p2p_fast" if peer == 1 else f"p2p_fast_{figure['route']['kind'].replace(' ', '_')}"
            out[key if key not in out else f"{key}_{peer}"] = figure
        count = max(1, min(STREAM_COPIES, pair.gpus[1].vram_size // size))
        out["p2p_stream"] = best([pair.stream(0, 1, size, count, seed=20 + i) for i in range(runs)])
        out["p2p_message"] = best([pair.copy(0, 1, size, seed=9 + i, fast=False) for i in range(runs)])
        a, b = pair.gpus[:2]
        bounce = mmap.mmap(-1, size)
        with a.map(bounce, BOUNCE_IOVA):
            a.run([Transfer(Op.FILL_PRNG, src=4, dst=0, length=size)])
            seconds = device_ns = float("inf")
            for _ in range(runs):
                b.vram.view(0, size)[:] = bytes(size)
                t0 = time.perf_counter()
                (d1,) = a.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=BOUNCE_IOVA, length=size)], timeout=120)
                (d2,) = b.run([Transfer(Op.HOST_TO_VRAM, src=BOUNCE_IOVA, dst=0, length=size)], timeout=120)
                seconds = min(seconds, time.perf_counter() - t0)
                device_ns = min(device_ns, d1["duration_ns"] + d2["duration_ns"])
        ok = bytes(b.vram.view(0, size)) == regs.prng_bytes(4, size)
        out["bounce"] = {"seconds": seconds, "mb_per_s": size / seconds / 1e6, "match": ok,
                         "device_mb_per_s": size / max(device_ns, 1) * 1e3,
                         "route": route(a.device.bdf, b.device.bdf),
                         "path": "two DMAs through guest RAM (direct fd path both ways)"}
        bounce.close()
        va, vb = a.vram.view(0, size), b.vram.view(0, size)
        seconds = float("inf")
        for _ in range(runs):
            t0 = time.perf_counter()
            vb[:] = va
            seconds = min(seconds, time.perf_counter() - t0)
        out["cpu_copy"] = {"seconds": seconds, "mb_per_s": size / seconds / 1e6, "match": vb == va,
                           "route": route(a.device.bdf, b.device.bdf),
                           "path": "guest CPU memcpy between the two BAR2 mmaps"}
        va.release(), vb.release()
        out["groups"], out["kernel"] = pair.groups, pair.kernel
    out["size"], out["backend"] = size, backend
    return out


def isolation(from_bdf: str | None = None, to_bdf: str | None = None) -> dict:
    """A's DMA to B's BAR IOVA faults (DMA_UNMAPPED on A's error vector) while the
    guest has not mapped it -- before ever, and after an unmap that follows a
    proven fast-path copy -- and B's VRAM stays as it was."""
    from .gpu_driver import GpuDmaError
    bdfs = pick_bdfs(from_bdf, to_bdf)[:2]
    canary = b"B's VRAM canary " * 256
    out = {}
    with open_container() as container:
        gpus = [GpuDriver.open(bdf, container=container, control_iova=c) for bdf, c in zip(bdfs, CONTROL_IOVAS)]
        try:
            a, b = gpus
            iova = PEER_BAR_IOVA + PEER_BAR_STRIDE
            a.run([Transfer(Op.FILL_PRNG, src=7, dst=0, length=1 << 20)])

            def attempt(name):
                b.vram_write(0, canary)
                try:
                    a.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=iova, length=1 << 20, cookie=0xBAD)])
                    fault = None
                except GpuDmaError as err:
                    fault = {"status": regs.Status(err.status).name, "address": err.address,
                             "cookie": err.cookie, "index": err.index}
                out[name] = {"fault": fault, "b_unchanged": b.vram_read(0, len(canary)) == canary}

            attempt("never_mapped")
            with map_peer_bar(a, b, iova):
                kib0 = a.bar0.read32(regs.REG_P2P_PEER_KIB)
                a.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=iova, length=1 << 20)])
                out["mapped_copy"] = {
                    "match": b.vram_read(0, 1 << 20) == regs.prng_bytes(7, 1 << 20),
                    "peer_kib": (a.bar0.read32(regs.REG_P2P_PEER_KIB) - kib0) & 0xFFFFFFFF}
            attempt("after_unmap")
            out["recovered"] = bool(a.bar0.read32(regs.REG_STATUS) & regs.STATUS_ENABLED)
        finally:
            for gpu in reversed(gpus):
                gpu.close()
    return out


def bad_inputs(from_bdf: str | None = None, to_bdf: str | None = None) -> dict:
    """Each bad request gives a clear error and leaves no mapping behind."""
    bdfs = pick_bdfs(from_bdf, to_bdf)[:2]
    out = {}

    def expect(name, container, fn):
        before = len(container.mappings)
        try:
            fn()
            out[name] = {"error": None}
        except VfioError as err:
            out[name] = {"error": str(err), "type": type(err).__name__}
        out[name]["mappings_left"] = len(container.mappings) - before

    with PeerPair(bdfs) as pair:
        a, b = pair.gpus
        # the guest's vfio-pci lets every page-sized BAR be mmapped (BAR0 too); the
        # config region is never mmappable
        expect("bar_not_mmappable", pair.container,
               lambda: map_peer_bar(a, b, 0x30_0000_0000, region=uapi.VFIO_PCI_CONFIG_REGION_INDEX))
        expect("size_beyond_bar", pair.container,
               lambda: map_peer_bar(a, b, 0x30_0000_0000, size=b.vram_size + 4096))
    a = GpuDriver.open(bdfs[0])           # each in its own container
    try:
        b = GpuDriver.open(bdfs[1])
        try:
            expect("peer_in_other_container", a.device.container,
                   lambda: map_peer_bar(a, b, PEER_BAR_IOVA))
            out["peer_in_other_container"]["peer_mappings_left"] = len(b.device.container.mappings) - 1
        finally:
            b.close()
    finally:
        a.close()
    return out


def kernel_config(names: tuple[str, ...]) -> dict[str, str | None]:
    """``CONFIG_X`` -> y/m/None from /proc/config.gz (the lab kernel) or /boot/config-<release>."""
    import gzip
    release = os.uname().release
    text = ""
    for path, opener in (("/proc/config.gz", gzip.open), (f"/boot/config-{release}", open)):
        if os.path.exists(path):
            with opener(path, "rt") as f:
                text = f.read()
            break
    found = dict(line.split("=", 1) for line in text.splitlines() if line.startswith("CONFIG_") and "=" in line)
    return {name: found.get(name) for name in names}


def iommufd_report(from_bdf: str | None = None, to_bdf: str | None = None, size: int = 1 << 20) -> dict:
    """P2P on iommufd: what the kernel allowed or refused for each GPU's BAR2, the copies
    when it allowed them, and proof nothing was left open (type1 P2P works afterwards:
    a device still open through its cdev could not be opened through its group)."""
    config = kernel_config(("CONFIG_IOMMUFD", "CONFIG_VFIO_DEVICE_CDEV", "CONFIG_PCI_P2PDMA",
                            "CONFIG_DMA_SHARED_BUFFER", "CONFIG_VFIO_PCI_DMABUF"))
    out = {"release": os.uname().release, "config": config, "refused": None}
    try:
        out.update(run(from_bdf, to_bdf, size, both_ways=False, backend="iommufd"))
    except P2pError as err:
        out.update({"refused": str(err), "kernel": getattr(err, "kernel", {}),
                    "groups": getattr(err, "groups", {}), "copies": [], "match": False})
    after = run(from_bdf, to_bdf, 64 << 10, both_ways=False, backend="type1")
    out["type1_after"] = {"match": after["match"], "copies": len(after["copies"])}
    return out


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.p2p", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="from_bdf", metavar="BDF",
                        help="initiating GPU (default: the first that shares a PCIe switch with another)")
    parser.add_argument("--to", dest="to_bdf", metavar="BDF", help="peer GPU (default: every other GPU)")
    parser.add_argument("--size", type=_size, default=1 << 20, help="bytes (4K, 1M, 16M ...; default 1M)")
    parser.add_argument("--backend", choices=BACKENDS, default="type1",
                        help="one type1 container (default) or one iommufd IOAS (needs the dma-buf route: "
                             "CONFIG_VFIO_PCI_DMABUF)")
    parser.add_argument("--path", choices=("auto", "message"), default="auto",
                        help="auto: the proven peer fast path when the device holds a proof; "
                             "message: force DMA_WRITE messages (REG_P2P_CONTROL)")
    parser.add_argument("--one-way", action="store_true", help="only --from -> its peers")
    parser.add_argument("--pull", action="store_true",
                        help="the initiating GPU reads the peer's VRAM into its own (HOST_TO_VRAM; "
                             "with --path message: DMA_READ messages answered by QEMU)")
    parser.add_argument("--bench", action="store_true", help="all guest-side bench figures (JSON)")
    parser.add_argument("--check", choices=("isolation", "bad-input", "iommufd"),
                        help="print (JSON) the isolation, the bad-input or the iommufd checks instead")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.check:
            if args.check == "iommufd":
                print(json.dumps(iommufd_report(args.from_bdf, args.to_bdf, args.size)))
            else:
                fn = isolation if args.check == "isolation" else bad_inputs
                print(json.dumps(fn(args.from_bdf, args.to_bdf)))
            return 0
        if args.bench:
            print(json.dumps(bench(args.from_bdf, args.to_bdf, args.size, backend=args.backend)))
            return 0
        result = run(args.from_bdf, args.to_bdf, args.size, not args.one_way, args.path == "auto",
                     args.backend, pull=args.pull)
    except VfioError as err:
        print(f"p2p: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0 if result["match"] else 1
    print(f"backend: {result['backend']}")
    for bdf, group in result["groups"].items():
        print(f"{bdf}: IOMMU group {group}")
    for what, said in result["kernel"].items():
        print(f"{what}: {said}")
    for c in result["copies"]:
        print(f"{c['from']} -> {c['to']}: {c['size']} bytes, checksum "
              f"{'MATCH' if c['match'] else 'MISMATCH'} (sha256 {c['sha256'][:16]}…), "
              f"{c['mb_per_s']:.0f} MB/s via the {c['path']}; {c['route']['path']}")
    return 0 if result["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
