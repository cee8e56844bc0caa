"""scripts/bench storage's own arithmetic: the host's O_DIRECT reference and the targets."""

import hashlib
import os

from vfio_cxl.bench.__main__ import SUBCOMMANDS
from vfio_cxl.bench.storage import LoadSampler, host_odirect, targets


def cell(path, size, depth, mb_s, cpu, verified=True, rnd=0):
    return {"path": path, "io_size": size, "queue_depth": depth, "mb_s": mb_s, "guest_cpu_s_per_gb": cpu,
            "verified": verified, "round": rnd}


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


def test_targets_pair_paths_within_a_round_and_take_the_median():
    # round 1 ran under load: every path's CPU doubled; the ratios stay, the median is round 0's
    cells = []
    for rnd, scale in ((0, 1.0), (1, 2.0), (2, 1.0)):
        cells += [cell("bounce", 1 << 20, 8, 100, 10.0 * scale, rnd=rnd), cell("p2p", 1 << 20, 8, 150, 3.0 * scale, rnd=rnd),
                  cell("cmb", 1 << 20, 4, 110, 9.0 * scale, rnd=rnd),
                  cell("gpu-initiated", 4096, 32, 40, 0.5 * scale + (0.5 if rnd == 1 else 0), rnd=rnd)]
    t = targets(cells)
    assert t["p2p_cpu_vs_bounce_rounds"] == [0.3, 0.3, 0.3] and t["p2p_cpu_vs_bounce"] == 0.3
    assert t["cmb_vs_bounce_mb_s"] == 1.1 and t["cmb_cpu_vs_bounce"] == 0.9
    assert t["gpu_initiated_cpu_vs_bounce_rounds"] == [0.05, 1.5 / 20, 0.05]
    assert t["gpu_initiated_cpu_vs_bounce"] == 0.05 and t["gpu_initiated_target_met"]
    assert "gpu_initiated_cpu_vs_bounce_same_size" not in t          # no bounce cell at 4K x 32
    cells.append(cell("bounce", 4096, 32, 8, 40.0, rnd=0))
    assert targets(cells)["gpu_initiated_cpu_vs_bounce_same_size_rounds"] == [0.5 / 40.0]


def test_bounce_buffer_option_checks_the_size_as_the_topology_does(capsys):
    import argparse

    import pytest

    from vfio_cxl.bench.storage import with_bounce_buffer
    from vfio_cxl.lab import topology

    topo = with_bounce_buffer(topology.load("storage"), "16M", argparse.ArgumentParser())
    nvme0, nvme1 = topo.vm("host0").nvmes
    assert (nvme0.bounce_buffer, nvme0.cmb, nvme1.bounce_buffer) == (16 << 20, 4 << 20, 1 << 20)
    for bad, why in (("3M", "a power of two from 4K to 64M"), ("xx", "bad size")):
        parser = argparse.ArgumentParser(prog="scripts/bench storage")
        with pytest.raises(SystemExit):
            with_bounce_buffer(topology.load("storage"), bad, parser)
        err = capsys.readouterr().err
        assert f"--bounce-buffer {bad}: " in err and why in err, err


def test_load_sampler_reports_the_busy_share_between_two_moments():
    s = LoadSampler()
    # (wall clock, busy jiffies, total jiffies, load average)
    s.samples = [(100.0, 0, 0, 1.0), (101.0, 50, 200, 2.0), (102.0, 250, 400, 3.0), (103.0, 250, 600, 4.0)]
    assert s.between(101.2, 101.9) == {"host_busy_pct": 100.0, "load_average_1min": 2.0}
    assert s.between(101.0, 103.0) == {"host_busy_pct": 50.0, "load_average_1min": 2.0}
    assert s.between(50.0, 500.0)["host_busy_pct"] == 250 / 600 * 100   # outside: the whole run
    with LoadSampler(interval=0.01) as real:
        sum(range(10 ** 5))
    t0, busy0, total0, load0 = real.samples[0]
    assert len(real.samples) >= 2 and real.samples[-1][2] >= total0 and load0 >= 0


def test_storage_is_a_bench_subcommand():
    assert SUBCOMMANDS["storage"] == "vfio_cxl.bench.storage"
