"""A hostile client on the fabric manager's control socket -- on the FAKE lab (fm_fake_lab.py).

Whatever a client sends (nested or huge JSON, bytes that are not UTF-8, wrong
types, unknown ops, pipelined requests, never reading, leaving mid-op, many at
once), the manager stays up, answers every well-formed request and bounds the
memory it spends on a connection.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vfio_cxl.lab.fm import protocol
from vfio_cxl.lab.fm.events import EVENT_HISTORY
from vfio_cxl.lab.fm.reallab import RealLab
from vfio_cxl.paths import REPO_ROOT

from fm_harness import FakeFm, env, raw_exchange  # noqa: F401 (env: a fixture)

HELLO = b'{"version": 1, "op": "hello"}\n'
HOLDER = Path(__file__).with_name("fm_holder.py")


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


def vfio_cxl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vfio_cxl", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=timeout)


def test_events_and_follow_work_after_many_moves(env, soak):
    """FAKE hot-plug whose guests let go at once: 600 moves (2,000 under --soak), more events than
    the manager keeps, later `fm events` and `fm events --follow` still work, page by page, from
    the history the manager keeps: issue 23, item 4 (the whole history on one line broke the
    client past 1 MiB)."""
    fm = FakeFm("--fabric", "--auto-release")
    moves = soak(600, 2000)
    assert 2 * moves > EVENT_HISTORY   # the history must overflow
    with fm.client() as client:
        for i in range(moves):
            client.assign("gpu0", "b" if i % 2 == 0 else "a", keep_vram=True)
        latest = client.events_page(limit=1)["latest"]
        page = client.events_page(since=latest - 5, limit=2)
        assert [ev["seq"] for ev in page["events"]] == [latest - 4, latest - 3] and page["more"]
        everything = client.events()
    assert latest > 2 * moves
    assert [ev["seq"] for ev in everything] == list(range(latest - EVENT_HISTORY + 1, latest + 1))
    result = vfio_cxl("fm", "events", "--json")
    assert result.returncode == 0, result.stderr
    printed = [json.loads(line) for line in result.stdout.splitlines()]
    assert [ev["seq"] for ev in printed] == [ev["seq"] for ev in everything]
    assert f"{latest - EVENT_HISTORY} older events are no longer kept" in result.stderr
    follower = subprocess.Popen([sys.executable, "-m", "vfio_cxl", "fm", "events", "--follow", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT)
    try:
        for expected in range(latest - EVENT_HISTORY + 1, latest + 1):   # the kept past, in order
            assert json.loads(follower.stdout.readline())["seq"] == expected
        with fm.client() as client:
            client.assign("gpu0", "b", keep_vram=True)   # then live ones
        released, attached = (json.loads(follower.stdout.readline()) for _ in range(2))
        assert (released["kind"], attached["kind"]) == ("gpu-released", "gpu-attached")
        assert attached["seq"] == latest + 2
    finally:
        follower.kill()
        follower.wait()
    assert fm.alive()


# -- a hostile guest (FAKE guest: the FM's real guest scripts and parsers on a fake sysfs) ---
def hold(fm: FakeFm, name: str, vm: str = "a", gpu: str = "gpu0") -> subprocess.Popen:
    """A real process named ``name`` that holds ``gpu``'s node in the fake guest's tree."""
    tree = Path(fm.record.rundir) / f"guest-{vm}"
    bdf = {"gpu0": "0000:02:00.0", "gpu1": "0000:02:00.0"}[gpu]
    group = os.readlink(tree / "sys/bus/pci/devices" / bdf / "iommu_group").rsplit("/", 1)[1]
    proc = subprocess.Popen([sys.executable, str(HOLDER), name, str(tree / "dev/vfio" / group)],
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"holding\n"
    return proc


def test_a_holder_named_to_forge_fields_is_killed_and_pid_1_never_aimed_at(env):
    """Guest processes named '","pid":1,"":"' and 'a<newline>holder 1 ...' hold the GPU: release
    names them (quoted), --force kills exactly them, never pid 1: issue 23, item 7."""
    fm = FakeFm("--fabric")
    crafted = [hold(fm, '","pid":1,"":"'), hold(fm, "a\nholder 1 /dev")]
    default = int((Path(fm.record.rundir) / "holder.pid").read_text())
    with fm.client() as client:
        with pytest.raises(protocol.RemoteError) as err:
            client.release("gpu0", timeout=0.2)
        assert f'pid {crafted[0].pid} ("\\",\\"pid\\":1,\\"\\":\\"") on /dev/vfio/11' in err.value.what
        assert f"pid {crafted[1].pid} (a) on /dev/vfio/11" in err.value.what
        assert "pid 1 " not in err.value.what
        since = client.events_page(limit=1)["latest"]
        with pytest.raises(protocol.RemoteError):
            client.release("gpu0", timeout=0.2, force=True)
        force = next(ev for ev in client.events(since) if ev["kind"] == "gpu-force")
    assert sorted(force["pids"]) == sorted([default, *(p.pid for p in crafted)])
    for proc in crafted:
        assert proc.wait(10) == -signal.SIGKILL
    assert fm.alive()


@pytest.mark.parametrize("hostile, what", [
    ("yes 'holder 1 /dev/vfio/11 x' | head -c 3000000", "printed more than 65536 bytes"),
    ("echo 'group /dev/vfio/11'; echo '{\"pid\": 1, \"comm\": \"x\"}'", "line 2 not in its format"),
    ("echo 'group /dev/vfio/11'; echo 'holder 1 /dev/vfio/12 x'", "line 2 not in its format"),
    ("for i in $(seq 300); do echo \"holder $((i+1)) /dev/vfio/11 x\"; done | sed '1i group /dev/vfio/11'",
     "more than 256 processes hold the GPU"),
])
def test_a_guest_whose_holders_answer_is_flooded_or_malformed(env, hostile, what):
    """The guest's holders script is replaced: release fails saying what the guest printed, kills
    nothing, the GPU stays attached: issue 23, item 6."""
    fm = FakeFm("--fabric")
    (Path(fm.record.rundir) / "guest-a" / "hostile-holders").write_text(hostile)
    before = fm.rss_kib()
    with fm.client() as client:
        with pytest.raises(protocol.RemoteError) as err:
            client.release("gpu0", timeout=0.2, force=True)
        assert what in err.value.what
        assert client.status()["gpus"]["gpu0"]["state"] == "attached"
    assert not (Path(fm.record.rundir) / "killed").exists()
    assert fm.rss_kib() - before < 16 << 10
    assert fm.alive()


@pytest.mark.parametrize("hostile, what", [
    ("yes | head -c 3000000", "printed more than 65536 bytes"),
    ('echo \'{"bdf": "0000:03:00.0", "driver": "vfio-pci", "gpus": 2, "guest": {"start": "x", "seen": 1, '
     '"bound": 1, "first_scan": true}}\'', "has no guest times"),
    ('echo \'{"driver": "vfio-pci", "gpus": 2, "guest": {}}\'', "does not have the fields"),
    ('echo \'{"bdf": "../../x", "driver": "vfio-pci", "gpus": 2, "guest": {}}\'', "has no PCI address"),
    ("echo '" + "[" * 5000 + "'", "is not JSON"),
    ("printf 'x%.0s' $(seq 50000)", "is not JSON"),
])
def test_a_guest_whose_bind_answer_is_flooded_or_malformed(env, hostile, what):
    """The guest's bind check is replaced: assign fails saying what the guest printed, the GPU is
    `failed` (not `moving`) in that VM with an event saying so, and `fm restart` recovers it once
    the guest behaves: issue 23, item 6."""
    fm = FakeFm("--fabric", "--auto-release")
    hostile_file = Path(fm.record.rundir) / "guest-b" / "hostile-bind"
    hostile_file.write_text(hostile)
    with fm.client() as client:
        since = client.events_page(limit=1)["latest"]
        with pytest.raises(protocol.RemoteError) as err:
            client.assign("gpu0", "b")
        assert what in err.value.what
        gpu = client.status()["gpus"]["gpu0"]
        assert (gpu["state"], gpu["owner"]) == ("failed", "b")
        failed = [ev for ev in client.events(since) if ev["kind"] == "gpu-attach-failed"]
        assert len(failed) == 1 and what in failed[0]["message"] and "fm restart gpu0" in failed[0]["message"]
        hostile_file.unlink()
        client.restart("gpu0")
        gpu = client.status()["gpus"]["gpu0"]
        assert (gpu["state"], gpu["owner"]) == ("attached", "b")
    assert fm.alive()


def test_a_vm_that_dies_during_device_add_frees_the_gpu(env):
    """The GPU is owned from before device_add: a VM death handled while QEMU has not answered
    frees it (gpu-freed), never leaves it to a dead VM: issue 23, item 2."""
    fm = FakeFm("--fabric", "--auto-release")
    rundir = Path(fm.record.rundir)
    (rundir / "hold-device-add").touch()
    follower = fm.client()
    events = follower.follow_events(timeout=10)
    while next(events)["kind"] != "lab-ready":
        pass
    mover = fm.client(timeout=30)
    mover.send_raw(protocol.encode(protocol.request("assign", gpu="gpu0", vm="b", keep_vram=True)))
    while not (rundir / "device-add-started").exists():
        time.sleep(0.02)   # polling the fake's file: its stand-in for "QEMU got device_add"
    with fm.client() as client:
        os.kill(client.status()["vms"]["b"]["pid"], signal.SIGKILL)
    while (event := next(events))["kind"] != "vm-died":
        pass
    (rundir / "hold-device-add").unlink()
    mover.read_message()   # the assign's answer, whatever it is
    while (event := next(events))["kind"] != "gpu-freed" or event["gpu"] != "gpu0":
        pass   # (gpu1, b's own GPU, is freed too)
    assert event["vm"] == "b"
    with fm.client() as client:
        gpu = client.status()["gpus"]["gpu0"]
    assert (gpu["state"], gpu["owner"]) == ("free", None)
    mover.close()
    follower.close()


class FakeQmp:
    """FAKE QMP connection: queued events, and the devices QEMU has (qom-list)."""

    def __init__(self, events, present):
        self.events, self.present = list(events), set(present)

    def get_events(self, wait=False):
        events, self.events = self.events, []
        return events

    def pull_event(self, wait=False):
        if self.events:
            return self.events.pop(0)
        raise TimeoutError

    def cmd(self, name, **args):
        assert (name, args) == ("qom-list", {"path": "/machine/peripheral"})
        return [{"name": dev, "type": "child<vfio-user-pci>"} for dev in self.present]


def deleted(dev):
    return {"event": "DEVICE_DELETED", "data": {"device": dev, "path": f"/machine/peripheral/{dev}"}}


def test_waiting_for_one_device_keeps_the_others_deleted_events():
    """gpu1's DEVICE_DELETED arrives while the FM waits for gpu0's: kept for gpu1's wait (it was
    cleared); a device QEMU no longer has counts as deleted (its event went with a dropped
    connection); one it still has times out: issue 23, item 2."""
    lab = RealLab.__new__(RealLab)
    lab.deleted = {"a": set()}
    qmp = FakeQmp([deleted("gpu1-2-9"), deleted("gpu0-1-8")], present={"gpu1-2-9", "gpu0-1-8"})
    assert lab._wait_deleted("a", qmp, "gpu0-1-8", 1.0) is True
    assert lab._wait_deleted("a", qmp, "gpu1-2-9", 0.1) is True   # from the kept event
    assert lab._wait_deleted("a", FakeQmp([], present=set()), "gpu0-3-12", 5.0) is True
    assert lab._wait_deleted("a", FakeQmp([], present={"gpu0-3-12"}), "gpu0-3-12", 0.2) is False


def test_the_client_waits_as_long_as_the_fm_may_work_on_the_op(env):
    """A client whose own timeout (1 s) is shorter than the release's (2 s) still gets the FM's
    answer, not "no answer" while the op goes on: issue 23, item 9."""
    fm = FakeFm("--fabric")
    with fm.client(timeout=1) as client:
        t0 = time.monotonic()
        with pytest.raises(protocol.RemoteError, match="did not release GPU gpu0 within 2 s"):
            client.release("gpu0", timeout=2)
        assert time.monotonic() - t0 >= 2
        assert client.status()["gpus"]["gpu0"]["state"] == "attached"   # the connection is fine
    assert protocol.op_timeout("release", {"timeout": 600, "force": True}) >= 2 * 600


def test_pipelined_bad_and_good_lines_are_each_answered_in_order(env):
    """One write: invalid UTF-8, wrong types in every field of every op, unknown ops and fields,
    good requests between them; one answer per line, in order, the good ones ok."""
    fm = FakeFm("--fabric")
    lines, expect = [], []
    good = {"hello": {}, "status": {}, "events": {"since": 0, "limit": 5, "follow": False},
            "ssh_info": {"vm": "a"}, "assign": {"gpu": "gpu9", "vm": "a", "keep_vram": True},
            "release": {"gpu": "gpu9", "force": False, "keep_vram": False, "timeout": 1},
            "restart": {"gpu": "gpu9"}}
    for op, fields in good.items():
        for name in fields:
            for junk in (None, [], {}, "1" if not isinstance(fields[name], str) else 1, [[[[]]]]):
                lines.append(json.dumps({"version": 1, "op": op, **fields, name: junk}).encode())
                expect.append(f"field {name!r} must be")
        lines.append(json.dumps({"version": 1, "op": op, **fields}).encode())
        expect.append(None if op in ("hello", "status", "events", "ssh_info") else "no GPU 'gpu9'")
    lines += [b'{"version": 1, "op": "status", "\xff": 1}', b"\xc3\x28", b"", b"   ", b'{"version": 1, "op": "fly"}']
    expect += ["not JSON", "not JSON", "not JSON", "not JSON", "unknown op 'fly'"]
    answers = raw_exchange(fm.record.socket, b"".join(line + b"\n" for line in lines) + HELLO)
    assert len(answers) == len(lines) + 1
    for line, answer, what in zip(lines, answers, expect):
        if what is None:
            assert answer["ok"], (line, answer)
        else:
            assert not answer["ok"] and what in answer["error"]["what"], (line, answer)
    assert answers[-1]["ok"] and fm.alive()


def test_a_follower_that_never_reads_is_dropped_and_costs_bounded_memory(env):
    """A follower stops reading while events flow (GPU moves): the FM keeps at most 4 MiB for it,
    then drops it; everyone else is served."""
    fm = FakeFm("--fabric", "--auto-release")
    sleeper = socket.socket(socket.AF_UNIX)
    sleeper.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sleeper.connect(str(fm.record.socket))
    sleeper.sendall(protocol.encode(protocol.request("events", follow=True)))
    before = fm.rss_kib()
    with fm.client() as client:
        for i in range(50):
            client.assign("gpu0", "b" if i % 2 == 0 else "a", keep_vram=True)
            if i == 10:   # and asks for more than 4 MiB of answers it does not read
                sleeper.sendall(b'{"version": 1, "op": "status"}\n' * 4000)
        assert client.status()["state"] == "running"
    assert fm.rss_kib() - before < 24 << 10
    log = (fm.logdir / "fm.log").read_text()
    assert "dropping a client that does not read its events" in log
    sleeper.close()


def test_a_client_that_leaves_mid_op_does_not_stop_the_op_or_the_fm(env):
    fm = FakeFm("--fabric")
    with socket.socket(socket.AF_UNIX) as leaver:
        leaver.connect(str(fm.record.socket))
        leaver.sendall(protocol.encode(protocol.request("release", gpu="gpu0", timeout=30)))
        with fm.client() as client:
            while client.status()["gpus"]["gpu0"]["state"] != "moving":
                pass
    (Path(fm.record.rundir) / "deleted-gpu0").touch()   # the guest lets go after the client left
    with fm.client() as client:
        follow = client.follow_events(timeout=10)
        while next(follow)["kind"] != "gpu-released":
            pass
    with fm.client() as client:
        gpu = client.status()["gpus"]["gpu0"]
        assert (gpu["state"], gpu["owner"]) == ("free", None)


def test_many_clients_at_once(env):
    """100 connections, each with pipelined requests, all open at once: every one answered."""
    fm = FakeFm()
    socks = []
    for _ in range(100):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(fm.record.socket))   # blocking: waits while the backlog is full
        sock.settimeout(30)
        sock.sendall(HELLO + b'{"version": 1, "op": "status"}\n{"version": 1, "op": "events", "limit": 3}\n')
        socks.append(sock)
    for sock in socks:
        with sock, sock.makefile("rb") as reader:
            answers = [json.loads(reader.readline()) for _ in range(3)]
        assert [a["ok"] for a in answers] == [True, True, True]
    assert fm.alive()


def test_fm_fuzz(soak):
    """scripts/bench fm-fuzz as a user runs it: 600 requests; the documented run's 10,000 under --soak."""
    requests = soak(600, 10000)
    result = subprocess.run([str(REPO_ROOT / "scripts" / "bench"), "fm-fuzz", "--requests", str(requests),
                             "--seed", "7" if requests == 600 else "23", "--json"],
                            capture_output=True, text=True, timeout=1800, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["violation"] is None and report["requests"] >= requests
    assert report["answered"] > 500 and report["kinds"]["valid"] > 100
    assert report["rss_max_mib"] - report["rss_start_mib"] < report["rss_limit_mib"]


def test_the_control_socket_is_the_users_alone(env):
    """docs/fabric-manager.md: the control socket is mode 0600 (only the lab's user connects)."""
    fm = FakeFm()
    mode = os.stat(fm.record.socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert os.stat(fm.record.socket).st_uid == os.getuid()
