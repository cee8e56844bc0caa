"""The fabric manager's control protocol, supervision, registry and cleanup -- on a FAKE lab.

A real fabric-manager process (the same FabricManager class, loop and socket
as in a lab) runs over tests/fast/fm_fake_lab.py's FakeLab, whose "VMs" and
"GPU servers" are sleeping processes; what is checked is our own logic.  The VM
tests (tests/vm/test_lab_fm.py) do the same with QEMU.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab.fm.commands import lab_summary
from vfio_cxl.lab import topology
from vfio_cxl.lab.fm import protocol, registry
from vfio_cxl.lab.fm.cleanup import down, remove_leftovers
from vfio_cxl.lab.fm.client import FmClient
from vfio_cxl.lab.fm.procs import ProcessId, processes_mentioning, wait_gone
from vfio_cxl.paths import REPO_ROOT

from fm_harness import FakeFm, env, raw_exchange  # noqa: F401 (env: a fixture)


# -- the protocol, message by message ------------------------------------------------------
@pytest.mark.parametrize("line, what", [
    (b"{not json", "request is not JSON"),
    (b"[1, 2]", "request must be a JSON object, not list"),
    (b'{"op": "status"}', "protocol version None is not supported"),
    (b'{"version": 2, "op": "status"}', "protocol version 2 is not supported (this fabric manager speaks 1)"),
    (b'{"version": 1, "op": "teleport"}', "unknown op 'teleport'"),
    (b'{"version": 1, "op": "status", "verbose": true}', "op 'status' has no field 'verbose'"),
    (b'{"version": 1, "op": "events", "since": "3"}', "field 'since' must be int"),
    (b'{"version": 1, "op": "events", "since": true}', "field 'since' must be int"),
    (b'{"version": 1, "op": "ssh_info"}', "op 'ssh_info' needs field 'vm'"),
    (b"[" * 100_000, "request is nested too deeply to parse"),
    (b'{"version": 1, "op": []}', "unknown op []"),
    (b'{"version": 1, "op": {"a": 1}}', "unknown op {'a': 1}"),
    (b'{"version": 1, "op": "status", "x": "' + b"y" * 5000 + b'"}', "op 'status' has no field 'x'"),
    (b'{"version": 1, "op": "events", "since": "' + b"9" * 5000 + b'"}', "(5002 characters)"),
    (b'{"version": 1, "op": "ssh_info", "vm": ' + b"[" * 900 + b"]" * 900 + b"}", "field 'vm' must be str"),
    (b'{"version": 1, "op": "status"}\xff', "request is not JSON"),
])
def test_bad_requests_name_what_is_wrong_and_what_to_do(line, what):
    with pytest.raises(protocol.ProtocolError) as err:
        protocol.parse_request(line)
    assert what in err.value.what
    assert err.value.fix


def test_a_good_request_round_trips():
    line = protocol.encode(protocol.request("events", since=3, follow=True))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert protocol.parse_request(line) == {"version": 1, "op": "events", "since": 3, "follow": True}


# -- a real manager process over a fake lab ------------------------------------------------
def test_status_over_the_socket(env):
    fm = FakeFm()
    with fm.client() as client:
        assert client.hello()["lab"] == fm.name
        status = client.status()
    assert status["state"] == "running"
    assert set(status["vms"]) == {"a", "b"} and status["vms"]["a"]["ssh_port"] == 22000
    gpu = status["gpus"]["gpu0"]
    assert gpu["owner"] == "a" and gpu["state"] == "attached"
    assert ProcessId.of(gpu["server_pid"]) is not None and f"{fm.record.rundir}/gpu0" in \
        Path(f"/proc/{gpu['server_pid']}/cmdline").read_text().replace("\0", " ")


def test_bad_lines_get_errors_and_the_connection_stays_usable(env):
    fm = FakeFm()
    answers = raw_exchange(fm.record.socket, b"{oops\n" + b'{"version": 9, "op": "status"}\n'
                           + b'{"version": 1, "op": "fly"}\n' + b'{"version": 1, "op": "hello"}\n')
    assert [a["ok"] for a in answers] == [False, False, False, True]
    assert "not JSON" in answers[0]["error"]["what"] and answers[0]["error"]["fix"]
    assert "version 9" in answers[1]["error"]["what"]
    assert "unknown op 'fly'" in answers[2]["error"]["what"] and "status" in answers[2]["error"]["fix"]
    assert answers[3]["result"]["lab"] == fm.name


def test_an_overlong_line_is_refused_and_the_connection_closed(env):
    fm = FakeFm()
    answers = raw_exchange(fm.record.socket, b"x" * (protocol.MAX_LINE + 10))
    assert len(answers) == 1 and "without a newline" in answers[0]["error"]["what"]
    with fm.client() as client:   # the manager itself is fine
        assert client.status()["state"] == "running"


def test_fabric_ops_on_a_lab_without_hotplug_are_refused_with_the_reason(env):
    """The FAKE lab has no fabric (no QMP): assign/release/restart say so; unknown names are named."""
    fm = FakeFm()
    with fm.client() as client:
        for call in (lambda: client.restart("gpu0"), lambda: client.assign("gpu0", "b"),
                     lambda: client.release("gpu0")):
            with pytest.raises(protocol.RemoteError) as err:
                call()
            assert "no fabric" in err.value.what or "MSI-X" in err.value.what, err.value.what
        with pytest.raises(protocol.RemoteError, match="no GPU 'gpu9'"):
            client.restart("gpu9")
        with pytest.raises(protocol.RemoteError, match="no VM 'zz'"):
            client.assign("gpu0", "zz")


def test_a_dead_gpu_server_is_reported_within_a_second(env):
    fm = FakeFm()
    with fm.client() as client:
        pid = client.status()["gpus"]["gpu0"]["server_pid"]
    follower = fm.client()
    events = follower.follow_events(timeout=10)
    while next(events)["kind"] != "lab-ready":   # the past, then live
        pass
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    event = next(events)
    assert event["kind"] == "gpu-server-died" and event["gpu"] == "gpu0" and event["owner"] == "a"
    assert event["returncode"] == -signal.SIGKILL
    assert 0 <= event["time"] - killed_at < 1.0, f"reported {event['time'] - killed_at:.3f} s after the kill"
    with fm.client() as client:
        status = client.status()
    assert status["gpus"]["gpu0"]["state"] == "failed" and status["state"] == "degraded"
    assert status["vms"]["a"]["state"] == "running"
    follower.close()


def test_deaths_are_reported_and_status_answered_while_a_release_waits(env):
    """A release waits for the guest (FAKE hot-plug: until the test says DEVICE_DELETED); meanwhile
    another GPU's server dies: reported within 1 s, and status answers, from other connections."""
    fm = FakeFm("--fabric")
    with fm.client() as client:
        status = client.status()
        dev_id, gpu1_pid = status["gpus"]["gpu0"]["dev_id"], status["gpus"]["gpu1"]["server_pid"]
    follower = fm.client()
    events = follower.follow_events(timeout=10)
    while next(events)["kind"] != "lab-ready":
        pass
    releaser = fm.client()
    releaser.send_raw(protocol.encode(protocol.request("release", gpu="gpu0", timeout=30)))
    with fm.client() as client:
        deadline = time.monotonic() + 10
        while client.status()["gpus"]["gpu0"]["state"] != "moving":   # the worker took it
            assert time.monotonic() < deadline, "release did not start"
        killed_at = time.time()
        os.kill(gpu1_pid, signal.SIGKILL)
        event = next(events)
        assert event["kind"] == "gpu-server-died" and event["gpu"] == "gpu1"
        assert 0 <= event["time"] - killed_at < 1.0, f"reported {event['time'] - killed_at:.3f} s after the kill"
        status = client.status()   # answered while the release still waits
        assert status["gpus"]["gpu0"]["state"] == "moving" and status["gpus"]["gpu1"]["state"] == "failed"
    (Path(fm.record.rundir) / f"deleted-{dev_id}").touch()   # the guest lets go
    answer = releaser.read_message()
    assert answer["ok"], answer
    assert answer["result"]["gpu"] == "gpu0" and answer["result"]["scrubbed"] is True
    releaser.close()
    follower.close()
    with fm.client() as client:
        gpu0 = client.status()["gpus"]["gpu0"]
        assert (gpu0["state"], gpu0["owner"]) == ("free", None)
        client.stop()
    assert fm.wait() == 0


