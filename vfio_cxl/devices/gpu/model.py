"""The far-memory latency model of the GPU (docs/gpu-memory.md is its statement).

Pure code: no device state, no I/O.  Three parts:

* ``modelled_ns(counters, model)`` -- modelled execution time as a function of
  the events the device counted (far lines read / written, SR issued / hit /
  late, DS staged / stalled, fault batches, bytes migrated, VRAM lines) and of the
  model's parameters.  It never sees a mode's name: two runs with the same
  counts take the same modelled time.
* ``speculative_reads`` -- the SR prefetcher (a per-load-instruction stride
  prefetcher with a degree and a distance, throttled by the endpoint's load
  as CXL QoS telemetry would report it), simulated over an access stream with
  numpy, window by window.
* ``deterministic_store`` -- the DS write-through backlog (a fluid queue that
  drains at the endpoint's write rate), window by window.

Access streams are 64-byte line numbers in program order (numpy int64 arrays).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

LINE = 64  # bytes per cache line: the unit of every far access

# --------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """A CXL memory endpoint as seen from the GPU: round trip of the controllers and
    link (``controller_ns``) plus the medium's own access time."""

    name: str
    controller_ns: float
    media_read_ns: float
    media_write_ns: float
    source: str

    @property
    def read_ns(self) -> float:
        return self.controller_ns + self.media_read_ns

    @property
    def write_ns(self) -> float:
        return self.controller_ns + self.media_write_ns


DRAM_NS = 50.0  # DRAM media access behind an endpoint controller (tRCD + CL + queueing, DDR4/5 class)

PROFILES = {
    "cxl-80ns": Endpoint(
        "cxl-80ns", 80.0, DRAM_NS, DRAM_NS,
        "seed 004 (HotStorage 2024): the paper's CXL controller, ~80 ns round trip; DRAM media assumed"),
    "cxl-250ns": Endpoint(
        "cxl-250ns", 250.0, DRAM_NS, DRAM_NS,
        "seed 004: prototype endpoint controllers reported by Samsung and Meta, ~250 ns; DRAM media assumed"),
    "ssd": Endpoint(
        "ssd", 80.0, 3000.0, 10000.0,
        "low-latency flash behind the 80 ns controller: read ~3 us (Z-NAND / XL-Flash class tR), "
        "write 10 us (assumed: a buffered program)"),
}
PROFILE_NAMES = tuple(PROFILES)  # index = the LATENCY_PROFILE register value


@dataclass(frozen=True)
class Model:
    endpoint: Endpoint = PROFILES["cxl-80ns"]
    link_gbps: float = 32.0  # GB/s each way: CXL 2.0 x8 at 32 GT/s (flit overhead ignored)
    mlp: int = 64  # outstanding line requests the GPU keeps in flight (far and VRAM)
    vram_ns: float = 100.0  # VRAM access latency (HBM2-class device memory, assumed)
    vram_gbps: float = 512.0  # VRAM bandwidth (HBM2-class, assumed)
    buffer_ns: float = 10.0  # SR buffer hit: on-chip SRAM in the GPU's CXL controller (assumed)
    # one fault batch: fault interrupt, the driver's service, replay.  GPGPU-Sim UVMSmart's
    # far-fault latency, 66,645 cycles at 1481 MHz; the lab charges it per stop of the GPU
    batch_ns: float = 45_000.0
    pcie_gbps: float = 16.0  # UVM migration: PCIe 3.0 x16 (UVMSmart's default)
    sources: dict = field(default_factory=lambda: {
        "link_gbps": "PCIe 5.0 / CXL 2.0 x8: 32 GT/s x 8 lanes / 8 bits ~ 32 GB/s per direction",
        "mlp": "assumed: 64 outstanding 64-byte requests per memory port",
        "vram": "assumed: HBM2-class device memory, 100 ns, 512 GB/s",
        "batch_ns": "GPGPU-Sim UVMSmart default far-fault latency: 66,645 core cycles at 1481 MHz = 45 us, "
                    "charged once per fault batch (a stop of the GPU: interrupt, service, replay)",
        "pcie_gbps": "UVMSmart: PCIe 3.0 x16, 16 GB/s",
    })

    def with_profile(self, name: str) -> "Model":
        if name not in PROFILES:
            raise ValueError(f"unknown latency profile {name!r}: one of {', '.join(PROFILES)}")
        return Model(PROFILES[name], self.link_gbps, self.mlp, self.vram_ns, self.vram_gbps,
                     self.buffer_ns, self.batch_ns, self.pcie_gbps, self.sources)

    def describe(self) -> dict:
        d = asdict(self)
        d["endpoint"]["read_ns"] = self.endpoint.read_ns
        d["endpoint"]["write_ns"] = self.endpoint.write_ns
        d["line_bytes"] = LINE
        return d


