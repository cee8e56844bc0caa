"""Channel throughput for large records on this machine, beside zlib.crc32 over the same bytes.

    python -m vfio_cxl.bench channel [--records 256] [--size 1048576] [--json]

No VMs.  One anonymous shared mapping (64 MiB + header), two processes
(fork): the producer places each payload with one copy from a prepared
buffer (as a DMA engine would; its CRC32 is known) and publishes it; the
consumer receives it -- one zlib.crc32 over the payload in shared memory, a
memoryview handed out, no copy -- and acks it.  Figures:

* ``crc32_mb_s``: zlib.crc32 over each payload just copied in at successive
  places of the mapping -- the bytes as the consumer meets them (the
  reference); ``crc32_hot_mb_s``: over one payload again and again (cache-hot);
* ``consumer_mb_s``: the consumer's own time per record (receive + ack), one process;
* ``channel_mb_s``: records/s x size at the consumer, producer in another process;
* ``channel_x86_mb_s``: the same with the real x86 cache operations (if built);
* ``ratio``: channel_mb_s / crc32_mb_s, ``consumer_ratio``: consumer_mb_s /
  crc32_mb_s (target: >= 0.5);
* ``load_average``, ``cpus``: how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
import zlib

from ..guest.channel import COHERENT, Consumer, Producer

CHANNEL_BYTES = (64 << 20) + (1 << 16)


def _mapping() -> mmap.mmap:
    """The shared mapping, every page touched once (no page faults inside the measurements)."""
    m = mmap.mmap(-1, CHANNEL_BYTES)            # anonymous MAP_SHARED: a forked child writes the parent's memory
    chunk = bytes(1 << 20)
    for offset in range(0, CHANNEL_BYTES - len(chunk) + 1, len(chunk)):
        m[offset:offset + len(chunk)] = chunk
    return m


def _crc_rates(size: int, records: int) -> tuple[float, float]:
    """zlib.crc32 MB/s over one payload again and again (cache-hot), and over each payload just copied in
    at successive places of the 64 MiB mapping, as the consumer meets them (only the CRC is timed)."""
    payload = os.urandom(size)
    with _mapping() as m:
        view = memoryview(m)
        view[:size] = payload
        hot = min(_timed(lambda: zlib.crc32(view[:size])) for _ in range(20))
        spent, place = 0.0, 0
        for _ in range(records):
            if place + size > CHANNEL_BYTES:
                place = 0
            view[place:place + size] = payload
            spent += _timed(lambda: zlib.crc32(view[place:place + size]))
            place += -(-size // 4096) * 4096
        view.release()
    return size / hot / 1e6, size * records / spent / 1e6


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _consumer_only(size: int, records: int) -> float:
    """Consumer seconds per record, producer in the same process (its time not counted)."""
    payload = os.urandom(size)
    crc = zlib.crc32(payload)
    with _mapping() as m:
        p = Producer.create(m, coherence=COHERENT, ring_entries=64)
        c = Consumer.open(m, coherence=COHERENT)
        spent = 0.0
        for _ in range(records):
            r = p.reserve(size, timeout=0)
            r.view[:] = payload
            p.publish(r.offset, size, crc)
            t0 = time.perf_counter()
            rec = c.receive(timeout=0)
            c.ack(rec)
            spent += time.perf_counter() - t0
        p.close()
        c.close()
    return size * records / spent / 1e6


def _two_processes(size: int, records: int, coherence_name: str) -> float:
    payload = os.urandom(size)
    crc = zlib.crc32(payload)
    with _mapping() as m:
        coherence = COHERENT
        if coherence_name == "x86":
            from ..guest.cacheline import x86
            coherence = x86()
        p = Producer.create(m, coherence=coherence, ring_entries=64)
        pid = os.fork()
        if pid == 0:                            # the producer
            code = 1
            try:
                for _ in range(records):
                    r = p.reserve(size, timeout=60)
                    r.view[:] = payload
                    p.publish(r.offset, size, crc)
                code = 0
            finally:
                os._exit(code)
        p.close()
        c = Consumer.open(m, coherence=coherence)
        first = c.receive(timeout=60)            # the clock starts at the first record
        c.ack(first)
        t0 = time.perf_counter()
        for _ in range(records - 1):
            c.ack(c.receive(timeout=60))
        elapsed = time.perf_counter() - t0
        c.close()
        _, status = os.waitpid(pid, 0)
        if status:
            raise RuntimeError(f"the producer process failed (status {status})")
    return size * (records - 1) / elapsed / 1e6


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench channel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    hot, crc = _crc_rates(args.size, args.records)
    result = {"size": args.size, "records": args.records, "crc32_mb_s": crc, "crc32_hot_mb_s": hot,
              "consumer_mb_s": _consumer_only(args.size, args.records),
              "channel_mb_s": _two_processes(args.size, args.records, "coherent")}
    try:
        result["channel_x86_mb_s"] = _two_processes(args.size, args.records, "x86")
    except Exception as e:                      # no compiler, not x86: say so, keep the rest
        result["channel_x86_mb_s"] = None
        result["x86_unavailable"] = str(e)
    result["ratio"] = result["channel_mb_s"] / result["crc32_mb_s"]
    result["consumer_ratio"] = result["consumer_mb_s"] / result["crc32_mb_s"]
    result["cpus"], result["load_average"] = os.cpu_count(), os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
        return 0
    crc = result["crc32_mb_s"]
    print(f"{args.records} records of {args.size} bytes through the channel (this machine, no VMs)")
    print(f"{'':44} {'MB/s':>8} {'vs crc32':>9}")
    rows = [("zlib.crc32, one payload again (cache-hot)", result["crc32_hot_mb_s"]),
            ("zlib.crc32, each payload as copied in (ref.)", crc),
            ("consumer alone (receive: CRC32 + view, ack)", result["consumer_mb_s"]),
            ("channel, 2 processes, COHERENT", result["channel_mb_s"]),
            ("channel, 2 processes, x86 CLWB/CLFLUSHOPT", result["channel_x86_mb_s"])]
    for name, value in rows:
        print(f"{name:44} " + (f"{value:>8.0f} {value / crc:>8.0%}" if value else f"{'n/a':>8}"))
    print(f"(load average {result['load_average']:.1f} on {result['cpus']} CPUs: the two processes compete "
          f"with everything else for them; the consumer alone is the channel's own cost)")
    if result.get("x86_unavailable"):
        print(f"(x86 cache operations unavailable: {result['x86_unavailable']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
