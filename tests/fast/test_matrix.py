"""The matrix: file parsing, expansion, include/exclude, refusals, our scheduling logic (on a
fake engine), the child supervisor (real processes) and the report writers (JUnit read back
with junitparser, KCIDB validated with kcidb-io)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import kcidb_io
import pytest
from junitparser import Error, Failure, JUnitXml, Skipped

from vfio_cxl import cli
from vfio_cxl.errors import LabError
from vfio_cxl.lab import selftests
from vfio_cxl.matrix import engine, job, report, spec
from vfio_cxl.matrix.command import jobs_of

TWO_BY_TWO = """
[axes]
kernel = ["debian", "lab"]
topology = ["single", "hb2"]
[[run]]
name = "uname"
guest = { vm = "host0", command = "uname -r" }
"""


def parse(text: str) -> spec.Matrix:
    return spec.parse(textwrap.dedent(text), "m.toml", Path("."))


def labels(text: str) -> list[str]:
    return [j.cell.label for j in spec.expand(parse(text))]


# ---------------------------------------------------------------- file and expansion

def test_two_by_two_expands_to_four_cells_in_order():
    assert labels(TWO_BY_TWO) == ["uname kernel=debian topology=single", "uname kernel=debian topology=hb2",
                                  "uname kernel=lab topology=single", "uname kernel=lab topology=hb2"]
    first = spec.expand(parse(TWO_BY_TWO))[0]
    assert first.id == "uname-debian-single"
    assert first.resources["resources"] == {"tcg_vm": 1}
    assert first.resources["memory"] == (1 << 30) + (512 << 20)   # the VM's 1G + 512M
    assert first.spec["topology"]["name"] == "single" and "[[vm]]" in first.spec["topology"]["toml"]


def test_exclude_drops_matching_combinations_and_include_adds():
    got = labels(TWO_BY_TWO + """
[[exclude]]
kernel = "lab"
topology = "hb2"
[[include]]
kernel = "lab"
topology = ["p2p", "single"]
""")
    assert got == ["uname kernel=debian topology=single", "uname kernel=debian topology=hb2",
                   "uname kernel=lab topology=single", "uname kernel=lab topology=p2p"]


def test_runs_span_only_their_axes():
    got = labels("""
[axes]
kernel = ["debian", "lab"]
topology = ["single", "hb2"]
backend = ["type1", "iommufd"]
[[exclude]]
kernel = "debian"
backend = "iommufd"
[[run]]
name = "st"
selftest = { k = ["vfio_dma_mapping_test"] }
[[run]]
name = "life"
tests = { select = ["tests/vm/test_lab_lifecycle.py"], k = "detach" }
[[run]]
name = "boot"
bench = { name = "boot", args = ["--topology", "single"] }
""")
    assert got == ["st kernel=debian topology=selftest backend=type1", "life", "boot",
                   "st kernel=lab topology=selftest backend=type1", "st kernel=lab topology=selftest backend=iommufd"]


def test_guest_command_sees_the_backend_and_timeout_and_retries_travel():
    jobs = spec.expand(parse("""
[axes]
backend = ["type1"]
[[run]]
name = "env"
guest = { vm = "host0", command = "echo $VFIO_CXL_BACKEND" }
timeout = 60
retries = 2
"""))
    assert [(j.cell.label, j.timeout, j.retries) for j in jobs] == [("env kernel=debian topology=single backend=type1", 60, 2)]


def test_a_backend_cell_runs_its_command_with_that_backend():
    """The command sees $VFIO_CXL_BACKEND (docs/matrix.md), and the guest library, which reads
    its own variable, drives the devices with the cell's backend."""
    from vfio_cxl.guest.vfio.backend import BACKEND_ENV
    from vfio_cxl.matrix.node import guest_command

    line = guest_command("vfio-cxl gpu dma", {"kernel": "lab", "backend": "type1"})
    ran = subprocess.run(["bash", "-c", line.replace("vfio-cxl gpu dma", f"echo $VFIO_CXL_BACKEND ${BACKEND_ENV}")],
                         capture_output=True, text=True, check=True)
    assert ran.stdout.split() == ["type1", "type1"]
    assert guest_command("uname -r", {"kernel": "lab"}) == "uname -r"


