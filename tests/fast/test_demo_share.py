"""vfio-cxl demo share's own logic: whichever side of the A→B stream fails, its error is printed.

The VMs are fakes that answer with what `python3 -m vfio_cxl.guest.cmd.stream` prints (its JSON
report, exit 3 with an ``error`` in it, or a traceback and exit 1); the real stream runs in
tests/vm/test_share.py and the demo itself in tests/vm/test_documented_commands.py."""

import json
from types import SimpleNamespace

import pytest
from ssh_loopback import FakeRunning

from vfio_cxl.demos import dma, share
from vfio_cxl.errors import LabError
from vfio_cxl.lab import record_stream

PRODUCED = {"count": 2, "done_at": [1.0, 2.0], "elapsed": 1.0, "full_waits": 0, "clock": {"offset": 0.5}}
CONSUMED = {"delivered": [0, 1], "rejected": [], "bad_bytes": [], "seen_at": [1.6, 2.6], "bytes": 10,
            "elapsed": 1.0, "error": None}
TIMED_OUT = {**CONSUMED, "delivered": [], "seen_at": [], "error": "ChannelTimeout: no record within 30 s"}
TRACEBACK = ("Traceback (most recent call last):\n  File \"stream.py\", line 154, in produce\n"
             "vfio_cxl.guest.cxl.CxlError: cannot reach 169.254.0.2:7002: [Errno 111] Connection refused")


def answer(exited: int, stdout: str = "", stderr: str = ""):
    return SimpleNamespace(exited=exited, stdout=stdout, stderr=stderr)


class FakeVm:
    def __init__(self, stream_answer):
        self.stream_answer = stream_answer

    def run(self, command, timeout=None, check=True):
        assert not check or "stream reset" in command, "the producer's failure must not hide the consumer's"
        return self.stream_answer if " produce " in command else answer(0, '{"reset": true}')

    def start_command(self, command, timeout=None):
        assert " consume " in command
        return FakeRunning(self.stream_answer, done=True)


def lab(producer, consumer):
    return {"a": FakeVm(producer), "b": FakeVm(consumer)}


def test_a_producer_that_dies_and_a_consumer_that_times_out_are_both_named():
    with pytest.raises(LabError) as failed:
        record_stream.stream(lab(answer(1, stderr=TRACEBACK), answer(3, json.dumps(TIMED_OUT))), 2)
    said = str(failed.value)
    assert "producer in a: exited 1:" in said and "Connection refused" in said
    assert "consumer in b: ChannelTimeout: no record within 30 s" in said


def test_a_consumer_with_no_report_is_named_beside_a_producer_that_reported():
    with pytest.raises(LabError, match=r"producer in a: no error; consumer in b: exited 1: .*Killed"):
        record_stream.stream(lab(answer(0, json.dumps(PRODUCED)), answer(1, stderr="Killed")), 2)


def test_the_demo_prints_the_consumer_s_error_and_fails(monkeypatch, capsys):
    """The failure seen under load: the consumer reports an error (exit 3), and the demo used to
    print only "0/200 records" and exit 1."""
    class FakeLab(dict):
        def __init__(self, *args, **kwargs):
            super().__init__(lab(answer(0, json.dumps(PRODUCED)), answer(3, json.dumps(TIMED_OUT))))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(dma, "Lab", FakeLab)
    monkeypatch.setattr(dma, "resolve", lambda *args: None)
    monkeypatch.setattr(share, "seed_flow", lambda *args: {
        "a": {"message": "DMA", "dma_ms": 1.0}, "b": {"head": "DMA", "sha256": "0" * 64},
        "a_match": True, "b_match": True, "host_match": True})
    assert share.main(["--records", "2"]) == 1
    out = capsys.readouterr().out
    assert "0/2 records A→B" in out and "no visibility latency" in out
    assert "consumer in b failed: ChannelTimeout: no record within 30 s" in out


# What `python3 -m vfio_cxl.guest.cmd.stream consume --timeout 5` printed in VM b with no producer,
# before it reported that as its error (exit 1; the demo printed nothing of it).
NO_PRODUCER = """Traceback (most recent call last):
  File "/opt/vfio-cxl/vfio_cxl/guest/cmd/stream.py", line 223, in consume
    consumer = Consumer.open(view, coherence=coherence(coherence_name), wait=timeout)
  File "/opt/vfio-cxl/vfio_cxl/channel.py", line 805, in open
    raise type(e)(f"no valid channel after waiting {wait}s: {e.what}", e.fix)
vfio_cxl.guest.channel.NoChannel: no valid channel after waiting 5.0s: no channel header at offset 0 (all zero)

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/opt/vfio-cxl/vfio_cxl/guest/dax.py", line 47, in close
    self.map.close()
    ~~~~~~~~~~~~~~^^
BufferError: cannot close exported pointers exist
"""


def test_a_traceback_is_summed_up_by_its_exception_lines():
    said = record_stream.what_failed(NO_PRODUCER)
    assert said == ("vfio_cxl.guest.channel.NoChannel: no valid channel after waiting 5.0s: no channel header at offset 0 "
                    "(all zero) | BufferError: cannot close exported pointers exist")
    assert record_stream.what_failed("Killed") == "Killed" and record_stream.what_failed("") == "(no output)"
