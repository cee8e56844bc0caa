"""The lab's QMP connections are bounded, and an interrupted one is closed.

QEMU serves one monitor client at a time and greets it only then.  A connect interrupted
(a matrix job's SIGINT from its dying supervisor, Ctrl-C) once stayed open in the event loop:
``stop``'s own connect then waited for a greeting without end, and the lab and its QEMU with
it.  Real UNIX sockets stand in for QEMU's monitor here: one that never greets, one that
greets as QEMU does (the real monitor is driven by every VM test).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from vfio_cxl.errors import LabError

GREETING = {"QMP": {"version": {"qemu": {"micro": 3, "minor": 1, "major": 11}, "package": ""},
                    "capabilities": ["oob"]}}


class Monitor:
    """A UNIX listening socket at ``path``; its client is kept (silent) or greeted and answered
    (at most ``answers`` requests, the capabilities negotiation included; None: all)."""

    def __init__(self, path: Path, greet: bool, answers: int | None = None, listen: bool = True):
        self.greet = greet
        self.answers = answers
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.clients: list[socket.socket] = []
        self.closed = threading.Event()     # a client went away (EOF)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        if listen:
            self.listen()

    def listen(self) -> None:
        """Bound but not listening until now: connects are refused, as between QEMU's bind and listen."""
        self.listener.listen(4)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        self.clients.append(conn)
        with conn:
            if self.greet:
                conn.sendall(json.dumps(GREETING).encode() + b"\r\n")
            buffered = ""
            while True:
                data = conn.recv(4096)
                if not data:
                    self.closed.set()
                    return
                buffered = (buffered + data.decode()).lstrip()
                while self.greet and buffered:   # QMP is a stream of JSON objects, no line ends needed
                    try:
                        request, end = json.JSONDecoder().raw_decode(buffered)
                    except ValueError:
                        break                      # the rest of the object is still on its way
                    buffered = buffered[end:].lstrip()
                    if self.answers is not None:
                        if self.answers == 0:
                            continue              # read, never answered: a wedged QEMU
                        self.answers -= 1
                    answer = {"return": {}, **({"id": request["id"]} if "id" in request else {})}
                    conn.sendall(json.dumps(answer).encode() + b"\r\n")

    def close(self) -> None:
        self.listener.close()


def test_a_monitor_that_never_greets_is_named_and_its_connection_closed(vm):
    monitor = Monitor(vm.res.qmp_socket, greet=False)
    try:
        with pytest.raises(LabError, match=r"\[host0\] QEMU did not greet on QMP within 1 s") as err:
            vm._open_qmp(1.0)
        assert "another client holds its monitor" in err.value.fix
        assert monitor.closed.wait(10), "the half-open QMP connection was left open"
    finally:
        monitor.close()


def test_a_socket_bound_but_not_yet_listening_is_tried_again(vm):
    """QEMU makes its QMP socket file (bind) before it listens: a connect in between is refused
    (seen at a lab's start under load: an unhandled ConnectError).  The lab tries again."""
    monitor = Monitor(vm.res.qmp_socket, greet=True, listen=False)
    timer = threading.Timer(0.5, monitor.listen)
    timer.start()
    try:
        qmp = vm._open_qmp(10)
        qmp.close()
        assert monitor.clients, "it never connected"
    finally:
        timer.cancel()
        monitor.close()


def test_a_socket_that_never_listens_is_named(vm):
    monitor = Monitor(vm.res.qmp_socket, greet=True, listen=False)
    try:
        with pytest.raises(LabError, match=r"\[host0\] cannot connect to QEMU's QMP socket"):
            vm._open_qmp(1.0)
    finally:
        monitor.close()


def test_a_monitor_whose_backlog_is_full_is_named_within_the_timeout(vm):
    """Clients queued behind the one QEMU serves fill its socket's backlog; a blocking UNIX
    connect would then wait for room without end.  The lab's is tried until its deadline and
    named."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(vm.res.qmp_socket))
    listener.listen(0)                     # never accepted: room for one queued connect
    queued = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    queued.setblocking(False)
    try:
        queued.connect(str(vm.res.qmp_socket))
        t0 = time.monotonic()
        with pytest.raises(LabError, match=r"\[host0\] cannot connect to QEMU's QMP socket: .*unavailable") as err:
            vm._open_qmp(1.0)
        assert 1.0 <= time.monotonic() - t0 < 5
        assert "other clients hold QEMU's monitor" in err.value.fix
    finally:
        queued.close()
        listener.close()


def test_an_interrupted_connect_is_closed_and_the_next_one_works(vm):
    """SIGINT (KeyboardInterrupt) while waiting for the greeting: the connection goes, and a new
    connection on the same thread's event loop negotiates with a monitor that greets."""
    silent = Monitor(vm.res.qmp_socket, greet=False)

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            vm._open_qmp(30)
        assert silent.closed.wait(10), "the interrupted QMP connection was left open"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        silent.close()
    vm.res.qmp_socket.unlink()
    greeting = Monitor(vm.res.qmp_socket, greet=True)
    try:
        qmp = vm._open_qmp(10)
        qmp.settimeout(5)
        assert qmp.cmd("query-status") == {}
        qmp.close()
        assert greeting.closed.wait(10)
    finally:
        greeting.close()


def test_stop_kills_a_qemu_whose_monitor_never_answers(vm):
    """A stand-in QEMU process (its own session, as the lab starts QEMU) and a silent monitor:
    ``stop`` gives up on QMP and kills the process group rather than waiting forever."""
    monitor = Monitor(vm.res.qmp_socket, greet=False)
    vm.process = subprocess.Popen(["sleep", "600"], start_new_session=True)
    stopper = threading.Thread(target=vm.stop, kwargs={"timeout": 1}, daemon=True)
    try:
        stopper.start()
        stopper.join(60)
        assert not stopper.is_alive(), "stop() is still waiting on a monitor that never answers"
        assert vm.process.returncode == -signal.SIGKILL
        assert monitor.closed.wait(10)
    finally:
        monitor.close()


def test_a_qemu_that_greets_but_never_answers_info_usernet_is_named(vm):
    """Reading the SSH port QEMU chose: the command is bounded by the boot's deadline too."""
    monitor = Monitor(vm.res.qmp_socket, greet=True, answers=1)     # the negotiation only
    vm.process = subprocess.Popen(["sleep", "600"], start_new_session=True)   # a QEMU that stays up
    try:
        with pytest.raises(LabError, match=r"\[host0\] QEMU did not answer 'info usernet' on QMP in time"):
            vm.wait_ready(timeout=1)
        assert monitor.closed.wait(10), "the QMP connection was left open"
    finally:
        monitor.close()
