"""`vfio-cxl matrix run` on a real two-node Ray cluster on this machine, and locally.

The head and the worker are started with `ray start` in sessions of their own, one
``tcg_vm`` slot each; the worker is killed (every process of its session, SIGKILL) while it runs
a job, and that job must come back as an infrastructure retry on the head: two cells, so each
node runs one at once.  The documented example (2 x 2: both kernels, on
`single` and `hb2`) runs locally as typed.  Ctrl-C stops every job and leaves no VM.  Small labs
(`single`, `hb2`: one VM each); every Ray process started here is killed by its session.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import kcidb_io
import pytest

import documented_commands
from junitparser import JUnitXml

from vfio_cxl.lab.fm.procs import cmdline, comm, descendants, processes_mentioning
from vfio_cxl.lab.kernel import cached_lab_kernel
from vfio_cxl.matrix import node
from vfio_cxl.matrix.engine import session_processes
from vfio_cxl.lab.lab import free_ports
from vfio_cxl.paths import REPO_ROOT, runtime_root

pytestmark = pytest.mark.vm
VENV_BIN = Path(sys.executable).parent


def qemus_under(pid: int) -> set[int]:
    """The VMs below ``pid``: QEMUs with a QMP socket, not the `--version`/`-device help` probes that
    checking a node (the driver's probe, a job's own runtime check) runs and that end at once."""
    return {p for p in descendants(pid) if comm(p).startswith("qemu-system") and " -qmp " in cmdline(p)}


def kill_session(sid: int, sig: int) -> None:
    for pid in session_processes(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_until(what: str, check, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class RayNode:
    """`ray start --block` in a session of its own: stopping it kills exactly that session."""

    def __init__(self, name: str, args: list[str], env: dict, tmp: Path, ip: str = "127.0.0.1"):
        self.name = name
        self.log = tmp / f"ray-{name}.log"
        # A raylet aborts when its agents take over 15 s to start (ray issue 65983), which happens
        # at load 20 on 2 cores: start it again, as vfio_cxl.matrix.engine.LocalHead does.
        for attempt in range(1, 4):
            flags = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                     "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")
            picked = free_ports(len(flags))
            self.node_manager_port = picked[0]
            ports = [x for flag, port in zip(flags, picked) for x in (flag, str(port))]
            with open(self.log, "w") as out:
                self.proc = subprocess.Popen(
                    [str(VENV_BIN / "ray"), "start", "--block", "--node-ip-address", ip, "--num-cpus", "2",
                     "--resources", json.dumps({"tcg_vm": 1}), *ports, *args],
                    stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            started = time.monotonic()
            wait_until(f"ray node {name} to start or fail (log {self.log})",
                       lambda: "Ray runtime started" in self.log.read_text() or self.proc.poll() is not None, 300)
            if self.proc.poll() is None:
                break
            print(f"ray node {name}: attempt {attempt} failed: {self.log.read_text().splitlines()[-1:]}")
            self.stop()
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        self.seconds = time.monotonic() - started
        print(f"ray node {name} started in {self.seconds:.1f} s (attempt {attempt})")

    @property
    def raylet(self) -> int:
        return next(p for p in descendants(self.proc.pid) if comm(p) == "raylet")

    def kill(self, sig=signal.SIGKILL) -> None:
        kill_session(self.proc.pid, sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        try:
            wait_until(f"ray node {self.name} to stop", lambda: not session_processes(self.proc.pid), 30)
        except AssertionError:
            self.kill(signal.SIGKILL)
        self.proc.wait(timeout=30)
        wait_until(f"ray node {self.name}'s processes to go", lambda: not session_processes(self.proc.pid), 30)


@pytest.fixture(autouse=True)
def own_run_directories(monkeypatch):
    """A run-directory parent of this test's own ($VFIO_CXL_RUNDIR, which the Ray nodes and jobs
    inherit): the checks of what a run leaves behind look there, and the in-process labs that
    scripts/test runs on another worker meanwhile are not this run's (tests/xdist_units.py)."""
    root = Path(tempfile.mkdtemp(prefix="mx-", dir="/tmp"))   # short: UNIX socket paths below it
    monkeypatch.setenv("VFIO_CXL_RUNDIR", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def ray_env(tmp_path):
    """Ray's environment: a token of our own for Ray's token auth (Ray below 2.50, the extra's,
    has none and ignores it), no usage stats, patient agents, this venv's ray first."""
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_agent_register_timeout_ms": "300000", "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}


