"""The far-memory model on synthetic access streams (docs/gpu-memory.md): the SR
prefetcher, the DS backlog and modelled time as a function of counts only."""

import numpy as np
import pytest

from vfio_cxl.devices.gpu import model as m

MODEL = m.Model()


def counters(**kw):
    c = dict.fromkeys(m.COUNTER_NAMES, 0)
    c.update(kw)
    return c


def stream(n_lines, start=1 << 34):
    return np.arange(start, start + n_lines, dtype=np.int64)


def test_sr_on_a_stream_hits_at_least_90_percent():
    lines = stream(1 << 16)
    r = m.speculative_reads(lines, np.zeros(len(lines), np.int8), 8, 128, MODEL)
    assert r.hit_rate >= 0.9, r
    assert r.issued >= r.hits and r.wasted == r.issued - r.hits
    assert r.wasted <= 8 + 128   # only what runs past the end of the stream


def test_sr_on_a_random_gather_gains_at_most_10_percent():
    rng = np.random.default_rng(1)
    n_idx_lines = 4096
    table = 1 << 40 >> 6
    # per index line (16 u32 indices): the index line, then 16 random table lines
    idx = np.repeat(stream(n_idx_lines), 17)
    pcs = np.tile(np.array([0] + [1] * 16, np.int8), n_idx_lines)
    data = rng.integers(table, table + (1 << 20), size=len(idx))
    lines = np.where(pcs == 0, idx, data)
    base = m.modelled_ns(counters(far_lines_read=len(lines)), MODEL)["total_ns"]
    r = m.speculative_reads(lines, pcs, 8, 128, MODEL)
    sr = m.modelled_ns(counters(far_lines_read=int((~r.hit).sum()), sr_issued=r.issued,
                                sr_hits=r.hits, sr_late=r.late), MODEL)["total_ns"]
    assert base / sr <= 1.10, (base, sr, r)
    assert not r.hit[pcs == 1].any(), "a random gather must not be predicted"


def test_sr_late_when_the_distance_is_shorter_than_the_latency():
    lines = stream(8192)
    far = m.speculative_reads(lines, np.zeros(8192, np.int8), 4, 256, MODEL.with_profile("cxl-250ns"))
    near = m.speculative_reads(lines, np.zeros(8192, np.int8), 4, 8, MODEL.with_profile("cxl-250ns"))
    assert far.late == 0 and near.late == near.hits > 0


def test_sr_throttles_when_speculation_overloads_the_endpoint():
    # short runs of 3 with a new stride each time: every run trains then stops, wasting degree lines
    rng = np.random.default_rng(2)
    starts = rng.integers(0, 1 << 30, size=20000) * 64
    lines = (starts[:, None] + np.arange(3)[None, :]).ravel()
    r = m.speculative_reads(lines, np.zeros(len(lines), np.int8), 16, 4, MODEL, window=4096)
    assert r.throttled > 0 and r.wasted > r.hits


def test_ds_backlog_stays_empty_when_the_endpoint_keeps_up_and_stalls_when_it_does_not():
    w = np.tile([False, True], 1 << 15)      # copy: one read, one write
    fast = m.deterministic_store(w, 4096, MODEL)
    assert fast.stalls == 0 and fast.hwm <= 64 and fast.staged == 1 << 15
    slow = m.deterministic_store(w, 4096, MODEL.with_profile("ssd"))
    assert slow.stalls > 0 and slow.hwm == 4096 and slow.pending > 0
    assert slow.staged + slow.stalls == 1 << 15


def test_modelled_time_depends_on_counts_only():
    c = counters(far_lines_read=1000, far_lines_written=500, vram_lines=10, faults=2, fault_batches=2,
                 bytes_migrated=8192)
    assert m.modelled_ns(c, MODEL) == m.modelled_ns(dict(c), MODEL)
    more = dict(c, fault_batches=3)
    assert m.modelled_ns(more, MODEL)["total_ns"] - m.modelled_ns(c, MODEL)["total_ns"] == pytest.approx(45_000)


def test_uvm_is_charged_per_batch_and_per_byte_not_per_fault():
    one = counters(faults=1, fault_batches=1, bytes_migrated=64 << 10)
    batched = counters(faults=32, fault_batches=1, bytes_migrated=2 << 20, prefetched_bytes=1 << 20)
    t_one, t_batched = (m.modelled_ns(c, MODEL)["uvm_ns"] for c in (one, batched))
    assert t_one == pytest.approx(45_000 + (64 << 10) / 16)
    assert t_batched == pytest.approx(45_000 + (2 << 20) / 16)   # prefetched bytes: among those migrated


def test_the_profiles_order_as_their_latencies():
    c = counters(far_lines_read=1 << 20)
    t = {p: m.modelled_ns(c, MODEL.with_profile(p))["total_ns"] for p in m.PROFILES}
    assert t["cxl-80ns"] < t["cxl-250ns"] < t["ssd"]
    assert t["cxl-250ns"] / t["cxl-80ns"] >= 1.3
    with pytest.raises(ValueError, match="unknown latency profile 'cxl-1ns'"):
        MODEL.with_profile("cxl-1ns")


def test_resident_vram_is_at_least_as_fast_as_far_memory():
    n = 1 << 20
    vram = m.modelled_ns(counters(vram_lines=n), MODEL)["total_ns"]
    far = m.modelled_ns(counters(far_lines_read=n), MODEL)["total_ns"]
    assert vram <= far