def test_release_timeout_names_the_holder_and_force_kills_it(env):
    """FAKE guest (the real holders and kill scripts on a fake sysfs, real processes): nothing lets
    go; release fails naming the holder; --force kills it and still fails honestly when the guest
    does not let go after that."""
    fm = FakeFm("--fabric")
    holder = int((Path(fm.record.rundir) / "holder.pid").read_text())
    holder_id = ProcessId.of(holder)
    with fm.client() as client:
        with pytest.raises(protocol.RemoteError) as err:
            client.release("gpu0", timeout=0.2)
        assert f"pid {holder} (holder) on /dev/vfio/11" in err.value.what and "--force" in err.value.fix
        assert client.status()["gpus"]["gpu0"]["state"] == "attached"   # back as it was
        with pytest.raises(protocol.RemoteError) as err:
            client.release("gpu0", timeout=0.2, force=True)
        assert (Path(fm.record.rundir) / "killed").read_text() == str(holder)
        assert wait_gone([holder_id], 10) == []   # really killed
        assert "could not be killed" in err.value.fix
        with pytest.raises(protocol.RemoteError, match="out of range"):
            client.release("gpu0", timeout=0)
        client.stop()
    assert fm.wait() == 0

def test_restart_on_failure_brings_the_gpu_back_at_most_max_restarts_times(env):
    """FAKE hot-plug; gpu0 has restart = "on-failure", max_restarts = 1."""
    fm = FakeFm("--fabric")
    follower = fm.client()
    events = follower.follow_events(timeout=10)
    while next(events)["kind"] != "lab-ready":
        pass
    with fm.client() as client:
        gpu = client.status()["gpus"]["gpu0"]
    os.kill(gpu["server_pid"], signal.SIGKILL)
    kinds = []
    while "gpu-auto-restart" not in kinds:
        kinds.append(next(events)["kind"])
    assert kinds[0] == "gpu-server-died", kinds
    (Path(fm.record.rundir) / f"deleted-{gpu['dev_id']}").touch()   # the guest lets go of the dead one
    while (event := next(events))["kind"] != "gpu-restarted":
        pass
    with fm.client() as client:
        again = client.status()["gpus"]["gpu0"]
    assert (again["state"], again["owner"], again["restarts"]) == ("attached", "a", 1)
    assert again["server_pid"] != gpu["server_pid"] and ProcessId.of(again["server_pid"]) is not None
    os.kill(again["server_pid"], signal.SIGKILL)   # the second death: over the limit
    while (event := next(events))["kind"] != "gpu-restart-limit":
        assert event["kind"] != "gpu-auto-restart"
    with fm.client() as client:
        assert client.status()["gpus"]["gpu0"]["state"] == "failed"
        client.stop()
    follower.close()
    assert fm.wait() == 0


