"""In the guest: the storage paths end to end, each printing one JSON result (VM tests, docs).

    python3 -m vfio_cxl.guest.cmd.storage_checks p2p|compat|cmb [--size N] [--offset N]
    python3 -m vfio_cxl.guest.cmd.storage_checks isolation
    python3 -m vfio_cxl.guest.cmd.storage_checks gpu-initiated [--count N] [--size N] [--depth N] [--sq-in-cmb]
    python3 -m vfio_cxl.guest.cmd.storage_checks reset
    python3 -m vfio_cxl.guest.cmd.storage_checks two-sessions [--mode p2p|compat|cmb] [--size N] [--offset N]
    (all take --nvme BDF --gpu BDF --backend type1|iommufd; default: the GPU and the NVMe
    controller that shares its PCIe switch)
    python3 -m vfio_cxl.guest.cmd.storage_checks hot-remove --nvme BDF --marker PATH
    (no GPU: batches of reads in flight until the controller fails; the host hot-removes it
    once PATH exists)

Every byte is checked: what lands in VRAM is read back through the GPU's BAR2 mmap and compared
with what the namespace holds (written beforehand through guest RAM); what the NVMe wrote from
VRAM is returned as a sha256 for the host to compare with the backing file."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from ...devices.gpu import regs
from ...devices.gpu.regs import Op
from ..drivers.nvme import IoOp, NvmeCommandError, NvmeController, NvmeError, find_controllers
from ..drivers.gpu import Transfer
from ..p2p import route
from ..vfio import find_pci_devices
from ..vfio.errors import VfioError
from ..storage.gpu_initiated import GpuQueue
from ..storage.session import MODES, VRAM_IOVA, StorageError, StorageSession


def pattern(seed: int, length: int) -> bytes:
    return random.Random(seed).randbytes(length)


def pick(nvme: str | None, gpu: str | None) -> tuple[str, str]:
    gpus = find_pci_devices(regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID)
    gpu = gpu or (gpus[0] if gpus else None)
    if gpu is None:
        raise VfioError("no GPU in this VM", "boot the storage topology")
    if nvme is None:
        beside = [n for n in find_controllers() if route(n, gpu)["kind"] == "switch"]
        if not beside:
            raise VfioError(f"no NVMe controller shares a PCIe switch with {gpu}", "give --nvme BDF")
        nvme = beside[0]
    return nvme, gpu


def put(s: StorageSession, offset: int, data: bytes) -> None:
    """The namespace's bytes at ``offset`` through guest RAM (the CPU path)."""
    buf = s.nvme.dma_buffer(len(data))
    try:
        buf.mem[:len(data)] = data
        s.nvme.write(1, offset, buf.iova, len(data))
    finally:
        s.nvme.free(buf)


def check_paths(s: StorageSession, size: int, offset: int) -> dict:
    """Read ``size`` bytes into VRAM and compare through the BAR mmap; then write VRAM's PRNG
    fill to ``offset + size`` (sha256 for the host)."""
    want = pattern(size ^ offset, size)
    put(s, offset, want)
    fh, buf = s.handle_register(1), s.buf_register(0, size)
    s.gpu.vram.view(0, size)[:] = bytes(size)
    n = s.read(fh, buf, size, offset, 0)
    got = s.gpu.vram.read(0, size)
    seed = size + 7
    s.gpu.run([Transfer(Op.FILL_PRNG, src=seed, dst=0, length=size)])
    s.write(fh, buf, size, offset + size, 0)
    return {"mode": s.mode, "vfio_backend": s.backend, "read": n, "read_match": got == want,
            "sha256_read": hashlib.sha256(got).hexdigest(), "written_at": offset + size,
            "sha256_written": hashlib.sha256(regs.prng_bytes(seed, size)).hexdigest(), "stats": s.stats,
            "kernel": s.kernel}


def dmar_faults() -> int:
    """DMAR fault reports in the kernel log so far (the guest's intel-iommu driver prints them)."""
    out = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout
    return sum(1 for line in out.splitlines() if "DMAR" in line and "fault" in line.lower())


def check_isolation(s: StorageSession) -> dict:
    """NVMe -> VRAM with the BAR not mapped for the NVMe: nothing lands in VRAM (read back through
    the BAR mmap); what the controller and the vIOMMU report is returned as they said it."""
    size = 64 << 10
    put(s, 0, pattern(99, size))
    canary = pattern(5, size)
    s.gpu.vram.view(0, size)[:] = canary
    s.unmap_vram()
    faults0 = dmar_faults()
    error = None
    try:
        s.nvme.read(1, 0, VRAM_IOVA, size)
    except NvmeCommandError as err:
        error = {"status": err.status, "what": err.what, "fix": err.fix}
    faults = dmar_faults() - faults0
    unchanged = s.gpu.vram.read(0, size) == canary
    s.map_vram()                 # and with the mapping the same read lands
    s.nvme.read(1, 0, VRAM_IOVA, size)
    return {"error": error, "dmar_faults": faults, "vram_unchanged": unchanged,
            "mapped_read_match": s.gpu.vram.read(0, size) == pattern(99, size)}


