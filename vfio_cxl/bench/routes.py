"""Route A vs route B in a real guest (boots ``single``): MB/s and copies, median of N.

    python -m vfio_cxl.bench routes [--sizes 1M,16M] [--runs 3] [--lab NAME]
"""

from __future__ import annotations

import argparse
import json

from ..lab import topology
from ..lab.borrow import add_lab_option, booted_or_borrowed
from ..lab.lab import Lab


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench routes", description=__doc__)
    parser.add_argument("--sizes", default="1M,16M")
    parser.add_argument("--runs", type=int, default=3)
    add_lab_option(parser, "single")
    args = parser.parse_args(argv)

    def boot():
        return Lab(topology.load("single"), log=lambda *_: None)

    with booted_or_borrowed(args, "single", boot, command="scripts/bench routes") as lab:
        out = lab["host0"].run(f"vfio-cxl-m vfio_cxl.guest.cmd.bench_routes --sizes {args.sizes} --runs {args.runs}",
                               timeout=600).stdout
    print(f"{'route':42} {'size':>8} {'copies':>6} {'median ms':>10} {'MB/s':>8}")
    for r in json.loads(out):
        print(f"{r['route']:42} {r['size'] >> 20:>6} MiB {r['copies']:>6} {r['median_ms']:>10.2f} {r['mb_per_s']:>8.0f}")
    print(f"(median of {args.runs}; TCG guest, GPU served over vfio-user; route A's copy is the guest CPU's)")
    return 0
