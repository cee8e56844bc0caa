"""Benchmark of the GPU server alone (no VM): DMA throughput and doorbell latency.

    scripts/bench gpu-server [--size-mib 32] [--runs 15] [--latency-runs 15]
                             [--max-xfer-mib 64] [--json]

The server runs as its own process (``python -m vfio_cxl.devices.gpu serve``), as
with QEMU; this process plays QEMU with the vfio-user client stand-in,
answering the server's DMA messages from local buffers.  It offers
``--max-xfer-mib`` as its max_data_xfer_size (64 MiB, like a patient QEMU;
QEMU 11.1's default is 1 MiB).  The stand-in is a lean client, and faster than
QEMU at this: like QEMU it reads each message's 16-byte header, then its body,
and answers every DMA_WRITE (unless NO_REPLY), but it receives a DMA_WRITE's
body straight into the target buffer (address and count first, 16 bytes, then
the data: one copy, where QEMU reads the whole body into a bounce buffer and
copies it again into guest memory), sends a DMA_READ reply from the buffer
(one copy, QEMU: the same plus its bounce) through a 4 MiB socket send buffer
(QEMU keeps the system's default), and waits for data in poll(2), as QEMU's
vfio-user I/O thread waits in its event loop on a non-blocking socket (QEMU
then hands each DMA request to a bottom half in its main loop: one more
hop the stand-in does not make).  Measured, side by side in one run:

* host memcpy bandwidth (memoryview copy between two memfd mappings): the reference;
* bare socket copy: another process splices a memfd's pages into a UNIX stream
  socket (as the server sends DMA_WRITE data), this one receives them into a
  buffer -- the kernel's copy out of 4 KiB page fragments, the one copy the
  message path VRAM -> host makes too (in its client, plus the protocol), so
  that path comes near it, not far past it; printed with the ratio of the two;
* direct path, sealed memfd (F_SEAL_SHRINK, like QEMU's memory-backend-memfd):
  the server copies through its mmap;
* direct path, unsealed file (like QEMU's memory-backend-file for CXL): the
  server uses preadv/pwritev (a truncated file cannot crash it);
* message path: DMA_MAP without fd, data travels in DMA_READ / DMA_WRITE;
* doorbell -> MSI-X eventfd for one 1 MiB VRAM -> host descriptor.

Each path gets one warm-up descriptor, then ``--runs`` single-descriptor
transfers, each timed from the (posted) doorbell write to the MSI-X eventfd.
Printed: the median with min-max, the median's share of host memcpy, and
the CPU seconds per GB both processes spent over all runs (server + client,
from the kernel's per-thread run time): a figure other load on the machine
moves little (memory-bandwidth contention still shows), where wall-clock
MB/s drop with every competing process.  The
load average is printed too: figures taken at load >= 1 are low.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.vfio_user.client import GuestMemory, VfioUserClient, wait_eventfd
from vfio_cxl.devices.vfio_user.connection import DMA_PIECE_MAX, DMA_WINDOW
from vfio_cxl.devices.vfio_user.splice import PageSender
from vfio_cxl.devices.vfio_user.transport import Transport
from vfio_cxl.devices.gpu.regs import DESC_FLAG_INTERRUPT, Op, Status, pack_descriptor

MB = 1_000_000
RING_IOVA = 0x1000_0000
DIRECT_IOVA = 0x1_0000_0000
FILE_IOVA = 0x3_0000_0000
MESSAGE_IOVA = 0x2_0000_0000
RING_ENTRIES = 64

TARGET_DIRECT_FRACTION = 0.5
TARGET_MESSAGE_TO_VRAM_MBPS = 1500  # host -> VRAM: DMA_READ
TARGET_MESSAGE_TO_HOST_MBPS = 3000  # VRAM -> host: DMA_WRITE
TARGET_LATENCY_MS = 5.0
QUIET_LOAD = 1.0  # above this load average wall-clock figures are not trustworthy


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far (ns resolution, /proc/PID/task/*/schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread just ended
            pass
    return total / 1e9


class Figure:
    """Wall-clock samples of one path plus the CPU both processes spent on them."""

    def __init__(self, size: int, times: list[float], cpu: tuple[float, float]):
        rates = sorted(size / t / MB for t in times)
        self.median, self.low, self.high = statistics.median(rates), rates[0], rates[-1]
        moved = size * len(times) / 1e9
        self.cpu_server, self.cpu_client = cpu[0] / moved, cpu[1] / moved

    @property
    def cpu(self) -> float:
        return self.cpu_server + self.cpu_client

    def as_dict(self) -> dict:
        return {"median_mbps": round(self.median), "min_mbps": round(self.low),
                "max_mbps": round(self.high), "cpu_s_per_gb": round(self.cpu, 3),
                "cpu_s_per_gb_server": round(self.cpu_server, 3),
                "cpu_s_per_gb_client": round(self.cpu_client, 3)}


def memcpy_bandwidth(size: int, runs: int) -> Figure:
    """A memoryview copy between two pre-touched memfd mappings (one warm-up)."""
    bufs = []
    for name in ("src", "dst"):
        fd = os.memfd_create(f"bench-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        os.close(fd)
        mm.write(b"\x5a" * size)  # fault every page in first
        bufs.append(mm)
    src, dst = (memoryview(b) for b in bufs)
    dst[:] = src
    times = []
    c0 = time.thread_time()
    for _ in range(runs):
        t0 = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - t0)
    cpu = time.thread_time() - c0
    src.release()
    dst.release()
    for b in bufs:
        b.close()
    return Figure(size, times, (0.0, cpu))


def socket_copy_bandwidth(size: int, runs: int) -> Figure:
    """The message path's ceiling for VRAM -> host: one UNIX stream socket, another
    process splicing memfd pages into it (as the server does, with its send
    buffer), this one receiving into a buffer (the client's one copy, out of 4 KiB
    page fragments).  No protocol, no Python per message; one warm-up."""
    fd = os.memfd_create("bench-socket-src", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    src = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    os.close(fd)
    src.write(b"\x5a" * size)
    dst = bytearray(size)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    go_r, go_w = os.pipe()
    pid = os.fork()  # no other thread runs in this process yet
    if pid == 0:  # the sender
        try:
            b.close()
            os.close(go_w)
            Transport(a, send_timeout=30).set_send_buffer(min(size, DMA_WINDOW * DMA_PIECE_MAX))
            pages, view = PageSender(), memoryview(src)
            while os.read(go_r, 1):
                if pages.available:
                    pages.send(a, view, socket.MSG_NOSIGNAL)
                else:
                    a.sendall(view)
        finally:
            os._exit(0)
    a.close()
    os.close(go_r)
    times, cpu = [], 0.0
    view = memoryview(dst)
    try:
        for i in range(runs + 1):
            c0, t0 = time.thread_time(), time.perf_counter()
            os.write(go_w, b"g")
            pos = 0
            while pos < size:
                got = b.recv_into(view[pos:])
                if not got:
                    raise RuntimeError("socket-copy sender died")
                pos += got
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
                cpu += time.thread_time() - c0
    finally:
        os.close(go_w)  # the sender sees EOF and ends
        os.waitpid(pid, 0)
        view.release()
        b.close()
        src.close()
    return Figure(size, times, (0.0, cpu))


class Bench:
    def __init__(self, sock: str, size: int, max_xfer: int, server_pid: int):
        self.server_pid = server_pid
        self.memory = GuestMemory()
        self.ring = self.memory.add(RING_IOVA, 2 * RING_ENTRIES * regs.DESC_SIZE, shared=True,
                                    sealed=True)
        self.direct = self.memory.add(DIRECT_IOVA, size, shared=True, sealed=True)
        self.file = self.memory.add(FILE_IOVA, size, shared=True, sealed=False)
        self.message = self.memory.add(MESSAGE_IOVA, size, shared=False)
        self.client = VfioUserClient(sock, self.memory, timeout=30)
        c = self.client
        c.negotiate(max_data_xfer_size=max_xfer)
        c.map_area(self.ring, direct=True)
        c.map_area(self.direct, direct=True)
        c.map_area(self.file, direct=True)
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
        for area in (self.direct, self.file, self.message):  # touch every page once
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
    parser = argparse.ArgumentParser(prog="scripts/bench gpu-server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=32, help="bytes per throughput run")
    parser.add_argument("--runs", type=int, default=15, help="throughput runs per path (median)")
    parser.add_argument("--latency-runs", type=int, default=15, help="1 MiB latency runs (median)")
    parser.add_argument("--max-xfer-mib", type=int, default=64,
                        help="max_data_xfer_size the client offers (QEMU 11.1: 1)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    size = args.size_mib * regs.MIB
    vram_mib = max(64, 1 << (args.size_mib - 1).bit_length())

    if args.runs < 1 or args.latency_runs < 1 or args.size_mib < 1:
        parser.error("--size-mib, --runs and --latency-runs must be at least 1")
    load = [os.getloadavg()[0]]
    memcpy = memcpy_bandwidth(size, args.runs)
    sockcopy = socket_copy_bandwidth(size, args.runs)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        sock = os.path.join(tmp, "gpu.sock")
        proc = start_server(sock, vram_mib)
        try:
            bench = Bench(sock, size, args.max_xfer_mib * regs.MIB, proc.pid)
            try:
                results, latency = measure(bench, size, args.runs, args.latency_runs)
            finally:
                bench.close()
        finally:
            proc.terminate()
            proc.wait(10)
    load.append(os.getloadavg()[0])
    if args.json:
        print(json.dumps({"size": size, "runs": args.runs, "max_data_xfer_size":
                          args.max_xfer_mib * regs.MIB, "load_average": load,
                          "memcpy": memcpy.as_dict(), "socket_copy": sockcopy.as_dict(),
                          "figures": {k: v.as_dict() for k, v in results.items()},
                          "latency_ms": {k: round(v, 3) for k, v in latency.items()},
                          "ratio_to_memcpy": {k: round(v.median / memcpy.median, 3)
                                              for k, v in results.items()},
                          "targets": targets(memcpy, results, latency)}, indent=2))
    else:
        report(memcpy, sockcopy, size, results, latency, load, args)
    return 0


CASES = {
    "direct (sealed memfd, mmap)   VRAM->host": (Op.VRAM_TO_HOST, 0, DIRECT_IOVA),
    "direct (sealed memfd, mmap)   host->VRAM": (Op.HOST_TO_VRAM, DIRECT_IOVA, 0),
    "direct (file, pwrite/pread)   VRAM->host": (Op.VRAM_TO_HOST, 0, FILE_IOVA),
    "direct (file, pwrite/pread)   host->VRAM": (Op.HOST_TO_VRAM, FILE_IOVA, 0),
    "message (DMA_WRITE)           VRAM->host": (Op.VRAM_TO_HOST, 0, MESSAGE_IOVA),
    "message (DMA_READ)            host->VRAM": (Op.HOST_TO_VRAM, MESSAGE_IOVA, 0),
}
MSG_TO_HOST = "message (DMA_WRITE)           VRAM->host"
MSG_TO_VRAM = "message (DMA_READ)            host->VRAM"


def measure(bench: Bench, size: int, runs: int, latency_runs: int) -> tuple[dict, dict]:
    bench.run(Op.FILL_PRNG, 1991, 0, size)  # VRAM content to move
    results = {}
    me = os.getpid()
    for name, (op, src, dst) in CASES.items():
        bench.run(op, src, dst, size)  # warm-up (first-touch faults in the server's mmaps)
        s0, c0 = cpu_seconds(bench.server_pid), cpu_seconds(me)
        times = [bench.run(op, src, dst, size) for _ in range(runs)]
        s1, c1 = cpu_seconds(bench.server_pid), cpu_seconds(me)
        results[name] = Figure(size, times, (s1 - s0, c1 - c0))
    # sanity: the bytes really arrived on every path
    expect = regs.prng_bytes(1991, 1 << 20)
    for area in (bench.direct, bench.file, bench.message):
        if bytes(area.view[:1 << 20]) != expect:
            raise RuntimeError(f"wrong bytes at IOVA {area.iova:#x}")
    latency = {}
    for name, dst in (("direct", DIRECT_IOVA), ("message", MESSAGE_IOVA)):
        bench.run(Op.VRAM_TO_HOST, 0, dst, 1 << 20)
        lat = [bench.run(Op.VRAM_TO_HOST, 0, dst, 1 << 20) for _ in range(latency_runs)]
        latency[name] = statistics.median(lat) * 1000
    return results, latency


def targets(memcpy: Figure, r: dict, latency: dict) -> dict:
    direct = min(v.median for k, v in r.items() if k.startswith("direct (sealed"))
    lat = max(latency.values())
    return {
        "direct >= 50% of memcpy": direct >= TARGET_DIRECT_FRACTION * memcpy.median,
        f"message host->VRAM >= {TARGET_MESSAGE_TO_VRAM_MBPS} MB/s":
            r[MSG_TO_VRAM].median >= TARGET_MESSAGE_TO_VRAM_MBPS,
        f"message VRAM->host >= {TARGET_MESSAGE_TO_HOST_MBPS} MB/s":
            r[MSG_TO_HOST].median >= TARGET_MESSAGE_TO_HOST_MBPS,
        f"1 MiB latency <= {TARGET_LATENCY_MS} ms": lat <= TARGET_LATENCY_MS,
    }


def report(memcpy: Figure, sockcopy: Figure, size: int, r: dict, latency: dict, load: list,
           args) -> None:
    print(f"GPU server DMA benchmark ({size >> 20} MiB per transfer, 1 warm-up + {args.runs} "
          f"runs per path; latency median of {args.latency_runs}; client max_data_xfer_size "
          f"{args.max_xfer_mib} MiB)")
    print(f"  {'path':41s} {'median':>7s} {'(min-max)':>13s}       {'of memcpy':>9s}  "
          f"CPU s/GB (server+client)")

    def line(name: str, f: Figure) -> None:
        split = ("(one thread)" if f is memcpy else "(receiving thread)" if f is sockcopy
                 else f"({f.cpu_server:.3f}+{f.cpu_client:.3f})")
        print(f"  {name:41s} {f.median:7.0f} ({f.low:5.0f}-{f.high:5.0f}) MB/s  "
              f"{f.median / memcpy.median:8.1%}  {f.cpu:6.3f} {split}")

    line("host memcpy (reference)", memcpy)
    line("socket: spliced pages -> recv (reference)", sockcopy)
    for name in CASES:
        line(name, r[name])
    print(f"  message VRAM->host: {r[MSG_TO_HOST].median / sockcopy.median:.0%} of the bare "
          f"socket copy; its client spends {r[MSG_TO_HOST].cpu_client / sockcopy.cpu:.2f}x that "
          f"copy's CPU")
    print(f"  1 MiB VRAM->host doorbell->MSI-X: direct {latency['direct']:.2f} ms, "
          f"message {latency['message']:.2f} ms")
    print(f"  load average {load[0]:.2f} at start, {load[1]:.2f} at end"
          + ("" if max(load) < QUIET_LOAD else
             f": the machine was busy, wall-clock figures are low (compare CPU s/GB)"))
    print("targets: " + "; ".join(f"{name}: {'ok' if ok else 'MISSED'}"
                                  for name, ok in targets(memcpy, r, latency).items()))


if __name__ == "__main__":
    sys.exit(main())
