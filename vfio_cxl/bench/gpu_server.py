"""Benchmark of the GPU server alone (no VM): DMA throughput and doorbell latency.

    python -m vfio_cxl.bench gpu-server [--size-mib 32] [--runs 3] [--latency-runs 9]

The server runs as its own process (``python -m vfio_cxl.devices.gpu serve``), as
with QEMU; this process plays QEMU with the vfio-user client, answering the
server's DMA messages from local buffers.  Measured:

* host memcpy bandwidth (memoryview copy between two memfd mappings);
* direct path: DMA_MAP with a memfd, the server copies through its mmap;
* message path: DMA_MAP without fd, data travels in DMA_READ / DMA_WRITE;
* doorbell -> MSI-X eventfd for one 1 MiB VRAM -> host descriptor.

Each throughput figure is the median of ``--runs`` single-descriptor
transfers, timed from the (posted) doorbell write to the MSI-X eventfd.
"""

from __future__ import annotations

import argparse
import mmap
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.vfio_user.client import GuestMemory, VfioUserClient, wait_eventfd
from vfio_cxl.devices.gpu.regs import DESC_FLAG_INTERRUPT, Op, Status, pack_descriptor

MB = 1_000_000
RING_IOVA = 0x1000_0000
DIRECT_IOVA = 0x1_0000_0000
MESSAGE_IOVA = 0x2_0000_0000
RING_ENTRIES = 64

TARGET_DIRECT_FRACTION = 0.5
TARGET_MESSAGE_MBPS = 500
TARGET_LATENCY_MS = 5.0


def memcpy_bandwidth(size: int, runs: int) -> float:
    """MB/s of a memoryview copy between two pre-touched memfd mappings."""
    bufs = []
    for name in ("src", "dst"):
        fd = os.memfd_create(f"bench-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        os.close(fd)
        mm.write(b"\x5a" * size)  # fault every page in first
        bufs.append(mm)
    src, dst = (memoryview(b) for b in bufs)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - t0)
    src.release()
    dst.release()
    for b in bufs:
        b.close()
    return size / statistics.median(times) / MB


class Bench:
    def __init__(self, sock: str, size: int):
        self.memory = GuestMemory()
        self.ring = self.memory.add(RING_IOVA, 2 * RING_ENTRIES * regs.DESC_SIZE, shared=True)
        self.direct = self.memory.add(DIRECT_IOVA, size, shared=True)
        self.message = self.memory.add(MESSAGE_IOVA, size, shared=False)
        self.client = VfioUserClient(sock, self.memory, timeout=30)
        c = self.client
        c.negotiate()
        c.map_area(self.ring, direct=True)
        c.map_area(self.direct, direct=True)
        c.map_area(self.message, direct=False)
        self.efds = c.attach_msix(regs.MSIX_VECTORS)
        self.compl_iova = RING_IOVA + RING_ENTRIES * regs.DESC_SIZE
        c.reset()
        c.set_bus_master()
        c.reg_write(regs.REG_RING_BASE_LO, RING_IOVA)
        c.reg_write(regs.REG_RING_SIZE, RING_ENTRIES)
        c.reg_write(regs.REG_COMPL_BASE_LO, self.compl_iova)
        c.reg_write(regs.REG_CONTROL, regs.CONTROL_ENABLE)
        self.tail = 0
        for area in (self.direct, self.message):  # touch every page once
            area.view[:] = bytes(len(area.view))

    def run(self, op: int, src: int, dst: int, length: int) -> float:
        """One descriptor; seconds from doorbell to MSI-X."""
        index = self.tail
        off = index * regs.DESC_SIZE
        self.ring.view[off:off + regs.DESC_SIZE] = pack_descriptor(
            op, src, dst, length, DESC_FLAG_INTERRUPT, cookie=index)
        self.tail = (self.tail + 1) % RING_ENTRIES
        t0 = time.perf_counter()
        self.client.reg_write(regs.REG_RING_TAIL, self.tail, posted=True)
        fired = wait_eventfd(self.efds[regs.VEC_DMA_DONE], 30)
        elapsed = time.perf_counter() - t0
        if not fired:
            raise RuntimeError(f"no MSI-X within 30 s (ERR_STATUS "
                               f"{self.client.reg_read(regs.REG_ERR_STATUS)})")
        coff = self.compl_iova - RING_IOVA + index * regs.COMPL_SIZE
        record = regs.unpack_completion(self.ring.view[coff:coff + regs.COMPL_SIZE])
        if record["status"] != Status.OK or record["bytes_done"] != length:
            raise RuntimeError(f"descriptor failed: {record}")
        return elapsed

    def close(self) -> None:
        for fd in self.efds:
            os.close(fd)
        self.client.close()
        self.memory.close()


