"""Cross-VM visibility latency and throughput through shared CXL memory (boots ``shared``).

    python -m vfio_cxl.bench share [--records 200]

Latency: GPU completion (MSI-X) in VM a -> record visible in VM b, one record
in flight, on a's clock (b's clock mapped over the link, NTP style).
Throughput: records streamed back to back.  Both for polling shared memory
and for "record N ready" over the private link.
"""

from __future__ import annotations

import argparse
import statistics

from ..demos.share import latencies_ms, stream
from ..lab import topology
from ..lab.lab import Lab


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench share", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--max-size", type=int, default=16 << 10)
    args = parser.parse_args(argv)
    rows = []
    with Lab(topology.load("shared"), log=lambda *_: None) as lab:
        for notify in (False, True):
            paced = stream(lab, args.records, notify=notify, paced=True, max_size=args.max_size)
            streamed = stream(lab, args.records, notify=notify, max_size=args.max_size)
            lat = latencies_ms(paced)
            b = streamed["b"]
            rows.append(("link notification" if notify else "polling", statistics.median(lat), _p95(lat),
                         len(b["delivered"]) / b["elapsed"], b["bytes"] / b["elapsed"] / 1e6,
                         paced["a"]["clock"]["rtt"] * 1e3))
    print(f"{args.records} records of 1..{args.max_size} bytes, GPU in VM a -> shared CXL -> VM b (TCG)")
    print(f"{'mode':18} {'latency median':>15} {'p95':>9} {'records/s':>10} {'MB/s':>7} {'clock rtt':>10}")
    for mode, median, p95, rate, mbs, rtt in rows:
        print(f"{mode:18} {median:>12.2f} ms {p95:>6.2f} ms {rate:>10.0f} {mbs:>7.1f} {rtt:>7.2f} ms")
    print("(latency: one record in flight; clock offset error <= half the clock rtt)")
    return 0
