"""The memcpy reference the DMA benchmarks compare against (our own logic; no timing asserted)."""

from __future__ import annotations

from vfio_cxl.bench import reference


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
