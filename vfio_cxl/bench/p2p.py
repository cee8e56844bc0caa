"""Peer-to-peer DMA figures, side by side in one run (boots ``p2p``: gpu0 and gpu1 behind
one PCIe switch, gpu2 on a root port of its own).

    scripts/bench p2p [--size 16M] [--json] [--backend type1|iommufd] [--kernel lab] [--lab NAME]

* P2P A->B, peer fast path, behind the switch: A's engine writes into B's VRAM
  through the IOVA of B's BAR2; the device holds a proof for the range and
  copies into B's VRAM memfd (docs/gpu-device.md, "P2P").
* P2P A->C, the same through the root complex (C on its own root port).
* P2P A->B, message path: the same copy with REG_P2P_CONTROL.FAST_DISABLE:
  DMA_WRITE messages to QEMU, which stores into B's BAR mapping.
* bounce: A -> guest RAM -> B, two DMAs (both on the direct fd path).
* CPU copy: the guest CPU copies between the two BAR2 mmaps.
* P2P A->B streamed: 4 copies (or as many as B's VRAM holds) queued in one submission,
  one interrupt at the end -- bandwidth as GPU benchmarks measure it (CUDA's
  p2pBandwidthLatencyTest queues its copies and synchronises once).
* host memcpy of the same size, this process, between memfd mappings: **cold** (bytes in
  no cache, STREAM's sizing rule: see lab/memcpy_reference.py), the reference the targets use,
  as a device's DMA never finds its bytes in the CPU's cache; and **hot** (the same two
  buffers every run: it runs out of the last-level cache).

Targets (issue 12): the best P2P path >= 2x the bounce and >= 50 % of host memcpy (cold).
``--backend iommufd`` needs the lab kernel with CONFIG_VFIO_PCI_DMABUF (``--kernel lab``).
``--lab NAME`` (or ``$VFIO_CXL_LAB``) runs in that running detached ``p2p`` lab instead of
booting one (vfio_cxl/lab/borrow.py).
"""

from __future__ import annotations

import argparse
import json
import os

from ..lab import topology
from ..lab.borrow import add_lab_option, booted_or_borrowed
from ..lab.lab import Lab
from ..lab.memcpy_reference import host_memcpy
from .options import add_kernel_option, guest_kernel, kernel_asked


def parse_size(text: str) -> int:
    """``16M``, ``16MiB``, ``4K``, ``4096``: bytes (the ``--size`` of the bench and of ``demo p2p``)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * mult


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench p2p", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=16 << 20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", choices=("type1", "iommufd"), default="type1")
    add_kernel_option(parser)
    add_lab_option(parser, "p2p")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]

    def boot():
        return Lab(topology.load("p2p"), kernel=guest_kernel(args), log=lambda *_: None)

    with booted_or_borrowed(args, "p2p", boot, command="scripts/bench p2p", kernel=kernel_asked(args)) as lab:
        out = json.loads(lab["host0"].run(f"vfio-cxl-m vfio_cxl.guest.cmd.p2p --bench --size {args.size} "
                                          f"--backend {args.backend}", timeout=900).stdout)
        reference = host_memcpy(args.size)   # same run, same machine load
    memcpy = reference.cold_mb_s
    fast = [(k, v) for k, v in out.items() if k.startswith("p2p_fast")]
    name = {"switch": "P2P A->B behind the switch", "root complex": "P2P A->C via the root complex"}
    rows = [(name.get(r["route"]["kind"], f"P2P A->{r['to']}"), r) for _, r in fast]
    stream = out["p2p_stream"]
    rows += [(f"P2P A->B streamed, {stream['count']} queued", stream)]
    rows += [("P2P A->B (message path)", out["p2p_message"]),
             ("bounce A->guest RAM->B", out["bounce"]),
             ("CPU copy BAR2 A -> BAR2 B", out["cpu_copy"])]
    best_name, best = max(rows[:len(fast) + 1], key=lambda nr: nr[1]["mb_per_s"])
    # one descriptor against one bounce (two descriptors): like for like
    single_name, single = max(rows[:len(fast)], key=lambda nr: nr[1]["mb_per_s"])
    result = {
        "size": args.size, "backend": args.backend, "kernel": args.kernel, "load_average_1min": load,
        "groups": out["groups"], "iommu": out["kernel"],
        "rows": [{"name": n, "mb_per_s": r["mb_per_s"], "device_mb_per_s": r.get("device_mb_per_s"),
                  "match": r["match"], "path": r["path"], "route": r["route"]["path"],
                  "from": r.get("from"), "to": r.get("to")} for n, r in rows],
        "host_memcpy_mb_per_s": memcpy, "host_memcpy": reference.as_dict(),
        "best_p2p": best_name,
        "p2p_vs_bounce": single["mb_per_s"] / out["bounce"]["mb_per_s"],
        "single_p2p": single_name, "single_p2p_vs_memcpy": single["mb_per_s"] / memcpy,
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
    print(f"{'host memcpy, cold (reference)':32} {memcpy:>9.0f} {'':>9} {'':>4}  this process, memfd to memfd, "
          f"bytes in no cache (pools of {reference.pool_bytes >> 20} MiB)")
    print(f"{'host memcpy, hot':32} {reference.hot_mb_s:>9.0f} {'':>9} {'':>4}  the same two buffers every run "
          f"(out of the last-level cache)")
    print(f"best of 3 each (memcpy: median of {reference.runs}); MB/s: guest doorbell -> MSI-X seen by the "
          "driver; device: the engine's time for the descriptors (completion records)")
    print(f"one descriptor: {single_name} = {result['p2p_vs_bounce']:.1f}x the bounce (target >= 2x), "
          f"{100 * result['single_p2p_vs_memcpy']:.0f} % of cold host memcpy end to end")
    print(f"best P2P ({best_name}) = {100 * result['p2p_vs_memcpy']:.0f} % of cold host memcpy end to end "
          f"(target >= 50 %), {100 * result['p2p_device_vs_memcpy']:.0f} % in the device; "
          f"{100 * best['mb_per_s'] / reference.hot_mb_s:.0f} % of hot memcpy")
    return 0