# ---------------------------------------------------------------- refusals, naming what is wrong

@pytest.mark.parametrize("text, words", [
    ("[axes]\narch = ['x86']\n[[run]]\nname='a'\nbench={name='boot'}", ["axes.arch", "unknown key"]),
    ("[axes]\nkernel = ['fedora']\n" + TWO_BY_TWO.split("[axes]")[1].split("\n", 3)[3],
     ["axes.kernel", "unknown kernel 'fedora'", "debian, lab"]),
    ("[axes]\ntopology = ['nosuch']\n[[run]]\nname='a'\nguest={vm='host0', command='true'}",
     ["axes.topology", "unknown topology 'nosuch'"]),
    ("[axes]\nbackend = ['vfio']\n[[run]]\nname='a'\nguest={vm='host0', command='true'}",
     ["axes.backend", "unknown backend 'vfio'", "type1, iommufd"]),
    ("[axes]\nkernel = ['debian']\n", ["no [[run]]"]),
    (TWO_BY_TWO + "[[exclude]]\nrun = 'uname'\n", ["the matrix is empty"]),
    (TWO_BY_TWO + "[[exclude]]\nrun = 'other'\n", ["exclude[0].run", "no [[run]] named 'other'"]),
    ("[[run]]\nname='a'\nguest={vm='b', command='true'}",
     ["cell [a kernel=debian topology=single]", "has no VM 'b'", "its VMs: host0"]),
    ("[axes]\nbackend = ['iommufd']\n[[run]]\nname='a'\nguest={vm='host0', command='true'}",
     ["cell [a kernel=debian topology=single backend=iommufd]", "no IOMMUFD", "exclude the cell"]),
    ("[[run]]\nname='a'\nguest={vm='host0', command='true'}\nbench={name='boot'}", ["exactly one of"]),
    ("[[run]]\nname='a'\nbench={name='boot'}\nretries=9", ["run[0].retries"]),
    ("[axes\n", ["malformed TOML"]),
])
def test_bad_files_are_refused_naming_the_key_or_cell(text, words):
    with pytest.raises(LabError) as err:
        spec.expand(parse(text))
    for word in words:
        assert word in str(err.value)


def test_iommufd_on_the_lab_kernel_is_allowed_its_fragment_has_it():
    assert spec.kernel_has_iommufd("lab")
    got = labels("[axes]\nkernel=['lab']\nbackend=['iommufd']\n[[run]]\nname='a'\nguest={vm='host0', command='true'}")
    assert got == ["a kernel=lab topology=single backend=iommufd"]


def test_a_kernel_file_is_read_for_iommufd(tmp_path):
    image = tmp_path / "bzImage"
    image.write_bytes(b"not really a kernel")
    (tmp_path / "config").write_text("CONFIG_IOMMUFD=y\nCONFIG_VFIO_DEVICE_CDEV=n\n")
    (tmp_path / "m.toml").write_text("[axes]\nkernel=['bzImage']\nbackend=['iommufd']\n"
                                     "[[run]]\nname='a'\nguest={vm='host0', command='true'}\n")
    with pytest.raises(LabError, match=r"cell \[a kernel=bzImage .*no IOMMUFD"):
        spec.expand(spec.load(tmp_path / "m.toml"))
    (tmp_path / "config").write_text("CONFIG_IOMMUFD=y\nCONFIG_VFIO_DEVICE_CDEV=y\n")
    (one,) = jobs_of(spec.load(tmp_path / "m.toml"))
    assert one["kernel_path"] == str(image) and one["recipes"]["kernel"] == "file-" + job.file_hash(image)


