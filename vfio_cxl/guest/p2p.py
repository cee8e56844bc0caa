"""In the guest: peer-to-peer DMA -- one GPU's engine writes straight into another GPU's VRAM.

    python3 -m vfio_cxl.guest.p2p [--from BDF] [--to BDF] [--size N] [--json]
                                  [--bench] [--path auto|message]

Both GPUs join ONE type1 container (one IOMMU context); each GPU's BAR2
(VRAM) is mmapped through its VFIO region and that mmap is DMA-mapped into
the container (``VFIO_IOMMU_MAP_DMA``), so each GPU can reach the other's
VRAM at an IOVA.  ``--from`` GPU fills its VRAM, its engine copies
VRAM -> IOVA(peer BAR2), and the bytes are checked through both BAR mmaps;
then the other way round.

``run()`` and ``main()`` are the entry points a guest ``vfio-cxl gpu p2p``
command hooks into.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time

from ..devices.gpu import regs
from ..devices.gpu.regs import Op
from .gpu_driver import GpuDriver, GpuError, Transfer
from .vfio import Container, DmaMapping, find_pci_devices, iommu_group
from .vfio import uapi
from .vfio.bind import modprobe
from .vfio.errors import VfioError

# IOVA layout in the shared container (docs/gpu-device.md, "P2P"): each GPU's
# control area at its own IOVA, the peer BARs high above guest-RAM buffers.
CONTROL_IOVAS = (0x0010_0000, 0x0020_0000)
PEER_BAR_IOVA = 0x10_0000_0000           # BAR2 of GPU i at PEER_BAR_IOVA + i * PEER_BAR_STRIDE
PEER_BAR_STRIDE = 0x1_0000_0000
BOUNCE_IOVA = 0x0800_0000                 # guest RAM (the bounce path in the bench)
SEEDS = (0xA11CE, 0xB0B)


class P2pError(GpuError):
    """Peer-to-peer set-up or verification failed."""


def open_container() -> Container:
    """The shared container; vfio-pci loaded first (it brings /dev/vfio/vfio)."""
    if not os.path.exists("/dev/vfio/vfio"):
        modprobe("vfio-pci")
    return Container.open()


def map_peer_bar(initiator: GpuDriver, peer: GpuDriver, iova: int, size: int | None = None,
                 region: int = regs.BAR_VRAM) -> DmaMapping:
    """DMA-map ``peer``'s BAR2 (its VRAM, via the VFIO region mmap) at ``iova`` so
    ``initiator`` can reach it.  Both must share one container (one IOMMU context).

    Clear errors, nothing left mapped: a peer in another container, a BAR that
    is not mmappable, a size beyond the BAR."""
    shared = initiator.device.container
    if shared is None or shared is not peer.device.container:   # None: iommufd, one IOAS each
        raise P2pError(f"{peer.device.bdf} is not in the same VFIO container as {initiator.device.bdf}: "
                       "a mapping made in the peer's container is invisible to the initiator's IOMMU context",
                       "open both GPUs with GpuDriver.open(bdf, container=shared_container)")
    bar = peer.device.region(region)   # VFIO region index: BARn is n
    size = bar.size if size is None else size
    if not 0 < size <= bar.size:
        raise P2pError(f"size {size:#x} is beyond {peer.device.bdf}'s {bar.name} ({bar.size:#x} bytes)",
                       f"map at most {bar.size:#x} bytes")
    mm = bar.mmap_object()   # RegionError if the BAR cannot be mmapped
    view = memoryview(mm)[:size]
    try:
        return initiator.device.map_dma(view, iova)
    except BaseException:
        view.release()
        raise


class PeerPair:
    """Two GPUs in one container, each BAR2 DMA-mapped for the other.  Context manager."""

    def __init__(self, bdfs: tuple[str, str]):
        self.bdfs = bdfs
        self.groups = {bdf: iommu_group(bdf) for bdf in bdfs}
        self.kernel: dict[str, str] = {}
        self._stack = contextlib.ExitStack()
        with self._stack as stack:
            self.container = open_container()
            stack.callback(self.container.close)
            self.gpus = []
            for bdf, control in zip(bdfs, CONTROL_IOVAS):
                gpu = GpuDriver.open(bdf, container=self.container, control_iova=control)
                stack.callback(gpu.close)
                self.gpus.append(gpu)
            # the container's mappings go before the devices leave it
            stack.callback(self.container.unmap_all)
            self.bar_iovas = []
            for i, gpu in enumerate(self.gpus):
                iova = PEER_BAR_IOVA + i * PEER_BAR_STRIDE
                t0 = time.perf_counter()
                map_peer_bar(self.gpus[1 - i], gpu, iova)
                self.kernel[f"map BAR2 of {gpu.device.bdf}"] = (
                    f"VFIO_IOMMU_MAP_DMA accepted: {gpu.vram_size >> 20} MiB at IOVA {iova:#x} "
                    f"in {(time.perf_counter() - t0) * 1e3:.0f} ms")
                self.bar_iovas.append(iova)
            self._stack = stack.pop_all()

    def copy(self, src: int, length: int, *, seed: int, fast: bool = True,
             pull: bool = False) -> dict:
        """GPU ``src`` fills VRAM[0:length] with PRNG(seed), its engine copies it into the
        other GPU's VRAM through the IOVA; every byte checked through both BAR mmaps.
        ``pull``: the other way -- the peer's VRAM holds the bytes and GPU ``src``'s
        engine reads them through the IOVA into its own VRAM (HOST_TO_VRAM; on the
        message path these are DMA_READ messages that QEMU answers)."""
        a, b = self.gpus[src], self.gpus[1 - src]
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
            op = Transfer(Op.HOST_TO_VRAM, src=self.bar_iovas[1 - src], dst=0, length=length)
        else:
            op = Transfer(Op.VRAM_TO_HOST, src=0, dst=self.bar_iovas[1 - src], length=length)
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
                "path": "peer fast path" if peer_kib * 1024 >= length - 4096 else "message path",
                "peer_kib": peer_kib, "seconds": seconds, "mb_per_s": length / seconds / 1e6,
                # the engine's own time for the descriptor (completion record), without the
                # doorbell and the interrupt delivery through TCG
                "device_mb_per_s": length / max(done["duration_ns"], 1) * 1e3}

    def close(self) -> None:
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.close()

    def __enter__(self) -> "PeerPair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pick_bdfs(from_bdf: str | None, to_bdf: str | None) -> tuple[str, str]:
    found = find_pci_devices(regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID)
    from_bdf = from_bdf or (found[0] if found else None)
    to_bdf = to_bdf or next((b for b in found if b != from_bdf), None)
    if not from_bdf or not to_bdf:
        raise P2pError(f"peer-to-peer DMA needs two GPUs; this VM has {len(found)} ({', '.join(found) or 'none'})",
                       "boot the p2p topology: vfio-cxl vm up p2p")
    if from_bdf == to_bdf:
        raise P2pError(f"--from and --to are both {from_bdf}", "name two different GPUs")
    return from_bdf, to_bdf


def run(from_bdf: str | None = None, to_bdf: str | None = None, size: int = 1 << 20,
        both_ways: bool = True, fast: bool = True, pull: bool = False) -> dict:
    """A -> B (and B -> A), every byte checked; the IOMMU groups and what the kernel did.
    ``pull``: A's engine reads B's VRAM instead (and B's reads A's)."""
    bdfs = pick_bdfs(from_bdf, to_bdf)
    with PeerPair(bdfs) as pair:
        copies = [pair.copy(0, size, seed=SEEDS[0], fast=fast, pull=pull)]
        if both_ways:
            copies.append(pair.copy(1, size, seed=SEEDS[1], fast=fast, pull=pull))
        return {"groups": pair.groups, "kernel": pair.kernel, "copies": copies,
                "match": all(c["match"] for c in copies)}


def bench(from_bdf: str | None = None, to_bdf: str | None = None, size: int = 16 << 20,
          runs: int = 3) -> dict:
    """Every guest-side figure of `scripts/bench p2p`, in one session (best of ``runs``)."""
    import mmap
    bdfs = pick_bdfs(from_bdf, to_bdf)
    out = {}
    with PeerPair(bdfs) as pair:
        pair.copy(0, size, seed=1)                      # warm-up: proofs made here
        best = lambda runs: max(runs, key=lambda r: r["mb_per_s"])   # noqa: E731
        out["p2p_fast"] = best([pair.copy(0, size, seed=2 + i) for i in range(runs)])
        out["p2p_message"] = best([pair.copy(0, size, seed=9 + i, fast=False) for i in range(runs)])
        a, b = pair.gpus
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
                         "path": "two DMAs through guest RAM (direct fd path both ways)"}
        bounce.close()
        va, vb = a.vram.view(0, size), b.vram.view(0, size)
        seconds = float("inf")
        for _ in range(runs):
            t0 = time.perf_counter()
            vb[:] = va
            seconds = min(seconds, time.perf_counter() - t0)
        out["cpu_copy"] = {"seconds": seconds, "mb_per_s": size / seconds / 1e6, "match": vb == va,
                           "path": "guest CPU memcpy between the two BAR2 mmaps"}
        va.release(), vb.release()
    out["size"] = size
    return out


def isolation(from_bdf: str | None = None, to_bdf: str | None = None) -> dict:
    """A's DMA to B's BAR IOVA faults (DMA_UNMAPPED on A's error vector) while the
    guest has not mapped it -- before ever, and after an unmap that follows a
    proven fast-path copy -- and B's VRAM stays as it was."""
    from .gpu_driver import GpuDmaError
    bdfs = pick_bdfs(from_bdf, to_bdf)
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
    bdfs = pick_bdfs(from_bdf, to_bdf)
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


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.p2p", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="from_bdf", metavar="BDF", help="initiating GPU (default: the first)")
    parser.add_argument("--to", dest="to_bdf", metavar="BDF", help="peer GPU (default: the other)")
    parser.add_argument("--size", type=_size, default=1 << 20, help="bytes (4K, 1M, 16M ...; default 1M)")
    parser.add_argument("--path", choices=("auto", "message"), default="auto",
                        help="auto: the proven peer fast path when the device holds a proof; "
                             "message: force DMA_WRITE messages (REG_P2P_CONTROL)")
    parser.add_argument("--one-way", action="store_true", help="only --from -> --to")
    parser.add_argument("--pull", action="store_true",
                        help="the initiating GPU reads the peer's VRAM into its own (HOST_TO_VRAM; "
                             "with --path message: DMA_READ messages answered by QEMU)")
    parser.add_argument("--bench", action="store_true", help="all guest-side bench figures (JSON)")
    parser.add_argument("--check", choices=("isolation", "bad-input"),
                        help="print (JSON) the isolation or the bad-input checks instead")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.check:
            fn = isolation if args.check == "isolation" else bad_inputs
            print(json.dumps(fn(args.from_bdf, args.to_bdf)))
            return 0
        if args.bench:
            print(json.dumps(bench(args.from_bdf, args.to_bdf, args.size)))
            return 0
        result = run(args.from_bdf, args.to_bdf, args.size, not args.one_way, args.path == "auto",
                     args.pull)
    except VfioError as err:
        print(f"p2p: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0 if result["match"] else 1
    for bdf, group in result["groups"].items():
        print(f"{bdf}: IOMMU group {group}")
    for what, said in result["kernel"].items():
        print(f"{what}: {said}")
    for c in result["copies"]:
        print(f"{c['from']} -> {c['to']}: {c['size']} bytes, checksum "
              f"{'MATCH' if c['match'] else 'MISMATCH'} (sha256 {c['sha256'][:16]}…), "
              f"{c['mb_per_s']:.0f} MB/s via the {c['path']}")
    return 0 if result["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
