"""scripts/bench storage's own arithmetic: the host's O_DIRECT reference and the targets."""

import hashlib
import os

from vfio_cxl.bench.__main__ import SUBCOMMANDS
from vfio_cxl.bench.storage import host_odirect, targets


def cell(path, size, depth, mb_s, cpu, verified=True):
    return {"path": path, "io_size": size, "queue_depth": depth, "mb_s": mb_s, "guest_cpu_s_per_gb": cpu,
            "verified": verified}


def test_host_odirect_reads_the_file_and_checksums_it(tmp_path):
    path = tmp_path / "ns.raw"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    mb_s, sha = host_odirect(path, 2 << 20)
    assert sha == hashlib.sha256(data[:2 << 20]).hexdigest() and mb_s > 0


def test_targets_compare_the_best_verified_cells():
    cells = [cell("bounce", 1 << 20, 8, 100, 10.0), cell("bounce", 1 << 20, 32, 120, 12.0),
             cell("p2p", 1 << 20, 8, 150, 4.0), cell("p2p", 1 << 20, 32, 900, 1.0, verified=False),
             cell("gpu-initiated", 4096, 8, 50, 0.1), cell("gpu-initiated", 4096, 32, 40, 0.6)]
    t = targets(cells)
    assert t["p2p_vs_bounce_mb_s"] == 150 / 120 and t["p2p_cpu_vs_bounce"] == 4.0 / 12.0 and t["p2p_target_met"]
    # only depth >= 16 counts for the GPU-initiated target: 0.6 s/GB against 12 -> 5 %
    assert t["gpu_initiated_cpu_vs_bounce"] == 0.6 / 12.0 and t["gpu_initiated_target_met"]
    slow = targets([cell("bounce", 1 << 20, 8, 100, 10.0), cell("p2p", 1 << 20, 8, 90, 2.0)])
    assert not slow["p2p_target_met"] and "gpu_initiated_cpu_vs_bounce" not in slow


def test_storage_is_a_bench_subcommand():
    assert SUBCOMMANDS["storage"] == "vfio_cxl.bench.storage"
