"""Boot-to-SSH time of one VM (the single topology, GPU attached), median of N boots.

    python -m vfio_cxl.bench boot [--runs 3] [--no-gpu]
"""

from __future__ import annotations

import argparse
import statistics

from ..lab import topology
from ..lab.image import find_image
from ..lab.lab import Lab
from ..lab.qemu_runtime import find_runtime


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench boot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-gpu", action="store_true")
    args = parser.parse_args(argv)
    runtime, image = find_runtime(), find_image()
    seconds = []
    for run in range(1, args.runs + 1):
        with Lab(topology.load("single"), runtime=runtime, image=image, gpu=not args.no_gpu,
                 log=lambda *_: None) as lab:
            seconds.append(lab["host0"].boot_seconds)
        print(f"boot {run}: {seconds[-1]:.2f} s to SSH")
    print(f"{runtime.version_string}, accel tcg, kernel {image.manifest['kernel']}")
    print(f"boot-to-SSH median of {len(seconds)}: {statistics.median(seconds):.2f} s "
          f"(min {min(seconds):.2f}, max {max(seconds):.2f}; target <= 15 s)")
    return 0
