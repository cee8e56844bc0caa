"""Labs that stay up, driven from a second process: `vm up --detach`, `vm ls`, `vm ssh`, `fm events`,
`fm status`, `vm down` -- each a separate `vfio-cxl` process, as a user in another terminal runs them.

Real QEMU, real guests, the real fabric manager.  Deaths are caused with
SIGKILL and their reports checked by the event's own timestamp against the
kill time (no sleeps); figures are printed (pytest -s or -rA shows them).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vfio_cxl.lab.fm import registry
from vfio_cxl.lab.fm.procs import ProcessId, processes_mentioning, wait_gone
from vfio_cxl.paths import REPO_ROOT

from suite_kernel import suite_kernel_name


def vfio_cxl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vfio_cxl", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=timeout)


class Detached:
    """A lab started with `vfio-cxl vm up TOPOLOGY --detach` in a child process, on the suite's
    kernel (tests/suite_kernel.py: ``--kernel lab`` when it is cached)."""

    def __init__(self, topology: str | None, name: str | None = None):
        if name is not None:   # a lab up already (see of())
            self.name, self.seconds, self.record = name, 0.0, registry.find(name)
            return
        t0 = time.monotonic()
        kernel = suite_kernel_name()
        result = vfio_cxl("vm", "up", topology, "--detach", *(["--kernel", kernel] if kernel else []), timeout=600)
        self.seconds = time.monotonic() - t0
        assert result.returncode == 0, result.stderr
        self.name = result.stdout.strip()
        assert self.name.startswith(f"{topology}-"), result.stdout
        self.record = registry.find(self.name)
        print(f"\n{topology}: vm up --detach returned after {self.seconds:.1f} s (every VM SSH-ready)")

    @classmethod
    def of(cls, name: str) -> "Detached":
        """A lab another fixture started (the plugin's ``lab``), driven the same way."""
        return cls(None, name)

    def status(self) -> dict:
        result = vfio_cxl("fm", "status", "--lab", self.name, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def ssh(self, vm: str, *command: str) -> subprocess.CompletedProcess:
        # A guest Python start takes minutes when the host is loaded (load 18 on 2 cores seen).
        return vfio_cxl("vm", "ssh", "--lab", self.name, vm, "--", *command, timeout=600)

    def down(self) -> subprocess.CompletedProcess:
        return vfio_cxl("vm", "down", self.name)

    def leftovers(self) -> dict:
        rundir = Path(self.record.rundir)
        files = list(rundir.rglob("*")) if rundir.exists() else []
        return {"processes": len(processes_mentioning(self.record.rundir)),
                "sockets": sum(1 for f in files if f.is_socket()),
                "rundir_files": len(files),
                "records": sum(1 for r in registry.records() if r.name == self.name)}


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def describe(pid: int) -> str:
    proc = Path(f"/proc/{pid}")
    try:
        return f"{pid}: {(proc / 'stat').read_text()[:80]} wchan={(proc / 'wchan').read_text()}"
    except OSError as err:
        return f"{pid}: {err}"


class EventFollower:
    """`vfio-cxl fm events --follow --json` in a child process."""

    def __init__(self, lab: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "vfio_cxl", "fm", "events", "--lab", lab,
                                      "--follow", "--json"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0)
        self.buffer = b""

    def next(self, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise AssertionError(f"no event within {timeout} s")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            assert chunk, f"fm events ended: {self.proc.stderr.read().decode()}"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def until(self, kind: str) -> dict:
        while (event := self.next())["kind"] != kind:
            pass
        return event

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


def running(lab: Detached) -> bool:
    return any(r.name == lab.name for r in registry.records())


def healthy(lab: Detached) -> bool:
    """Up, with every VM running and every GPU attached: as `vm up --detach` left it."""
    if not running(lab):
        return False
    result = vfio_cxl("fm", "status", "--lab", lab.name, "--json")
    if result.returncode != 0:
        return False
    status = json.loads(result.stdout)
    return (all(vm["state"] == "running" for vm in status["vms"].values())
            and all(gpu["state"] == "attached" for gpu in status["gpus"].values()))


@pytest.fixture
def detached(labs, kept_detached, request):
    """``detached(TOPOLOGY)``: a fresh `vm up --detach` lab, brought down after the test.
    ``detached(TOPOLOGY, shared=True)``: the lab of that topology an earlier test left up and
    healthy (every VM running, every GPU attached), else a fresh one; it stays up for the next
    test that shares it, unless this test brings it down, breaks it or fails.
    ``detached(TOPOLOGY, shared=NAME)``: the same among the tests that name NAME only -- a lab
    healthy but not as it booted (a GPU moved off its boot port) for tests that do not mind;
    the plugin's ``lab`` fixture and ``shared=True`` never get it."""
    labs.close()   # one lab at a time on two cores
    started: list[Detached] = []
    failed_before = request.session.testsfailed

    def start(topology: str, shared: bool | str = False) -> Detached:
        # the pool's key: the plugin's `lab` fixture shares (topology, kernel) labs; a named share
        # has a key of its own
        kernel = suite_kernel_name()
        key = (topology, kernel) if isinstance(shared, bool) else (topology, kernel, shared)
        kept = kept_detached.get(key)
        if shared and kept is not None:
            if not isinstance(kept, Detached):   # the plugin's RunningLab: its connections go
                kept.disconnect()
                kept = Detached.of(kept.name)
            if healthy(kept):
                kept_detached[key] = kept
                return kept
        labs.close_detached()   # one lab at a time
        lab = Detached(topology)
        if shared:
            kept_detached[key] = lab
        else:
            started.append(lab)
        return lab
    yield start
    if request.session.testsfailed > failed_before:   # a failed test's lab is nobody's to reuse
        started.extend(kept_detached.values())
        kept_detached.clear()
    for lab in started:   # whatever a test left running
        if running(lab):
            lab.down()


def test_detached_lab_from_a_second_process(detached):
    lab = detached("single", shared=True)   # the one test_lab_fabric's MSI-X release test used
    listing = json.loads(vfio_cxl("vm", "ls", "--json").stdout)
    mine = next(entry for entry in listing if entry["name"] == lab.name)
    assert mine["state"] == "running" and mine["topology"] == "single"
    assert mine["gpus"] == {"gpu0": {"owner": "host0", "state": "attached",
                                     "server_pid": mine["gpus"]["gpu0"]["server_pid"]}}
    assert mine["vms"]["host0"]["state"] == "running"
    human = vfio_cxl("vm", "ls").stdout
    assert lab.name in human and f"host0:{mine['vms']['host0']['ssh_port']}" in human

    result = lab.ssh("host0", "hostname")
    assert (result.returncode, result.stdout.strip()) == (0, "host0")
    assert lab.ssh("host0", "sh", "-c", "exit 7").returncode == 7   # exit status passed through
    assert lab.ssh("host0", "ls /sys/bus/pci/devices | wc -l").stdout.strip().isdigit()
    result = lab.ssh("nosuch", "true")
    assert result.returncode == 1 and "no VM 'nosuch'" in result.stderr and "host0" in result.stderr

    # A GPU server that dies is reported at once, by timestamp, and the VM carries on.
    status = lab.status()
    server = status["gpus"]["gpu0"]["server_pid"]
    events = EventFollower(lab.name)
    try:
        events.until("lab-ready")
        killed_at = time.time()
        os.kill(server, signal.SIGKILL)
        event = events.until("gpu-server-died")
    finally:
        events.close()
    latency = event["time"] - killed_at
    print(f"GPU server SIGKILL -> gpu-server-died event: {latency * 1e3:.1f} ms")
    assert event["gpu"] == "gpu0" and event["owner"] == "host0" and event["pid"] == server
    assert 0 <= latency < 1.0, f"reported {latency:.3f} s after the kill"
    status = lab.status()
    assert status["gpus"]["gpu0"]["state"] == "failed" and status["gpus"]["gpu0"]["server_pid"] == server
    assert status["gpus"]["gpu0"]["owner"] == "host0"
    assert status["vms"]["host0"]["state"] == "running" and status["state"] == "degraded"
    assert lab.ssh("host0", "true").returncode == 0
    result = vfio_cxl("fm", "restart", "--lab", lab.name, "gpu0")
    assert result.returncode == 1 and "MSI-X" in result.stderr and 'irq = "msi"' in result.stderr   # single: MSI-X, not hot-removable on QEMU 11.1.3

    result = lab.down()
    assert result.returncode == 0, result.stderr
    assert lab.leftovers() == {"processes": 0, "sockets": 0, "rundir_files": 0, "records": 0}
    logdir = Path(lab.record.logdir)
    for log in ("fm.log", "host0/console.log", "host0/qemu.log", "host0/gpu0.log"):
        assert (logdir / log).stat().st_size > 0, f"{log} was not kept"
    assert str(logdir) in result.stdout


def test_down_after_the_fabric_manager_was_sigkilled(detached):
    lab = detached("single")
    status = lab.status()
    children = [ProcessId.of(status["vms"]["host0"]["qemu_pid"]), ProcessId.of(status["gpus"]["gpu0"]["server_pid"])]
    assert all(children) and lab.leftovers()["processes"] >= 3   # bwrap, QEMU, GPU server
    fm = lab.record.fm_id()
    os.kill(fm.pid, signal.SIGKILL)
    assert wait_gone([fm], 10) == []
    # The lab's processes die with their parent (PDEATHSIG): nothing is left running...
    left = wait_gone(children, 10)
    assert left == [], f"outlived the fabric manager: {[describe(p.pid) for p in left]}"
    listing = json.loads(vfio_cxl("vm", "ls", "--json").stdout)
    assert next(e for e in listing if e["name"] == lab.name)["state"] == "fm-dead"
    assert "vm down " + lab.name in vfio_cxl("vm", "ls").stdout
    result = lab.ssh("host0", "true")
    assert result.returncode == 1 and "is not running" in result.stderr
    # ... but its files are, until `vm down`.
    assert lab.leftovers()["rundir_files"] > 0
    result = lab.down()
    assert result.returncode == 0, result.stderr
    assert "is gone" in result.stderr
    assert lab.leftovers() == {"processes": 0, "sockets": 0, "rundir_files": 0, "records": 0}
    assert (Path(lab.record.logdir) / "host0" / "console.log").stat().st_size > 0


def test_a_dead_qemu_is_reported_and_the_other_vm_still_answers(detached):
    lab = detached("shared")
    status = lab.status()
    qemu_a = status["vms"]["a"]["qemu_pid"]
    assert Path(f"/proc/{qemu_a}/comm").read_text().startswith("qemu-system")
    events = EventFollower(lab.name)
    try:
        events.until("lab-ready")
        killed_at = time.time()
        os.kill(qemu_a, signal.SIGKILL)
        event = events.until("vm-died")
    finally:
        events.close()
    latency = event["time"] - killed_at
    print(f"QEMU SIGKILL -> vm-died event: {latency * 1e3:.1f} ms")
    assert event["vm"] == "a" and event["qemu_pid"] == qemu_a
    assert 0 <= latency < 1.0, f"reported {latency:.3f} s after the kill"
    status = lab.status()
    assert status["vms"]["a"]["state"] == "dead" and status["vms"]["b"]["state"] == "running"
    result = lab.ssh("b", "hostname")
    assert (result.returncode, result.stdout.strip()) == (0, "b")
    result = lab.ssh("a", "true")
    assert result.returncode == 1 and "VM a of lab" in result.stderr and "dead" in result.stderr
    result = lab.down()
    assert result.returncode == 0, result.stderr
    assert lab.leftovers() == {"processes": 0, "sockets": 0, "rundir_files": 0, "records": 0}


def test_ctrl_c_during_a_detached_start_stops_everything(labs):
    labs.close()
    before = {r.name for r in registry.records()}
    # SIGINT as at a terminal, even if this test runs in a background job (which ignores it).
    cli = subprocess.Popen([sys.executable, "-m", "vfio_cxl", "vm", "up", "single", "--detach"], cwd=REPO_ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # Interrupt once QEMU runs (the guest then needs seconds more to answer SSH).
        deadline = time.monotonic() + 120
        record = None
        while time.monotonic() < deadline:
            # The new lab whose fabric manager our CLI started (other labs may start meanwhile).
            record = next((r for r in registry.records() if r.name not in before and parent_of(r.fm["pid"]) == cli.pid),
                          None)
            if record and any(Path(f"/proc/{pid}/comm").read_text().startswith("qemu-system")
                              for pid in processes_mentioning(record.rundir)):
                break
            time.sleep(0.05)   # polling /proc with a deadline; not synchronisation
        else:
            raise AssertionError("QEMU never started")
        cli.send_signal(signal.SIGINT)
        assert cli.wait(120) == 130
        assert "interrupted" in cli.stderr.read()
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        if record and any(r.name == record.name for r in registry.records()):
            vfio_cxl("vm", "down", record.name)   # whatever the outcome, no lab is left running
    fm = record.fm_id()
    assert wait_gone([fm], 30) == []
    assert processes_mentioning(record.rundir) == []
    assert not Path(record.rundir).exists()
    assert all(r.name != record.name for r in registry.records())
    assert "interrupted while starting" in (Path(record.logdir) / "fm.log").read_text()
