"""The fabric manager's control protocol server (vfio_cxl.lab.fm.server), in this process:
framing, order, a busy connection, bounds, followers.  The test runs the server's loop itself."""

from __future__ import annotations

import json
import os
import selectors
import socket
import stat
import time

import pytest

from vfio_cxl.lab.fm import protocol
from vfio_cxl.lab.fm.server import MAX_OUTBUF, ControlServer

STATUS = protocol.encode(protocol.request("status"))
HELLO = protocol.encode(protocol.request("hello"))
RELEASE = protocol.encode(protocol.request("release", gpu="gpu0"))


class Rig:
    """A ControlServer on a socket in tmp_path; ``handle`` answers ok(op), or None (busy) for
    a release; ``turn()`` runs one loop turn."""

    def __init__(self, tmp_path):
        self.sel = selectors.DefaultSelector()
        self.logs: list[str] = []
        self.held: list = []   # the clients whose release is "running"
        self.server = ControlServer(self.sel, self.handle, self.logs.append)
        self.path = tmp_path / "fm.sock"
        self.server.listen(self.path)

    def handle(self, client, request):
        if request["op"] == "release":
            self.held.append(client)
            return None
        if request["op"] == "events":
            client.follow = True
        return protocol.ok(request["op"])

    def turn(self) -> None:
        for key, mask in self.sel.select(timeout=0.01):
            what, client = key.data
            if what == "listen":
                self.server.accept()
            else:
                self.server.ready(client, mask)

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(self.path))
        sock.setblocking(False)
        before = len(self.server.clients)
        while len(self.server.clients) == before:   # until the server accepted it
            self.turn()
        return sock

    def lines(self, sock: socket.socket, count: int) -> list[dict]:
        """Run the loop until ``sock`` has ``count`` lines (10 s at most)."""
        data, deadline = b"", time.monotonic() + 10
        while data.count(b"\n") < count:
            assert time.monotonic() < deadline, f"got {data[:200]!r}, wanted {count} lines"
            self.turn()
            try:
                data += sock.recv(1 << 16)
            except BlockingIOError:
                pass
        return [json.loads(line) for line in data.splitlines()]

    def closed(self, sock: socket.socket) -> bytes:
        """Run the loop until the server closes ``sock``; what it sent before."""
        data, deadline = b"", time.monotonic() + 10
        while True:
            assert time.monotonic() < deadline, "the server did not close the connection"
            self.turn()
            try:
                chunk = sock.recv(1 << 16)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                return data
            if not chunk:
                return data
            data += chunk


@pytest.fixture
def rig(tmp_path):
    rig = Rig(tmp_path)
    yield rig
    rig.server.close()
    rig.sel.close()


def test_the_socket_is_for_the_labs_user_only(rig):
    assert stat.S_IMODE(os.stat(rig.path).st_mode) == 0o600


def test_pipelined_requests_are_answered_in_order(rig):
    sock = rig.connect()
    sock.sendall(HELLO + STATUS + HELLO)
    assert [a["result"] for a in rig.lines(sock, 3)] == ["hello", "status", "hello"]


def test_a_bad_line_gets_an_error_and_the_next_one_is_served(rig):
    sock = rig.connect()
    sock.sendall(b"not json\n" + b'{"version": 1, "op": "nope"}\n' + HELLO)
    answers = rig.lines(sock, 3)
    assert [a["ok"] for a in answers] == [False, False, True]
    assert "nope" in answers[1]["error"]["what"] and answers[1]["error"]["fix"]


def test_a_busy_connection_waits_for_its_answer_before_its_next_request(rig):
    sock = rig.connect()
    sock.sendall(RELEASE + HELLO)
    while not rig.held:
        rig.turn()
    for _ in range(5):
        rig.turn()
    with pytest.raises(BlockingIOError):
        sock.recv(1)   # the hello waits behind the release
    rig.server.answer_later(rig.held[0], protocol.encode(protocol.ok("released")))
    assert [a["result"] for a in rig.lines(sock, 2)] == ["released", "hello"]


def test_an_answer_for_a_connection_that_left_is_dropped(rig):
    sock = rig.connect()
    sock.sendall(RELEASE)
    while not rig.held:
        rig.turn()
    client = rig.held[0]
    rig.server._drop(client)   # as when it hung up and the loop saw it
    sock.close()
    rig.server.answer_later(client, protocol.encode(protocol.ok("released")))
    assert rig.server.clients == {}


def test_a_line_longer_than_max_line_is_refused_and_the_connection_closed(rig):
    sock = rig.connect()
    sock.setblocking(True)
    sock.settimeout(0.01)
    chunk, sent = b"x" * (1 << 16), 0
    while sent <= protocol.MAX_LINE + len(chunk):
        try:
            sent += sock.send(chunk)
        except (BlockingIOError, TimeoutError):
            pass
        except BrokenPipeError:
            break   # refused and closed before the rest was sent
        rig.turn()
    sock.setblocking(False)
    answers = [json.loads(line) for line in rig.closed(sock).splitlines()]
    assert answers == [protocol.error(f"request longer than {protocol.MAX_LINE} bytes without a newline",
                                      "end each JSON request with a newline")]


def test_a_client_that_shuts_its_side_gets_its_answers_then_the_close(rig):
    sock = rig.connect()
    sock.sendall(HELLO + b'{"version": 1, "op": "hel')   # a partial last line: dropped
    sock.shutdown(socket.SHUT_WR)
    answers = [json.loads(line) for line in rig.closed(sock).splitlines()]
    assert [a["result"] for a in answers] == ["hello"]


def test_events_go_to_followers_only(rig):
    follower, other = rig.connect(), rig.connect()
    follower.sendall(protocol.encode(protocol.request("events", follow=True)))
    rig.lines(follower, 1)
    rig.server.broadcast(protocol.encode(protocol.event({"seq": 1, "kind": "tick"})))
    assert rig.lines(follower, 1) == [protocol.event({"seq": 1, "kind": "tick"})]
    for _ in range(5):
        rig.turn()
    with pytest.raises(BlockingIOError):
        other.recv(1)


def test_a_follower_that_does_not_read_is_dropped(rig):
    follower = rig.connect()
    follower.sendall(protocol.encode(protocol.request("events", follow=True)))
    rig.lines(follower, 1)
    line = protocol.encode(protocol.event({"seq": 1, "message": "z" * 4096}))
    for _ in range(2 * MAX_OUTBUF // len(line)):
        rig.server.broadcast(line)
    assert rig.server.clients == {}
    assert rig.logs == ["dropping a client that does not read its events"]
