"""Host memcpy, the reference the DMA benchmarks print their figures beside.

A memcpy's speed on this kind of machine depends more on where its bytes are
than on its size: a 16 MiB copy repeated between the same two buffers runs
out of the last-level cache (a cloud host's L3 can be hundreds of MiB:
~12 GB/s measured on a 2-core TCG lab machine), where a copy of bytes that are
not in any cache runs at memory speed (~4.5-5 GB/s on the same machine).  A
device model's DMA copies VRAM the guest or another process wrote a moment
ago, never the same hot buffer twice, so the benchmarks measure both:

* **cold** (the reference the targets use): each run copies a different
  ``size`` slot of two pools that together hold at least four times the
  last-level cache (STREAM's sizing rule), so no run finds its bytes cached;
* **hot**: the same two buffers every run (what a naive loop measures).

Both pools are memfd mappings, as VRAM and guest RAM are.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from dataclasses import dataclass

STREAM_FACTOR = 4             # STREAM: arrays >= 4x the sum of the last-level caches
FALLBACK_LLC = 32 << 20       # when sysfs does not say
MAX_POOL = 4 << 30            # per pool: the machine must not swap for a reference figure


def last_level_cache() -> int:
    """Bytes of the largest cache sysfs lists for CPU 0 (a shared L3 on most machines)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = [e for e in os.listdir(base) if e.startswith("index")]
    except OSError:
        return FALLBACK_LLC
    for entry in entries:
        try:
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * mult)
    return best or FALLBACK_LLC


@dataclass(frozen=True)
class Memcpy:
    size: int
    cold_mb_s: float     # median over runs, each on bytes in no cache
    hot_mb_s: float      # median over runs, the same two buffers each time
    runs: int
    pool_bytes: int      # each of the two cold pools

    def as_dict(self) -> dict:
        return {"size": self.size, "cold_mb_s": round(self.cold_mb_s), "hot_mb_s": round(self.hot_mb_s),
                "runs": self.runs, "pool_bytes": self.pool_bytes}


def _pool(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    fd = os.memfd_create("bench-reference", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    view = memoryview(mm)
    chunk = b"\x5a" * (1 << 20)
    for off in range(0, nbytes, len(chunk)):   # every page faulted in before timing
        n = min(len(chunk), nbytes - off)
        view[off:off + n] = chunk[:n]
    return mm, view


def _median_mb_s(size: int, seconds: list[float]) -> float:
    return statistics.median(size / s / 1e6 for s in seconds)


def host_memcpy(size: int, runs: int = 15) -> Memcpy:
    """Cold and hot memcpy of ``size`` bytes between two memfd mappings (median of ``runs``)."""
    slots = max(2, -(-STREAM_FACTOR * last_level_cache() // size))
    slots = min(slots, max(2, MAX_POOL // size))
    pool = slots * size
    (src_mm, src), (dst_mm, dst) = _pool(pool), _pool(pool)
    try:
        cold = []
        for i in range(runs):
            # a slot last touched when the pools were filled: >= 4x the cache ago
            k = i % slots
            a, b = src[k * size:(k + 1) * size], dst[k * size:(k + 1) * size]
            t0 = time.perf_counter()
            b[:] = a
            cold.append(time.perf_counter() - t0)
            a.release(), b.release()
        a, b = src[:size], dst[:size]
        b[:] = a   # warm-up: from here on the same bytes, cached
        hot = []
        for _ in range(runs):
            t0 = time.perf_counter()
            b[:] = a
            hot.append(time.perf_counter() - t0)
        a.release(), b.release()
    finally:
        src.release(), dst.release()
        src_mm.close(), dst_mm.close()
    return Memcpy(size, _median_mb_s(size, cold), _median_mb_s(size, hot), runs, pool)
