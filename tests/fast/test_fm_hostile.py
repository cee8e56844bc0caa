"""A hostile client on the fabric manager's control socket -- on the FAKE lab (fm_fake_lab.py).

Whatever a client sends (nested or huge JSON, bytes that are not UTF-8, wrong
types, unknown ops, pipelined requests, never reading, leaving mid-op, many at
once), the manager stays up, answers every well-formed request and bounds the
memory it spends on a connection.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from vfio_cxl.lab.fm import protocol

from fm_harness import FakeFm, env, raw_exchange  # noqa: F401 (env: a fixture)

HELLO = b'{"version": 1, "op": "hello"}\n'


def test_nested_json_gets_an_error_and_the_connection_stays_usable(env):
    """json.loads raises RecursionError (not ValueError) on deep nesting: issue 23, item 1."""
    fm = FakeFm()
    answers = raw_exchange(fm.record.socket, b"[" * 100_000 + b"\n" + b'{"a":' * 50_000 + b"\n" + HELLO)
    assert [a["ok"] for a in answers] == [False, False, True], answers
    assert "nested" in answers[0]["error"]["what"] and answers[0]["error"]["fix"]
    assert answers[2]["result"]["lab"] == fm.name
    assert fm.alive()
    with fm.client() as client:
        assert client.status()["state"] == "running"


def test_a_client_streaming_bytes_while_its_slow_op_runs_is_held_back(env):
    """A release waits (FAKE guest: never lets go); the same connection then streams bytes with no
    newline.  The manager stops reading it past one line's worth (the client's writes block), its
    memory stays bounded, its answer comes when the op ends, then the over-long line is refused:
    issue 23, item 5."""
    fm = FakeFm("--fabric")
    before = fm.rss_kib()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(fm.record.socket))
        sock.sendall(protocol.encode(protocol.request("release", gpu="gpu0", timeout=600)))
        with fm.client() as client:
            while client.status()["gpus"]["gpu0"]["state"] != "moving":
                pass
        sock.settimeout(3)
        chunk, sent = b"x" * (1 << 20), 0
        try:
            while sent < 64 << 20:
                sock.sendall(chunk)
                sent += len(chunk)
        except TimeoutError:
            pass
        grown = fm.rss_kib() - before
        assert sent < 16 << 20, f"the manager took {sent >> 20} MiB of a request while busy"
        assert grown < 16 << 10, f"the manager grew by {grown >> 10} MiB"
        with fm.client() as client:   # others are still served
            assert client.status()["gpus"]["gpu0"]["state"] == "moving"
        (Path(fm.record.rundir) / "deleted-gpu0").touch()   # the guest lets go
        sock.settimeout(10)
        reader = sock.makefile("rb")
        answer = json.loads(reader.readline())
        assert answer["ok"] and answer["result"]["gpu"] == "gpu0", answer
        refusal = json.loads(reader.readline())
        assert "without a newline" in refusal["error"]["what"]
        try:   # closed (a reset: the manager closed it with our bytes unread)
            assert reader.readline() == b""
        except ConnectionResetError:
            pass
    assert fm.alive()
