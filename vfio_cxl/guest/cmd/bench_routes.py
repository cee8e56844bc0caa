"""In the guest: route A (GPU -> guest RAM, then CPU copy into CXL) vs route B (GPU -> CXL).

    python3 -m vfio_cxl.guest.cmd.bench_routes [--sizes 1M,16M] [--runs 3]   (JSON out)
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time

from ...devices.gpu.regs import Op
from .. import cxl
from ..dax import DaxMapping
from ..drivers.gpu import GpuDriver, Transfer


def _size(text: str) -> int:
    return int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text)


def measure(sizes: list[int], runs: int) -> list[dict]:
    dax_device = cxl.ensure_ram_devdax()
    results = []
    with DaxMapping(dax_device) as dax, GpuDriver.open() as gpu:
        bounce = mmap.mmap(-1, max(sizes))
        bounce_view = memoryview(bounce)
        with gpu.map(dax.map, GpuDriver.DATA_IOVA), gpu.map(bounce, GpuDriver.BOUNCE_IOVA):
            for size in sizes:
                gpu.run([Transfer(Op.FILL_PRNG, src=size, dst=0, length=size)])
                route_a, route_b = [], []
                for _ in range(runs):
                    start = time.perf_counter()
                    gpu.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=GpuDriver.BOUNCE_IOVA, length=size)])
                    dax.view[:size] = bounce_view[:size]            # the extra CPU copy
                    route_a.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    gpu.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=GpuDriver.DATA_IOVA, length=size)])
                    route_b.append(time.perf_counter() - start)
                for route, times, copies in (("A: GPU -> guest RAM -> CPU copy -> CXL", route_a, 2),
                                             ("B: GPU -> CXL devdax", route_b, 1)):
                    median = statistics.median(times)
                    results.append({"route": route, "size": size, "copies": copies,
                                    "median_ms": median * 1e3, "mb_per_s": size / median / 1e6})
        bounce_view.release()
        bounce.close()
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.bench_routes", description=__doc__)
    parser.add_argument("--sizes", default="1M,16M")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(measure([_size(s) for s in args.sizes.split(",")], args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
