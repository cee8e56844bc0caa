"""Storage straight into the GPU, every path side by side in one run (boots ``storage``).

    scripts/bench storage [--quick] [--json] [--backend type1|iommufd] [--kernel distro|lab]

Paths (docs/storage.md): bounce (NVMe -> guest RAM -> GPU copy: cuFile's compatibility mode),
p2p (NVMe -> VRAM through the GPU's BAR2 mapped in the NVMe's IOMMU context), gpu-initiated (the
GPU drives an NVMe queue pair in its VRAM: NVME_IO).  CMB staging is not measured (the lab's
``nvme1`` has a CMB; no path uses it yet).  The full sweep: I/O size 4K, 64K, 1M x queue depth 1,
8, 32, 64; ``--quick``: 1 MiB at depth 8 and 4 KiB at depth 32 on each path.

Per cell: MB/s, IOPS, latency p50/p99, guest CPU seconds per GB (the guest process's user +
system time), GPU vfio-user messages per I/O, bytes through guest RAM and bytes QEMU carried into
the BAR, and ``verified`` (every byte read back through the BAR2 mmap).  The reference: the host
reading the same bytes of the namespace's backing file with O_DIRECT, and their sha256 against
what the guest wrote.  Targets (issue 22): p2p >= bounce in MB/s at 1 MiB with <= 50 % of its
guest CPU per GB; gpu-initiated at depth >= 16 with <= 10 % of the bounce's guest CPU per GB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import time

from ..lab import topology
from ..lab.lab import Lab
from .options import add_kernel_option, guest_kernel


def host_odirect(path, length: int, chunk: int = 1 << 20) -> tuple[float, str]:
    """MB/s of an O_DIRECT read of ``length`` bytes from the start of ``path``, and their sha256."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, chunk)            # page-aligned, as O_DIRECT needs
    digest = hashlib.sha256()
    try:
        t0 = time.perf_counter()
        done = 0
        while done < length:
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                break
            digest.update(buf[:min(n, length - done)])
            done += n
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return length / seconds / 1e6, digest.hexdigest()


def targets(cells: list[dict]) -> dict:
    def best(path: str, size: int | None = None, min_depth: int = 0) -> dict | None:
        rows = [c for c in cells if c["path"] == path and (size is None or c["io_size"] == size)
                and c["queue_depth"] >= min_depth and c["verified"]]
        return max(rows, key=lambda c: c["mb_s"]) if rows else None
    bounce, p2p = best("bounce", 1 << 20), best("p2p", 1 << 20)
    gpu = best("gpu-initiated", None, 16)
    bounce_cpu = bounce["guest_cpu_s_per_gb"] if bounce else None
    out = {}
    if bounce and p2p:
        out["p2p_vs_bounce_mb_s"] = p2p["mb_s"] / bounce["mb_s"]
        out["p2p_cpu_vs_bounce"] = p2p["guest_cpu_s_per_gb"] / bounce_cpu
        out["p2p_target_met"] = out["p2p_vs_bounce_mb_s"] >= 1 and out["p2p_cpu_vs_bounce"] <= 0.5
    if bounce and gpu:
        out["gpu_initiated_cpu_vs_bounce"] = gpu["guest_cpu_s_per_gb"] / bounce_cpu
        out["gpu_initiated_target_met"] = out["gpu_initiated_cpu_vs_bounce"] <= 0.10
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench storage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", choices=("type1", "iommufd"), default="type1")
    add_kernel_option(parser)
    args = parser.parse_args(argv)
    kernel = guest_kernel(args)
    load = os.getloadavg()[0]
    topo = topology.load("storage")
    with Lab(topo, kernel=kernel, log=lambda *_: None) as lab:
        out = json.loads(lab["host0"].run(f"python3 -m vfio_cxl.guest.cmd.storage_bench --backend {args.backend}"
                                          + (" --quick" if args.quick else ""), timeout=3600).stdout)
        host_mb_s, host_sha = host_odirect(lab.nvme_file("host0", "nvme0"), out["data_bytes"])
    nvme0 = topo.vm("host0").nvmes[0]
    result = {"backend": args.backend, "kernel": args.kernel, "quick": args.quick, "load_average_1min": load,
              "bounce_buffer": nvme0.bounce_buffer, "host_odirect_mb_s": host_mb_s,
              "host_sha256_match": host_sha == out["data_sha256"], "cells": out["cells"],
              "targets": targets(out["cells"])}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"storage, TCG guest, {args.kernel} kernel, {args.backend} backend, QEMU bounce buffer {nvme0.bounce_buffer >> 10} KiB; "
          f"host load average {load:.2f} at the start")
    print(f"{'path':14} {'size':>7} {'QD':>3} {'MB/s':>8} {'IOPS':>8} {'p50 us':>8} {'p99 us':>8} "
          f"{'CPU s/GB':>9} {'msg/IO':>7} {'guestRAM':>9} {'QEMU BAR':>9} ok")
    for c in out["cells"]:
        print(f"{c['path']:14} {c['io_size'] >> 10:>6}K {c['queue_depth']:>3} {c['mb_s']:>8.1f} {c['iops']:>8.0f} "
              f"{c['lat_p50_us']:>8.0f} {c['lat_p99_us']:>8.0f} {c['guest_cpu_s_per_gb']:>9.2f} "
              f"{c['gpu_messages_per_io']:>7.2f} {c['guest_ram_bytes'] >> 20:>8}M {c['qemu_bar_bytes'] >> 20:>8}M "
              f"{'yes' if c['verified'] else 'NO'}")
    print(f"{'host O_DIRECT':14} {'':>7} {'':>3} {host_mb_s:>8.1f}  reference: the backing file's first "
          f"{out['data_bytes'] >> 20} MiB, sha256 {'matches' if result['host_sha256_match'] else 'DIFFERS from'} "
          "what the guest wrote")
    t = result["targets"]
    if "p2p_vs_bounce_mb_s" in t:
        print(f"p2p at 1 MiB: {t['p2p_vs_bounce_mb_s']:.2f}x the bounce's MB/s (target >= 1), "
              f"{100 * t['p2p_cpu_vs_bounce']:.0f} % of its guest CPU per GB (target <= 50 %)")
    if "gpu_initiated_cpu_vs_bounce" in t:
        print(f"gpu-initiated at QD >= 16: {100 * t['gpu_initiated_cpu_vs_bounce']:.1f} % of the bounce's guest "
              "CPU per GB (target <= 10 %)")
    return 0
