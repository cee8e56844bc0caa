"""Boot-to-SSH time of one VM (the single topology, GPU attached), median of N boots,
for Debian's kernel (the image's) and the lab kernel side by side.

    python -m vfio_cxl.bench boot [--runs 3] [--no-gpu] [--kernel PATH|lab|debian ...]
"""

from __future__ import annotations

import argparse
import statistics

from ..lab import topology
from ..lab.image import find_image
from ..lab.kernel import cached_lab_kernel, resolve
from ..lab.lab import Lab
from ..lab.qemu_runtime import find_runtime

TARGETS = {"debian": "<= 15 s", "lab": "<= 4 s"}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench boot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-gpu", action="store_true")
    parser.add_argument("--kernel", action="append", metavar="PATH|lab|debian",
                        help="kernels to time (default: debian, and lab if it is built)")
    args = parser.parse_args(argv)
    kernels = args.kernel or ["debian"] + (["lab"] if cached_lab_kernel() else [])
    runtime, image = find_runtime(), find_image()
    chosen = {name: None if name == "debian" else resolve(name, provision=False) for name in kernels}
    seconds: dict[str, list[float]] = {name: [] for name in kernels}
    releases: dict[str, str] = {}
    for run in range(1, args.runs + 1):
        for name, kernel in chosen.items():   # alternating, so every kernel sees the same machine load
            with Lab(topology.load("single"), runtime=runtime, image=image, gpu=not args.no_gpu,
                     kernel=kernel, log=lambda *_: None) as lab:
                seconds[name].append(lab["host0"].boot_seconds)
                releases[name] = lab["host0"].run("uname -r").stdout.strip()
            print(f"{name} boot {run}: {seconds[name][-1]:.2f} s to SSH ({releases[name]})")
    rows = [(name, releases[name], seconds[name]) for name in kernels]
    print(f"{runtime.version_string}, accel tcg")
    print(f"{'kernel':8} {'release':28} {'median':>7} {'min':>6} {'max':>6}  target")
    for name, release, seconds in rows:
        print(f"{name:8} {release:28} {statistics.median(seconds):6.2f}s {min(seconds):5.2f}s "
              f"{max(seconds):5.2f}s  {TARGETS.get(name, '')}")
    if not args.kernel and "lab" not in kernels:
        print("lab      (not built: vfio-cxl provision --kernel lab)")
    return 0
