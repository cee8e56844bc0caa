"""The memcpy reference the DMA benchmarks compare against (our own logic; no timing asserted)."""

from __future__ import annotations

from vfio_cxl.lab import memcpy_reference as reference


def test_the_last_level_cache_is_read_from_sysfs():
    assert reference.last_level_cache() >= 1 << 20


def test_cold_pools_hold_four_times_the_cache(monkeypatch):
    # a pretend 1 MiB cache keeps the test small; the sizing rule is what is checked
    monkeypatch.setattr(reference, "last_level_cache", lambda: 1 << 20)
    result = reference.host_memcpy(64 << 10, runs=3)
    assert result.pool_bytes == reference.STREAM_FACTOR * (1 << 20)
    assert result.cold_mb_s > 0 and result.hot_mb_s > 0
    assert result.as_dict()["size"] == 64 << 10


def test_pools_are_capped_so_a_huge_cache_cannot_exhaust_memory(monkeypatch):
    monkeypatch.setattr(reference, "last_level_cache", lambda: 1 << 40)
    monkeypatch.setattr(reference, "MAX_POOL", 8 << 20)
    assert reference.host_memcpy(1 << 20, runs=2).pool_bytes == 8 << 20


def _figure(kind: str, mb_per_s: float, match: bool = True) -> dict:
    # the shape of one entry of `python3 -m vfio_cxl.guest.cmd.p2p --bench` (guest/cmd/p2p.py bench())
    return {"mb_per_s": mb_per_s, "match": match, "path": "peer fast path",
            "route": {"kind": kind, "via": "0000:01:00.0", "path": f"{kind} path"}}


def test_demo_p2p_prints_the_memcpy_reference_it_gets(monkeypatch):
    # issue 23 item 11: host_memcpy returns a Memcpy; the demo formatted it as a number and
    # died at its last line. The real reference is measured here (small), then printed.
    from vfio_cxl.demos import p2p
    monkeypatch.setattr(reference, "last_level_cache", lambda: 1 << 20)
    memcpy = reference.host_memcpy(64 << 10, runs=3)
    figures = {"p2p_fast": _figure("switch", 2468), "p2p_fast_root_complex": _figure("root complex", 2355),
               "p2p_stream": _figure("switch", 4442), "p2p_message": _figure("switch", 60),
               "bounce": _figure("switch", 289), "cpu_copy": _figure("switch", 238),
               "groups": {"0000:02:00.0": 10}, "kernel": {}, "size": 16 << 20, "backend": "type1"}
    text = p2p.report(16 << 20, figures, memcpy)
    lines = text.splitlines()
    assert "figures (16 MiB, TCG):" in lines
    assert any(line.split()[:4] == ["P2P", "A->B,", "peer", "fast"] and "2468 MB/s" in line for line in lines)
    assert any(line.split()[:3] == ["P2P", "A->C,", "peer"] for line in lines)
    cold = next(line for line in lines if "host memcpy, cold" in line)
    assert f"{memcpy.cold_mb_s:.0f} MB/s" in cold
    hot = next(line for line in lines if "host memcpy, hot" in line)
    assert f"{memcpy.hot_mb_s:.0f} MB/s" in hot
