"""One job on one node: check its recipes, run it in a child process, bring its logs back.

The job carries the recipe hashes of what it boots (QEMU tree, guest image, kernel), computed
on the driver from its checkout.  The node computes the same from its own checkout and
refuses the job as an *infrastructure* failure when they differ (another checkout) or when
an artefact is missing and the job may not provision it.  With ``provision`` the node
builds what is missing from the same recipes (``vfio-cxl provision`` does the same): the
artefacts never travel, only a kernel file named in the matrix does (through Ray's object
store, written into the node's cache by its hash).

The work itself runs as a child process in a session of its own: the same commands a user
types (``vfio-cxl selftest vfio``, ``pytest tests/vm/...``, ``python -m vfio_cxl.bench``) or,
for a guest command, :mod:`vfio_cxl.matrix.node`.  Each boots its labs with the lab's own
lifecycle (``with Lab(...)``), so stopping the child with SIGINT stops its VMs; the child
dies with the process that supervises it (PR_SET_PDEATHSIG), and QEMU dies with the child,
so a lost node or a killed worker leaves no VM either.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from ..errors import LabError
from ..paths import REPO_ROOT, cache_root, runtime_root

PASS, FAIL, ERROR, SKIP, INFRA = "pass", "fail", "error", "skip", "infra"
LOG_BUDGET = 32 << 20          # bytes of logs a job brings back; the rest is listed, not sent
STOP_GRACE = 90                # seconds a child gets to stop its labs after SIGINT
OUTPUT_KEEP = 16 << 10         # bytes of a command's output kept in the report


# ---------------------------------------------------------------- recipes

def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def recipes(kernel: str | None, kernel_hash: str | None = None) -> dict:
    """The recipe hashes of what a job on ``kernel`` boots, from this checkout (nothing is run)."""
    from ..lab.image import image_path
    from ..lab.kernel import FRAGMENT, LAB_RECIPE
    from ..lab.qemu_runtime import tree_path
    from ..lab.recipe import recipe_hash

    found = {"qemu": tree_path().name, "image": image_path().name}
    if kernel == "lab":
        found["kernel"] = "lab-" + recipe_hash(LAB_RECIPE, FRAGMENT)
    elif kernel not in (None, "debian"):
        found["kernel"] = "file-" + (kernel_hash or "?")
    else:
        found["kernel"] = "debian-" + found["image"]
    return found


def node_facts(kernels: list[str]) -> dict:
    """What this node has: its recipes and which artefacts are provisioned (a probe; builds nothing)."""
    from ..lab.image import image_path
    from ..lab.kernel import cached_lab_kernel
    from ..lab.qemu_runtime import provisioned_runtime

    runtime = provisioned_runtime()
    return {"host": socket.gethostname(), "recipes": recipes(None),
            "lab_recipe": recipes("lab")["kernel"],
            "qemu": runtime.version_string if runtime else None,
            "image": (image_path() / "rootfs.raw").is_file(),
            "lab_kernel": cached_lab_kernel() is not None if "lab" in kernels else None}


def node_problems(facts: dict, kernels: list[str]) -> list[str]:
    """What a node lacks for these kernels, one phrase each (empty: it can run every job)."""
    missing = []
    if not facts["qemu"]:
        missing.append("QEMU is not provisioned")
    if not facts["image"]:
        missing.append(f"the guest image {facts['recipes']['image']} is not built")
    if "lab" in kernels and not facts["lab_kernel"]:
        missing.append("the lab kernel is not built")
    return missing


def provision(kernels: list[str], log=print) -> dict:
    """Build what this node lacks from its recipes (what `vfio-cxl provision [--kernel lab]` does)."""
    from ..lab.image import find_image
    from ..lab.kernel import lab_kernel
    from ..lab.qemu_runtime import find_runtime

    started = time.monotonic()
    find_runtime(log=log)
    find_image(log=log)
    if "lab" in kernels:
        lab_kernel(log=log)
    return {"seconds": round(time.monotonic() - started, 1)}


def config_beside(image: Path) -> str | None:
    """The text of the config beside a kernel file, if any (it travels with the kernel)."""
    from ..lab.kconfig import config_beside as beside

    found = beside(image)
    return found.read_text(errors="replace") if found else None


def place_kernel(data: bytes, name: str, config: str | None, digest: str) -> Path:
    """A kernel file shipped with the job, in this node's cache under its hash (config beside it)."""
    if hashlib.sha256(data).hexdigest()[:16] != digest:
        raise LabError(f"the kernel {name} shipped with the job does not match its hash {digest}")
    dest = cache_root() / "kernels" / f"matrix-{digest}"
    image = dest / name
    if not image.is_file():
        scratch = dest.with_name(f".{dest.name}.{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        (scratch / name).write_bytes(data)
        if config is not None:
            (scratch / "config").write_text(config)
        try:
            scratch.rename(dest)
        except OSError:          # another job placed it first
            shutil.rmtree(scratch, ignore_errors=True)
    return image


# ---------------------------------------------------------------- the child

def child_argv(job: dict, workdir: Path) -> list[str]:
    """The command that does the job: what a user would type for it."""
    cell, spec = job["cell"], job["spec"]
    py = sys.executable
    if job["kind"] == "guest":
        return [py, "-m", "vfio_cxl.matrix.node", str(workdir / "job.json")]
    if job["kind"] == "selftest":
        argv = [py, "-m", "vfio_cxl", "selftest", spec["suite"], "--json"]
        if cell.get("kernel") not in (None, "debian"):
            argv += ["--kernel", job.get("kernel_local") or cell["kernel"]]
        argv += ["--backend", cell.get("backend") or "all"]
        for f in spec["k"]:
            argv += ["-k", f]
        return argv
    if job["kind"] == "tests":
        argv = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={workdir / 'junit.xml'}",
                *spec["select"]]
        return argv + (["-k", spec["k"]] if spec.get("k") else [])
    if job["kind"] == "bench":
        return [py, "-m", "vfio_cxl.bench", spec["name"], *spec["args"]]
    raise LabError(f"unknown job kind {job['kind']!r}")


