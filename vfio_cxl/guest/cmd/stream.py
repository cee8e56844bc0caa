"""In the guests: stream records from VM a's GPU to VM b through shared CXL memory.

    a$ python3 -m vfio_cxl.guest.cmd.stream produce --count N --peer 169.254.0.2 [--notify] [--corrupt 5,17]
    b$ python3 -m vfio_cxl.guest.cmd.stream consume --count N [--notify]
    a$ python3 -m vfio_cxl.guest.cmd.stream reset         # forget any earlier channel

The channel (``vfio_cxl.guest.channel``) lives in the devdax device from
CHANNEL_BASE on.  For each record the producer reserves space, has the GPU
fill VRAM with the record's PRNG stream and DMA it into the reserved range
(route B: straight into CXL), then publishes the record; optionally it also
sends "record N ready" over the private link.  The consumer polls shared
memory (or waits for the message), checks the record and verifies every byte
against the PRNG stream.  Both print JSON with per-record timestamps of their
own CLOCK_MONOTONIC; ``clock_offset`` (measured over the link, NTP style:
the exchange with the smallest round trip) maps b's clock onto a's.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import socket
import sys
import threading
import time
import zlib

from .. import cacheline
from ..channel import (COHERENT, BadHeader, ChannelFull, ChannelTimeout, Coherence, Consumer, CorruptRecord,
                       NoChannel, Producer)
from ...devices.gpu import regs
from ...devices.gpu.regs import Op
from .. import cxl
from ..dax import DaxMapping

CHANNEL_BASE = 128 << 20
CHANNEL_SIZE = 64 << 20
NOTIFY_PORT = 7000        # "record N ready" (TCP), b listens
CLOCK_PORT = 7001         # clock echo (UDP), b answers
FULL_PORT = 7002          # "ring full" (TCP, back-pressure check), b listens


def record_seed(seed: int, seq: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{seq}".encode()).digest()[:8], "little")


def record_length(seed: int, seq: int, max_size: int) -> int:
    return 1 + record_seed(seed ^ 0x5A5A, seq) % max_size


def coherence(name: str) -> Coherence:
    """The lab's memory is coherent (one host file under both VMs): "coherent" says so explicitly;
    "x86" runs the real cache-line instructions anyway (what non-coherent CXL hardware would need)."""
    if name == "coherent":
        return COHERENT
    try:
        return cacheline.x86()
    except cacheline.CachelineError as e:
        raise cxl.CxlError(f"--coherence x86: {e.what}", e.fix) from None


def prefault(view: memoryview, *, write: bool) -> None:
    """Touch every 4 KiB page of ``view`` once, so no page fault lands inside a measurement.

    Under TCG a first touch of a devdax page costs ~0.1 ms.  One byte per page,
    in C (strided slices).  ``write``: rewrite each byte with itself -- only
    the producer, before Producer.create, when nobody else writes the area."""
    pages = view[::4096]
    if write:
        pages[:] = bytes(pages)
    else:
        bytes(pages)
    pages.release()


def channel_view(dax: DaxMapping) -> memoryview:
    if dax.size < CHANNEL_BASE + CHANNEL_SIZE:
        raise cxl.CxlError(f"devdax is {dax.size} bytes; the channel needs {CHANNEL_BASE + CHANNEL_SIZE}")
    return dax.view[CHANNEL_BASE:CHANNEL_BASE + CHANNEL_SIZE]


# -- clock offset over the link ----------------------------------------------
def serve_clock(port: int, stop: threading.Event) -> threading.Thread:
    """Answer each datagram with our monotonic time (b's side)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    sock.settimeout(0.2)

    def loop():
        with sock:
            while not stop.is_set():
                try:
                    data, peer = sock.recvfrom(64)
                except socket.timeout:
                    continue
                sock.sendto(data + b" %.9f" % time.monotonic(), peer)
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


PROBE_WAIT = 0.2   # s: how long one probe waits for its echo before the next is sent


def _echo_of(data: bytes) -> tuple[int, float] | None:
    """(probe number, b's clock) of an echo, or None for a datagram that is not one."""
    try:
        tag, remote = data.split()
        return int(tag), float(remote)
    except ValueError:
        return None


def measure_clock_offset(host: str, port: int, timeout: float, samples: int = 30) -> dict:
    """b's clock minus a's, from the exchange with the smallest round trip.

    Retries until b answers (it may start after us), up to ``timeout``.  Each probe waits up to
    PROBE_WAIT for its echo before the next is sent; an echo that comes back later is an exchange
    all the same, timed from its own probe -- so one slow echo never leaves the reads a probe
    behind the probes."""
    best = None
    sent_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for i in itertools.count():
            if i >= samples and best is not None:
                break                                   # enough exchanges
            if best is None and time.monotonic() > deadline:
                break                                   # b never answered
            sent_at[i] = t1 = time.monotonic()
            sock.sendto(b"%d" % i, (host, port))
            while (left := t1 + PROBE_WAIT - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    data, _ = sock.recvfrom(128)
                except socket.timeout:
                    break
                t2 = time.monotonic()
                echo = _echo_of(data)
                if echo is None or echo[0] not in sent_at:
                    continue                            # not an echo of ours
                tag, remote = echo
                t0 = sent_at.pop(tag)
                if best is None or t2 - t0 < best[0]:
                    best = (t2 - t0, remote - (t0 + t2) / 2)
                if tag == i:
                    break
    if best is None:
        raise cxl.CxlError(f"no clock echo from {host}:{port} within {timeout} s ({len(sent_at)} probes sent)",
                           "start the consumer in VM b")
    return {"offset": best[1], "rtt": best[0]}


def connect_with_retry(host: str, port: int, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as err:
            if time.monotonic() > deadline:
                raise cxl.CxlError(f"cannot reach {host}:{port}: {err}", "start the consumer with --notify") from None
            time.sleep(0.05)   # retry back-off while b starts listening


# -- producer (VM a) ----------------------------------------------------------
def produce(count: int, seed: int, max_size: int, ring_entries: int, peer: str, notify: bool,
            corrupt: set[int], timeout: float, paced: bool = False, report_full: bool = False,
            coherence_name: str = "coherent") -> dict:
    from ..drivers.gpu import GpuDriver, Transfer   # only VM a has the GPU

    dax_device = cxl.ensure_ram_devdax()
    clock = measure_clock_offset(peer, CLOCK_PORT, timeout)
    notifier = connect_with_retry(peer, NOTIFY_PORT, timeout) if notify else None
    full_reporter = connect_with_retry(peer, FULL_PORT, timeout) if report_full else None
    done_at: list[float] = []
    full_waits = 0
    with DaxMapping(dax_device) as dax, GpuDriver.open() as gpu:
        view = channel_view(dax)
        prefault(view, write=True)
        on_publish = (lambda seq, offset, length: notifier.sendall(b"%d\n" % seq)) if notifier else None
        producer = Producer.create(view, coherence=coherence(coherence_name), ring_entries=ring_entries,
                                   on_publish=on_publish)
        start = time.monotonic()
        with gpu.map(dax.map, GpuDriver.DATA_IOVA):
            for _ in range(count):
                seq = producer.next_seq
                length = record_length(seed, seq, max_size)
                try:
                    reservation = producer.reserve(length, timeout=0)
                except ChannelFull:
                    full_waits += 1                      # back-pressure: wait for b's acks
                    if full_reporter and full_waits == 1:
                        full_reporter.sendall(b"full\n")
                    reservation = producer.reserve(length, timeout=60)
                gpu.run([Transfer(Op.FILL_PRNG, src=record_seed(seed, seq), dst=0, length=length),
                         Transfer(Op.VRAM_TO_HOST, src=0,
                                  dst=GpuDriver.DATA_IOVA + CHANNEL_BASE + reservation.offset, length=length)])
                done_at.append(time.monotonic())         # the GPU's MSI-X has arrived
                checksum = None
                if seq in corrupt:
                    # Injected fault: the record carries the intact payload's checksum,
                    # but the bytes b will see differ.  (Flipping after publish would
                    # race with b's read.)
                    checksum = zlib.crc32(view[reservation.offset:reservation.offset + length])
                    view[reservation.offset] ^= 0xFF
                published = producer.publish(reservation.offset, length, checksum=checksum)
                assert published == seq
                if paced:   # one record in flight: latency without queueing
                    deadline = time.monotonic() + timeout
                    while producer.acked <= seq:
                        if time.monotonic() > deadline:
                            raise cxl.CxlError(f"record {seq} not acked within {timeout} s", "is the consumer alive?")
        elapsed = time.monotonic() - start
        producer.close()
        view.release()
    for sock in (notifier, full_reporter):
        if sock:
            sock.close()
    return {"count": count, "done_at": done_at, "elapsed": elapsed, "full_waits": full_waits,
            "clock": clock, "corrupted": sorted(corrupt)}


# -- consumer (VM b) ----------------------------------------------------------
def consume(count: int, seed: int, max_size: int, notify: bool, timeout: float,
            stall_until_full: bool, coherence_name: str = "coherent") -> dict:
    dax_device = cxl.ensure_ram_devdax()
    stop = threading.Event()
    server = conn = full_server = None
    serve_clock(CLOCK_PORT, stop)
    if notify:
        server = socket.create_server(("0.0.0.0", NOTIFY_PORT))
        server.settimeout(timeout)
    if stall_until_full:
        full_server = socket.create_server(("0.0.0.0", FULL_PORT))
        full_server.settimeout(timeout)
    delivered, rejected, bad_bytes, seen_at = [], [], [], []
    error = None
    with DaxMapping(dax_device) as dax:
        view = channel_view(dax)
        prefault(view, write=False)
        consumer = None
        try:
            # Inside the try: a producer that has not made the channel within ``timeout`` is this
            # side's reported error (exit 3), not a traceback that left ``view`` exported.
            consumer = Consumer.open(view, coherence=coherence(coherence_name), wait=timeout)
            if server:
                conn, _ = server.accept()
                conn.settimeout(timeout)
                lines = conn.makefile("rb")
            start = None
            while len(delivered) + len(rejected) < count:
                expected = consumer.next_seq
                try:
                    if server:
                        line = lines.readline()
                        if not line:
                            raise ChannelTimeout(f"the producer closed the link before record {expected}")
                        record = consumer.receive(timeout=timeout, expect=int(line))
                    else:
                        record = consumer.receive(timeout=timeout)
                except CorruptRecord as err:
                    rejected.append(err.seq)
                    consumer.skip()
                    consumer.ack()
                    continue
                seen_at.append(time.monotonic())
                start = start or seen_at[-1]
                want = regs.prng_bytes(record_seed(seed, record.seq), record_length(seed, record.seq, max_size))
                if record.view != want:
                    bad_bytes.append(record.seq)
                delivered.append(record.seq)
                if stall_until_full and len(delivered) == 1:
                    # Hold this record un-acked until the producer says a
                    # reservation was refused (acking on seeing the ring full
                    # would race with its next reserve).
                    reporter, _ = full_server.accept()
                    with reporter:
                        reporter.settimeout(timeout)
                        if reporter.makefile("rb").readline() != b"full\n":
                            raise ChannelTimeout("the producer never reported the ring full")
                consumer.ack(record)
        except (ChannelTimeout, NoChannel, BadHeader, socket.timeout, OSError) as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            if consumer is not None:
                consumer.close()
            view.release()
            stop.set()
            for s in (conn, server, full_server):
                if s:
                    s.close()
    elapsed = (seen_at[-1] - seen_at[0]) if len(seen_at) > 1 else 0.0
    total = sum(record_length(seed, s, max_size) for s in delivered)
    return {"delivered": delivered, "rejected": rejected, "bad_bytes": bad_bytes, "seen_at": seen_at,
            "bytes": total, "elapsed": elapsed, "error": error}


def reset() -> dict:
    with DaxMapping(cxl.ensure_ram_devdax()) as dax:
        dax.write(CHANNEL_BASE, bytes(4096))   # no header: a consumer waits for the new producer
    return {"reset": True}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.stream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["produce", "consume", "reset"])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-size", type=int, default=64 << 10)
    parser.add_argument("--ring-entries", type=int, default=256)
    parser.add_argument("--peer", default="169.254.0.2", help="producer: the consumer's link address")
    parser.add_argument("--notify", action="store_true",
                        help="send/wait for 'record N ready' over the link instead of polling")
    parser.add_argument("--corrupt", default="", help="producer: comma-separated seqs to corrupt after publish")
    parser.add_argument("--timeout", type=float, default=30)
    parser.add_argument("--paced", action="store_true",
                        help="producer: wait for each record's ack before the next (latency without queueing)")
    parser.add_argument("--stall-until-full", action="store_true",
                        help="consumer: hold the first record until the producer reports the ring full")
    parser.add_argument("--coherence", choices=["coherent", "x86"], default="coherent",
                        help="cache operations: none (the lab's memory is coherent) or real x86 CLWB/CLFLUSHOPT/MFENCE")
    parser.add_argument("--report-full", action="store_true",
                        help="producer: tell the consumer (over the link) when a reservation is first refused")
    args = parser.parse_args(argv)
    try:
        if args.role == "produce":
            corrupt = {int(s) for s in args.corrupt.split(",") if s}
            result = produce(args.count, args.seed, args.max_size, args.ring_entries, args.peer, args.notify,
                             corrupt, args.timeout, args.paced, args.report_full, args.coherence)
        elif args.role == "consume":
            result = consume(args.count, args.seed, args.max_size, args.notify, args.timeout,
                             args.stall_until_full, args.coherence)
        else:
            result = reset()
    except cxl.CxlError as err:
        print(f"stream: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0 if not result.get("error") else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
