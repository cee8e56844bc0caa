"""Peer-to-peer DMA figures, side by side in one run (boots ``p2p``).

    scripts/bench p2p [--size 16M] [--json]

* P2P A->B, peer fast path: A's engine writes into B's VRAM through the
  IOVA of B's BAR2; the device holds a proof for the range and copies into
  B's VRAM memfd (docs/gpu-device.md, "P2P").
* P2P A->B, message path: the same copy with REG_P2P_CONTROL.FAST_DISABLE:
  DMA_WRITE messages to QEMU, which stores into B's BAR mapping.
* bounce: A -> guest RAM -> B, two DMAs (both on the direct fd path).
* CPU copy: the guest CPU copies between the two BAR2 mmaps.
* host memcpy: the reference, this process copying between two mmaps.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time

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
    args = parser.parse_args(argv)
    with Lab(topology.load("p2p"), log=lambda *_: None) as lab:
        out = json.loads(lab["host0"].run(f"python3 -m vfio_cxl.guest.p2p --bench --size {args.size}",
                                          timeout=900).stdout)
        memcpy = host_memcpy(args.size)   # same run, same machine load
    rows = [("P2P A->B (peer fast path)", out["p2p_fast"]),
            ("P2P A->B (message path)", out["p2p_message"]),
            ("bounce A->guest RAM->B", out["bounce"]),
            ("CPU copy BAR2 A -> BAR2 B", out["cpu_copy"])]
    best = out["p2p_fast"]["mb_per_s"]
    result = {
        "size": args.size,
        "rows": [{"name": n, "mb_per_s": r["mb_per_s"], "device_mb_per_s": r.get("device_mb_per_s"),
                  "match": r["match"], "path": r["path"]} for n, r in rows],
        "host_memcpy_mb_per_s": memcpy,
        "p2p_vs_bounce": best / out["bounce"]["mb_per_s"],
        "p2p_vs_memcpy": best / memcpy,
        "p2p_device_vs_memcpy": out["p2p_fast"]["device_mb_per_s"] / memcpy,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'what':30} {'MB/s':>9} {'device':>9} {'ok':>4}  path taken ({args.size >> 20} MiB, TCG guest)")
    for row in result["rows"]:
        dev = f"{row['device_mb_per_s']:>9.0f}" if row["device_mb_per_s"] else f"{'-':>9}"
        print(f"{row['name']:30} {row['mb_per_s']:>9.0f} {dev} {'yes' if row['match'] else 'NO':>4}  {row['path']}")
    print(f"{'host memcpy (reference)':30} {memcpy:>9.0f} {'':>9} {'':>4}  this process, memfd mmap to memfd mmap")
    print("best of 3 each; MB/s: guest doorbell -> MSI-X seen by the driver; device: the engine's time for the "
          "descriptor (completion record)")
    print(f"P2P fast path = {result['p2p_vs_bounce']:.1f}x bounce (target >= 2x), "
          f"{100 * result['p2p_vs_memcpy']:.0f} % of host memcpy end to end, "
          f"{100 * result['p2p_device_vs_memcpy']:.0f} % in the device (target >= 50 %)")
    return 0