def test_the_command_refuses_before_ray_starts(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(engine, "RayEngine", lambda *a, **k: pytest.fail("Ray started for a bad file"))
    (tmp_path / "m.toml").write_text("[axes]\ntopology = ['nosuch']\n[[run]]\nname='a'\nbench={name='boot'}\n")
    assert cli.main(["matrix", "run", str(tmp_path / "m.toml")]) == 1
    assert "axes.topology: unknown topology 'nosuch'" in capfd.readouterr().err
    assert cli.main(["matrix", "run", str(tmp_path / "none.toml")]) == 1
    assert "no matrix file" in capfd.readouterr().err


def test_dry_run_lists_cells_with_resources_and_recipes(tmp_path, capfd):
    (tmp_path / "m.toml").write_text(TWO_BY_TWO)
    assert cli.main(["matrix", "run", str(tmp_path / "m.toml"), "--dry-run"]) == 0
    out = capfd.readouterr().out.splitlines()
    assert len(out) == 4 and out[2].startswith("uname kernel=lab topology=single: guest, tcg_vm 1")
    assert "kernel=lab-" in out[2] and "image=" in out[0]


def test_missing_ray_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(LabError, match=r"Ray is not installed.*pip install -e '\.\[matrix\]'"):
        engine.RayEngine()


def test_an_unreachable_address_fails_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]     # nothing listens there once closed
    with pytest.raises(LabError, match=f"--address 127.0.0.1:{port}: cannot reach a Ray head"):
        engine.check_address(f"127.0.0.1:{port}", timeout=2)
    with pytest.raises(LabError, match="not HOST:PORT"):
        engine.check_address("somewhere")


def test_an_unreachable_address_is_refused_before_ray_or_any_lab_starts(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(engine, "RayEngine", lambda *a, **k: pytest.fail("Ray started for an unreachable address"))
    (tmp_path / "m.toml").write_text(TWO_BY_TWO)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["matrix", "run", str(tmp_path / "m.toml"), "--address", f"127.0.0.1:{port}",
                     "--out", str(tmp_path / "out")]) == 1
    err = capfd.readouterr().err
    assert f"--address 127.0.0.1:{port}: cannot reach a Ray head" in err and "ray start --head --port" in err


def test_the_driver_attaches_by_the_heads_ip_when_this_machine_has_it():
    ray = pytest.importorskip("ray")
    here = ray.util.get_node_ip_address()
    # `ray start` registers a head given 127.0.0.1 under the machine's address: so does the driver
    assert engine.driver_ip("127.0.0.1:6379") == engine.driver_ip("localhost:6379") == here
    assert engine.driver_ip(f"{here}:6379") == here
    assert engine.driver_ip("127.0.0.2:6379") == "127.0.0.2"       # a second node on this machine
    assert engine.driver_ip("203.0.113.1:6379") is None              # a head elsewhere: Ray's own choice
    assert engine.driver_ip("auto") is None


# ---------------------------------------------------------------- scheduling logic on a fake engine

PROVISIONED = {"host": "h", "recipes": {"image": "a7eb7380d42730d1"}, "qemu": "QEMU emulator version 11.1.3", "image": True, "lab_kernel": True}


class FakeEngine:
    """Runs nothing: each (job id, attempt) gets its scripted outcome on its scripted node."""

    def __init__(self, script: dict, nodes: dict | None = None, facts: dict | None = None):
        self.script = script                       # (id, attempt) -> (node, status) or "lost"
        self.node_info = nodes or {"A": {"label": "a", "resources": {"tcg_vm": 1, "CPU": 2, "memory": 8 << 30}},
                                   "B": {"label": "b", "resources": {"tcg_vm": 1, "CPU": 2, "memory": 8 << 30}}}
        self.facts = facts or {}
        self.events, self.submitted, self.cancelled, self.provisioned = [], [], [], []

    def nodes(self):
        return self.node_info

    def probe(self, node, kernels):
        return self.facts.get(node, PROVISIONED)

    def provision(self, node, kernels):
        self.provisioned.append(node)
        return {"seconds": 1.0}

    def submit(self, j):
        handle = (j["id"], j["attempt"])
        self.submitted.append(handle)
        got = self.script.get(handle, ("A", job.PASS))
        self.events.append((j["id"], j["attempt"], got[0]))
        return handle

    def wait(self, handles, timeout):
        return list(handles)

    def outcome(self, handle):
        node, status = self.script.get(handle, ("A", job.PASS))
        if status == "lost":
            raise engine.InfraFailure("NodeDiedError: the node died")
        return {"id": handle[0], "attempt": handle[1], "node": {"id": node, "host": node}, "status": status,
                "tests": [{"name": "t", "status": status, "seconds": 1.5, "message": "", "output": "6.12.0"}],
                "message": "" if status == job.PASS else "it broke", "seconds": 2.0, "logs": b"",
                "start_time": "2026-11-25T18:00:00+00:00"}

    def started(self):
        events, self.events = self.events, []
        return events

    def cancel(self, handles, force=False):
        self.cancelled.append((list(handles), force))

    def close(self):
        pass


