"""Two hosts, one CXL memory: the seed's flow and the private control link."""

import json
import re
import time

from vfio_cxl.guest import cacheline
from vfio_cxl.bench.share import phases, transport_run
from vfio_cxl.demos.share import seed_flow
from vfio_cxl.guest.record_plan import parse_plan
from vfio_cxl.lab.record_stream import B_LINK_ADDRESS, STREAM, stream
from vfio_cxl.guest.cmd.stream import CHANNEL_BASE


def test_gpu_in_a_writes_what_b_reads_with_no_copy(shared_lab):
    result = seed_flow(shared_lab, 1 << 20, 0x400000)
    assert result["a"]["message"] == "DMA FROM GPU TO CXL MEMORY"
    assert result["b"]["head"].startswith("DMA FROM GPU TO CXL MEMORY")
    assert result["a_match"] and result["b_match"] and result["host_match"], result


def test_b_has_no_gpu(shared_lab):
    assert shared_lab["b"].run("lspci -n -d 0601:1991").stdout.strip() == ""
    assert "0601:1991" in shared_lab["a"].run("lspci -n -d 0601:1991").stdout


def test_private_link_between_the_guests_is_link_local_only(shared_lab):
    a, b = shared_lab["a"], shared_lab["b"]
    out = a.run("ip -4 -o addr show").stdout
    link = [line for line in out.splitlines() if "169.254." in line]
    assert link, out
    assert re.search(r"169\.254\.0\.1/24", link[0])
    # Nothing but slirp's SSH address and the link-local address.
    assert set(re.findall(r"inet (\S+)", out)) == {"127.0.0.1/8", "10.0.2.15/24", "10.0.3.15/24", "169.254.0.1/24"}
    # b reaches a's SSH server over the link (a stream socket between the two QEMUs).
    # The identification line only: a server may send its key exchange right behind it.
    banner = b.run("python3 -c \"import socket; s=socket.create_connection(('169.254.0.1', 22), 5); "
                   "print(s.makefile('rb').readline().decode())\"").stdout
    assert banner.startswith("SSH-2.0-")


def test_1000_records_stream_a_to_b_exactly_once_and_a_corrupt_one_is_rejected(shared_lab):
    result = stream(shared_lab, 1000, corrupt=(123,), max_size=32 << 10)
    b = result["b"]
    assert b["error"] is None
    assert b["rejected"] == [123]                      # never delivered as good data
    assert b["delivered"] == [s for s in range(1000) if s != 123]   # no loss, no duplicate, in order
    assert b["bad_bytes"] == []                        # every payload byte-exact (GPU PRNG stream)


def test_notification_over_the_link_delivers_too(shared_lab):
    result = stream(shared_lab, 100, notify=True, max_size=8 << 10)
    assert result["b"]["error"] is None
    assert result["b"]["delivered"] == list(range(100)) and result["b"]["bad_bytes"] == []


def test_stream_with_the_real_x86_cache_operations_in_both_guests(shared_lab):
    cacheline.build()                  # on the host: the guests have no compiler and load this build
    info = json.loads(shared_lab["b"].run("python3 -m vfio_cxl.guest.cacheline info --json").stdout)
    assert info["built"] and info["coherence"].startswith("x86: flush ")
    result = stream(shared_lab, 200, max_size=16 << 10, coherence="x86")
    b = result["b"]
    assert b["error"] is None and b["delivered"] == list(range(200)) and b["bad_bytes"] == []


def test_channel_and_tcp_carry_the_same_checked_payloads(shared_lab):
    plan = "64:3:paced,4096:20:stream,1048576:3:stream"
    for transport in ("channel", "tcp"):
        sent, got = transport_run(shared_lab, transport, plan)
        assert got["bad"] == 0 and len(got["seen_at"]) == len(sent["sent_at"]) == 26, (transport, got)
        table = phases(parse_plan(plan), sent, got)
        assert table[64]["rtt_ms_median"] > 0 and table[1048576]["mb_s"] > 0
    assert got["guest_crc32_mb_s"] > 0


def test_ring_full_back_pressure(shared_lab):
    # b holds its first record un-acked until the 8-entry ring is full; a must wait, then finish.
    result = stream(shared_lab, 40, ring_entries=8, stall_until_full=True, max_size=4096)
    assert result["a"]["full_waits"] >= 1
    assert result["b"]["delivered"] == list(range(40)) and result["b"]["error"] is None


def test_a_consumer_whose_producer_never_comes_reports_it(shared_lab):
    """The failure `vfio-cxl demo share` met under heavy load: no channel within the consumer's
    --timeout.  It is the consumer's reported error (exit 3), which the demo prints -- it was a
    traceback (NoChannel, then a BufferError from the mapping it left exported) and exit 1."""
    b = shared_lab["b"]
    b.run(f"{STREAM} reset")
    result = b.run(f"{STREAM} consume --count 2 --timeout 2", check=False)
    assert result.exited == 3, result.stderr
    report = json.loads(result.stdout)
    assert report["delivered"] == [] and report["error"].startswith("NoChannel: no valid channel after waiting 2.0s")
    assert result.stderr == ""


def test_producer_vm_dying_mid_stream_is_reported_not_hung(shared_lab, labs):
    a, b = shared_lab["a"], shared_lab["b"]
    a.run(f"{STREAM} reset")
    consumer = b.start_command(f"{STREAM} consume --count 100000 --max-size 4096 --timeout 10", timeout=120)
    producer = a.start_command(f"{STREAM} produce --count 100000 --max-size 4096 --peer {B_LINK_ADDRESS}",
                               timeout=120)
    published_at = CHANNEL_BASE + 64   # the producer's published counter (vfio_cxl.guest.channel layout)
    deadline = time.monotonic() + 120
    while int.from_bytes(shared_lab.read_backend("shared", published_at, 8), "little") < 50:
        if time.monotonic() > deadline:
            raise AssertionError(f"the producer never got going: a={producer.join(check=False)} "
                                 f"b={consumer.join(check=False)}")
        time.sleep(0.05)   # polling the shared memory from the host; not synchronisation
    a.stop()                   # VM a dies mid-stream
    result = consumer.join(check=False)
    producer.join(check=False)
    labs.close()               # the lab lost a VM: the next test gets a fresh one
    assert result.exited == 3
    report = json.loads(result.stdout)
    assert "ChannelTimeout" in report["error"]
    assert len(report["delivered"]) >= 50 and report["bad_bytes"] == []