@contextlib.contextmanager
def ray_cluster(env: dict, tmp_path: Path, worker_env: dict | None = None):
    """A head and a worker, started with `ray start` on this machine, one tcg_vm slot each."""
    temp = runtime_root() / f"ray-{os.getpid()}"
    nodes = []
    try:
        (port,) = free_ports(1)
        nodes.append(RayNode("head", ["--head", "--port", str(port), "--include-dashboard=false",
                                      "--disable-usage-stats", "--temp-dir", str(temp)], env, tmp_path))
        # Its own IP (all of 127/8 is this machine's): Ray attaches a driver to a raylet of the
        # driver's IP, and with both nodes on one IP that may be the worker this test kills.
        nodes.append(RayNode("worker", ["--address", f"127.0.0.1:{port}"], worker_env or env, tmp_path,
                             ip="127.0.0.2"))
        yield {"address": f"127.0.0.1:{port}", "head": nodes[0], "worker": nodes[1]}
    finally:
        for node in reversed(nodes):
            node.stop()
        subprocess.run(["rm", "-rf", str(temp)], check=False)


@pytest.fixture
def cluster(ray_env, tmp_path):
    with ray_cluster(ray_env, tmp_path) as found:
        yield found


def kernels() -> list[str]:
    # the lab kernel when it is cached (never built here); else the matrix is 1 x 2
    return ["debian", "lab"] if cached_lab_kernel() else ["debian"]


def write_matrix(path: Path, topologies: list[str]) -> Path:
    path.write_text(f"[axes]\nkernel = {json.dumps(kernels())}\ntopology = {json.dumps(topologies)}\n"
                    "[[run]]\nname = \"uname\"\nguest = { vm = \"host0\", command = \"uname -r\" }\n"
                    # a lab that failed to boot on this shared machine (seen: SSH refused at load 20) runs again
                    "timeout = 900\nretries = 1\n")
    return path