def two_jobs(retries: int = 0) -> list[dict]:
    jobs = jobs_of(parse(TWO_BY_TWO + "[[exclude]]\nkernel='lab'\n"))
    return [{**j, "retries": retries} for j in jobs]


def run_fake(fake, jobs, **kw):
    return engine.run(jobs, fake, progress=engine.Progress(out=open("/dev/null", "w")), log=lambda m: None, **kw)


def test_a_job_lost_with_its_node_is_retried_and_reported_as_infrastructure():
    fake = FakeEngine({("uname-debian-single", 1): ("B", "lost"), ("uname-debian-single", 2): ("A", job.PASS)})
    states = run_fake(fake, two_jobs())
    table = report.rows(states)
    assert [r["status"] for r in table] == ["pass", "pass"]
    assert table[0]["infra_retries"] == 1 and table[0]["retries"] == 0 and table[0]["node"] == "a"
    assert [a["status"] for a in table[0]["attempts"]] == ["infra", "pass"]
    assert table[0]["attempts"][0]["node"] == "b" and "NodeDiedError" in table[0]["attempts"][0]["message"]
    data = report.summary(table, "m", 1.0)
    assert (data["passed"], data["failed"], data["infra_retries"]) == (2, 0, 1)
    assert "1: " not in report.text(table) and "infra on b (NodeDiedError" in report.text(table)


def test_the_driver_removes_the_work_directory_of_a_job_killed_with_its_worker(tmp_path, monkeypatch):
    """A worker killed mid-job cannot remove its work directory; on one machine the driver's
    run does, when it ends (else it stayed until the next job here)."""
    monkeypatch.setattr(job, "runtime_root", lambda: tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"matrix-uname-debian-single-1-{dead.pid}").mkdir()    # what the killed worker left
    fake = FakeEngine({("uname-debian-single", 1): ("B", "lost"), ("uname-debian-single", 2): ("A", job.PASS)})
    run_fake(fake, two_jobs())
    assert list(tmp_path.iterdir()) == []


def test_infrastructure_retries_are_bounded_and_never_a_test_failure():
    fake = FakeEngine({("uname-debian-single", n): ("B", "lost") for n in range(1, 10)})
    states = run_fake(fake, two_jobs(retries=3))
    assert states[0].status == job.INFRA and len(states[0].attempts) == engine.INFRA_RETRIES + 1
    data = report.summary(report.rows(states), "m", 1.0)
    assert (data["failed"], data["infra_failed"]) == (0, 1)


def test_a_failed_job_is_retried_only_as_its_run_asks():
    script = {("uname-debian-single", 1): ("A", job.FAIL), ("uname-debian-single", 2): ("A", job.FAIL),
              ("uname-debian-hb2", 1): ("A", job.FAIL), ("uname-debian-hb2", 2): ("B", job.PASS)}
    assert [s.status for s in run_fake(FakeEngine(script), two_jobs(retries=0))] == ["fail", "fail"]
    states = run_fake(FakeEngine(script), two_jobs(retries=1))
    assert [s.status for s in states] == ["fail", "pass"]
    assert report.rows(states)[1]["retries"] == 1 and report.rows(states)[1]["node"] == "b"


