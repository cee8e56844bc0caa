"""In the guest: the storage paths side by side (``scripts/bench storage`` runs this).

    python3 -m vfio_cxl.guest.cmd.storage_bench [--quick] [--nvme BDF --gpu BDF] [--backend type1|iommufd]

Cells: path (bounce, p2p, cmb, gpu-initiated) x I/O size x queue depth, each reading ``WORK``
bytes of the namespace (written once beforehand, a seeded pattern) into VRAM:

* bounce: QEMU's NVMe reads ``depth`` requests into guest RAM (one doorbell), then the GPU copies
  each into VRAM (HOST_TO_VRAM) -- cuFile's compatibility mode;
* p2p: the NVMe reads straight into VRAM (its PRPs point at the GPU's BAR2 IOVA), ``depth`` in
  flight, one doorbell per refill;
* cmb: the NVMe reads ``depth`` requests into its own Controller Memory Buffer (served inside
  the controller, no DMA), then the GPU copies each CMB -> VRAM by peer reads (DMA_READ
  messages through its window); depth is bounded by the CMB's size;
* gpu-initiated: one NVME_IO descriptor; the GPU drives an NVMe queue pair in its VRAM;
* gpu-initiated-cmb-sq: the same with the SQ in the NVMe's CMB (the GPU writes the entries
  there by peer writes; GPU interface 1.3).

The cells run in ``--rounds`` rounds, every path once per round, so paths are compared under
the same host load (the host's other work inflates a TCG guest's CPU times: see ``cpu_seconds``).

Per cell: wall time, per-request latency (submit -> completion seen), guest CPU seconds of this
process (``time.process_time``: the scheduler's runtime of all its threads) per GB, its wall-clock start and end (the
host maps them to its load), GPU messages per I/O (the driver's RING_TAIL
writes, each one vfio-user REGION_WRITE, plus the GPU's doorbell DMA_WRITEs counted by
MSGWIN_WRITES), bytes through guest RAM and bytes QEMU carried into the BAR; and every byte
read back through the BAR2 mmap and compared.  Prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

from ...devices.gpu import regs
from ...devices.gpu.regs import Op
from ..drivers.nvme import IoOp
from ..drivers.gpu import Transfer
from .storage_checks import pick, put
from ..storage.gpu_initiated import GpuQueue
from ..storage.session import CMB_IOVA, VRAM_IOVA, StorageSession

SEED = 2026
FULL = {"sizes": (4096, 65536, 1 << 20), "depths": (1, 8, 32, 64), "work": 16 << 20}
PATHS = ("bounce", "p2p", "cmb", "gpu-initiated", "gpu-initiated-cmb-sq")
GPU_PATHS = {"gpu-initiated": False, "gpu-initiated-cmb-sq": True}     # path -> SQ in the CMB
QUICK = {"cells": [("bounce", 1 << 20, 8), ("p2p", 1 << 20, 8), ("cmb", 1 << 20, 4), ("gpu-initiated", 1 << 20, 16),
                   ("gpu-initiated-cmb-sq", 1 << 20, 16),
                   ("bounce", 4096, 32), ("p2p", 4096, 32), ("cmb", 4096, 32), ("gpu-initiated", 4096, 32),
                   ("gpu-initiated-cmb-sq", 4096, 32)],
         "work": {1 << 20: 16 << 20, 4096: 4 << 20}, "rounds": 3}


def cpu_seconds() -> float:
    """This process's CPU time, every thread, not its children, not wall time:
    CLOCK_PROCESS_CPUTIME_ID, the scheduler's own runtime count (nanoseconds).  Not ``os.times``:
    user/system there are sampled at the timer tick (10 ms here), so a cell that spends 5 ms
    of CPU is charged 0 or 10 ms depending on where the ticks fell -- at a few ms per cell the
    figure was mostly noise.  Under TCG the guest clock follows the host's, and the guest
    kernel has no steal time for a vCPU thread the host preempted (``/proc/stat`` steal stays
    0): time the host gives to others while this process is on the vCPU is charged to it.  So
    a figure taken under load is inflated by the load at that moment; the bench compares paths
    within one round."""
    return time.process_time()


def tick_cpu_seconds() -> float:
    """The same from ``os.times`` (user + system at tick resolution), reported beside."""
    t = os.times()
    return t.user + t.system


def steal_ticks() -> int:
    """The guest's steal time so far (``/proc/stat``, all CPUs): 0 under TCG (reported beside)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def percentile(values: list[float], p: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, len(ordered) * p // 100)]


