"""Running the jobs: our scheduling logic (:func:`run`) over an engine (:class:`RayEngine`).

:func:`run` owns every job's state: queued -> running (on a node) -> done or failed, and the
retries.  A job whose node or worker died (Ray reports it lost), or that its node could not
run (not provisioned, another checkout), is an *infrastructure* failure: it is queued again,
up to :data:`INFRA_RETRIES` times, and runs wherever Ray places it; it is never counted as a
test failure.  A job that ran and failed is run again only if its run asks for ``retries``.

The engine is what runs a job somewhere: :class:`RayEngine` (``ray.init()`` local, or a
cluster's address) or, in the fast tests, a fake that calls :func:`job.execute` in-process.
Every job declares its resources (``num_cpus``, ``memory``, ``tcg_vm``: the VMs it boots), so
Ray never places more labs on a node than it offers ``tcg_vm`` slots.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import LabError
from ..paths import runtime_root
from . import job as jobs
from .job import ERROR, FAIL, INFRA, PASS

INFRA_RETRIES = 3
PROBE_TIMEOUT = 120
HEAD_START_TIMEOUT = 300
HEAD_ATTEMPTS = 3
CANCEL_GRACE = jobs.STOP_GRACE + 30
INSTALL_HINT = ("install the matrix extra into this checkout's venv: .venv/bin/pip install -e '.[matrix]' "
                "(or: pip install 'vfio-cxl[matrix]')")


class InfraFailure(Exception):
    """The job was lost with its node or worker: not the job's fault."""


class DriverLost(LabError):
    """The Ray node the driver attached to died: every job's result went with it (the run is lost)."""


class Engine(Protocol):
    def nodes(self) -> dict[str, dict]: ...                # alive node id -> {"label", "resources"}
    def probe(self, node: str, kernels: list[str]) -> dict: ...
    def provision(self, node: str, kernels: list[str]) -> dict: ...
    def submit(self, job: dict): ...                        # -> a handle
    def wait(self, handles: list, timeout: float) -> list: ...   # the finished ones
    def outcome(self, handle) -> dict: ...                  # raises InfraFailure
    def started(self) -> list[tuple[str, int, str]]: ...    # (job id, attempt, node id) since last call
    def cancel(self, handles: list, force: bool = False) -> None: ...
    def close(self) -> None: ...


@dataclass
class State:
    job: dict
    attempt: int = 0
    infra: int = 0
    status: str = "queued"           # queued, running, then pass/fail/error/skip/infra
    node: str | None = None
    attempts: list[dict] = field(default_factory=list)
    outcome: dict | None = None


class Progress:
    """One line per change: jobs queued / running / done / failed, and per node."""

    def __init__(self, out=sys.stderr, labels: dict[str, str] | None = None):
        self.out = out
        self.labels = labels or {}
        self.start = time.monotonic()
        self.last = ""

    def show(self, states: list[State], event: str = "") -> None:
        count = {k: 0 for k in ("queued", "running", "done", "failed")}
        nodes: dict[str, dict[str, int]] = {}
        for s in states:
            bucket = s.status if s.status in ("queued", "running") else "done" if s.status in (PASS, "skip") \
                else "failed"
            count[bucket] += 1
            if s.node is not None and bucket != "queued":
                per = nodes.setdefault(self.labels.get(s.node, s.node[:8]), {"running": 0, "done": 0, "failed": 0})
                per[bucket] += 1
        line = " ".join(f"{k} {v}" for k, v in count.items())
        if nodes:
            line += " | " + "; ".join(f"{n}: " + " ".join(f"{k} {v}" for k, v in per.items() if v)
                                      for n, per in sorted(nodes.items()))
        if event or line != self.last:
            print(f"[matrix {time.monotonic() - self.start:6.1f}s] {event + ' -- ' if event else ''}{line}",
                  file=self.out, flush=True)
            self.last = line