def check_gpu_initiated(s: StorageSession, count: int, size: int, depth: int, entries: int = 64,
                        sq_in_cmb: bool = False) -> dict:
    total = count * size
    want = pattern(count ^ size, total)
    put(s, 0, want)
    s.gpu.vram.view(0, total)[:] = bytes(total)
    q = GpuQueue(s, entries=entries, sq_in_cmb=sq_in_cmb)
    try:
        order = list(range(count))
        random.Random(1).shuffle(order)          # request i reads block order[i] into slot i
        result = q.run([(order[i] * size, size, i * size) for i in range(count)], depth=depth)
        vram = s.gpu.vram.read(0, total)
        bad = [i for i in range(count) if vram[i * size:(i + 1) * size] != want[order[i] * size:(order[i] + 1) * size]]
        again = q.run([(0, size, 0)], depth=1)   # the queue carries on from where it stood
    finally:
        q.close()
    lat = sorted(result["latency_us"])
    return {"count": count, "size": size, "depth": depth, "bytes": result["bytes"], "seconds": result["seconds"],
            "statuses_ok": all(st == 0 for st in result["statuses"]), "mismatched": bad[:8],
            "doorbell_messages": result["doorbell_messages"], "again_ok": again["statuses"] == [0],
            "sq_iova": q.sq_iova, "sq_in_cmb": sq_in_cmb,
            "lat_p50_us": lat[len(lat) // 2], "lat_p99_us": lat[min(len(lat) - 1, len(lat) * 99 // 100)]}


def check_reset(s: StorageSession) -> dict:
    """A batch in flight when the controller resets fails cleanly; the controller works after.

    The batch reads into guest RAM: with the NVMe's DMA into the GPU's BAR in flight, a
    controller reset deadlocks QEMU 11.1.3 (docs/storage.md, "QEMU 11.1's nvme")."""
    size, count = 512 << 10, 64
    buf = s.nvme.dma_buffer(size * count)
    queue = s.nvme.queues[1]
    reqs = [s.nvme.submit_rw(queue, IoOp.READ, 1, i * size, size, buf.iova + i * size) for i in range(count)]
    queue.ring()
    s.nvme.reset()
    done = sum(1 for r in reqs if r.completion is not None and r.completion.ok)
    failed = [r.extra.get("error") for r in reqs if r.completion is None]
    error = None
    try:
        s.nvme.wait(s.nvme.queues[1], [r for r in reqs if r.completion is None][:1] or reqs[:0], 10)
    except NvmeError as err:
        error = err.what
    s.nvme.free(buf)
    put(s, 0, pattern(3, 4096))
    fh, vbuf = s.handle_register(1), s.buf_register(0, 4096)
    s.read(fh, vbuf, 4096, 0, 0)
    return {"events": done + len(failed), "ok": done, "failed": failed[:2], "failed_count": len(failed),
            "wait_error": error, "after_reset_match": s.gpu.vram.read(0, 4096) == pattern(3, 4096)}


def check_two_sessions(nvme: str, gpu: str, backend: str, size: int, offset: int, mode: str = "p2p") -> dict:
    """Two sessions one after the other in this process, the second opening the same VFIO groups
    (or device cdevs) again: each reads ``size`` bytes into VRAM (CPU-driven, in ``mode``) and 64
    blocks with a GPU queue it leaves open for the session's close; after each close, what is
    left of this process's VFIO and iommufd fds; then a read on the closed session."""
    fds0 = vfio_fds()
    rounds = []
    for i in range(2):
        with StorageSession.open(nvme, gpu, mode=mode, backend=backend) as s:
            want = pattern(size ^ offset ^ i, size)
            put(s, offset, want)
            fh, buf = s.handle_register(1), s.buf_register(0, size)
            s.gpu.vram_write(0, bytes(size))
            n = s.read(fh, buf, size, offset, 0)
            read_match = s.gpu.vram_read(0, size) == want
            block = fh.block_size
            s.gpu.vram_write(0, bytes(64 * block))
            q = GpuQueue(s, entries=16)          # not closed here: the session's close does it
            result = q.run([(offset + k * block, block, k * block) for k in range(64)], depth=8)
            gpu_match = s.gpu.vram_read(0, 64 * block) == want[:64 * block]
        rounds.append({"read": n, "read_match": read_match, "gpu_statuses_ok": result["statuses"] == [0] * 64,
                       "gpu_match": gpu_match, "queue_closed": q.closed,
                       "vfio_fds_left": [fd for fd in vfio_fds() if fd not in fds0]})
    try:
        s.read(fh, buf, block, offset, 0)
        closed_read = None
    except StorageError as err:
        closed_read = {"type": type(err).__name__, "what": err.what, "fix": err.fix}
    except Exception as err:       # what the issue saw: a bare KeyError
        closed_read = {"type": type(err).__name__, "what": str(err), "fix": ""}
    return {"vfio_backend": backend, "mode": mode, "rounds": rounds, "closed_read": closed_read}


def vfio_fds() -> list[str]:
    """This process's open fds into VFIO or iommufd (what a released device must not leave)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("/dev/vfio", "/dev/iommu")) or "vfio" in target:
            found.append(target)
    return found


def check_hot_remove(bdf: str, backend: str, marker: str, size: int = 512 << 10, count: int = 32) -> dict:
    """Batches of ``count`` reads in flight, one after another, until the controller fails
    (the host hot-removes it once ``marker`` exists); then what the driver left: its queues,
    the error, and -- after close -- open VFIO fds, and whether the kernel finished the removal."""
    fds0 = vfio_fds()
    nvme = NvmeController.open(bdf, backend=backend, interrupts=True)
    batches, error, failed, error_at = 0, None, 0, None
    try:
        buf = nvme.dma_buffer(size * count)
        queue = nvme.queues[1]
        deadline = time.monotonic() + 600
        while error is None and time.monotonic() < deadline:
            reqs = [nvme.submit_rw(queue, IoOp.READ, 1, i * size, size, buf.iova + i * size) for i in range(count)]
            queue.ring()
            if batches == 0:
                Path(marker).write_text("in flight\n")
            try:
                nvme.wait(queue, reqs, 30)
            except NvmeError as err:
                error_at = time.time()
                error = {"type": type(err).__name__, "what": err.what, "fix": err.fix}
                failed = sum(1 for r in reqs if r.completion is None)
            batches += 1
        state = {"queues_after_error": len(nvme.queues), "requests_failed": failed,
                 "request_error": next((r.extra.get("error") for r in reqs if r.completion is None), None)}
    finally:
        nvme.close()
    closed_at = time.time()
    sysfs = Path("/sys/bus/pci/devices", bdf)
    while sysfs.exists() and time.time() - closed_at < 60:   # the kernel finishing the removal
        time.sleep(0.1)
    return {"nvme": bdf, "batches": batches, "error": error, "error_at": error_at, "closed_at": closed_at,
            "removed": not sysfs.exists(), "removed_after_close_s": time.time() - closed_at,
            "vfio_fds_left": [fd for fd in vfio_fds() if fd not in fds0], **state}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.storage_checks")
    p.add_argument("check", choices=("p2p", "compat", "cmb", "isolation", "gpu-initiated", "reset", "hot-remove",
                                     "two-sessions"))
    p.add_argument("--marker", default="/tmp/storage-hot-remove.inflight")
    p.add_argument("--nvme")
    p.add_argument("--gpu")
    p.add_argument("--backend", default="type1", choices=("type1", "iommufd"))
    p.add_argument("--mode", default="p2p", choices=MODES, help="two-sessions: the sessions' mode")
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--count", type=int, default=1024)
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--sq-in-cmb", action="store_true", help="gpu-initiated: the SQ in the NVMe's CMB")
    args = p.parse_args(argv)
    try:
        if args.check == "hot-remove":
            if not args.nvme:
                p.error("hot-remove needs --nvme BDF (the controller the host will remove)")
            print(json.dumps(check_hot_remove(args.nvme, args.backend, args.marker)))
            return 0
        nvme, gpu = pick(args.nvme, args.gpu)
        if args.check == "two-sessions":
            out = check_two_sessions(nvme, gpu, args.backend, args.size, args.offset, args.mode)
            print(json.dumps(out | {"nvme": nvme, "gpu": gpu, "route": route(nvme, gpu)["kind"]}))
            return 0
        mode = args.check if args.check in ("compat", "cmb") else "p2p"
        with StorageSession.open(nvme, gpu, mode=mode, backend=args.backend) as s:
            if args.check in ("p2p", "compat", "cmb"):
                out = check_paths(s, args.size, args.offset)
            elif args.check == "isolation":
                out = check_isolation(s)
            elif args.check == "gpu-initiated":
                out = check_gpu_initiated(s, args.count, args.size if args.size != 1 << 20 else 4096, args.depth,
                                          sq_in_cmb=args.sq_in_cmb)
            else:
                out = check_reset(s)
        out |= {"nvme": nvme, "gpu": gpu, "route": route(nvme, gpu)["kind"]}
    except (VfioError, NvmeError) as err:
        print(f"storage: error: {err.what} -- {err.fix}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
