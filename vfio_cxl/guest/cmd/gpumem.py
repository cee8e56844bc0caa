"""In the guest: many GPU-memory runs in one process, the guest half of `scripts/bench gpumem`.

    python3 -m vfio_cxl.guest.cmd.gpumem --plan JSON|- [--gpu BDF]

The bench sends the plan as JSON on stdin (``--plan -``: the guest's SSH server refuses a
command line of over 9,000 bytes, and the quick plan's 72 runs are more); each run is
``vfio_cxl.guest.gpumem.GpuMemory.run`` (docs/gpu-memory.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..drivers.gpu import GpuError
from ..gpumem import GpuMemory, layout


PLAN_MAX = 1 << 20   # bytes of a plan read from stdin


def bench(plan: list[dict], bdf: str | None = None) -> list[dict]:
    """Each entry: kernel, mode, latency, working_set, vram_cache, unit, warm.  Inputs are
    prepared once per (kernel, working set) and reused (scatter, which updates in place,
    every time)."""
    out = []
    far = max(layout(p["kernel"], p["working_set"]).size for p in plan)
    with GpuMemory.open(bdf, far) as mem:
        prepared: dict = {}
        for p in plan:
            key = (p["kernel"], p["working_set"])
            if p["kernel"] == "scatter" or key not in prepared:
                lay = layout(p["kernel"], p["working_set"])
                prepared[key] = (lay, mem.prepare(lay, p.get("seed", 1)))
            out.append(mem.run(p["kernel"], p["mode"], p["latency"], p["working_set"],
                               p.get("vram_cache"), p.get("unit", "64K"), p.get("warm", False),
                               prepared=prepared[key]))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.gpumem")
    parser.add_argument("--plan", required=True, help="JSON list of runs, or - to read it from stdin")
    parser.add_argument("--gpu", metavar="BDF")
    args = parser.parse_args(argv)
    text = sys.stdin.read(PLAN_MAX + 1) if args.plan == "-" else args.plan
    if len(text) > PLAN_MAX:
        parser.error(f"the plan is over {PLAN_MAX} bytes: split it into several runs of this command")
    try:
        plan = json.loads(text)
    except ValueError as err:
        parser.error(f"the plan is not JSON ({err}): a list of runs, see vfio_cxl.guest.gpumem")
    try:
        print(json.dumps(bench(plan, args.gpu)))
    except GpuError as err:
        print(f"gpumem: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
