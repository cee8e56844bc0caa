"""In the guest: checks of the GPU driver stack against the real kernel (JSON out).

    python3 -m vfio_cxl.guest.cmd.gpu_checks isolation
    python3 -m vfio_cxl.guest.cmd.gpu_checks random [--count 100] [--seed 1]
    python3 -m vfio_cxl.guest.cmd.gpu_checks unmapped [--count 1]

``isolation``: a descriptor whose destination IOVA is not mapped must fail
with the device's fault status on the error vector, and leave devdax and
every other mapped buffer unchanged.  ``random``: transfers of random sizes
and offsets into devdax, each verified by checksum; afterwards no DMA
mapping and no file descriptor remains.  ``unmapped``: ``--count`` descriptors,
one after the other, each writing 64 bytes to a never-mapped page (page i of
0x70000000, modulo 256); each must halt the ring with the device's fault
status at that IOVA, and the ring must work afterwards (the guest's IOMMU
logs the faults the device reports to QEMU: docs/gpu-device.md, "Faults").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import random
import sys
import time
from collections import Counter

from ...devices.gpu import regs
from ...devices.gpu.regs import Op, Status
from .. import cxl
from ..dax import DaxMapping
from ..drivers.gpu import GpuDmaError, GpuDriver, Transfer

UNMAPPED_IOVA = 0x7000_0000


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def isolation() -> dict:
    dax_device = cxl.ensure_ram_devdax()
    with DaxMapping(dax_device) as dax, GpuDriver.open() as gpu:
        canary = mmap.mmap(-1, 1 << 20)
        canary[:] = bytes([0xA5]) * len(canary)
        dax.write(0, os.urandom(1 << 20))
        before = (hashlib.sha256(dax.view).hexdigest(), hashlib.sha256(canary).hexdigest())
        with gpu.map(dax.map, GpuDriver.DATA_IOVA), gpu.map(canary, GpuDriver.BOUNCE_IOVA):
            gpu.run([Transfer(Op.FILL_PATTERN, src=0x1122334455667788, dst=0, length=1 << 20)])
            try:
                gpu.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=UNMAPPED_IOVA, length=1 << 20, cookie=0xBAD)])
                fault = None
            except GpuDmaError as err:
                fault = {"status": Status(err.status).name, "index": err.index, "cookie": err.cookie,
                         "address": err.address, "errno": err.errno, "message": str(err)}
            after = (hashlib.sha256(dax.view).hexdigest(), hashlib.sha256(canary).hexdigest())
            # The driver reset the ring after the fault: it must work again.
            gpu.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=GpuDriver.BOUNCE_IOVA, length=4096)])
            recovered = canary[:4096] == regs.pattern_bytes(0x1122334455667788, 4096)
        canary.close()
        backend = gpu.device.backend
    return {"fault": fault, "dax_unchanged": before[0] == after[0], "canary_unchanged": before[1] == after[1],
            "recovered": recovered, "vfio_backend": backend}


def random_transfers(count: int, seed: int) -> dict:
    rng = random.Random(seed)
    fds_before = _fds()
    dax_device = cxl.ensure_ram_devdax()
    verified = 0
    failures = []
    with DaxMapping(dax_device) as dax:
        gpu = GpuDriver.open()
        try:
            with gpu.map(dax.map, GpuDriver.DATA_IOVA):
                for i in range(count):
                    length = rng.randint(1, 256 << 10)
                    offset = rng.randrange(0, dax.size - length)
                    vram = rng.randrange(0, gpu.vram_size - length)
                    prng_seed = rng.getrandbits(64)
                    gpu.run([Transfer(Op.FILL_PRNG, src=prng_seed, dst=vram, length=length),
                             Transfer(Op.VRAM_TO_HOST, src=vram, dst=GpuDriver.DATA_IOVA + offset, length=length)])
                    got = hashlib.sha256(dax.view[offset:offset + length]).digest()
                    if got == hashlib.sha256(regs.prng_bytes(prng_seed, length)).digest():
                        verified += 1
                    else:
                        failures.append({"i": i, "offset": offset, "length": length})
            mappings_left = len(gpu.device.mappings) - 1   # the driver's own control ring
        finally:
            gpu.close()
    return {"count": count, "verified": verified, "failures": failures[:5],
            "mappings_after_unmap": mappings_left, "fds_leaked": sorted(_fds() - fds_before)}


def unmapped_faults(count: int) -> dict:
    statuses, wrong, first = Counter(), 0, None
    with GpuDriver.open() as gpu:
        bounce = mmap.mmap(-1, 4096)
        with gpu.map(bounce, GpuDriver.BOUNCE_IOVA):
            start = time.monotonic()
            for i in range(count):
                iova = UNMAPPED_IOVA + (i % 256) * 4096
                try:
                    gpu.run([Transfer(Op.VRAM_TO_HOST, src=0, dst=iova, length=64, cookie=0xBAD)])
                    fault = None
                except GpuDmaError as err:
                    fault = {"status": Status(err.status).name, "address": err.address,
                             "errno": err.errno, "cookie": err.cookie}
                statuses[fault["status"] if fault else "OK"] += 1
                wrong += fault is None or fault["address"] != iova
                first = first or fault
            seconds = time.monotonic() - start
            gpu.run([Transfer(Op.FILL_PATTERN, src=7, dst=0, length=4096),
                     Transfer(Op.VRAM_TO_HOST, src=0, dst=GpuDriver.BOUNCE_IOVA, length=4096)])
            recovered = bounce[:] == regs.pattern_bytes(7, 4096)
        bounce.close()
        bdf, backend = gpu.device.bdf, gpu.device.backend
    return {"count": count, "statuses": dict(statuses), "wrong_address": wrong, "first": first,
            "seconds": round(seconds, 3), "recovered": recovered, "bdf": bdf, "vfio_backend": backend}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.gpu_checks", description=__doc__)
    parser.add_argument("check", choices=["isolation", "random", "unmapped"])
    parser.add_argument("--count", type=int, default=None,
                        help="transfers (random: default 100) or faults (unmapped: default 1)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.check == "isolation":
        result = isolation()
    elif args.check == "random":
        result = random_transfers(100 if args.count is None else args.count, args.seed)
    else:
        result = unmapped_faults(1 if args.count is None else args.count)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
