"""vfio_cxl.lab.vm.BoundedQMP's connect against a QMP server on a UNIX socket that does what
QEMU's monitor may do: send an event between switching out of capabilities-negotiation mode
and sending the reply to ``qmp_capabilities``."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from qemu.qmp import ExecuteError

from vfio_cxl.lab.vm import BoundedQMP

GREETING = {"QMP": {"version": {"qemu": {"major": 11, "minor": 1, "micro": 3}, "package": ""},
                    "capabilities": ["oob"]}}
EVENT = {"event": "RESUME", "data": {}, "timestamp": {"seconds": 1, "microseconds": 2}}


class FakeMonitor:
    """One client: greeting, then for ``qmp_capabilities`` the messages ``answer`` makes of the
    command (its id included); then every further command gets ``{"return": {}}``."""

    def __init__(self, path, answer):
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.answer = answer
        self.received: list[dict] = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        conn, _ = self.listener.accept()
        with conn:
            conn.sendall(json.dumps(GREETING).encode() + b"\r\n")
            for command in commands(conn):
                self.received.append(command)
                replies = self.answer(command) if command["execute"] == "qmp_capabilities" else \
                    [{"return": {}, "id": command.get("id")}]
                conn.sendall(b"".join(json.dumps(reply).encode() + b"\r\n" for reply in replies))

    def close(self):
        self.listener.close()
        self.thread.join(5)


def commands(conn):
    """JSON objects as a client sends them: one after another, no separator needed (as QEMU
    parses them)."""
    decoder, buffer = json.JSONDecoder(), ""
    while chunk := conn.recv(4096):
        buffer += chunk.decode()
        while buffer.strip():
            try:
                command, end = decoder.raw_decode(buffer.lstrip())
            except ValueError:
                break   # incomplete: wait for more
            buffer = buffer.lstrip()[end:]
            yield command


@pytest.fixture
def monitor(tmp_path):
    made = []

    def start(answer):
        made.append(FakeMonitor(tmp_path / "qmp.sock", answer))
        return str(tmp_path / "qmp.sock")

    yield start
    for m in made:
        m.close()


def test_an_event_before_the_capabilities_reply_is_queued_not_taken_for_the_reply(monitor):
    path = monitor(lambda command: [EVENT, {"return": {}, "id": command.get("id")}])
    qmp = BoundedQMP(path)
    try:
        qmp.connect_within(5)
        assert qmp.cmd("query-status") == {}   # the session works after it
        assert [e["event"] for e in qmp.get_events()] == ["RESUME"]
    finally:
        qmp.close()


def test_a_refused_qmp_capabilities_is_an_error_not_a_session(monitor):
    path = monitor(lambda command: [{"error": {"class": "CommandNotFound", "desc": "no"}, "id": command.get("id")}])
    qmp = BoundedQMP(path)
    try:
        with pytest.raises(ExecuteError, match="no"):
            qmp.connect_within(5)
    finally:
        qmp.close()
