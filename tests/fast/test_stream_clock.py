"""The stream's clock exchange over the private link (vfio_cxl.guest.cmd.stream), against a real
UDP echo on loopback: serve_clock answering, and an echo that comes back late.

A late echo once left every later read one probe behind its probe: each read took the previous
probe's echo, dropped it as stale, and the producer gave up after its whole timeout with "no clock
echo" while b answered every probe (a share-stream failure in a loaded suite run)."""

from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest

from vfio_cxl.guest import cxl
from vfio_cxl.guest.cmd import stream


@pytest.fixture
def echo():
    """A UDP echo on 127.0.0.1 that answers as serve_clock does (``data + b" <clock>"``), one
    datagram at a time in order, as b's one thread does; ``delays[n]``: it stalls that many
    seconds before it answers the n-th datagram (b's vCPU not scheduled), the later ones queueing
    behind it; ``junk`` datagrams go to the prober before each answer (a stray sender)."""
    state = {"delays": {}, "junk": [], "got": 0}

    class Echo(socketserver.BaseRequestHandler):
        def handle(self):
            data, sock = self.request
            n, state["got"] = state["got"], state["got"] + 1
            for junk in state["junk"]:
                sock.sendto(junk, self.client_address)
            time.sleep(state["delays"].get(n, 0))   # the stall modelled, not a wait for anything
            sock.sendto(data + b" %.9f" % time.monotonic(), self.client_address)

    with socketserver.UDPServer(("127.0.0.1", 0), Echo) as server:
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        state["port"] = server.server_address[1]
        yield state
        server.shutdown()
        thread.join(5)


def test_an_echo_later_than_its_wait_does_not_leave_the_reads_behind(echo):
    # b stalls on probe 0 past its wait: its echo comes back while probe 1 waits, probe 1's queues
    # behind it and comes after probe 2 is sent -- with one read per probe, every read from then
    # on took the echo of the probe before, until the timeout.
    echo["delays"][0] = 1.5 * stream.PROBE_WAIT
    t0 = time.monotonic()
    clock = stream.measure_clock_offset("127.0.0.1", echo["port"], timeout=5.0, samples=10)
    assert time.monotonic() - t0 < 3.0
    assert clock["rtt"] < stream.PROBE_WAIT and abs(clock["offset"]) < 0.05, clock


def test_stray_datagrams_are_not_taken_for_echoes(echo):
    echo["junk"] = [b"", b"x", b"1 2 3", b"999 nan-ish", b"\xff" * 64]
    clock = stream.measure_clock_offset("127.0.0.1", echo["port"], timeout=5.0, samples=5)
    assert clock["rtt"] < stream.PROBE_WAIT and abs(clock["offset"]) < 0.05, clock


def test_serve_clock_answers_and_no_answer_is_an_error_naming_the_peer():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]   # a port nobody answers on once closed
    with pytest.raises(cxl.CxlError, match=rf"no clock echo from 127\.0\.0\.1:{port} within 0\.5 s \(\d+ probes sent\)"):
        stream.measure_clock_offset("127.0.0.1", port, timeout=0.5)
    stop = threading.Event()
    thread = stream.serve_clock(port, stop)
    try:
        clock = stream.measure_clock_offset("127.0.0.1", port, timeout=5.0, samples=3)
        assert clock["rtt"] < stream.PROBE_WAIT and abs(clock["offset"]) < 0.05, clock
    finally:
        stop.set()
        thread.join(5)