def test_max_parallel_bounds_the_jobs_in_flight():
    class Counting(FakeEngine):
        peak = 0

        def wait(self, handles, timeout):
            Counting.peak = max(Counting.peak, len(handles))
            return list(handles)[:1]
    run_fake(Counting({}), two_jobs(), max_parallel=1)
    assert Counting.peak == 1


def test_the_cluster_is_checked_before_any_job():
    fake = FakeEngine({}, nodes={"A": {"label": "a", "resources": {"CPU": 4}}})
    with pytest.raises(LabError, match="no node of the Ray cluster offers the resource tcg_vm"):
        run_fake(fake, two_jobs())
    assert fake.submitted == []
    big = [{**j, "resources": {**j["resources"], "resources": {"tcg_vm": 2}}} for j in two_jobs()]
    with pytest.raises(LabError, match=r"cell \[uname kernel=debian topology=single\] needs 2 tcg_vm"):
        run_fake(FakeEngine({}), big)
    bare = {**PROVISIONED, "qemu": None, "image": False}
    fake = FakeEngine({}, facts={"B": bare})
    with pytest.raises(LabError, match="node b: QEMU is not provisioned, the guest image") as err:
        run_fake(fake, two_jobs())
    assert "--provision" in err.value.fix and fake.submitted == []
    fake = FakeEngine({}, facts={"B": bare})
    assert [s.status for s in run_fake(fake, two_jobs(), provision=True)] == ["pass", "pass"]
    assert fake.provisioned == ["B"]


def test_an_interrupt_cancels_every_running_job():
    class Interrupted(FakeEngine):
        def wait(self, handles, timeout):
            if not self.cancelled:
                raise KeyboardInterrupt
            return list(handles)
    fake = Interrupted({})
    with pytest.raises(KeyboardInterrupt):
        run_fake(fake, two_jobs())
    assert fake.cancelled == [([("uname-debian-single", 1), ("uname-debian-hb2", 1)], False)]


def test_json_stdout_is_the_report_alone_whatever_ray_prints(tmp_path, capfd, monkeypatch):
    class Chatty(FakeEngine):     # Ray prints a dead node's message on the driver's sys.stdout
        def outcome(self, handle):
            print("(raylet) Raylet is terminated. Termination is unexpected.")
            return super().outcome(handle)

        def close(self):
            print("(raylet) leftover lines flushed by ray.shutdown()")
    monkeypatch.setattr(engine, "RayEngine", lambda *a, **k: Chatty({}))
    (tmp_path / "m.toml").write_text(TWO_BY_TWO + "[[exclude]]\nkernel='lab'\n")
    assert cli.main(["matrix", "run", str(tmp_path / "m.toml"), "--json", "--out", str(tmp_path / "out")]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == json.loads((tmp_path / "out" / "report.json").read_text())
    assert "Raylet is terminated" in err and "leftover lines" in err and "2 passed" in err


def test_losing_the_drivers_own_node_aborts_the_run_naming_it():
    class DriverNodeDied(FakeEngine):
        def outcome(self, handle):
            raise engine.DriverLost("the Ray node this driver ran on (b) died: ... the run is lost",
                                    "run the driver on the head")
    fake = DriverNodeDied({})
    with pytest.raises(engine.DriverLost, match=r"driver ran on \(b\) died.*the run is lost") as err:
        run_fake(fake, two_jobs())
    assert isinstance(err.value, LabError) and fake.cancelled == []      # a clear error, no job reported


# ---------------------------------------------------------------- the node side, on real processes

def test_a_job_on_a_node_with_another_checkout_is_an_infrastructure_failure():
    (one, _) = two_jobs()
    got = job.execute({**one, "recipes": {**one["recipes"], "image": "0000000000000000"}}, {"id": "A", "host": "h"})
    assert got["status"] == job.INFRA and "image 0000000000000000 there" in got["message"]


def test_work_directories_of_dead_workers_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(job, "runtime_root", lambda: tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"matrix-uname-debian-hb2-1-{dead.pid}").mkdir()
    (tmp_path / f"matrix-uname-debian-hb2-2-{os.getpid()}").mkdir()
    (tmp_path / "vfio-cxl-other-lab").mkdir()
    job.remove_stale_workdirs()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"matrix-uname-debian-hb2-2-{os.getpid()}",
                                                           "vfio-cxl-other-lab"]


