"""Two VMs, one CXL memory: the channel against TCP over the private link (boots ``shared``).

    python -m vfio_cxl.bench share [--records 200] [--plan PLAN] [--json]

1. Sizes 64 B, 4 KiB, 64 KiB, 1 MiB (``vfio_cxl.guest.share_bench``): the CXL
   channel (consumer polling shared memory) and TCP over the private link
   between the same two guests, same payloads, same check (one CRC32 per
   payload at the receiver), CPU-copied in at the sender.  Latency: one record
   in flight, hand-over in a -> checked payload in b, on a's clock (b's clock
   mapped over the link, NTP style).  Throughput: records back to back, at b.
   Beside them, the guest's own zlib.crc32 rate.
2. GPU-placed records (``vfio_cxl.guest.stream``): GPU completion (MSI-X) in a
   -> record visible in b, polling and "record N ready" over the link, 1..16 KiB.
3. The cost of the x86 cache operations (``vfio_cxl.cacheline bench``) in VM b.

``--json``: one object with ``channel_mb_s`` and ``tcp_mb_s`` (1 MiB records),
``guest_crc32_mb_s``, ``poll_latency_ms_median`` and ``tcp_latency_ms_median``
(one-way, 64 B), ``poll_rtt_ms_median`` and ``tcp_rtt_ms_median`` (round trip,
64 B), ``sizes`` (every size), ``gpu`` (part 2), ``guest_cache_operations`` (part 3).
"""

from __future__ import annotations

import argparse
import json
import statistics

from .. import cacheline
from ..demos.share import B_LINK_ADDRESS, STREAM, latencies_ms, stream
from ..guest.share_bench import DEFAULT_PLAN, parse_plan
from ..lab import topology
from ..lab.lab import Lab

SHARE_BENCH = "python3 -m vfio_cxl.guest.share_bench"


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


def transport_run(lab: Lab, transport: str, plan: str, timeout: float = 120) -> tuple[dict, dict]:
    """The receiver in b and the sender in a at once; both sides' JSON."""
    a, b = lab["a"], lab["b"]
    if transport == "channel":
        a.run(f"{STREAM} reset")              # no stale header for b to attach to
    common = f"--transport {transport} --plan {plan} --timeout {timeout}"
    receiver = b.start_command(f"{SHARE_BENCH} recv {common}", timeout=timeout + 900)
    sent = json.loads(a.run(f"{SHARE_BENCH} send {common} --peer {B_LINK_ADDRESS}", timeout=timeout + 900).stdout)
    got = receiver.join(check=False)
    if got.exited != 0:
        raise RuntimeError(f"{transport} receiver failed: {got.stderr.strip()}")
    return sent, json.loads(got.stdout)