def check_cluster(jobs_: list[dict], engine: Engine, provision: bool, log) -> dict[str, dict]:
    """Refuse before anything starts: no node offers tcg_vm, a job needs more than any node has,
    a node lacks QEMU/the image/the lab kernel (unless ``provision``: then it is built there now)."""
    nodes = engine.nodes()
    slots = {n: info for n, info in nodes.items() if info["resources"].get("tcg_vm", 0) >= 1}
    if not slots:
        raise LabError("no node of the Ray cluster offers the resource tcg_vm (lab slots)",
                       "start nodes with: ray start ... --resources '{\"tcg_vm\": N}' (see docs/matrix.md)")
    for j in jobs_:
        need = j["resources"]["resources"]["tcg_vm"]
        fits = [n for n, info in slots.items() if info["resources"]["tcg_vm"] >= need
                and info["resources"].get("memory", float("inf")) >= j["resources"]["memory"]
                and info["resources"].get("CPU", 0) >= j["resources"]["num_cpus"]]
        if not fits:
            biggest = max(info["resources"]["tcg_vm"] for info in slots.values())
            raise LabError(f"cell [{j['cell_label']}] needs {need} tcg_vm, {j['resources']['num_cpus']} CPU and "
                           f"{j['resources']['memory'] >> 20} MiB; no node offers that (most tcg_vm: {biggest})",
                           "start a node with more --resources '{\"tcg_vm\": N}' (or --max-parallel, locally), "
                           "or lower the run's resources")
    kernels = sorted({j["cell"]["kernel"] for j in jobs_ if j["cell"].get("kernel") in ("debian", "lab")})
    problems = []
    for node, info in slots.items():
        facts = engine.probe(node, kernels)
        missing = jobs.node_problems(facts, kernels)
        if missing and provision:
            log(f"[matrix] provisioning {info['label']}: {', '.join(missing)}")
            spent = engine.provision(node, kernels)
            log(f"[matrix] provisioned {info['label']} in {spent['seconds']:.0f} s")
        elif missing:
            problems.append(f"node {info['label']}: {', '.join(missing)}")
    if problems:
        raise LabError("nodes cannot run the matrix:\n  " + "\n  ".join(problems),
                       "run 'vfio-cxl provision' (and '--kernel lab' for kernel lab) on each, or pass "
                       "--provision to build there from the same recipes")
    return slots


def run(jobs_: list[dict], engine: Engine, *, max_parallel: int | None = None, provision: bool = False,
        out_dir: Path | None = None, progress: Progress | None = None, log=None) -> list[State]:
    """Run every job to a final status; returns their states (attempts, outcome) in job order."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    slots = check_cluster(jobs_, engine, provision, log)
    progress = progress or Progress()
    progress.labels = {n: info["label"] for n, info in engine.nodes().items()}
    states = [State(job=j) for j in jobs_]
    queue = list(states)
    running: dict = {}            # handle -> State
    limit = max_parallel or sum(int(info["resources"]["tcg_vm"]) for info in slots.values())
    progress.show(states, f"{len(states)} jobs on {len(slots)} node(s)")
    try:
        while queue or running:
            while queue and len(running) < limit:
                state = queue.pop(0)
                state.attempt += 1
                state.status, state.node = "queued", None
                running[engine.submit({**state.job, "attempt": state.attempt, "provision": provision})] = state
            for job_id, attempt, node in engine.started():
                for s in running.values():
                    if s.job["id"] == job_id and s.attempt == attempt:
                        s.status, s.node = "running", node
                        progress.labels.setdefault(node, engine.nodes().get(node, {}).get("label", node[:8]))
                        progress.show(states, f"{job_id} (attempt {attempt}) running on {progress.labels[node]}")
            for handle in engine.wait(list(running), timeout=1.0):
                state = running.pop(handle)
                try:
                    outcome = engine.outcome(handle)
                except InfraFailure as err:
                    outcome = {"id": state.job["id"], "attempt": state.attempt, "status": INFRA,
                               "node": {"id": state.node, "host": None}, "message": str(err), "tests": [],
                               "seconds": 0.0, "logs": b""}
                node_id = outcome["node"].get("id") or state.node
                state.node = node_id
                label = progress.labels.get(node_id, (node_id or "?")[:8]) if node_id else "?"
                if node_id and node_id not in progress.labels:
                    label = progress.labels[node_id] = engine.nodes().get(node_id, {}).get("label", node_id[:8])
                if out_dir is not None and outcome.get("logs"):
                    _unpack(outcome["logs"], out_dir / state.job["id"] / f"attempt-{state.attempt}")
                state.attempts.append({"attempt": state.attempt, "node": label, "status": outcome["status"],
                                       "message": outcome.get("message", ""), "seconds": outcome.get("seconds", 0.0)})
                if outcome["status"] == INFRA and state.infra < INFRA_RETRIES:
                    state.infra += 1
                    state.status, state.node = "queued", None
                    queue.insert(0, state)
                    progress.show(states, f"{state.job['id']}: infrastructure failure on {label} "
                                          f"({outcome.get('message', '')}); queued again")
                    continue
                retries_used = state.attempt - 1 - state.infra
                if outcome["status"] in (FAIL, ERROR) and retries_used < state.job["retries"]:
                    state.status, state.node = "queued", None
                    queue.append(state)
                    progress.show(states, f"{state.job['id']}: {outcome['status']} on {label}; retrying "
                                          f"({retries_used + 1} of {state.job['retries']})")
                    continue
                state.status, state.outcome = outcome["status"], outcome
                progress.show(states, f"{state.job['id']}: {outcome['status']} on {label} "
                                      f"in {outcome.get('seconds', 0):.0f} s")
    except DriverLost:
        raise     # nothing left to cancel through: the jobs elsewhere die with this driver's Ray job
    except BaseException:
        if running:
            log(f"[matrix] cancelling {len(running)} job(s); each stops its lab")
            handles = list(running)
            try:
                engine.cancel(handles)
                left = handles
                deadline = time.monotonic() + CANCEL_GRACE
                while left and time.monotonic() < deadline:
                    done = engine.wait(left, timeout=1.0)
                    left = [h for h in left if h not in done]
                if left:
                    engine.cancel(left, force=True)   # the worker dies; its child and QEMU die with it
            except Exception as err:   # the cluster is going too: the children die with their workers
                log(f"[matrix] cancelling: {type(err).__name__}: {err}")
        raise
    finally:
        # a job killed with its worker (its node lost, or cancelled by force) left its work
        # directory; on this machine nothing else would remove it before the next job here
        jobs.remove_stale_workdirs()
    return states


def _unpack(data: bytes, dest: Path) -> None:
    import io
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")


# ---------------------------------------------------------------- Ray

def _ray():
    try:
        import ray
    except ImportError:
        raise LabError("Ray is not installed (the matrix runs on Ray)", INSTALL_HINT) from None
    return ray


def check_address(address: str, timeout: float = 5.0) -> None:
    """An unreachable HOST:PORT fails here, at once, instead of after Ray's own retries."""
    if address == "auto":       # a cluster started on this machine: Ray finds it, or says there is none
        return
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise LabError(f"--address {address}: not HOST:PORT", "give the head's GCS address, e.g. 10.0.0.1:6379, "
                                                              "or 'auto' for a cluster started on this machine")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise LabError(f"--address {address}: cannot reach a Ray head there ({err.strerror or err})",
                       "start it with 'ray start --head --port PORT' on that machine, or check the address "
                       "and the firewall") from None


