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