def test_restart_on_failure_needs_msi():
    text = '[gpus.gpu0]\nowner = "a"\nrestart = "on-failure"\n[[vm]]\nname = "a"\n'
    with pytest.raises(LabError, match='irq = "msi"'):
        topology.parse(text, "t")


def test_a_dead_smc_server_is_reported_and_the_lab_degraded(env):
    fm = FakeFm()
    with fm.client() as client:
        status = client.status()
    assert status["smcs"]["smc0"]["state"] == "attached" and status["smcs"]["smc0"]["hosts"] == ["a", "b"]
    follower = fm.client()
    events = follower.follow_events(timeout=10)
    while next(events)["kind"] != "lab-ready":   # the past, then live
        pass
    os.kill(status["smcs"]["smc0"]["server_pid"], signal.SIGKILL)
    event = next(events)
    assert event["kind"] == "smc-server-died" and event["smc"] == "smc0" and event["hosts"] == ["a", "b"]
    assert event["returncode"] == -signal.SIGKILL
    with fm.client() as client:
        status = client.status()
    assert status["smcs"]["smc0"]["state"] == "failed" and status["state"] == "degraded"
    assert status["gpus"]["gpu0"]["state"] == "attached" and status["vms"]["b"]["state"] == "running"
    follower.close()


def test_a_dead_vm_is_reported_and_the_other_vm_is_untouched(env):
    fm = FakeFm()
    with fm.client() as client:
        status = client.status()
        events = fm.client().follow_events(since=len(client.events()), timeout=10)
        killed_at = time.time()
        os.kill(status["vms"]["b"]["pid"], signal.SIGKILL)
        event = next(events)
        assert event["kind"] == "vm-died" and event["vm"] == "b"
        assert 0 <= event["time"] - killed_at < 1.0
        status = client.status()
    assert status["vms"]["b"]["state"] == "dead" and status["vms"]["a"]["state"] == "running"
    assert status["gpus"]["gpu0"]["state"] == "attached"
    with fm.client() as client:
        with pytest.raises(protocol.RemoteError, match="VM b of lab .* is dead"):
            client.ssh_info("b")
        assert client.ssh_info("a")["port"] == 22000


def count_leftovers(record) -> tuple[int, int, int]:
    """(processes naming the run dir, sockets, files in the run dir)"""
    rundir = Path(record.rundir)
    files = list(rundir.rglob("*")) if rundir.exists() else []
    return (len(processes_mentioning(record.rundir)), sum(1 for f in files if f.is_socket()), len(files))