def driver_ip(address: str) -> str | None:
    """The IP the driver attaches by: the head's (the host of ``--address``) when this machine has it.

    Ray attaches a driver to the first alive raylet registered with its node IP (read from the
    session's ``node_ip_address.json``, which the node started last on this machine wrote); with
    two nodes on one machine that may be a worker, and the run is lost with it.  The head's raylet
    registers with the GCS host's IP (``ray start`` turns 127.0.0.1 into the machine's address),
    so naming that IP attaches the driver to the head.  ``auto``, or a head on another machine:
    Ray's own choice."""
    if address == "auto":
        return None
    host = address.removeprefix("ray://").rpartition(":")[0].strip("[]")
    ray = _ray()
    try:
        ip = ray.util.get_node_ip_address() if host in ("127.0.0.1", "localhost", "::1") else \
            socket.gethostbyname(host)
        with socket.socket(socket.AF_INET) as s:
            s.bind((ip, 0))        # an address of this machine
    except OSError:
        return None
    return ip


def _task(job: dict, tracker, kernel_file) -> dict:
    """The Ray task: tell the tracker where it runs, then run the job here."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    here = {"id": node, "host": socket.gethostname()}
    tracker.started.remote(job["id"], job["attempt"], node)
    try:
        return jobs.execute(job, here, ray.get(kernel_file[0]) if kernel_file else None)
    except Exception as err:     # the job's own error (a bad kernel file, ...): reported, not lost
        return {"id": job["id"], "attempt": job["attempt"], "node": here, "status": ERROR, "tests": [],
                "message": f"{type(err).__name__}: {err}", "seconds": 0.0, "logs": b""}


def _probe(kernels: list[str]) -> dict:
    return jobs.node_facts(kernels)


def _provision(kernels: list[str]) -> dict:
    return jobs.provision(kernels, log=lambda m: print(m, file=sys.stderr, flush=True))


class _Tracker:
    """An actor on the driver's node: the tasks' "started on node N" messages."""

    def __init__(self):
        self.events: list = []

    def started(self, job_id: str, attempt: int, node: str) -> None:
        self.events.append((job_id, attempt, node))

    def take(self) -> list:
        events, self.events = self.events, []
        return events


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (Ray's workers make process groups of their own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


class LocalHead:
    """The local Ray of a run without --address: ``ray start --head --block`` in a session of its
    own, every port chosen here, one tcg_vm slot per lab it may hold; stopped with the run.

    A Ray 2.60 raylet gives its agents (Python processes) a fixed 15 s to write their port files
    and aborts past that (ray issue 65983); on a 2-core machine at load average 16-24 they often
    took longer (``import ray`` alone: 9 s wall for 1.5 CPU-s), with ``ray.init()`` as with
    ``ray start``.  The extra asks for Ray below 2.50 (2.49.2 started there); a head that fails to
    start anyway is started again, up to :data:`HEAD_ATTEMPTS` times."""

    FLAGS = ("--port", "--node-manager-port", "--object-manager-port", "--dashboard-agent-grpc-port",
             "--dashboard-agent-listen-port", "--metrics-export-port", "--runtime-env-agent-port")

    def __init__(self, slots: int, log):
        # Ray's temp dir of this run (its session, sockets, logs), removed when the run ends;
        # kept only when the head did not start (the error names its logs).
        self.temp = runtime_root() / f"ray-{os.getpid()}"
        self.temp.mkdir(parents=True, exist_ok=True)
        # Ray below 2.50 (the extra) has no authentication and ignores these; later Ray uses the
        # token for this run's Ray and its driver (nothing read from ~/.ray).
        if "RAY_AUTH_MODE" not in os.environ:
            os.environ["RAY_AUTH_MODE"] = "token"
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.log_file = self.temp / "head.log"
        for attempt in range(1, HEAD_ATTEMPTS + 1):
            try:
                self._start(slots, log)
                return
            except LabError as err:
                if attempt == HEAD_ATTEMPTS:
                    raise
                log(f"[matrix] {err.what.splitlines()[0]}; starting it again ({attempt + 1} of {HEAD_ATTEMPTS})")

    def _start(self, slots: int, log) -> None:
        from ..lab.lab import free_ports

        ports = dict(zip(self.FLAGS, free_ports(len(self.FLAGS))))
        self.address = f"127.0.0.1:{ports['--port']}"
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [str(ray_bin), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
               "--num-cpus", str(slots + 1), "--resources", f'{{"tcg_vm": {slots}}}', "--include-dashboard=false",
               "--disable-usage-stats", "--temp-dir", str(self.temp),
               *[str(x) for flag, port in ports.items() for x in (flag, port)]]

        def setup():   # dies with the driver, and sees SIGTERM even if the driver blocks it
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG

        started = time.monotonic()
        with open(self.log_file, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=setup)
        try:
            while "Ray runtime started" not in self.log_file.read_text(errors="replace"):
                if self.proc.poll() is not None or time.monotonic() - started > HEAD_START_TIMEOUT:
                    tail = "\n".join(self.log_file.read_text(errors="replace").splitlines()[-3:])
                    raise LabError(f"the local Ray did not start in {time.monotonic() - started:.0f} s:\n{tail}",
                                   f"see {self.log_file} and {self.temp}/session_latest/logs/raylet.out")
                time.sleep(0.5)
        except BaseException:
            self.stop(remove=False)
            raise
        log(f"[matrix] local Ray started in {time.monotonic() - started:.1f} s ({slots} tcg_vm)")

    def stop(self, remove: bool = True) -> None:
        """Stop every process of the head's session; then remove its temp dir (unless ``remove`` is false)."""
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            for pid in session_processes(self.proc.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while session_processes(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not session_processes(self.proc.pid):
                break
        self.proc.wait()
        if remove:
            shutil.rmtree(self.temp, ignore_errors=True)


class RayEngine:
    LOST = ()

    def __init__(self, address: str | None = None, slots: int | None = None, log=None):
        ray = self.ray = _ray()
        self.head: LocalHead | None = None
        self.nodes_seen: dict[str, str] = {}     # node id -> label, dead ones too
        from ray import exceptions as rex

        # Lost with its node or worker: retried elsewhere, never a test failure.
        self.LOST = tuple(getattr(rex, n) for n in ("NodeDiedError", "WorkerCrashedError", "ObjectLostError",
                                                    "OwnerDiedError", "RaySystemError", "TaskUnschedulableError")
                          if hasattr(rex, n))
        # The driver's own raylet died: the run is lost (see DriverLost), not one job.
        self.driver_lost = getattr(rex, "LocalRayletDiedError", ())
        self.cancelled = getattr(rex, "TaskCancelledError", ())
        self.log = log or (lambda m: None)
        if address:
            check_address(address)
            ip = driver_ip(address)
            try:
                ray.init(address=address, log_to_driver=False, logging_level="ERROR",
                         **({"_node_ip_address": ip} if ip else {}))
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise LabError(f"--address {address}: cannot join the Ray cluster: {err}",
                               "check that the head runs (ray status --address HOST:PORT) and that this "
                               "machine runs a node of it (or use a ray:// client address)") from None
        else:
            self.head = LocalHead(slots or max(1, (os.cpu_count() or 1) // 2), log or (lambda m: None))
            try:
                ray.init(address=self.head.address, log_to_driver=False, logging_level="ERROR")
            except BaseException:
                self.head.stop()
                raise
        # The tracker lives on the head (it outlives any worker node), else on the driver's node.
        self.driver_node = ray.get_runtime_context().get_node_id()
        here = next((n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]),
                    self.driver_node)
        if address:
            label = self.nodes().get(self.driver_node, {}).get("label", self.driver_node)
            if here == self.driver_node:
                self.log(f"[matrix] driver attached to {label} (the head)")
            else:
                self.log(f"[matrix] driver attached to {label}, not the head: the run is lost if that node dies "
                         "(run it on the head; two nodes on one machine need --node-ip-address of their own)")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.pin = lambda node: NodeAffinitySchedulingStrategy(node, soft=False)
        self.tracker = ray.remote(num_cpus=0)(_Tracker).options(scheduling_strategy=self.pin(here)).remote()
        self.task = ray.remote(_task)
        self.shipped: dict[str, tuple] = {}

    def nodes(self) -> dict[str, dict]:
        alive = [n for n in self.ray.nodes() if n["Alive"]]
        hosts = [n["NodeManagerHostname"] for n in alive]
        found = {n["NodeID"]: {"label": n["NodeManagerHostname"] if hosts.count(n["NodeManagerHostname"]) == 1
                               else f"{n['NodeManagerHostname']}:{n['NodeManagerPort']}",
                               "resources": n["Resources"]} for n in alive}
        self.nodes_seen.update((node, info["label"]) for node, info in found.items())
        return found

    def probe(self, node: str, kernels: list[str]) -> dict:
        fn = self.ray.remote(num_cpus=0)(_probe).options(scheduling_strategy=self.pin(node))
        try:
            return self.ray.get(fn.remote(kernels), timeout=PROBE_TIMEOUT)
        except (self.ray.exceptions.GetTimeoutError, *self.LOST) as err:
            raise LabError(f"node {self.nodes().get(node, {}).get('label', node)} did not answer the probe "
                           f"in {PROBE_TIMEOUT} s ({type(err).__name__})",
                           "check it with 'ray status'; is vfio-cxl installed there with the matrix extra?") from None

    def provision(self, node: str, kernels: list[str]) -> dict:
        fn = self.ray.remote(num_cpus=0)(_provision).options(scheduling_strategy=self.pin(node))
        return self.ray.get(fn.remote(kernels))

    def submit(self, job: dict):
        kernel_file = None
        if job.get("kernel_path"):   # a kernel file travels through the object store, once
            path = Path(job["kernel_path"])
            if job["kernel_path"] not in self.shipped:
                config = jobs.config_beside(path)
                self.shipped[job["kernel_path"]] = (self.ray.put((path.read_bytes(), path.name, config)),)
            kernel_file = self.shipped[job["kernel_path"]]
        res = job["resources"]
        return self.task.options(num_cpus=res["num_cpus"], memory=res["memory"], resources=res["resources"],
                                 max_retries=0, name=f"{job['id']}#{job['attempt']}").remote(
            job, self.tracker, kernel_file)

    def wait(self, handles: list, timeout: float) -> list:
        if not handles:
            return []
        done, _ = self.ray.wait(handles, num_returns=len(handles), timeout=timeout)
        return done

    def outcome(self, handle) -> dict:
        try:
            return self.ray.get(handle)
        except self.driver_lost as err:
            label = self.nodes_seen.get(self.driver_node, self.driver_node)
            raise DriverLost(f"the Ray node this driver ran on ({label}) died: every running job's result went "
                             f"with it, the run is lost ({type(err).__name__})",
                             "run the driver on the head (vfio-cxl matrix run ... --address HEAD:PORT there); "
                             "nodes sharing one machine need an --node-ip-address each") from None
        except self.LOST as err:
            raise InfraFailure(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None

    def started(self) -> list:
        try:
            return self.ray.get(self.tracker.take.remote(), timeout=30)
        except Exception:   # the tracker is unreachable: no progress events, the results still come
            return []

    def cancel(self, handles: list, force: bool = False) -> None:
        for h in handles:
            try:
                self.ray.cancel(h, force=force)
            except Exception:   # already finished
                pass

    def close(self) -> None:
        try:
            self.ray.shutdown()
        finally:
            if self.head is not None:
                self.head.stop()
