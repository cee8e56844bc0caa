"""In the guests: the CXL channel against TCP over the private link, same payloads, same checks.

    b$ python3 -m vfio_cxl.guest.cmd.share_bench recv --transport T [--plan PLAN] [--smc-peer 0]
    a$ python3 -m vfio_cxl.guest.cmd.share_bench send --transport T [--plan PLAN] [--peer 169.254.0.2] [--smc-peer 1]

Transports: ``channel`` (the CXL channel, the consumer polls shared memory),
``doorbell`` (the channel, the consumer sleeps on its shared-memory
controller doorbell, rung by the producer after each commit -- and the
producer sleeps on its own, rung after each ack), ``link`` (the channel, the
consumer sleeps on a "record N ready" message over the private link, and paced
acks come back the same way), ``tcp`` (the payloads themselves over the link).

PLAN is ``SIZE:COUNT:MODE,...`` with MODE ``paced`` (one record in flight:
each waits for the previous one's ack -- latency) or ``stream`` (back to back
-- throughput).  Each payload is ``SIZE`` random bytes, copied in by the CPU
on the sending side (into the channel's reserved space, or into the socket)
with its CRC32 known; the receiving side checks the CRC32 of every payload
in one ``zlib.crc32`` call (the channel does it in ``receive()``; the TCP
receiver after ``recv_into``) and records when it has a checked payload, on
its CLOCK_MONOTONIC.  The sender records when each payload was handed over
(just before ``publish`` / ``sendmsg``) and, for paced records, when it saw
b's ack (the channel's acked count, or one byte back): a round trip on a's
clock alone.  It also measures the clock offset to b over the link
(``vfio_cxl.guest.cmd.stream``) for one-way figures.  ``recv`` also reports the
guest's own zlib.crc32 rate over 1 MiB of devdax memory.

The channel uses the devdax region of ``vfio_cxl.guest.cmd.stream``; TCP runs
over the private link with TCP_NODELAY.  ``recv`` also reports its CPU
seconds (a polling consumer burns its vCPU while it waits; a sleeping one
does not).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time
import zlib

from ..channel import ChannelError, Consumer, CorruptRecord, Producer
from .. import cxl
from ..dax import DaxMapping
from ..smc_channel import SmcWakeup
from ..drivers.smc import SmcDriver, SmcError
from ..record_plan import DEFAULT_PLAN, parse_plan
from .stream import (CLOCK_PORT, channel_view, coherence, connect_with_retry, measure_clock_offset, prefault,
                     serve_clock)

TCP_PORT = 7003
LINK_PORT = 7004                     # "record N ready" for the link transport
SEQ = struct.Struct("<Q")
CHANNELS = ("channel", "doorbell", "link")
TRANSPORTS = CHANNELS + ("tcp",)
HEADER = struct.Struct("<II")        # TCP framing: payload length, CRC32


def _payloads(plan) -> dict[int, tuple[bytes, int]]:
    out = {}
    for size, _, _ in plan:
        if size not in out:
            data = os.urandom(size)
            out[size] = (data, zlib.crc32(data))
    return out


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise cxl.CxlError(f"{what} within {timeout} s", "is the receiver alive?")


# -- sending side (VM a) ---------------------------------------------------------------------------
def _send_plan(p: Producer, plan, payloads, timeout: float, wake, link, sent_at: list, acked_at: list) -> None:
    """The channel transports: every record of the plan, paced ones waiting for b's ack."""
    for size, count, mode in plan:
        data, crc = payloads[size]
        for _ in range(count):
            r = p.reserve(size, timeout=timeout)
            r.view[:] = data
            sent_at.append(time.monotonic())
            seq = p.publish(r.offset, size, crc)
            if mode != "paced":
                acked_at.append(None)
                continue
            if wake is not None:
                p.wait_acked(seq, timeout)          # asleep on a's doorbell, rung by b's ack
            elif link is not None:
                if link.recv(1) != b"k":
                    raise cxl.CxlError("the link receiver closed the connection", "see its output")
            else:
                _wait(lambda: p.acked > seq, timeout, f"no ack of record {seq}")
            acked_at.append(time.monotonic())
    # the receiver's last ack: it has checked everything before we unmap
    if wake is not None:
        p.wait_acked(p.next_seq - 1, timeout)
    else:
        _wait(lambda: p.acked == p.next_seq, timeout, "not all records acked")


def send(transport: str, plan, peer: str, timeout: float, coherence_name: str, smc_peer: int = 1) -> dict:
    payloads = _payloads(plan)
    clock = measure_clock_offset(peer, CLOCK_PORT, timeout)
    sent_at: list[float] = []
    acked_at: list[float | None] = []       # paced records: when a saw b's ack (round trip on a's clock alone)
    if transport in CHANNELS:
        smc = SmcDriver.open() if transport == "doorbell" else None
        link = connect_with_retry(peer, LINK_PORT, timeout) if transport == "link" else None
        if link is not None:
            link.settimeout(timeout)            # connect_with_retry's socket waits 1 s per call
        try:
            wake = SmcWakeup(smc, [smc_peer]) if smc is not None else None
            on_publish = (lambda seq, _offset, _length: link.sendall(SEQ.pack(seq))) if link is not None else None
            with DaxMapping(cxl.ensure_ram_devdax()) as dax:
                view = channel_view(dax)
                prefault(view, write=True)
                p = Producer.create(view, coherence=coherence(coherence_name), ring_entries=256, wakeup=wake,
                                    on_publish=on_publish)
                try:
                    _send_plan(p, plan, payloads, timeout, wake, link, sent_at, acked_at)
                finally:                            # released before the mapping closes, even on an error
                    p.close()
                    view.release()
        finally:
            if smc is not None:
                smc.close()
            if link is not None:
                link.close()
    else:
        sock = connect_with_retry(peer, TCP_PORT, timeout)
        sock.settimeout(timeout)
        with sock:
            for size, count, mode in plan:
                data, crc = payloads[size]
                header = HEADER.pack(size, crc)
                for _ in range(count):
                    sent_at.append(time.monotonic())
                    done = sock.sendmsg([header, data])     # one copy into the kernel, like the channel's one copy
                    if done < len(header) + size:           # a full socket buffer takes part of it
                        sock.sendall((header + data)[done:] if done < len(header) else data[done - len(header):])
                    if mode == "paced":
                        if sock.recv(1) != b"k":
                            raise cxl.CxlError("the TCP receiver closed the connection", "see its output")
                        acked_at.append(time.monotonic())
                    else:
                        acked_at.append(None)
            if sock.recv(1) != b"k":                    # everything received and checked
                raise cxl.CxlError("the TCP receiver did not confirm the end", "see its output")
    return {"transport": transport, "sent_at": sent_at, "acked_at": acked_at, "clock": clock}