def test_stop_removes_everything_and_keeps_the_logs(env):
    fm = FakeFm()
    record = fm.record
    follower = fm.client()
    events = follower.follow_events(timeout=10)
    assert count_leftovers(record)[0] == 4   # two fake VMs, one fake GPU server, one fake SMC server
    down(record, log=lambda text: None)
    assert fm.wait() == 0
    assert count_leftovers(record) == (0, 0, 0)
    assert not Path(record.rundir).exists() and registry.records() == []
    kinds = [ev["kind"] for ev in events]   # the follower sees the stop, then the end of the stream
    assert kinds[-2:] == ["stop-requested", "lab-stopping"]
    assert (Path(record.logdir) / "a" / "console.log").read_text() == "fake console\n"
    assert "stopped" in (Path(record.logdir) / "fm.log").read_text()


def test_down_after_the_manager_was_sigkilled(env):
    fm = FakeFm("--orphan")
    record = fm.record
    assert count_leftovers(record)[0] == 5   # and the orphan
    fm.proc.kill()
    fm.wait()
    assert lab_summary(record)["state"] == "fm-dead"
    with pytest.raises(Exception, match="is not running"):
        FmClient.for_lab(record.name)
    # The fake VMs and server die with the manager (PDEATHSIG); the orphan does not.
    messages = []
    down(record, log=messages.append)
    assert "is gone" in messages[0]
    assert count_leftovers(record) == (0, 0, 0)
    assert registry.records() == [] and not Path(record.rundir).exists()
    assert (Path(record.logdir) / "a" / "console.log").exists()


def test_lab_names_do_not_repeat_and_old_logs_are_pruned(env):
    names = [registry.reserve_name("fake")[0] for _ in range(3)]
    assert names == ["fake-1", "fake-2", "fake-3"]
    logs = registry.logs_root()
    for i, name in enumerate(names):
        os.utime(logs / name, (1000 + i, 1000 + i))
    registry.prune_logs(keep=2)
    assert sorted(p.name for p in logs.iterdir()) == ["fake-2", "fake-3"]
    assert registry.reserve_name("fake")[0] == "fake-4"


