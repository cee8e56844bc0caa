"""Two VMs, one CXL memory: the channel (three wake-ups) against TCP over the private link.

    python -m vfio_cxl.bench share [--records 200] [--plan PLAN] [--json]

1. Boots ``smc`` (two guests, one CXL memory, one shared-memory controller,
   a private link).  Sizes 64 B, 4 KiB, 64 KiB, 1 MiB
   (``vfio_cxl.guest.cmd.share_bench``): the CXL channel with the consumer asleep
   on its SMC doorbell (``doorbell``), polling shared memory (``poll``), asleep
   on a "record N ready" message over the link (``link``), and TCP over the
   link between the same two guests -- same payloads, same check (one CRC32
   per payload at the receiver), CPU-copied in at the sender.  Latency: one
   record in flight, hand-over in a -> checked payload in b (b's clock mapped
   onto a's over the link, NTP style), and the round trip to b's ack on a's
   clock alone.  Throughput: records back to back, at b.  Beside them, the
   guest's own zlib.crc32 rate and b's CPU seconds per transport.  Then the
   cost of the x86 cache operations (``vfio_cxl.guest.cacheline bench``) in VM b.
2. Boots ``shared`` (``--records`` > 0): GPU-placed records
   (``vfio_cxl.guest.cmd.stream``): GPU completion (MSI-X) in a -> record visible
   in b, polling and "record N ready" over the link, 1..16 KiB.

``--json``: one object with ``channel_mb_s`` (1 MiB records, the doorbell
channel), ``poll_mb_s``, ``link_mb_s``, ``tcp_mb_s`` (1 MiB), ``guest_crc32_mb_s``,
``doorbell_latency_ms_median``, ``poll_latency_ms_median``,
``link_latency_ms_median``, ``tcp_latency_ms_median`` (one-way, 64 B), the same
with ``_rtt_`` (round trip, 64 B), ``goal`` (CXL >= 5x TCP at 1 MiB, lower
latency at every size), ``load`` (the host's load average before and after),
``sizes`` (every size and transport), ``consumer_cpu_s``, ``gpu`` (part 2),
``guest_cache_operations``; the table then goes to stderr.  A run that fails says why on
stderr (``bench share: failed: ...``; with ``--json`` also ``{"error": ...}`` on stdout) and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

from ..errors import LabError
from ..guest import cacheline
from ..guest.record_plan import DEFAULT_PLAN, parse_plan
from ..lab import topology
from ..lab.lab import Lab
from ..lab.record_stream import B_LINK_ADDRESS, STREAM, latencies_ms, stream, what_failed

SHARE_BENCH = "vfio-cxl-m vfio_cxl.guest.cmd.share_bench"
BOOT_TIMEOUT = 600          # s per VM to SSH: a loaded 2-core host took over 180 s


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


TRANSPORTS = {"doorbell": "doorbell", "poll": "channel", "link": "link", "tcp": "tcp"}   # column -> --transport


def transport_run(lab: Lab, transport: str, plan: str, timeout: float = 120) -> tuple[dict, dict]:
    """The receiver in b and the sender in a at once; both sides' JSON."""
    a, b = lab["a"], lab["b"]
    if transport != "tcp":
        a.run(f"{STREAM} reset")              # no stale header for b to attach to
    common = f"--transport {transport} --plan {plan} --timeout {timeout}"
    if transport == "doorbell":
        (_, host_a), (_, host_b) = lab.topology.smc_of("a"), lab.topology.smc_of("b")
        send_extra, recv_extra = f" --smc-peer {host_b}", f" --smc-peer {host_a}"
    else:
        send_extra = recv_extra = ""
    # Leaving the block unjoined (the sender's run raised, Ctrl-C) cancels the receiver.
    with b.start_command(f"{SHARE_BENCH} recv {common}{recv_extra}", timeout=timeout + 900) as receiver:
        sender = a.run(f"{SHARE_BENCH} send {common} --peer {B_LINK_ADDRESS}{send_extra}",
                       timeout=timeout + 900, check=False)
        if sender.exited != 0:
            # The receiver is cancelled, unless it has ended: often the cause (the sender waits for it).
            got = receiver.join(check=False) if receiver.done else None
            raise RuntimeError(f"{transport}: sender in a {side_failure(sender)}; receiver in b "
                               + (side_failure(got) if got is not None else "still running (cancelled)"))
        got = receiver.join(check=False)
    if got.exited != 0:
        raise RuntimeError(f"{transport}: receiver in b {side_failure(got)}")
    return json.loads(sender.stdout), json.loads(got.stdout)