def _child_setup() -> None:
    # Ray's processes block SIGINT, and a blocked mask is inherited: the child must see SIGINT.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # So is an ignored SIGINT (`matrix run ... &` in a script: the shell ignores it in
    # background jobs), and a Python started so never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)   # PR_SET_PDEATHSIG: stop like Ctrl-C


def supervise(argv: list[str], workdir: Path, timeout: float, cwd: Path = REPO_ROOT) -> dict:
    """Run ``argv`` with its output in ``workdir``; stop it with SIGINT (its labs stop) on timeout
    or when this process is interrupted (a cancelled Ray task), SIGKILL its group if it hangs."""
    started = time.monotonic()
    with open(workdir / "stdout.log", "wb") as out, open(workdir / "stderr.log", "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd,
                                start_new_session=True, preexec_fn=_child_setup)
    timed_out = False
    try:
        while True:
            try:
                proc.wait(timeout=1)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - started > timeout:
                    timed_out = True
                    stop_child(proc)
                    break
    except BaseException:        # KeyboardInterrupt from ray.cancel, SIGTERM, ...
        stop_child(proc)
        raise
    return {"returncode": proc.returncode, "timed_out": timed_out,
            "seconds": round(time.monotonic() - started, 1)}


def stop_child(proc: subprocess.Popen, grace: float = STOP_GRACE) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # whatever is left of its session (QEMU dies with the lab)
    except ProcessLookupError:
        pass
    proc.wait()


# ---------------------------------------------------------------- results

def _tail(path: Path, limit: int = OUTPUT_KEEP) -> str:
    if not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        return f.read().decode(errors="replace")


def results(job: dict, workdir: Path, ran: dict) -> tuple[str, list[dict], str]:
    """(status, test cases, message) of a finished child, from what it wrote."""
    name = job["id"]
    if ran["timed_out"]:
        return ERROR, [{"name": name, "status": ERROR, "seconds": ran["seconds"],
                        "message": f"timed out after {job['timeout']:.0f} s", "output": _tail(workdir / "stderr.log")}], \
            f"timed out after {job['timeout']:.0f} s"
    rc = ran["returncode"]
    stderr = _tail(workdir / "stderr.log")
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    kind = job["kind"]
    if kind == "guest":
        result_file = workdir / "result.json"
        if not result_file.is_file():
            return ERROR, [{"name": name, "status": ERROR, "seconds": ran["seconds"], "message": last,
                            "output": stderr}], last or f"exited {rc}"
        got = json.loads(result_file.read_text())
        status = PASS if got["exit"] == 0 else FAIL
        message = "" if status == PASS else f"'{job['spec']['command']}' exited {got['exit']}"
        return status, [{"name": name, "status": status, "seconds": got["seconds"], "message": message,
                         "output": got["stdout"] + got["stderr"]}], message
    if kind == "selftest":
        try:
            got = json.loads((workdir / "stdout.log").read_text())
        except (OSError, ValueError):
            return ERROR, [{"name": name, "status": ERROR, "seconds": ran["seconds"], "message": last,
                            "output": stderr}], last or f"exited {rc}"
        cases = []
        for r in got["results"]:
            status = {"pass": PASS, "fail": FAIL}.get(r["result"], SKIP)
            cases.append({"name": f"{r['test']}.{r['case']} [{r['device']} {r['backend']}]", "status": status,
                          "seconds": 0.0, "message": r.get("note") or ("" if status == PASS else r["result"]),
                          "output": ""})
        status = PASS if got["failed"] == 0 and rc == 0 else FAIL
        return status, cases, f"{got['passed']} passed, {got['failed']} failed (guest kernel {got.get('kernel')})"
    if kind == "tests":
        cases = _junit_cases(workdir / "junit.xml")
        status = {0: PASS, 1: FAIL}.get(rc, ERROR)
        message = "" if rc == 0 else (last or f"pytest exited {rc}") if status == ERROR else \
            f"{sum(c['status'] == FAIL for c in cases)} failed"
        if rc == 5:
            message = "the selection matched no test"
        return status, cases, message
    status = PASS if rc == 0 else FAIL
    return status, [{"name": name, "status": status, "seconds": ran["seconds"],
                     "message": "" if rc == 0 else (last or f"exited {rc}"),
                     "output": _tail(workdir / "stdout.log")}], "" if rc == 0 else last