class Command:
    """`vfio-cxl matrix run ...` as a user types it, in a session of its own; stderr collected."""

    def __init__(self, args: list[str], env: dict):
        self.lines: list[str] = []
        # SIGINT at its default, as in a terminal, even when this test runs as a background job
        self.proc = subprocess.Popen([str(VENV_BIN / "vfio-cxl"), "matrix", "run", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,
                                     start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()

    def finish(self, timeout: float = 1500) -> tuple[int, str]:
        try:
            out = self.proc.stdout.read()
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                kill_session(self.proc.pid, signal.SIGKILL)
        self.reader.join(10)
        return self.proc.returncode, out

    def stderr(self) -> str:
        return "".join(self.lines)


def fast_matrix(path: Path) -> Path:
    """Two runs of this checkout's fast tests: jobs that boot no lab."""
    path.write_text("".join(f'[[run]]\nname = "{name}"\n'
                            f'tests = {{ select = ["tests/fast/test_matrix.py"], k = "{k}" }}\n'
                            for name, k in (("expand", "expands"), ("junit", "junit"))))
    return path


def left_behind(before: set[Path]) -> list[Path]:
    """What a run left in the run-directory parent: Ray's temp dir, job work dirs, lab run dirs."""
    return sorted(p for p in set(runtime_root().iterdir()) - before
                  if p.name.startswith(("ray-", "matrix-", "vfio-cxl-")))


def results(data: dict) -> dict:
    return {j["id"]: (j["status"], [t["output"].strip() for t in j["tests"]]) for j in data["jobs"]}


def test_two_node_cluster_retries_a_job_of_a_killed_worker_on_the_head(cluster, ray_env, tmp_path):
    # two cells, one per node at once (a tcg_vm slot each): one per kernel on `single`, or `single`
    # and `hb2` on the Debian kernel alone; more would only boot more labs (the documented
    # example below runs the 2 x 2)
    matrix = write_matrix(tmp_path / "m.toml", ["single"] if len(kernels()) == 2 else ["single", "hb2"])
    before = set(runtime_root().glob("matrix-*"))
    host = socket.gethostname()
    head = f"{host}:{cluster['head'].node_manager_port}"
    worker = f"{host}:{cluster['worker'].node_manager_port}"
    cmd = Command([str(matrix), "--address", cluster["address"], "--json", "--out", str(tmp_path / "out"),
                   "--junit", str(tmp_path / "junit.xml"), "--kcidb", str(tmp_path / "kcidb.json")], ray_env)
    try:
        line = wait_until("a job running on the worker", lambda: next(
            (m for m in map(re.compile(rf"(\S+) \(attempt 1\) running on {re.escape(worker)}").search, cmd.lines)
             if m), None), 600)
        raylet = cluster["worker"].raylet
        qemus = wait_until(f"{line.group(1)}'s QEMU on the worker", lambda: qemus_under(raylet), 300)
        cluster["worker"].kill()                 # the node dies mid-job: every process of it at once
        wait_until("the killed worker's VMs to stop", lambda: not any(Path(f"/proc/{p}").exists() for p in qemus), 120)
    finally:
        code, out = cmd.finish()
    assert code == 0, cmd.stderr()[-4000:]
    assert f"driver attached to {head} (the head)" in cmd.stderr()
    data = json.loads(out)                                  # --json: the report on stdout
    assert data == json.loads((tmp_path / "out" / "report.json").read_text())
    lost = [j for j in data["jobs"] if j["infra_retries"]]
    assert [j["id"] for j in lost] == [line.group(1)], cmd.stderr()[-4000:]
    (job,) = lost
    assert job["status"] == "pass" and job["node"] == head and job["retries"] == 0
    assert job["attempts"][0]["status"] == "infra" and job["attempts"][0]["node"] == worker
    assert data["passed"] == 2 and data["failed"] == 0 and data["infra_retries"] == 1
    assert "infrastructure failure on " + worker in cmd.stderr()
    for j in data["jobs"]:   # logs came back: the command's output and the lab's console log
        back = tmp_path / "out" / j["id"] / f"attempt-{len(j['attempts'])}"
        assert (back / "result.json").is_file() and list(back.glob("lab/*/console.log")), sorted(back.rglob("*"))
    releases = {j["cell"]["kernel"]: j["tests"][0]["output"].strip() for j in data["jobs"]}
    assert len(set(releases.values())) == len(kernels())          # each kernel reports its own release
    # the killed worker's job (vfio_cxl.matrix.node, in a session of its own) and all that names its
    # work directory end with its supervisor, within node.ORPHAN_GRACE, and the directory goes too
    wait_until("the killed worker's job to end", lambda: not processes_mentioning(f"/matrix-{job['id']}-1-"),
               node.ORPHAN_GRACE + 30)
    assert not set(runtime_root().glob("matrix-*")) - before, "the killed worker's job left its work directory"
    xml = JUnitXml.fromfile(str(tmp_path / "junit.xml"))
    assert sorted(s.name for s in xml) == sorted(j["label"] for j in data["jobs"])
    assert xml.tests == len(data["jobs"]) and xml.failures == 0 and xml.errors == 0
    kcidb_io.schema.LATEST.validate(json.loads((tmp_path / "kcidb.json").read_text()))


def test_the_documented_example_runs_on_a_local_ray_as_typed(tmp_path):
    """`vfio-cxl matrix run docs/matrix-example.toml --junit junit.xml --kcidb kcidb.json`, typed in
    a directory that holds the example (its documented-commands case points here: one run for
    both): kernel x single|hb2, uname -r, on a local Ray, with
    no --address; every cell passes, each kernel reports its own release, and nothing is left."""
    before = set(runtime_root().iterdir())
    line = "vfio-cxl matrix run docs/matrix-example.toml --junit junit.xml --kcidb kcidb.json"
    case = documented_commands.CASES[line]
    ran = documented_commands.run(line, case, tmp_path)
    documented_commands.check(ran, case)
    junit = JUnitXml.fromfile(str(tmp_path / "junit.xml"))
    cells = sorted(s.name for s in junit)
    assert len(cells) == 4 and junit.failures == 0 and junit.errors == 0, ran.describe()
    releases = {dict((p.name, p.value) for p in suite.properties())["kernel"]: case.system_out.strip()
                for suite in junit for case in suite}
    assert sorted(releases) == ["debian", "lab"] and len(set(releases.values())) == 2, releases
    kcidb = json.loads((tmp_path / "kcidb.json").read_text())
    kcidb_io.schema.LATEST.validate(kcidb)
    assert not left_behind(before)                            # the local Ray's temp dir went with it


def test_ctrl_c_cancels_every_job_and_leaves_no_vm(ray_env, tmp_path):
    matrix = write_matrix(tmp_path / "m.toml", ["single"])
    before = set(runtime_root().iterdir())
    cmd = Command([str(matrix), "--json", "--out", str(tmp_path / "out")], ray_env)
    try:
        wait_until("the job to run", lambda: any("(attempt 1) running on" in line for line in cmd.lines), 600)
        qemus = wait_until("the job's VM", lambda: qemus_under(cmd.proc.pid), 300)
        os.killpg(cmd.proc.pid, signal.SIGINT)    # what Ctrl-C in a terminal does
        code, _ = cmd.finish(timeout=300)
    finally:
        if cmd.proc.poll() is None:
            kill_session(cmd.proc.pid, signal.SIGKILL)
    assert code == 130, cmd.stderr()[-3000:]
    assert "cancelling 1 job(s)" in cmd.stderr() and "interrupted" in cmd.stderr()
    assert not any(Path(f"/proc/{p}").exists() for p in qemus)    # stopped before the command returned
    wait_until("every process of the run (Ray's too) to go", lambda: not session_processes(cmd.proc.pid), 60)
    assert not left_behind(before)          # the lab's run directory, the job's, Ray's temp dir
    assert not list(runtime_root().glob("vfio-cxl-*/lab.pid")) or all(
        not Path(f"/proc/{int(p.read_text())}").exists() for p in runtime_root().glob("vfio-cxl-*/lab.pid"))


def test_a_local_run_prints_its_report_on_stdout_and_leaves_no_ray_behind(ray_env, tmp_path):
    before = set(runtime_root().iterdir())
    cmd = Command([str(fast_matrix(tmp_path / "m.toml")), "--json", "--out", str(tmp_path / "out"),
                   "--junit", str(tmp_path / "junit.xml")], ray_env)
    code, out = cmd.finish(timeout=600)
    assert code == 0, cmd.stderr()[-3000:]
    data = json.loads(out)
    assert data == json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(j["id"], j["status"]) for j in data["jobs"]] == [("expand", "pass"), ("junit", "pass")]
    assert all(j["tests"] and all(t["status"] == "pass" for t in j["tests"]) for j in data["jobs"])
    assert "cell" in cmd.stderr() and "2 passed, 0 failed" in cmd.stderr()      # the table went to stderr
    wait_until("every process of the run (Ray's too) to go", lambda: not session_processes(cmd.proc.pid), 60)
    assert not left_behind(before)


def test_a_cluster_node_without_qemu_is_refused_before_any_job(ray_env, tmp_path):
    """The worker's cache is empty (no QEMU tree, no image): the run names it and starts nothing."""
    bare = {**ray_env, "VFIO_CXL_CACHE": str(tmp_path / "empty-cache")}
    with ray_cluster(ray_env, tmp_path, worker_env=bare) as found:
        worker = f"{socket.gethostname()}:{found['worker'].node_manager_port}"
        head = f"{socket.gethostname()}:{found['head'].node_manager_port}"
        cmd = Command([str(write_matrix(tmp_path / "m.toml", ["single"])), "--address", found["address"],
                       "--out", str(tmp_path / "out")], ray_env)
        code, out = cmd.finish(timeout=600)
    err = cmd.stderr()
    assert code == 1, err[-3000:]
    assert f"nodes cannot run the matrix:\n  node {worker}: QEMU is not provisioned, the guest image" in err, err
    assert "--provision" in err and f"node {head}:" not in err   # the head is provisioned: only the worker named
    assert "running on" not in err and not (tmp_path / "out" / "report.json").exists()   # no job started
    assert not list((tmp_path / "empty-cache").rglob("rootfs.raw"))                      # nothing built


def test_a_driver_whose_own_node_dies_stops_the_run_naming_it(cluster, ray_env, tmp_path):
    """A driver told to attach to the worker (--address by the worker's IP) loses its raylet with
    it: the run stops with the cause and what to do, not with every job counted lost or failed."""
    worker = f"{socket.gethostname()}:{cluster['worker'].node_manager_port}"
    port = cluster["address"].rpartition(":")[2]
    cmd = Command([str(fast_matrix(tmp_path / "m.toml")), "--address", f"127.0.0.2:{port}", "--json",
                   "--out", str(tmp_path / "out")], ray_env)
    try:
        wait_until("the driver to attach", lambda: any("driver attached to" in line for line in cmd.lines), 300)
        assert any(f"driver attached to {worker}, not the head" in line for line in cmd.lines), cmd.stderr()
        wait_until("a job running on the worker", lambda: any(f"running on {worker}" in line for line in cmd.lines),
                   300)
        cluster["worker"].kill()
    finally:
        code, out = cmd.finish(timeout=600)
    err = cmd.stderr()
    assert code == 1 and out == "", err[-3000:]
    assert f"the Ray node this driver ran on ({worker}) died" in err and "the run is lost" in err, err[-3000:]
    assert "run the driver on the head" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "report.json").exists()