# --------------------------------------------------------------------------
# Modelled time
# --------------------------------------------------------------------------
COUNTER_NAMES = (
    "far_lines_read",  # demand reads that went to the endpoint (SR misses included)
    "far_lines_written",  # lines written to the endpoint (synchronously or drained by DS)
    "vram_lines",  # kernel line accesses served by VRAM (uvm resident pages, DS staging)
    "sr_issued", "sr_hits", "sr_late", "sr_wasted", "sr_throttled",
    "ds_staged", "ds_stalls", "ds_backlog_hwm",
    "faults", "migrations", "evictions", "bytes_migrated",
    "fault_batches", "prefetched_bytes",
)


def modelled_ns(c, model: Model) -> dict:
    """Modelled time (ns) of the work behind counters ``c`` (a mapping of COUNTER_NAMES),
    with its parts.  Reads, writes, VRAM and the fault path are serialised (a
    memory-bound kernel, no compute time); within each part the time is the larger of
    latency / MLP and bytes / bandwidth; the DS drain runs in the background and shows
    only where it outlasts everything else."""
    ep = model.endpoint
    link = model.link_gbps  # GB/s == bytes per ns
    reads = c["far_lines_read"]
    late = min(c["sr_late"], c["sr_hits"])
    timely = c["sr_hits"] - late
    read_latency = (reads + late / 2) * ep.read_ns / model.mlp + timely * model.buffer_ns / model.mlp
    read_bw = (reads + c["sr_issued"]) * LINE / link
    t_read = max(read_latency, read_bw)

    staged = min(c["ds_staged"], c["far_lines_written"])
    sync_writes = c["far_lines_written"] - staged  # DS stalls are among them
    t_write = max(sync_writes * ep.write_ns / model.mlp, sync_writes * LINE / link)

    vram = c["vram_lines"]
    t_vram = max(vram * model.vram_ns / model.mlp, vram * LINE / model.vram_gbps)

    # per batch and per byte (prefetched bytes are among bytes_migrated); the faults of one
    # batch share its round trip, as NVIDIA's driver services them together
    t_uvm = c["fault_batches"] * model.batch_ns + c["bytes_migrated"] / model.pcie_gbps

    foreground = t_read + t_write + t_vram + t_uvm
    drain = staged * LINE / link
    t_drain = max(0.0, drain - foreground)
    total = foreground + t_drain
    return {"total_ns": total, "read_ns": t_read, "write_ns": t_write, "vram_ns": t_vram,
            "uvm_ns": t_uvm, "ds_drain_exposed_ns": t_drain}


def read_line_ns(model: Model) -> float:
    """Time one demand line occupies the read path when requests are pipelined."""
    return max(model.endpoint.read_ns / model.mlp, LINE / model.link_gbps)


def write_line_ns(model: Model) -> float:
    return max(model.endpoint.write_ns / model.mlp, LINE / model.link_gbps)


# --------------------------------------------------------------------------
# SR: speculative reads
# --------------------------------------------------------------------------
@dataclass
class SrResult:
    hit: np.ndarray  # bool per demand read: served from the SR buffer
    issued: int = 0
    hits: int = 0
    late: int = 0
    wasted: int = 0
    throttled: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / len(self.hit) if len(self.hit) else 0.0


SR_WINDOW = 16384  # demand reads per QoS telemetry window
SR_QOS_LIMIT = 1.25  # requests (demand + speculative) per demand read above which SR pauses


