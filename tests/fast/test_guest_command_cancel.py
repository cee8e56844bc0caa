"""A guest command started with GuestShell.start (VirtualMachine.start_command) never keeps the
interpreter alive, and is cancelled as soon as its caller fails or is interrupted.

The failure seen: ``scripts/bench share --json`` failed, and its process stayed alive 17 min
after its main thread ended, waiting on the 1020 s timer of a receiver nobody joined (invoke's
per-command timer, a non-daemon threading.Timer).  The commands here run against a loopback
SSH server (ssh_loopback.py: paramiko's server side running each as a local ``bash -c``,
honouring the "signal" request as the guests' dropbear does); the callers' own logic against
fake VMs."""

import json
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
from ssh_loopback import FakeRunning, LoopbackSsh

from vfio_cxl.guest import cacheline
from vfio_cxl.bench import share as bench_share
from vfio_cxl.errors import LabError
from vfio_cxl.lab import record_stream, ssh
from vfio_cxl.lab.ssh import GuestCommandError, join_all


@pytest.fixture
def server(tmp_path):
    server = LoopbackSsh(tmp_path)
    yield server
    server.close()


@pytest.fixture
def shell(server):
    shell = server.shell()
    yield shell
    shell.close()


def non_daemon_threads() -> set:
    return {t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()}


def test_run_gives_output_exit_status_and_takes_stdin(shell):
    result = shell.run("echo out; echo err >&2; exit 3", check=False)
    assert (result.stdout, result.stderr, result.exited) == ("out\n", "err\n", 3)
    with pytest.raises(GuestCommandError, match=r"^\[loopback\] 'exit 4' exited 4"):
        shell.run("exit 4")
    assert shell.run("cat", stdin="line\n").stdout == "line\n"


def test_input_for_a_command_that_ended_without_reading_it_is_dropped(shell, monkeypatch):
    """The lab's regions command does not read the plan it is given when the guest's init started
    the regions; it once ended, and its channel closed, before invoke's stdin thread sent the plan:
    paramiko's "Socket is closed" in that thread failed the command (a suite run on a loaded host).
    Here the input is held back until the channel has closed."""
    channel = []

    class LateInput(ssh.WholeInput):
        def read(self, size=-1):
            deadline = time.monotonic() + 30
            while not (channel and channel[0].closed) and time.monotonic() < deadline:
                time.sleep(0.01)   # polling the channel's state with a deadline; not synchronisation
            return super().read()

    monkeypatch.setattr(ssh, "WholeInput", LateInput)
    with shell.start("echo done", stdin="the plan\n") as running:
        channel.append(running.channel)
        result = running.join()
    assert channel[0].closed and (result.exited, result.stdout) == (0, "done\n")


def test_a_started_command_has_no_thread_that_keeps_the_interpreter_alive(server, shell):
    before = non_daemon_threads()
    running = shell.start("sleep 60", timeout=1020)   # the bench's receiver: 120 + 900 s
    try:
        assert non_daemon_threads() <= before, "a thread that would keep the interpreter alive"
    finally:
        running.cancel()


def test_a_started_command_whose_caller_raises_is_cancelled(server, shell):
    before = non_daemon_threads()
    with pytest.raises(RuntimeError, match="the sender failed"):
        with shell.start("sleep 60", timeout=1020) as receiver:
            raise RuntimeError("the sender failed")
    session = server.session("sleep 60")
    assert session.ended.wait(5), "the guest command is still running"
    assert session.signals == ["TERM"] and session.process.returncode == -signal.SIGTERM
    assert receiver.channel.closed
    assert non_daemon_threads() <= before
    with pytest.raises(LabError, match="'sleep 60' was cancelled before it was joined"):
        receiver.join()


def test_a_joined_command_is_not_cancelled_by_its_block(server, shell):
    with shell.start("echo done", timeout=10) as running:
        assert running.join().stdout == "done\n"
    assert running.join().stdout == "done\n"   # the same result again
    assert server.session("echo done").signals == []


def test_a_command_past_its_deadline_is_cancelled_and_named(server, shell):
    t0 = time.monotonic()
    with pytest.raises(LabError, match=r"^\[loopback\] 'echo partial; exec sleep 60' did not finish within 1 s; "
                                       r"cancelled\n  partial -- "):
        shell.run("echo partial; exec sleep 60", timeout=1)
    assert time.monotonic() - t0 < 5
    session = server.session("echo partial; exec sleep 60")
    assert session.ended.wait(5) and session.signals == ["TERM"]


def test_join_all_cancels_the_others_when_one_fails(server, shell):
    with ExitStack() as started:
        running = {"b": started.enter_context(shell.start("echo broken >&2; exit 2", timeout=30)),
                   "a": started.enter_context(shell.start("sleep 60", timeout=1020))}
        t0 = time.monotonic()
        with pytest.raises(GuestCommandError, match="'echo broken >&2; exit 2' exited 2:\n  broken"):
            join_all(running)
        assert time.monotonic() - t0 < 5, "waited for the others before raising"
    session = server.session("sleep 60")
    assert session.ended.wait(5) and session.signals == ["TERM"]


def test_join_all_cancels_the_others_on_ctrl_c():
    class Interrupted(FakeRunning):
        def join(self, check=True):
            raise KeyboardInterrupt

    first, second, third = FakeRunning(SimpleNamespace(exited=0)), Interrupted(), FakeRunning()
    with pytest.raises(KeyboardInterrupt):
        join_all({"a": first, "b": second, "c": third})
    assert first.joined and not first.cancelled
    assert second.cancelled and third.cancelled and not third.joined