def vfio_cxl(*args, env_vars=None):
    return subprocess.run([sys.executable, "-m", "vfio_cxl", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60, env={**os.environ, **(env_vars or {})})


def test_cli_with_no_lab_and_with_two(env):
    result = vfio_cxl("vm", "ssh", "a", "--", "true")
    assert result.returncode == 1
    assert result.stderr.strip() == ("vfio-cxl: error: no lab is running -- "
                                     "start one with: vfio-cxl vm up TOPOLOGY --detach")
    assert "no labs running" in vfio_cxl("vm", "ls").stdout
    first, second = FakeFm(), FakeFm()
    result = vfio_cxl("fm", "status")
    assert result.returncode == 1 and "2 labs are running" in result.stderr and "--lab" in result.stderr
    listing = json.loads(vfio_cxl("vm", "ls", "--json").stdout)
    assert [lab["name"] for lab in listing] == [first.name, second.name]
    assert listing[0]["gpus"]["gpu0"] == {"owner": "a", "state": "attached",
                                          "server_pid": listing[0]["gpus"]["gpu0"]["server_pid"]}
    status = json.loads(vfio_cxl("fm", "status", "--lab", second.name, "--json").stdout)
    assert status["name"] == second.name and status["gpus"]["gpu0"]["owner"] == "a"
    result = vfio_cxl("vm", "down", "--all")
    assert result.returncode == 0 and registry.records() == []
    assert first.wait() == 0 and second.wait() == 0


def test_down_of_a_hung_manager_kills_it_and_cleans_up(env):
    fm = FakeFm()
    record = fm.record
    os.kill(record.fm["pid"], signal.SIGSTOP)   # takes no requests, handles no signals
    messages = []
    down(record, timeout=1, log=messages.append)
    assert "does not take requests" in messages[0] and "killing it" in messages[1]
    assert fm.proc.wait(10) == -signal.SIGKILL
    assert count_leftovers(record) == (0, 0, 0)
    assert registry.records() == []


def test_detach_with_a_bad_topology_fails_before_anything_starts(env):
    result = vfio_cxl("vm", "up", "nosuch", "--detach")
    assert result.returncode == 1 and "unknown topology 'nosuch'" in result.stderr
    assert "Traceback" not in result.stderr
    assert registry.records() == [] and list(registry.logs_root().iterdir()) == []
    result = vfio_cxl("vm", "up", "single", "--detach", "--run", "true")
    assert result.returncode == 1 and "--run and --detach do not go together" in result.stderr
    # a kernel the lab could not boot (--detach takes --kernel since the pytest plugin's
    # --lab-kernel): refused before the fabric manager starts
    result = vfio_cxl("vm", "up", "single", "--detach", "--kernel", "/nonexistent/bzImage")
    assert result.returncode == 1 and "--kernel /nonexistent/bzImage: no such file" in result.stderr
    assert registry.records() == [] and list(registry.logs_root().iterdir()) == []


def test_a_lab_that_fails_to_start_leaves_nothing_but_its_logs(env):
    """The real fabric manager and Lab: the SSH port is taken, so the lab fails before QEMU starts."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        result = vfio_cxl("vm", "up", "single", "--detach", "--ssh-port", str(port))
    assert result.returncode == 1, result.stdout
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"vfio-cxl: error: port {port} on 127.0.0.1 is already in use")
    logdir = registry.logs_root() / "single-1"
    assert f"(logs: {logdir})" in error and (logdir / "fm.log").exists()
    assert "start failed" in (logdir / "fm.log").read_text()
    assert registry.records() == []
    assert list(Path(os.environ["VFIO_CXL_RUNDIR"]).iterdir()) == []


@pytest.mark.parametrize("stem, name", [
    ("fabric", "fabric-1"), ("my_lab", "my-lab-1"), ("Fabric", "fabric-1"), ("lab.v2", "lab-v2-1"),
    ("2x", "lab-2x-1"), ("__", "lab-1"), ("é", "lab-1"), ("a" * 100, "a" * 40 + "-1"),
])
def test_lab_names_come_from_any_topology_stem(env, stem, name):
    """A topology file's stem outside [a-z][a-z0-9-]* made reserve_name retry the same mkdir
    forever (`vm up my_lab.toml --detach` never answered): issue 23, item 3."""
    done = []
    thread = threading.Thread(target=lambda: done.append(registry.reserve_name(stem)), daemon=True)
    thread.start()
    thread.join(10)
    assert done, f"reserve_name({stem!r}) did not return within 10 s"
    assert done[0][0] == name and done[0][1].is_dir()
    second = registry.reserve_name(stem)[0]   # the second lab of that topology: the case that hung
    assert second == name[:-1] + "2"


def test_vm_up_detach_of_a_topology_file_with_any_stem(env, tmp_path):
    """The same through the CLI, up to where the lab fails for a taken SSH port (before QEMU)."""
    topo = tmp_path / "my_lab.toml"
    topo.write_text((REPO_ROOT / "qemu/topologies/single.toml").read_text())
    registry.reserve_name("my_lab")   # an earlier lab's logs
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        result = vfio_cxl("vm", "up", str(topo), "--detach", "--ssh-port", str(taken.getsockname()[1]))
    assert result.returncode == 1
    assert f"(logs: {registry.logs_root() / 'my-lab-2'})" in result.stderr, result.stderr


def test_vm_down_by_a_user_skips_another_users_process_and_says_so(env, monkeypatch):
    """`vm down` run by a user (not root) meets a matching process of another user: it skips it
    with a message instead of stopping with PermissionError: issue 23, item 10."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as two users")
    tmp_path = env / "shared"
    tmp_path.mkdir()
    os.chmod(env, 0o755)
    for d in ("cache", "run", "logs"):
        (tmp_path / d).mkdir(mode=0o777)
        os.chmod(tmp_path / d, 0o777)
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("VFIO_CXL_CACHE", str(tmp_path / "cache"))
    rundir = tmp_path / "run" / "vfio-cxl-x"
    rundir.mkdir(mode=0o777)
    os.chmod(rundir, 0o777)
    record = registry.LabRecord(name="fake-1", topology="fake", rundir=str(rundir), logdir=str(tmp_path / "logs"),
                                fm={"pid": 2 ** 22 + 1, "start": 1}, created=0)
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "vfio_cxl", str(rundir)])
    try:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:   # a user (nobody) runs vm down's sweep
            os.close(read)
            try:
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                messages = []
                remove_leftovers(record, log=messages.append)
                os.write(write, json.dumps(messages).encode())
                os._exit(0)
            except BaseException as err:
                os.write(write, f"{type(err).__name__}: {err}".encode())
                os._exit(1)
        os.close(write)
        with os.fdopen(read) as pipe:
            said = pipe.read()
        assert os.waitpid(child, 0)[1] == 0, said
        assert f"skipping pid {theirs.pid}" in said and "not yours to signal" in said
        assert theirs.poll() is None   # left alone
        assert not rundir.exists()
    finally:
        theirs.kill()
        theirs.wait()