def side_failure(result) -> str:
    """How one side ended: its exit status and what it said (share_bench's error line, else the
    exception lines of its traceback, else its last lines)."""
    return f"exited {result.exited}: {what_failed(result.stderr or result.stdout)}"


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


def goal(table: dict, sizes: list[int], big: int) -> dict:
    """Issue 14's goal: CXL (doorbell) >= 5x TCP throughput at 1 MiB, and lower one-way latency at every size."""
    d, t = table["doorbell"], table["tcp"]
    ratio = d[big]["mb_s"] / t[big]["mb_s"] if "mb_s" in d[big] and "mb_s" in t[big] else float("nan")
    not_lower = [s for s in sizes if "latency_ms_median" in d[s] and "latency_ms_median" in t[s]
                 and d[s]["latency_ms_median"] >= t[s]["latency_ms_median"]]
    return {"throughput_ratio_1mib": ratio, "throughput_5x": ratio >= 5,
            "doorbell_latency_lower_everywhere": not not_lower, "doorbell_latency_not_lower_at": not_lower}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench share", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200, help="GPU-placed records per run (part 2; 0: skip)")
    parser.add_argument("--max-size", type=int, default=16 << 10)
    parser.add_argument("--plan", default=DEFAULT_PLAN, help="SIZE:COUNT:paced|stream,... (part 1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        return bench(args)
    except Exception as err:   # a side's failure, a lab that did not come up, bad output: say so
        if not isinstance(err, (LabError, RuntimeError)):
            traceback.print_exc()   # unforeseen: where it came from, too
        said = str(err) if isinstance(err, LabError) else f"{type(err).__name__}: {err}"
        if args.json:   # stdout carries the one object either way
            print(json.dumps({"error": said}), flush=True)
        print(f"bench share: failed: {said}", file=sys.stderr, flush=True)
        return 1


def bench(args: argparse.Namespace) -> int:
    plan = parse_plan(args.plan)
    gpu_rows = []
    try:
        cacheline.build()                     # the guests load the host's build of the x86 cache operations
        guest_cache_ops: dict | str = {}
    except cacheline.CachelineError as e:
        guest_cache_ops = f"not measured: {e}"
    load_before = os.getloadavg()
    with Lab(topology.load("smc"), log=lambda *_: None).start(timeout=BOOT_TIMEOUT) as lab:
        if isinstance(guest_cache_ops, dict):
            guest_cache_ops = json.loads(lab["b"].run("python3 -m vfio_cxl.guest.cacheline bench --json",
                                                      timeout=300).stdout)
        runs = {col: transport_run(lab, t, args.plan) for col, t in TRANSPORTS.items()}
    load_after = os.getloadavg()
    table = {col: phases(plan, *runs[col]) for col in runs}
    crc_rate = runs["poll"][1]["guest_crc32_mb_s"]
    clock_rtt = runs["poll"][0]["clock"]["rtt"] * 1e3
    cpu = {col: runs[col][1]["cpu_seconds"] for col in runs}
    if args.records:
        with Lab(topology.load("shared"), log=lambda *_: None).start(timeout=BOOT_TIMEOUT) as lab:
            for notify in (False, True):
                paced = stream(lab, args.records, notify=notify, paced=True, max_size=args.max_size)
                streamed = stream(lab, args.records, notify=notify, max_size=args.max_size)
                lat = latencies_ms(paced)
                b = streamed["b"]
                gpu_rows.append({"mode": "link notification" if notify else "polling",
                                 "latency_ms_median": statistics.median(lat), "latency_ms_p95": _p95(lat),
                                 "records_s": len(b["delivered"]) / b["elapsed"],
                                 "mb_s": b["bytes"] / b["elapsed"] / 1e6,
                                 "clock_rtt_ms": paced["a"]["clock"]["rtt"] * 1e3})
    sizes = sorted(table["poll"])
    big, small = max(sizes), min(sizes)
    result = {"channel_mb_s": table["doorbell"][big].get("mb_s"), "poll_mb_s": table["poll"][big].get("mb_s"),
              "link_mb_s": table["link"][big].get("mb_s"), "tcp_mb_s": table["tcp"][big].get("mb_s"),
              "guest_crc32_mb_s": crc_rate, "clock_rtt_ms": clock_rtt,
              "load": {"before": load_before, "after": load_after}}
    for col in TRANSPORTS:
        result[f"{col}_latency_ms_median"] = table[col][small].get("latency_ms_median")
        result[f"{col}_rtt_ms_median"] = table[col][small].get("rtt_ms_median")
    result["goal"] = goal(table, sizes, big)
    result.update({"consumer_cpu_s": cpu,
                   "sizes": [{"size": s, **{col: table[col][s] for col in TRANSPORTS}} for s in sizes],
                   "gpu": gpu_rows, "guest_cache_operations": guest_cache_ops})
    if args.json:
        print(json.dumps(result), flush=True)
    out = sys.stderr if args.json else sys.stdout      # with --json the table goes to stderr

    def cell(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    cols = list(TRANSPORTS)
    print("VM a -> VM b (TCG, smc topology): the CXL channel woken by the SMC doorbell / polling / a link "
          "message, vs TCP over the private link; same payloads, CRC32-checked at b", file=out)
    print(f"{'':>8} | {'one-way latency, ms (median)':^35} | {'round trip, ms (median)':^35} | "
          f"{'throughput, MB/s':^35}", file=out)
    heads = " ".join(f"{c:>8}" for c in cols)
    print(f"{'size':>8} | {heads} | {heads} | {heads}", file=out)
    for s in sizes:
        rows = [table[c][s] for c in cols]
        print(f"{s:>8} | " + " ".join(cell(r, "latency_ms_median", ">8.2f") for r in rows) + " | "
              + " ".join(cell(r, "rtt_ms_median", ">8.2f") for r in rows) + " | "
              + " ".join(cell(r, "mb_s", ">8.1f") for r in rows), file=out)
    g = result["goal"]
    print(f"goal: CXL (doorbell) >= 5x TCP throughput at 1 MiB: {g['throughput_ratio_1mib']:.1f}x "
          f"({'met' if g['throughput_5x'] else 'NOT met'}); CXL (doorbell) one-way latency below TCP at every "
          f"size: {'yes' if g['doorbell_latency_lower_everywhere'] else 'no: ' + str(g['doorbell_latency_not_lower_at'])}", file=out)
    print(f"guest zlib.crc32: {crc_rate:.0f} MB/s.  b's CPU seconds over each run: "
          + ", ".join(f"{c} {cpu[c]:.1f}" for c in cols)
          + f".  Host load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (2 cores).", file=out)
    print(f"Medians, one record in flight.  Round trip: hand-over in a -> checked in b -> b's ack seen in a "
          f"(doorbell: b rings a; poll: a polls; link/TCP: one byte back), on a's clock.  One-way: b's clock "
          f"mapped onto a's, error <= half the clock rtt ({clock_rtt:.2f} ms)", file=out)
    if isinstance(guest_cache_ops, dict):
        per_mib, line = guest_cache_ops["per_size_us"], guest_cache_ops["per_line_ns_single_call"]
        print(f"\ncache operations in VM b ({guest_cache_ops['coherence']}; TCG, so no real caches behind them): "
              f"write back a dirty MiB {per_mib['flush_dirty']:.0f} us, invalidate a MiB {per_mib['invalidate']:.0f} us, "
              f"one line per call + MFENCE {line['flush+fence']:.0f} ns (cffi call alone "
              f"{line['cffi_call_overhead(nop, no fence)']:.0f} ns)", file=out)
    else:
        print(f"\ncache operations in the guest: {guest_cache_ops}", file=out)
    if gpu_rows:
        print(f"\n{args.records} GPU-placed records of 1..{args.max_size} bytes, GPU in VM a -> shared CXL -> VM b", file=out)
        print(f"{'mode':18} {'latency median':>15} {'p95':>9} {'records/s':>10} {'MB/s':>7} {'clock rtt':>10}", file=out)
        for r in gpu_rows:
            print(f"{r['mode']:18} {r['latency_ms_median']:>12.2f} ms {r['latency_ms_p95']:>6.2f} ms "
                  f"{r['records_s']:>10.0f} {r['mb_s']:>7.1f} {r['clock_rtt_ms']:>7.2f} ms", file=out)
        print("(latency: GPU MSI-X in a -> record visible in b, one record in flight)", file=out)
    return 0