def _junit_cases(path: Path) -> list[dict]:
    """pytest's JUnit, read back with junitparser, as our test cases."""
    if not path.is_file():
        return []
    from junitparser import Error, Failure, JUnitXml, Skipped

    cases = []
    xml = JUnitXml.fromfile(str(path))
    suites = list(xml) if isinstance(xml, JUnitXml) else [xml]
    for suite in suites:
        for case in suite:
            status, message = PASS, ""
            for r in case.result:
                status = FAIL if isinstance(r, Failure) else ERROR if isinstance(r, Error) else \
                    SKIP if isinstance(r, Skipped) else status
                message = r.message or ""
            cases.append({"name": f"{case.classname}.{case.name}" if case.classname else case.name,
                          "status": status, "seconds": float(case.time or 0), "message": message, "output": ""})
    return cases


def pack_logs(workdir: Path, budget: int = LOG_BUDGET) -> bytes:
    """The job's files as a tar.gz, at most ``budget`` bytes of content (larger files are skipped
    and named in SKIPPED.txt)."""
    buf = io.BytesIO()
    skipped, used = [], 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(p for p in workdir.rglob("*") if p.is_file() and not p.is_symlink()):
            size = path.stat().st_size
            if used + size > budget:
                skipped.append(f"{path.relative_to(workdir)} ({size} bytes)")
                continue
            used += size
            tar.add(path, arcname=str(path.relative_to(workdir)))
        if skipped:
            data = ("over the log budget, left on the node:\n" + "\n".join(skipped) + "\n").encode()
            info = tarfile.TarInfo("SKIPPED.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def remove_stale_workdirs() -> None:
    """Work directories of jobs whose worker is gone (killed with its node: nothing removed them)."""
    for workdir in runtime_root().glob("matrix-*-*"):
        pid = workdir.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(workdir, ignore_errors=True)


def execute(job: dict, node: dict, kernel_file: tuple[bytes, str, str | None] | None = None) -> dict:
    """Run one job here: the body of the Ray task (and of the fake engine's, in tests).

    Returns the outcome: status (pass/fail/error, or infra when this node cannot run it),
    test cases, seconds, the node, and the job's logs as a tar.gz."""
    started = time.monotonic()
    outcome = {"id": job["id"], "attempt": job.get("attempt", 1), "node": node, "tests": [], "logs": b"",
               "start_time": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())}
    kernel = job["cell"].get("kernel")
    mine = recipes(kernel, job["recipes"].get("kernel", "").removeprefix("file-") or None)
    differ = [f"{k} {job['recipes'][k]} there, {mine.get(k)} here" for k in job["recipes"]
              if job["recipes"][k] != mine.get(k)]
    if differ:
        return {**outcome, "status": INFRA, "seconds": 0.0,
                "message": f"this node's checkout has other recipes: {'; '.join(differ)}"}
    facts = node_facts([kernel] if kernel else [])
    missing = node_problems(facts, [kernel] if kernel else [])
    if missing and not job.get("provision"):
        return {**outcome, "status": INFRA, "seconds": 0.0,
                "message": f"{', '.join(missing)} on {facts['host']}"}
    remove_stale_workdirs()
    # beside the labs' run directories, no parent of its own: nothing is left once it goes
    workdir = runtime_root() / f"matrix-{job['id']}-{job.get('attempt', 1)}-{os.getpid()}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    try:
        if missing:
            with open(workdir / "provision.log", "w") as log:
                provision([kernel] if kernel else [], log=lambda m: print(m, file=log, flush=True))
        if kernel_file is not None:
            data, name, config = kernel_file
            job = {**job, "kernel_local": str(place_kernel(data, name, config, mine["kernel"][len("file-"):]))}
        # "supervisor": this process, which the child (vfio_cxl.matrix.node) ends with
        (workdir / "job.json").write_text(json.dumps({**job, "workdir": str(workdir), "supervisor": os.getpid()},
                                                     indent=1))
        ran = supervise(child_argv(job, workdir), workdir, job["timeout"])
        status, tests, message = results(job, workdir, ran)
        return {**outcome, "status": status, "tests": tests, "message": message,
                "seconds": round(time.monotonic() - started, 1), "logs": pack_logs(workdir)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