def phases(plan: list[tuple[int, int, str]], sent: dict, got: dict) -> dict:
    """Per size: median latency (paced records) and MB/s (streamed records)."""
    if got["bad"] or len(got["seen_at"]) != len(sent["sent_at"]):
        raise RuntimeError(f"{sent['transport']}: {got['bad']} bad payloads, {len(got['seen_at'])} of "
                           f"{len(sent['sent_at'])} records checked")
    offset = sent["clock"]["offset"]
    out: dict[int, dict] = {}
    i = 0
    for size, count, mode in plan:
        sent_at, seen_at = sent["sent_at"][i:i + count], got["seen_at"][i:i + count]
        acked_at = sent["acked_at"][i:i + count]
        i += count
        row = out.setdefault(size, {})
        if mode == "paced":
            lat = [(seen - offset - t) * 1e3 for t, seen in zip(sent_at, seen_at)]
            row["latency_ms_median"], row["latency_ms_p95"] = statistics.median(lat), _p95(lat)
            rtt = [(acked - t) * 1e3 for t, acked in zip(sent_at, acked_at)]
            row["rtt_ms_median"] = statistics.median(rtt)
        else:
            row["mb_s"] = size * (count - 1) / (seen_at[-1] - seen_at[0]) / 1e6
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench share", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200, help="GPU-placed records per run (part 2; 0: skip)")
    parser.add_argument("--max-size", type=int, default=16 << 10)
    parser.add_argument("--plan", default=DEFAULT_PLAN, help="SIZE:COUNT:paced|stream,... (part 1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    plan = parse_plan(args.plan)
    gpu_rows = []
    try:
        cacheline.build()                     # the guests load the host's build of the x86 cache operations
        guest_cache_ops: dict | str = {}
    except cacheline.CachelineError as e:
        guest_cache_ops = f"not measured: {e}"
    with Lab(topology.load("shared"), log=lambda *_: None) as lab:
        if isinstance(guest_cache_ops, dict):
            guest_cache_ops = json.loads(lab["b"].run("python3 -m vfio_cxl.cacheline bench --json",
                                                      timeout=300).stdout)
        runs = {t: transport_run(lab, t, args.plan) for t in ("channel", "tcp")}
        table = {t: phases(plan, *runs[t]) for t in runs}
        crc_rate = runs["channel"][1]["guest_crc32_mb_s"]
        clock_rtt = runs["channel"][0]["clock"]["rtt"] * 1e3
        for notify in (False, True) if args.records else ():
            paced = stream(lab, args.records, notify=notify, paced=True, max_size=args.max_size)
            streamed = stream(lab, args.records, notify=notify, max_size=args.max_size)
            lat = latencies_ms(paced)
            b = streamed["b"]
            gpu_rows.append({"mode": "link notification" if notify else "polling",
                             "latency_ms_median": statistics.median(lat), "latency_ms_p95": _p95(lat),
                             "records_s": len(b["delivered"]) / b["elapsed"], "mb_s": b["bytes"] / b["elapsed"] / 1e6,
                             "clock_rtt_ms": paced["a"]["clock"]["rtt"] * 1e3})
    sizes = sorted(table["channel"])
    big, small = max(sizes), min(sizes)
    result = {"channel_mb_s": table["channel"][big].get("mb_s"), "tcp_mb_s": table["tcp"][big].get("mb_s"),
              "guest_crc32_mb_s": crc_rate,
              "poll_latency_ms_median": table["channel"][small].get("latency_ms_median"),
              "tcp_latency_ms_median": table["tcp"][small].get("latency_ms_median"),
              "poll_rtt_ms_median": table["channel"][small].get("rtt_ms_median"),
              "tcp_rtt_ms_median": table["tcp"][small].get("rtt_ms_median"),
              "clock_rtt_ms": clock_rtt,
              "sizes": [{"size": s, "channel": table["channel"][s], "tcp": table["tcp"][s]} for s in sizes],
              "gpu": gpu_rows, "guest_cache_operations": guest_cache_ops}
    if args.json:
        print(json.dumps(result))
        return 0

    def cell(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    print("VM a -> VM b (TCG): CXL channel (polling) vs TCP over the private link; same payloads, "
          "CRC32-checked at b")
    print(f"{'size':>8} | {'round trip':>10} {'':>10} | {'one-way':>10} {'':>10} | {'throughput':>10}")
    print(f"{'':>8} | {'CXL':>10} {'TCP':>10} | {'CXL':>10} {'TCP':>10} | {'CXL MB/s':>10} {'TCP MB/s':>10} "
          f"{'CXL/TCP':>8}")
    for s in sizes:
        c, t = table["channel"][s], table["tcp"][s]
        ratio = f"{c['mb_s'] / t['mb_s']:.1f}x" if "mb_s" in c and "mb_s" in t else "-"
        print(f"{s:>8} | {cell(c, 'rtt_ms_median', '>7.2f')} ms {cell(t, 'rtt_ms_median', '>7.2f')} ms | "
              f"{cell(c, 'latency_ms_median', '>7.2f')} ms {cell(t, 'latency_ms_median', '>7.2f')} ms | "
              f"{cell(c, 'mb_s', '>10.1f')} {cell(t, 'mb_s', '>10.1f')} {ratio:>8}")
    print(f"guest zlib.crc32: {crc_rate:.0f} MB/s.  Medians, one record in flight.  Round trip: hand-over in a -> "
          f"checked in b -> b's ack seen in a, on a's clock.  One-way: b's clock mapped onto a's, error <= half "
          f"the clock rtt ({clock_rtt:.2f} ms)")
    if isinstance(guest_cache_ops, dict):
        per_mib, line = guest_cache_ops["per_size_us"], guest_cache_ops["per_line_ns_single_call"]
        print(f"\ncache operations in VM b ({guest_cache_ops['coherence']}; TCG, so no real caches behind them): "
              f"write back a dirty MiB {per_mib['flush_dirty']:.0f} us, invalidate a MiB {per_mib['invalidate']:.0f} us, "
              f"one line per call + MFENCE {line['flush+fence']:.0f} ns (cffi call alone "
              f"{line['cffi_call_overhead(nop, no fence)']:.0f} ns)")
    else:
        print(f"\ncache operations in the guest: {guest_cache_ops}")
    if gpu_rows:
        print(f"\n{args.records} GPU-placed records of 1..{args.max_size} bytes, GPU in VM a -> shared CXL -> VM b")
        print(f"{'mode':18} {'latency median':>15} {'p95':>9} {'records/s':>10} {'MB/s':>7} {'clock rtt':>10}")
        for r in gpu_rows:
            print(f"{r['mode']:18} {r['latency_ms_median']:>12.2f} ms {r['latency_ms_p95']:>6.2f} ms "
                  f"{r['records_s']:>10.0f} {r['mb_s']:>7.1f} {r['clock_rtt_ms']:>7.2f} ms")
        print("(latency: GPU MSI-X in a -> record visible in b, one record in flight)")
    return 0
