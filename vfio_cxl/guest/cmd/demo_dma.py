"""In the guest: the GPU DMAs a payload from its VRAM straight into CXL devdax (route B).

    python3 -m vfio_cxl.guest.cmd.demo_dma [--size BYTES] [--offset BYTES] [--json]

The payload starts with the seed's string and continues with the GPU's PRNG
fill; the driver checks the bytes it reads back through the devdax mapping.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from ...devices.gpu.regs import Op
from .. import cxl
from ..dax import DaxMapping
from ..drivers.gpu import GpuDriver, Transfer
from ..payload import MESSAGE, SEED, expected_payload

def run(size: int, offset: int, bdf: str | None = None) -> dict:
    dax_device = cxl.ensure_ram_devdax()
    if offset % 4096 or offset < 0 or size <= len(MESSAGE) or offset + size > dax_device.size:
        raise cxl.CxlError(f"--size {size} at --offset {offset} does not fit devdax {dax_device.name} "
                           f"({dax_device.size} bytes): the offset must be a multiple of 4096, the size more than "
                           f"{len(MESSAGE)} bytes (the message), and offset + size at most the devdax size",
                           f"use --size <= {dax_device.size - offset}")
    with DaxMapping(dax_device) as dax, GpuDriver.open(bdf) as gpu:
        if size > gpu.vram_size:
            raise cxl.CxlError(f"--size {size} exceeds the GPU's VRAM ({gpu.vram_size} bytes)", "use a smaller --size")
        dax.write(offset, bytes(size))                      # so stale data cannot pass the check
        t0 = time.perf_counter()
        with gpu.map(dax.map, GpuDriver.DATA_IOVA):
            t_map = time.perf_counter() - t0
            gpu.vram_write(0, MESSAGE)                      # CPU store into VRAM (BAR2)
            gpu.run([Transfer(Op.FILL_PRNG, src=SEED, dst=len(MESSAGE), length=size - len(MESSAGE))])
            t1 = time.perf_counter()
            (done,) = gpu.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=GpuDriver.DATA_IOVA + offset, length=size)])
            t_dma = time.perf_counter() - t1
        landed = dax.read(offset, size)
        backend = gpu.device.backend
    want = hashlib.sha256(expected_payload(size)).hexdigest()
    got = hashlib.sha256(landed).hexdigest()
    return {"message": landed[:len(MESSAGE)].decode(errors="replace"), "bytes": done["bytes_done"],
            "size": size, "offset": offset, "dax": str(dax_device.path), "region": dax_device.region,
            "sha256_expected": want, "sha256_read": got, "match": want == got,
            "map_ms": t_map * 1e3, "dma_ms": t_dma * 1e3, "device_us": done["duration_ns"] / 1e3,
            "mb_per_s": size / t_dma / 1e6, "vfio_backend": backend}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.demo_dma", description=__doc__)
    parser.add_argument("--size", type=lambda s: int(s, 0), default=1 << 20)
    parser.add_argument("--offset", type=lambda s: int(s, 0), default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        result = run(args.size, args.offset)
    except cxl.CxlError as err:
        print(f"demo_dma: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print(f"GPU wrote: {result['message']!r} + {result['size'] - len(MESSAGE)} bytes of PRNG fill")
        print(f"{result['bytes']} bytes into {result['dax']} ({result['region']}) at offset {result['offset']:#x}")
        print(f"checksum {'MATCH' if result['match'] else 'MISMATCH'}: sha256 {result['sha256_read'][:16]}… "
              f"(VFIO backend: {result['vfio_backend']})")
        print(f"DMA map {result['map_ms']:.1f} ms; doorbell→MSI-X {result['dma_ms']:.2f} ms "
              f"({result['mb_per_s']:.0f} MB/s); device time {result['device_us']:.0f} µs")
    return 0 if result["match"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