def speculative_reads(lines: np.ndarray, pcs: np.ndarray, degree: int, distance: int,
                      model: Model, *, window: int = SR_WINDOW,
                      qos_limit: float = SR_QOS_LIMIT) -> SrResult:
    """Simulate the SR prefetcher over the demand reads ``lines`` (issued by load
    instruction ``pcs``, both in program order).

    Per instruction, a constant non-zero stride seen twice in a row trains it; a
    trained access at line x with stride s tells the endpoint to read
    x + s*distance ... x + s*(distance + degree - 1) ahead (each target once: a run of
    trained accesses adds one new target per access).  A demand read is a hit if such a
    target was issued for it; it is late if it was issued less than one endpoint read
    latency before the demand (the demand stream taken at the link's line rate).
    QoS: when a window's requests (demand misses + speculative reads) exceed
    ``qos_limit`` per demand read, the endpoint reports itself loaded and the prefetcher
    issues nothing in the next window (counted as throttled).
    """
    lines = np.asarray(lines, dtype=np.int64)
    pcs = np.asarray(pcs)
    n = len(lines)
    hit = np.zeros(n, dtype=bool)
    result = SrResult(hit)
    if n == 0 or degree <= 0:
        return result
    enabled = np.ones(n, dtype=bool)
    lead_min = model.endpoint.read_ns / (LINE / model.link_gbps)  # demand reads per read latency
    streams = []
    for p in np.unique(pcs):
        g = np.flatnonzero(pcs == p)
        x = lines[g]
        d = np.zeros(len(x), dtype=np.int64)
        d[1:] = np.diff(x)
        trained = np.zeros(len(x), dtype=bool)
        trained[2:] = (d[2:] != 0) & (d[2:] == d[1:-1])
        streams.append((g, x, d, trained))
    off = 0
    while off < n:
        end = min(n, off + window)
        issued_w = 0
        for g, x, d, trained in streams:
            lo, hi = np.searchsorted(g, off), np.searchsorted(g, end)
            if lo == hi:
                continue
            on = trained[lo:hi] & enabled[g[lo:hi]]
            # new targets: all `degree` after a gap in training, else the one at the far end
            prev_on = np.zeros(hi - lo, dtype=bool)
            ks = np.arange(lo, hi)
            has_prev = ks > 0
            prev = np.where(has_prev, ks - 1, 0)
            prev_on[has_prev] = (trained[prev] & enabled[g[prev]] & (d[prev] == d[ks]))[has_prev]
            issued_w += int(np.sum(np.where(on, np.where(prev_on, 1, degree), 0)))
            # hits: the earliest issuer (largest t) that covers access jj
            jj = np.arange(lo, hi)
            first_t = np.zeros(hi - lo, dtype=np.int64)
            for t in range(distance, distance + degree):
                k = jj - t
                ok = k >= 0
                kk = np.where(ok, k, 0)
                cover = ok & trained[kk] & enabled[g[kk]] & (x[kk] + d[kk] * t == x[jj])
                first_t = np.where(cover, t, first_t)
            is_hit = first_t > 0
            if is_hit.any():
                issuer = jj - first_t
                lead = g[jj] - g[np.where(is_hit, issuer, 0)]
                late = is_hit & (lead < lead_min)
                result.late += int(late.sum())
            hit[g[lo:hi]] = is_hit
        misses_w = int((~hit[off:end]).sum())
        result.issued += issued_w
        if end < n and (misses_w + issued_w) > qos_limit * (end - off):
            nxt = min(n, end + window)
            enabled[end:nxt] = False  # DevLoad says overloaded: SR pauses for one window
            result.throttled += 1
        off = end
    result.hits = int(hit.sum())
    result.wasted = max(0, result.issued - result.hits)
    return result


# --------------------------------------------------------------------------
# DS: deterministic store
# --------------------------------------------------------------------------
@dataclass
class DsResult:
    staged: int = 0  # writes acknowledged once staged in VRAM
    stalls: int = 0  # writes that found the backlog full and waited for the endpoint
    hwm: int = 0  # backlog high-water mark, lines
    pending: int = 0  # lines not yet written when the stream ends (FLUSH drains them)


DS_WINDOW = 4096  # accesses per step of the fluid backlog simulation


def deterministic_store(is_write: np.ndarray, backlog_lines: int, model: Model, *,
                        window: int = DS_WINDOW) -> DsResult:
    """The DS backlog over an access stream (``is_write`` per access, program order).

    Each window of accesses takes the time of its reads (at the demand read rate) and
    of staging its writes in VRAM; meanwhile the backlog drains at the endpoint's write
    rate.  Writes beyond ``backlog_lines`` stall (they are written synchronously)."""
    w = np.asarray(is_write, dtype=bool)
    res = DsResult()
    if not len(w) or not w.any():
        return res
    r_ns = read_line_ns(model)
    v_ns = max(model.vram_ns / model.mlp, LINE / model.vram_gbps)
    drain_ns = write_line_ns(model)
    n = len(w)
    edges = np.arange(0, n + window, window)
    edges[-1] = min(edges[-1], n)
    writes = np.add.reduceat(w.astype(np.int64), edges[:-1])[: len(edges) - 1]
    sizes = np.diff(edges)
    backlog = 0.0
    for a, size in zip(writes.tolist(), sizes.tolist()):
        if size <= 0:
            continue
        t = (size - a) * r_ns + a * v_ns
        backlog = max(0.0, backlog + a - t / drain_ns)
        if backlog > backlog_lines:
            res.stalls += int(round(backlog - backlog_lines))
            backlog = float(backlog_lines)
        res.hwm = max(res.hwm, int(np.ceil(backlog)))
    total = int(w.sum())
    res.stalls = min(res.stalls, total)
    res.staged = total - res.stalls
    # the backlog left, and at least the last MLP writes: still in flight when the stream ends
    res.pending = min(max(int(np.ceil(backlog)), model.mlp), res.staged)
    return res
