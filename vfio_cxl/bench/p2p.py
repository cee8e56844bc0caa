"""Peer-to-peer DMA figures, side by side in one run (boots ``p2p``: gpu0 and gpu1 behind
one PCIe switch, gpu2 on a root port of its own).

    scripts/bench p2p [--size 16M] [--json] [--backend type1|iommufd]

* P2P A->B, peer fast path, behind the switch: A's engine writes into B's VRAM
  through the IOVA of B's BAR2; the device holds a proof for the range and
  copies into B's VRAM memfd (docs/gpu-device.md, "P2P").
* P2P A->C, the same through the root complex (C on its own root port).
* P2P A->B, message path: the same copy with REG_P2P_CONTROL.FAST_DISABLE:
  DMA_WRITE messages to QEMU, which stores into B's BAR mapping.
* bounce: A -> guest RAM -> B, two DMAs (both on the direct fd path).
* CPU copy: the guest CPU copies between the two BAR2 mmaps.
* host memcpy: the reference, this process copying between two mmaps.

Targets (issue 12): the best P2P path >= 2x the bounce and >= 50 % of host memcpy.
``--backend iommufd`` needs the lab kernel with CONFIG_VFIO_PCI_DMABUF (``--kernel lab``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time

from ..errors import LabError
from ..lab import topology
from ..lab.lab import Lab


def host_memcpy(size: int, runs: int = 5) -> float:
    """Best of ``runs``: one memoryview copy between two memfd mmaps (what VRAM is)."""
    fds = [os.memfd_create("p2p-bench") for _ in range(2)]
    for fd in fds:
        os.ftruncate(fd, size)
    a, b = (mmap.mmap(fd, size, flags=mmap.MAP_SHARED) for fd in fds)
    for fd in fds:
        os.close(fd)
    va, vb = memoryview(a), memoryview(b)
    va[:] = b"\x5a" * size
    best = min(_timed(lambda: vb.__setitem__(slice(None), va)) for _ in range(runs))
    va.release(), vb.release()
    a.close(), b.close()
    return size / best / 1e6


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * mult


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench p2p", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=_size, default=16 << 20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", choices=("type1", "iommufd"), default="type1")
    parser.add_argument("--kernel", choices=("distro", "lab"), default="distro",
                        help="the guest kernel: Debian's 6.12 (no IOMMUFD) or the lab kernel (7.3)")
    args = parser.parse_args(argv)
    kernel = None
    if args.kernel == "lab":
        from ..lab.kernel import GuestKernel, boot_image, cached_lab_kernel
        found = cached_lab_kernel()
        if found is None:
            raise LabError("the lab kernel is not built", "run 'vfio-cxl provision --kernel lab' first")
        kernel = GuestKernel(boot_image(found), label="lab")
    load = os.getloadavg()[0]
    with Lab(topology.load("p2p"), kernel=kernel, log=lambda *_: None) as lab:
        out = json.loads(lab["host0"].run(f"python3 -m vfio_cxl.guest.p2p --bench --size {args.size} "
                                          f"--backend {args.backend}", timeout=900).stdout)
        memcpy = host_memcpy(args.size)   # same run, same machine load
    fast = [(k, v) for k, v in out.items() if k.startswith("p2p_fast")]
    name = {"switch": "P2P A->B behind the switch", "root complex": "P2P A->C via the root complex"}
    rows = [(name.get(r["route"]["kind"], f"P2P A->{r['to']}"), r) for _, r in fast]
    rows += [("P2P A->B (message path)", out["p2p_message"]),
             ("bounce A->guest RAM->B", out["bounce"]),
             ("CPU copy BAR2 A -> BAR2 B", out["cpu_copy"])]
    best_name, best = max(rows[:len(fast)], key=lambda nr: nr[1]["mb_per_s"])
    result = {
        "size": args.size, "backend": args.backend, "kernel": args.kernel, "load_average_1min": load,
        "groups": out["groups"], "iommu": out["kernel"],
        "rows": [{"name": n, "mb_per_s": r["mb_per_s"], "device_mb_per_s": r.get("device_mb_per_s"),
                  "match": r["match"], "path": r["path"], "route": r["route"]["path"],
                  "from": r.get("from"), "to": r.get("to")} for n, r in rows],
        "host_memcpy_mb_per_s": memcpy,
        "best_p2p": best_name,
        "p2p_vs_bounce": best["mb_per_s"] / out["bounce"]["mb_per_s"],
        "p2p_vs_memcpy": best["mb_per_s"] / memcpy,
        "p2p_device_vs_memcpy": best["device_mb_per_s"] / memcpy,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.size >> 20} MiB, TCG guest, {args.backend} backend, {args.kernel} kernel; "
          f"host load average {load:.2f} at the start")
    for bdf, group in out["groups"].items():
        print(f"  {bdf}: IOMMU group {group}")
    for what, said in out["kernel"].items():
        print(f"  {what}: {said}")
    print(f"{'what':32} {'MB/s':>9} {'device':>9} {'ok':>4}  path taken")
    for row in result["rows"]:
        dev = f"{row['device_mb_per_s']:>9.0f}" if row["device_mb_per_s"] else f"{'-':>9}"
        print(f"{row['name']:32} {row['mb_per_s']:>9.0f} {dev} {'yes' if row['match'] else 'NO':>4}  "
              f"{row['path']}; {row['route']}")
    print(f"{'host memcpy (reference)':32} {memcpy:>9.0f} {'':>9} {'':>4}  this process, memfd mmap to memfd mmap")
    print("best of 3 each; MB/s: guest doorbell -> MSI-X seen by the driver; device: the engine's time for the "
          "descriptor (completion record)")
    print(f"best P2P ({best_name}) = {result['p2p_vs_bounce']:.1f}x bounce (target >= 2x), "
          f"{100 * result['p2p_vs_memcpy']:.0f} % of host memcpy end to end, "
          f"{100 * result['p2p_device_vs_memcpy']:.0f} % in the device (target >= 50 %)")
    return 0