def run_cell(s: StorageSession, gq: GpuQueue, path: str, size: int, depth: int, work: int, data: bytes,
             bounce=None) -> dict:
    """One cell; ``bounce`` is the bounce path's guest-RAM buffer, mapped once beforehand (as
    cuFile's compatibility mode keeps a pinned pool): its mapping is set-up, not per-I/O work."""
    count = work // size
    gpu, nvme = s.gpu, s.nvme
    gpu.vram.view(0, work)[:] = bytes(work)
    order = list(range(count))
    random.Random(size * depth).shuffle(order)
    lat: list[float] = []
    runs = 0
    writes0, reads0 = gpu.bar0.read32(regs.REG_MSGWIN_WRITES), gpu.bar0.read32(regs.REG_MSGWIN_READS)
    guest_ram = qemu_bar = cmb_bytes = 0
    if path == "cmb" and s.window not in ("cmb", "doorbells+cmb"):
        s.set_cmb_window()
    steal0, wall0, ticks0 = steal_ticks(), time.time(), tick_cpu_seconds()
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    step = nvme.max_transfer                       # a request of more than MDTS is several commands
    pieces = -(-size // step)
    if path in GPU_PATHS:
        depth_used = min(depth, gq.entries - 1, regs.NVME_MAX_DEPTH)
        cmds = [(order[i] * size + o, min(step, size - o), i * size + o) for i in range(count)
                for o in range(0, size, step)]
        r = gq.run(cmds, depth=min(depth_used * pieces, gq.entries - 1, regs.NVME_MAX_DEPTH), count_messages=False)
        runs += 1
        lat = [float(max(r["latency_us"][i * pieces:(i + 1) * pieces])) for i in range(count)]
        ok_status = all(st == 0 for st in r["statuses"])
        qemu_bar = work
        split = {k: r[k] for k in ("submit_s", "submit_cpu_s", "wait_s", "wait_cpu_s")}
    else:
        split = {}
        queue = nvme.queues[1]
        depth_used = max(1, min(depth, queue.tracker.depth // pieces))
        if path == "cmb":
            depth_used = max(1, min(depth_used, s.cmb_staging // size))
        ok_status = True
        if path == "bounce":
            depth_used = max(1, min(depth_used, bounce.size // size))
        i = 0
        while i < count:
            n = min(depth_used, count - i)
            reqs = []
            for k in range(n):
                base = {"p2p": VRAM_IOVA + (i + k) * size, "cmb": CMB_IOVA + k * size}.get(path)
                base = bounce.iova + k * size if base is None else base
                for o in range(0, size, step):
                    reqs.append(nvme.submit_rw(queue, IoOp.READ, 1, order[i + k] * size + o, min(step, size - o),
                                               base + o, sgl=path == "cmb"))
            queue.ring()
            nvme.wait(queue, reqs, 30)
            now = time.monotonic()
            for k in range(n):
                lat.append((now - reqs[k * pieces].submitted) * 1e6)
            ok_status &= all(req.completion.ok for req in reqs)
            if path == "bounce":
                copies = [Transfer(Op.HOST_TO_VRAM, src=bounce.iova + k * size, dst=(i + k) * size, length=size)
                          for k in range(n)]
                gpu.run(copies, timeout=60)
                runs += 1
                guest_ram += n * size
            elif path == "cmb":
                s.gpu_copy(*[Transfer(Op.HOST_TO_VRAM, src=CMB_IOVA + k * size, dst=(i + k) * size, length=size)
                             for k in range(n)])
                runs += 1
                cmb_bytes += n * size
            else:
                qemu_bar += n * size
            i += n
    seconds = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    ticks = tick_cpu_seconds() - ticks0
    wall1, steal = time.time(), steal_ticks() - steal0
    window_reads = (gpu.bar0.read32(regs.REG_MSGWIN_READS) - reads0) & 0xFFFFFFFF
    messages = runs + ((gpu.bar0.read32(regs.REG_MSGWIN_WRITES) - writes0) & 0xFFFFFFFF) + window_reads
    vram = gpu.vram.read(0, work)
    verified = ok_status and all(vram[i * size:(i + 1) * size] == data[order[i] * size:(order[i] + 1) * size]
                                 for i in range(count))
    return {"path": path, "io_size": size, "queue_depth": depth_used, "requests": count, "bytes": work,
            "mb_s": work / seconds / 1e6, "iops": count / seconds, "lat_p50_us": percentile(lat, 50),
            "lat_p99_us": percentile(lat, 99), "guest_cpu_s": cpu, "guest_cpu_s_per_gb": cpu / (work / 1e9),
            "guest_cpu_ticks_s": ticks,
            "gpu_messages_per_io": messages / count, "gpu_window_reads": window_reads,
            "guest_ram_bytes": guest_ram, "qemu_bar_bytes": qemu_bar, "cmb_bytes": cmb_bytes,
            "guest_steal_ticks": steal, "t_start": wall0, "t_end": wall1, "verified": verified, **split}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.storage_bench")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--nvme")
    p.add_argument("--gpu")
    p.add_argument("--backend", default="type1", choices=("type1", "iommufd"))
    p.add_argument("--rounds", type=int, help="every cell this many times, paths interleaved "
                   "(default: 3 with --quick, else 1)")
    args = p.parse_args(argv)
    nvme_bdf, gpu_bdf = pick(args.nvme, args.gpu)
    if args.quick:
        cells, work_of = QUICK["cells"], QUICK["work"]
    else:
        cells = [(path, size, depth) for size in FULL["sizes"] for depth in FULL["depths"] for path in PATHS]
        work_of = {size: FULL["work"] if size >= 65536 else 4 << 20 for size in FULL["sizes"]}
    rounds = args.rounds or (QUICK["rounds"] if args.quick else 1)
    if rounds < 1:
        p.error(f"--rounds {rounds}: give 1 or more")
    work_max = max(work_of.values())
    data = random.Random(SEED).randbytes(work_max)
    rows = []
    with StorageSession.open(nvme_bdf, gpu_bdf, mode="p2p", backend=args.backend) as s:
        put(s, 0, data)
        skipped = {}
        if s.nvme.cap.cmbs:
            s.map_cmb()
        else:
            skipped["cmb"] = f"{nvme_bdf} has no Controller Memory Buffer (CAP.CMBS = 0)"
            skipped["gpu-initiated-cmb-sq"] = skipped["cmb"]
        gq = None
        staging = s.nvme.dma_buffer(max([min(work_of[size], depth * size) for path, size, depth in cells
                                         if path == "bounce"] or [4096]))
        try:
            for r in range(rounds):
                for path, size, depth in cells:
                    if path in skipped:
                        continue
                    if path in GPU_PATHS and (gq is None or gq.sq_in_cmb != GPU_PATHS[path]):
                        if gq is not None:   # one GPU queue at a time (one spare queue, one doorbell mapping)
                            gq.close()
                            gq = None
                        gq = GpuQueue(s, entries=128, sq_in_cmb=GPU_PATHS[path])
                    rows.append({"round": r, **run_cell(s, gq, path, size, depth, work_of[size],
                                                        data[:work_of[size]], staging)})
        finally:
            s.nvme.free(staging)
            if gq is not None:
                gq.close()
        bounce = s.nvme.max_transfer
        cmb = vars(s.nvme.cmb) if s.nvme.cmb else None
    print(json.dumps({"nvme": nvme_bdf, "gpu": gpu_bdf, "backend": args.backend, "mdts": bounce,
                      "data_sha256": hashlib.sha256(data).hexdigest(), "data_bytes": work_max,
                      "data_seed": SEED, "rounds": rounds, "cmb": cmb, "skipped": skipped,
                      "guest_clock": time.time(), "cells": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