# -- receiving side (VM b) -------------------------------------------------------------------------
def _accept_one(port: int, timeout: float) -> socket.socket:
    """The producer's one connection to ``port`` (no Nagle delay), within ``timeout``."""
    server = socket.create_server(("0.0.0.0", port))
    server.settimeout(timeout)
    with server:
        conn, _ = server.accept()
    conn.settimeout(timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise cxl.CxlError("the TCP sender closed the connection early", "see its output")
        got += n


def guest_crc32_rate(dax: DaxMapping) -> float:
    view = dax.view[:1 << 20]
    best = min(_timed(lambda: zlib.crc32(view)) for _ in range(10))
    view.release()
    return (1 << 20) / best / 1e6


def _timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def recv(transport: str, plan, timeout: float, coherence_name: str, smc_peer: int = 0) -> dict:
    stop = threading.Event()
    serve_clock(CLOCK_PORT, stop)
    seen_at: list[float] = []
    bad = 0
    smc = link = None
    cpu0 = time.process_time()
    try:
        with DaxMapping(cxl.ensure_ram_devdax()) as dax:
            crc_rate = guest_crc32_rate(dax)
            cpu0 = time.process_time()
            if transport in CHANNELS:
                view = channel_view(dax)
                prefault(view, write=False)
                if transport == "doorbell":
                    smc = SmcDriver.open()
                if transport == "link":
                    link = _accept_one(LINK_PORT, timeout)
                told = memoryview(bytearray(SEQ.size))
                c = Consumer.open(view, coherence=coherence(coherence_name), wait=timeout,
                                  wakeup=SmcWakeup(smc, [smc_peer]) if smc is not None else None)
                try:
                    for size, count, mode in plan:
                        for _ in range(count):
                            try:
                                if link is not None:                 # asleep in recv until "record N ready"
                                    _recv_exact(link, told)
                                    rec = c.receive(timeout=timeout, expect=SEQ.unpack(told)[0])
                                else:
                                    rec = c.receive(timeout=timeout)   # CRC32 checked in here
                            except CorruptRecord:
                                bad += 1
                                c.skip()
                                c.ack()
                                continue
                            seen_at.append(time.monotonic())
                            if rec.length != size:
                                bad += 1
                            c.ack(rec)
                            if link is not None and mode == "paced":
                                link.sendall(b"k")
                finally:
                    c.close()
                    view.release()
            else:
                conn = _accept_one(TCP_PORT, timeout)
                buf = memoryview(bytearray(max(size for size, _, _ in plan)))
                head = memoryview(bytearray(HEADER.size))
                with conn:
                    for size, count, mode in plan:
                        for _ in range(count):
                            _recv_exact(conn, head)
                            length, crc = HEADER.unpack(head)
                            if length != size:
                                raise cxl.CxlError(f"TCP frame of {length} bytes, expected {size}", "same --plan")
                            payload = buf[:length]
                            _recv_exact(conn, payload)
                            if zlib.crc32(payload) != crc:
                                bad += 1
                            seen_at.append(time.monotonic())
                            if mode == "paced":
                                conn.sendall(b"k")
                    conn.sendall(b"k")
    finally:
        stop.set()
        if smc is not None:
            smc.close()
        if link is not None:
            link.close()
    return {"transport": transport, "seen_at": seen_at, "bad": bad, "guest_crc32_mb_s": crc_rate,
            "cpu_seconds": time.process_time() - cpu0}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.share_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["send", "recv"])
    parser.add_argument("--transport", choices=TRANSPORTS, required=True)
    parser.add_argument("--plan", default=DEFAULT_PLAN)
    parser.add_argument("--peer", default="169.254.0.2", help="send: the receiver's link address")
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--coherence", choices=["coherent", "x86"], default="coherent")
    parser.add_argument("--smc-peer", type=int, default=None,
                        help="doorbell: the other host's ID on the controller (send: 1, recv: 0)")
    args = parser.parse_args(argv)
    try:
        plan = parse_plan(args.plan)
        if args.role == "send":
            result = send(args.transport, plan, args.peer, args.timeout, args.coherence,
                          1 if args.smc_peer is None else args.smc_peer)
        else:
            result = recv(args.transport, plan, args.timeout, args.coherence,
                          0 if args.smc_peer is None else args.smc_peer)
    except (cxl.CxlError, SmcError, ChannelError, OSError) as err:
        print(f"share_bench: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