STOPPABLE = """
import pathlib, sys, time
try:
    print("started", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    pathlib.Path(sys.argv[1]).write_text("stopped cleanly")
"""


def test_a_job_past_its_timeout_is_stopped_like_ctrl_c(tmp_path):
    ran = job.supervise([sys.executable, "-c", STOPPABLE, str(tmp_path / "flag")], tmp_path, timeout=1.5, cwd=tmp_path)
    assert ran["timed_out"] and (tmp_path / "flag").read_text() == "stopped cleanly"
    assert (tmp_path / "stdout.log").read_text() == "started\n"


@contextlib.contextmanager
def sigint_blocked():
    """What Ray's workers do: SIGINT blocked, and a blocked mask is inherited."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def sigint_ignored():
    """A background job of a non-interactive shell: SIGINT ignored, and children inherit that."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("supervisor", [sigint_blocked, sigint_ignored])
def test_the_child_sees_sigint_whatever_its_supervisor_does_with_it(tmp_path, supervisor):
    with supervisor():
        ran = job.supervise([sys.executable, "-c", STOPPABLE, str(tmp_path / "flag")], tmp_path, timeout=1.5,
                            cwd=tmp_path)
    assert ran["timed_out"] and ran["seconds"] < 30 and (tmp_path / "flag").read_text() == "stopped cleanly"


def test_an_interrupted_supervisor_stops_its_child_first(tmp_path):
    def interrupt(*_):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            job.supervise([sys.executable, "-c", STOPPABLE, str(tmp_path / "flag")], tmp_path, timeout=60, cwd=tmp_path)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert (tmp_path / "flag").read_text() == "stopped cleanly"


def test_pytest_junit_is_read_back_case_by_case(tmp_path):
    (tmp_path / "test_x.py").write_text("import pytest\ndef test_ok(): pass\ndef test_bad(): assert 1 == 2\n"
                                        "def test_skip(): pytest.skip('no lab kernel')\n")
    j = {"id": "t", "kind": "tests", "timeout": 60, "cell": {"run": "t"}, "spec": {"select": ["test_x.py"], "k": None}}
    ran = job.supervise(job.child_argv(j, tmp_path), tmp_path, 60, cwd=tmp_path)
    status, cases, message = job.results(j, tmp_path, ran)
    assert status == job.FAIL and message == "1 failed"
    assert {c["name"]: c["status"] for c in cases} == {"test_x.test_ok": "pass", "test_x.test_bad": "fail",
                                                       "test_x.test_skip": "skip"}


def test_selftest_json_becomes_test_cases(tmp_path):
    results = [selftests.Result("vfio_dma_mapping_test", "map", "gpu", "vfio_type1_iommu", selftests.PASS),
               selftests.Result("vfio_dma_mapping_test", "unmap", "gpu", "iommufd", selftests.NEEDS_IOMMUFD,
                                "the guest kernel has no IOMMUFD (/dev/iommu)")]
    (tmp_path / "stdout.log").write_text(json.dumps({**selftests.summary(results), "kernel": "6.12.0"}))
    (tmp_path / "stderr.log").write_text("")
    j = {"id": "st", "kind": "selftest", "timeout": 60, "cell": {"run": "st"}}
    status, cases, message = job.results(j, tmp_path, {"returncode": 0, "timed_out": False, "seconds": 3.0})
    assert status == job.PASS and message == "1 passed, 0 failed (guest kernel 6.12.0)"
    assert [(c["status"], c["message"]) for c in cases] == [
        ("pass", ""), ("skip", "the guest kernel has no IOMMUFD (/dev/iommu)")]


