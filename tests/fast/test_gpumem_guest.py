"""The guest side of GPU memory over CXL, without a VM: the eviction policy on synthetic
page streams, the operand layouts, and the verifier's arithmetic (plain Python, as in the
guest) against numpy."""

import random

import numpy as np
import pytest

from vfio_cxl.devices.gpu import regs
from vfio_cxl.guest import gpumem
from vfio_cxl.guest.cmd.cli import build_parser


def test_lru_evicts_the_least_recently_migrated_page():
    cache = gpumem.LruCache(2)
    assert cache.place(1) == (0, None, None)
    assert cache.place(2) == (1, None, None)
    cache.place(1)                                   # touched again: 2 is now the oldest
    assert cache.place(3) == (1, 2, 1)
    assert 2 not in cache and 1 in cache and 3 in cache
    with pytest.raises(gpumem.GpuMemError, match="no migration unit"):
        gpumem.LruCache(0)


def test_a_sequential_stream_faults_once_per_page_and_a_smaller_cache_faults_more():
    stream = list(range(64)) * 2                     # two passes over 64 pages
    assert gpumem.simulate_faults(stream, 64) == 64  # the second pass hits
    assert gpumem.simulate_faults(stream, 32) == 128  # LRU on a loop larger than the cache: all miss
    rnd = random.Random(1)
    zipf = [min(int(rnd.paretovariate(1.2)), 200) for _ in range(5000)]
    faults = [gpumem.simulate_faults(zipf, s) for s in (128, 64, 16, 4)]
    assert faults == sorted(faults) and faults[0] < faults[-1]


@pytest.mark.parametrize("kernel", list(regs.KERNELS))
def test_layouts_fit_the_working_set(kernel):
    for ws in (64 << 10, 1 << 20, 8 << 20):
        lay = gpumem.layout(kernel, ws)
        assert 0 < lay.size <= ws + 4096 and lay.size % 4096 == 0
    with pytest.raises(gpumem.GpuMemError, match="unknown kernel 'sort'"):
        gpumem.layout("sort", 1 << 20)


def test_the_big_integer_stencil_check_matches_numpy():
    x = np.random.default_rng(1).integers(0, 1 << 60, size=1000, dtype=np.uint64)
    want = x.copy()
    want[1:] += x[:-1]
    want[:-1] += x[1:]
    n = int.from_bytes(x.tobytes(), "little")
    got = (n + (n << 64) + (n >> 64)) & ((1 << 64000) - 1)
    assert got.to_bytes(8000, "little") == want.tobytes()
    masked = gpumem._masked(b"\xff" * 16, b"\xff" * 7 + b"\x0f")
    assert masked == (b"\xff" * 7 + b"\x0f") * 2


def test_the_run_command_parses_as_documented():
    args = build_parser().parse_args(["gpu", "run", "stream", "--mode", "cxl+sr+ds", "--latency",
                                      "cxl-250ns", "--working-set", "16M", "--vram-cache", "4M", "--json"])
    assert (args.kernel, args.mode, args.latency, args.working_set, args.vram_cache) == (
        "stream", "cxl+sr+ds", "cxl-250ns", 16 << 20, 4 << 20)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gpu", "run", "stream", "--mode", "hbm"])
