"""In the guest: the peer-to-peer DMA command and the guest half of `scripts/bench p2p`.

    python3 -m vfio_cxl.guest.cmd.p2p [--from BDF] [--to BDF] [--size N] [--json]
                                      [--backend type1|iommufd] [--bench] [--path auto|message]

``--from`` GPU fills its VRAM, its engine copies VRAM -> IOVA(peer BAR2), and
the bytes are checked through both BAR mmaps; then the other way round.  The
pairing, the shared IOMMU context and the BAR mappings are the library's
(``vfio_cxl.guest.p2p``); ``run()`` and ``main()`` are the entry points a guest
``vfio-cxl gpu p2p`` command hooks into.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ...devices.gpu import regs
from ...devices.gpu.regs import Op
from ..drivers.gpu import GpuDriver, Transfer
from ..p2p import (BACKENDS, CONTROL_IOVAS, PEER_BAR_IOVA, PEER_BAR_STRIDE, P2pError, PeerPair, map_peer_bar,
                   open_container, pick_bdfs, route)
from ..vfio import uapi
from ..vfio.errors import VfioError

BOUNCE_IOVA = 0x0800_0000                 # guest RAM (the bounce path in the bench)
STREAM_COPIES = 4                         # descriptors per submission in the streamed bench row
SEEDS = (0xA11CE, 0xB0B)


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
    from ..drivers.gpu import GpuDmaError
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
    a = GpuDriver.open(bdfs[0], backend="type1")   # each in its own container
    try:
        b = GpuDriver.open(bdfs[1], backend="type1")
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
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.p2p", description=__doc__,
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