def test_logs_come_back_within_their_budget(tmp_path):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "console.log").write_text("booted\n")
    (tmp_path / "huge.raw").write_bytes(b"\0" * 4096)
    data = job.pack_logs(tmp_path, budget=1024)
    engine._unpack(data, tmp_path / "back")
    assert (tmp_path / "back" / "lab" / "console.log").read_text() == "booted\n"
    assert not (tmp_path / "back" / "huge.raw").exists()
    assert "huge.raw (4096 bytes)" in (tmp_path / "back" / "SKIPPED.txt").read_text()


# ---------------------------------------------------------------- reports

def finished_table() -> list[dict]:
    script = {("uname-debian-single", 1): ("B", "lost"), ("uname-debian-single", 2): ("A", job.PASS),
              ("uname-debian-hb2", 1): ("A", job.FAIL)}
    return report.rows(run_fake(FakeEngine(script), two_jobs()))


def test_junit_has_every_cell_and_reads_back(tmp_path):
    report.junit(finished_table(), tmp_path / "junit.xml")
    xml = JUnitXml.fromfile(str(tmp_path / "junit.xml"))
    suites = {s.name: s for s in xml}
    assert list(suites) == ["uname kernel=debian topology=single", "uname kernel=debian topology=hb2"]
    first, second = suites.values()
    props = {p.name: p.value for p in first.properties()}
    assert props["node"] == "a" and props["infra_retries"] == "1" and props["kernel"] == "debian"
    (case,) = list(first)
    assert case.is_passed and case.system_out == "6.12.0"
    (case,) = list(second)
    assert isinstance(case.result[0], Failure)
    assert (xml.tests, xml.failures) == (2, 1)


def test_kcidb_validates_and_counts_an_infra_loss_as_missed_not_failed():
    table = finished_table()
    data = report.kcidb(table, "two by two", "vfio_cxl")
    kcidb_io.schema.LATEST.validate(data)
    assert [t["status"] for t in data["tests"]] == ["PASS", "FAIL"]
    assert data["tests"][0]["environment"]["misc"]["infra_retries"] == 1
    assert data["tests"][0]["path"] == "vfio_cxl.guest.uname.t"
    assert [b["config_name"] for b in data["builds"]] == ["debian"]
    lost = report.rows(run_fake(FakeEngine({("uname-debian-single", n): ("B", "lost") for n in range(1, 9)}),
                                two_jobs()))
    assert [t["status"] for t in report.kcidb(lost, "m")["tests"]] == ["MISS", "PASS"]
    with pytest.raises(LabError, match="KCIDB origin 'Bad-Origin'"):
        report.kcidb(table, "m", "Bad-Origin")


def test_junit_marks_a_lost_job_as_an_infrastructure_error(tmp_path):
    lost = report.rows(run_fake(FakeEngine({("uname-debian-single", n): ("B", "lost") for n in range(1, 9)}),
                                two_jobs()))
    report.junit(lost, tmp_path / "j.xml")
    case = next(iter(next(iter(JUnitXml.fromfile(str(tmp_path / "j.xml"))))))
    assert isinstance(case.result[0], Error) and case.result[0].message.startswith("infrastructure: NodeDiedError")
    assert not isinstance(case.result[0], (Failure, Skipped))


def test_the_shipped_example_matrix_expands():
    example = Path(__file__).resolve().parents[2] / "docs" / "matrix-example.toml"
    assert [j.cell.label for j in spec.expand(spec.load(example))] == [
        "uname kernel=debian topology=single", "uname kernel=debian topology=hb2",
        "uname kernel=lab topology=single", "uname kernel=lab topology=hb2"]


def test_subprocess_cli_help_lists_matrix():
    out = subprocess.run([sys.executable, "-m", "vfio_cxl", "matrix", "run", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--address auto|HOST:PORT" in out.stdout and "--kcidb" in out.stdout


def test_ports_picked_together_are_distinct():
    """free_ports holds every socket bound until all are picked: one bind at a time may hand the
    same port back twice, and a Ray node given one port for two components refuses to start."""
    from vfio_cxl.lab.lab import check_port_free, free_ports

    ports = free_ports(64)
    assert len(set(ports)) == 64
    check_port_free(ports[0])   # released again for whoever binds it next