# A script in an interpreter of its own, as `scripts/bench share` is: it starts a command against
# the loopback server with the bench receiver's timeout, then does BODY.
SCRIPT = """
import json, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)   # whatever this test was started with
from vfio_cxl.lab.ssh import GuestShell
shell = GuestShell(**json.loads(sys.argv[1]))
shell.connect(time.monotonic() + 10)
receiver = shell.start("sleep 60", timeout=1020)
print("started", flush=True)
{body}
"""


def script(server, body: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT.format(body=body), json.dumps(server.address)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_started(process: subprocess.Popen) -> None:
    ready, _, _ = select.select([process.stdout], [], [], 30)
    assert ready and process.stdout.readline() == "started\n", process.stderr.read() if not ready else ""


def ended(process: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"the interpreter was still alive {timeout} s on: {err}") from None
    return process.returncode, err


def test_an_interpreter_whose_main_raises_with_a_command_unjoined_exits_at_once(server):
    """The bench's shape before: the receiver started, then the sender's run raised."""
    process = script(server, 'raise RuntimeError("the sender failed")')
    wait_started(process)
    status, err = ended(process, 15)
    assert status == 1 and "RuntimeError: the sender failed" in err


def test_an_interpreter_interrupted_in_join_cancels_the_command_and_exits_at_once(server):
    """Ctrl-C while waiting for a command: invoke's join forwarded it and then waited for the
    command's output to end (60 s here); now the command is cancelled at once."""
    process = script(server, "receiver.join()")
    wait_started(process)
    session = server.session("sleep 60")
    time.sleep(0.3)   # into the join
    process.send_signal(signal.SIGINT)
    status, err = ended(process, 10)
    assert status != 0 and "KeyboardInterrupt" in err
    assert session.ended.wait(5) and session.signals == ["TERM"]


class FakeVm:
    """A guest where `share_bench send`/`stream produce` (run) and the receiver (start_command)
    answer as given; ``started`` is what start_command returned."""

    def __init__(self, run=None, started=None):
        self.answer, self.started = run, started

    def run(self, command, timeout=None, check=True):
        if " reset" in command:
            return SimpleNamespace(exited=0, stdout='{"reset": true}', stderr="")
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def start_command(self, command, timeout=None):
        return self.started


class FakeLab(dict):
    topology = SimpleNamespace(smc_of=lambda vm: ("smc0", {"a": 0, "b": 1}[vm]))

    def __init__(self, a, b):
        super().__init__(a=a, b=b)


def answer(exited, stdout="", stderr=""):
    return SimpleNamespace(exited=exited, stdout=stdout, stderr=stderr)


@pytest.mark.parametrize("failure", [LabError("[a] no SSH"), KeyboardInterrupt()])
def test_the_share_bench_cancels_its_receiver_when_the_sender_raises(failure):
    receiver = FakeRunning()
    with pytest.raises(type(failure)):
        bench_share.transport_run(FakeLab(FakeVm(run=failure), FakeVm(started=receiver)), "tcp", "64:2:paced")
    assert receiver.cancelled and not receiver.joined


def test_the_share_bench_names_both_sides_when_the_sender_fails():
    sender = answer(1, stderr="share_bench: error: no receiver at 169.254.0.2:7100")
    running = FakeRunning()   # still waiting for records
    with pytest.raises(RuntimeError, match=r"^channel: sender in a exited 1: share_bench: error: no receiver at "
                                           r"169\.254\.0\.2:7100; receiver in b still running \(cancelled\)$"):
        bench_share.transport_run(FakeLab(FakeVm(run=sender), FakeVm(started=running)), "channel", "64:2:paced")
    assert running.cancelled
    ended_first = FakeRunning(answer(1, stderr="share_bench: error: no channel"), done=True)
    with pytest.raises(RuntimeError, match=r"receiver in b exited 1: share_bench: error: no channel$"):
        bench_share.transport_run(FakeLab(FakeVm(run=sender), FakeVm(started=ended_first)), "channel", "64:2:paced")


def test_the_share_bench_prints_why_it_failed(monkeypatch, capsys):
    """`scripts/bench share --json` that fails says why: on stderr, and as the JSON object."""
    def no_cacheline():
        raise cacheline.CachelineError("not built here")

    receiver = FakeRunning()
    lab = FakeLab(FakeVm(run=answer(1, stderr="share_bench: error: no SMC doorbell")), FakeVm(started=receiver))

    class Lab:
        def __init__(self, *args, **kwargs):
            pass

        def start(self, timeout):
            return self

        def __enter__(self):
            return lab

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(cacheline, "build", no_cacheline)
    monkeypatch.setattr(bench_share, "Lab", Lab)
    assert bench_share.main(["--records", "0", "--json"]) == 1
    out, err = capsys.readouterr()
    said = ("RuntimeError: doorbell: sender in a exited 1: share_bench: error: no SMC doorbell; "
            "receiver in b still running (cancelled)")
    assert json.loads(out) == {"error": said}
    assert f"bench share: failed: {said}" in err
    assert receiver.cancelled


@pytest.mark.parametrize("failure", [LabError("[a] no SSH"), KeyboardInterrupt()])
def test_the_share_demo_cancels_its_consumer_when_the_producer_raises(failure):
    consumer = FakeRunning()
    with pytest.raises(type(failure)):
        record_stream.stream(FakeLab(FakeVm(run=failure), FakeVm(started=consumer)), 2)
    assert consumer.cancelled and not consumer.joined

