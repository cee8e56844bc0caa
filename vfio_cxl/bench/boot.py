"""Boot-to-SSH time per topology (GPU servers attached, regions brought up), median of N boots.

    python -m vfio_cxl.bench boot [--runs 3] [--no-gpu] [--topology NAME | --all]

Default: the single topology.  Each figure is the slowest VM of the lab from
QEMU start to SSH; the time to bring the declared regions up with cxl-cli,
daxctl and ndctl is reported beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ..lab import topology
from ..lab.image import find_image
from ..lab.lab import Lab
from ..lab.qemu_runtime import find_runtime


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench boot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-gpu", action="store_true")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--topology", default="single", help="a topology name or .toml path (default single)")
    which.add_argument("--all", action="store_true", help="every shipped topology")
    args = parser.parse_args(argv)
    names = topology.available() if args.all else [args.topology]
    runtime, image = find_runtime(), find_image()
    print(f"{runtime.version_string}, accel tcg, kernel {image.manifest['kernel']}")
    rows = []
    for name in names:
        topo = topology.load(name)
        boots, totals = [], []
        for run in range(1, args.runs + 1):
            t0 = time.monotonic()
            with Lab(topo, runtime=runtime, image=image, gpu=not args.no_gpu, log=lambda *_: None) as lab:
                totals.append(time.monotonic() - t0)
                boots.append(max(vm.boot_seconds for vm in lab.vms.values()))
            print(f"{name} boot {run}: {boots[-1]:.2f} s to SSH (slowest of {len(topo.vms)} VMs), "
                  f"{totals[-1]:.2f} s with regions up")
        rows.append((name, len(topo.vms), statistics.median(boots), statistics.median(totals)))
    print(f"\n{'topology':12} {'VMs':>3} {'boot-to-SSH':>12} {'+ regions':>10}   (median of {args.runs}; "
          "reference: single's target <= 15 s)")
    for name, count, boot, total in rows:
        print(f"{name:12} {count:3d} {boot:11.2f}s {total:9.2f}s")
    return 0