def start_server(sock: str, vram_mib: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "vfio_cxl.devices.gpu", "serve", "--socket", sock,
                             "--vram-mib", str(vram_mib)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != f"READY {sock}":
        proc.kill()
        raise RuntimeError(f"server did not start (got {line!r})")
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench gpu-server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=32, help="bytes per throughput run")
    parser.add_argument("--runs", type=int, default=3, help="throughput runs (median)")
    parser.add_argument("--latency-runs", type=int, default=9, help="1 MiB latency runs (median)")
    args = parser.parse_args(argv)
    size = args.size_mib * regs.MIB
    vram_mib = max(64, 1 << (args.size_mib - 1).bit_length())

    memcpy = memcpy_bandwidth(size, args.runs)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        sock = os.path.join(tmp, "gpu.sock")
        proc = start_server(sock, vram_mib)
        try:
            bench = Bench(sock, size)
            try:
                results = measure(bench, size, args.runs, args.latency_runs)
            finally:
                bench.close()
        finally:
            proc.terminate()
            proc.wait(10)
    report(memcpy, size, results, args)
    return 0


def measure(bench: Bench, size: int, runs: int, latency_runs: int) -> dict:
    bench.run(Op.FILL_PRNG, 1991, 0, size)  # VRAM content to move
    cases = {
        "direct  VRAM->host": (Op.VRAM_TO_HOST, 0, DIRECT_IOVA),
        "direct  host->VRAM": (Op.HOST_TO_VRAM, DIRECT_IOVA, 0),
        "message VRAM->host": (Op.VRAM_TO_HOST, 0, MESSAGE_IOVA),
        "message host->VRAM": (Op.HOST_TO_VRAM, MESSAGE_IOVA, 0),
    }
    results = {}
    for name, (op, src, dst) in cases.items():
        bench.run(op, src, dst, size)  # warm-up (first-touch faults in the server's mmaps)
        times = [bench.run(op, src, dst, size) for _ in range(runs)]
        results[name] = size / statistics.median(times) / MB
    # sanity: the bytes really arrived on both paths
    expect = regs.prng_bytes(1991, 1 << 20)
    for area in (bench.direct, bench.message):
        if bytes(area.view[:1 << 20]) != expect:
            raise RuntimeError(f"wrong bytes at IOVA {area.iova:#x}")
    for name, dst in (("direct", DIRECT_IOVA), ("message", MESSAGE_IOVA)):
        bench.run(Op.VRAM_TO_HOST, 0, dst, 1 << 20)
        lat = [bench.run(Op.VRAM_TO_HOST, 0, dst, 1 << 20) for _ in range(latency_runs)]
        results[f"latency {name}"] = statistics.median(lat) * 1000
    return results


def report(memcpy: float, size: int, r: dict, args) -> None:
    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    direct = min(r["direct  VRAM->host"], r["direct  host->VRAM"])
    message = min(r["message VRAM->host"], r["message host->VRAM"])
    lat = max(r["latency direct"], r["latency message"])
    print(f"GPU server DMA benchmark ({size >> 20} MiB per transfer, median of {args.runs}; "
          f"latency median of {args.latency_runs})")
    print(f"  host memcpy                 {memcpy:9.0f} MB/s")
    for name in ("direct  VRAM->host", "direct  host->VRAM", "message VRAM->host",
                 "message host->VRAM"):
        print(f"  {name:27s} {r[name]:9.0f} MB/s  ({r[name] / memcpy:5.1%} of memcpy)")
    print(f"  1 MiB VRAM->host doorbell->MSI-X: direct {r['latency direct']:.2f} ms, "
          f"message {r['latency message']:.2f} ms")
    print(f"targets: direct >= {TARGET_DIRECT_FRACTION:.0%} of memcpy: "
          f"{verdict(direct >= TARGET_DIRECT_FRACTION * memcpy)} ({direct / memcpy:.0%}); "
          f"message >= {TARGET_MESSAGE_MBPS} MB/s: {verdict(message >= TARGET_MESSAGE_MBPS)} "
          f"({message:.0f}); 1 MiB latency <= {TARGET_LATENCY_MS} ms: "
          f"{verdict(lat <= TARGET_LATENCY_MS)} ({lat:.2f} ms)")


if __name__ == "__main__":
    sys.exit(main())
