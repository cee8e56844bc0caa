"""One report of a matrix run: the table, merged JUnit, KCIDB JSON, and ``--json``.

Rows are jobs (cells): result, seconds, the node of the attempt that counted, and every
attempt before it.  An attempt lost with its node is an *infrastructure* retry: listed, never
a failure.  JUnit (written with junitparser): a ``testsuite`` per cell, its test cases and
properties (kernel, topology, backend, node, attempts).  KCIDB (KernelCI's schema, validated
with kcidb-io before it is written): one checkout for the run, one build per kernel, one test
per test case, all with our own ``origin``.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

from ..errors import LabError
from ..paths import REPO_ROOT
from .engine import State
from .job import ERROR, FAIL, INFRA, PASS, SKIP
from .spec import AXES

ORIGIN = "vfio_cxl"
KCIDB_STATUS = {PASS: "PASS", FAIL: "FAIL", ERROR: "ERROR", SKIP: "SKIP", INFRA: "MISS"}
EXCERPT = 16384


def rows(states: list[State]) -> list[dict]:
    """The report's rows, JSON-able (what --json prints under "jobs")."""
    out = []
    for s in states:
        outcome = s.outcome or {}
        final = s.attempts[-1] if s.attempts else {}
        out.append({
            "id": s.job["id"], "cell": s.job["cell"], "label": s.job["cell_label"], "kind": s.job["kind"],
            "status": s.status, "seconds": outcome.get("seconds", 0.0), "node": final.get("node"),
            "message": outcome.get("message", ""), "start_time": outcome.get("start_time"),
            "attempts": s.attempts,
            "infra_retries": sum(a["status"] == INFRA for a in s.attempts[:-1]) if s.status != INFRA else
            len(s.attempts) - 1,
            "retries": sum(a["status"] in (FAIL, ERROR) for a in s.attempts[:-1]),
            "recipes": s.job["recipes"],
            "tests": [{k: t[k] for k in ("name", "status", "seconds", "message")} | {"output": t.get("output", "")}
                      for t in outcome.get("tests", [])],
        })
    return out


def summary(table: list[dict], name: str, seconds: float) -> dict:
    return {"matrix": name, "seconds": round(seconds, 1), "jobs": table,
            "passed": sum(r["status"] == PASS for r in table),
            "failed": sum(r["status"] in (FAIL, ERROR) for r in table),
            "infra_failed": sum(r["status"] == INFRA for r in table),
            "infra_retries": sum(r["infra_retries"] for r in table)}


def text(table: list[dict]) -> str:
    width = max([len("cell")] + [len(r["label"]) for r in table])
    lines = [f"{'cell':{width}}  {'result':6}  {'seconds':>7}  {'node':20}  attempts"]
    for r in table:
        notes = [f"{a['status']} on {a['node']}" + (f" ({a['message']})" if a["message"] else "")
                 for a in r["attempts"][:-1]]
        attempts = f"{len(r['attempts'])}" + (f": {'; '.join(notes)}" if notes else "")
        lines.append(f"{r['label']:{width}}  {r['status']:6}  {r['seconds']:7.1f}  {str(r['node']):20}  {attempts}")
        if r["status"] not in (PASS, SKIP) and r["message"]:
            lines.append(f"{'':{width}}    {r['message']}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- JUnit

def junit(table: list[dict], path: Path) -> None:
    from junitparser import Error, Failure, JUnitXml, Skipped, TestCase, TestSuite

    xml = JUnitXml(name="vfio-cxl matrix")
    for r in table:
        suite = TestSuite(r["label"])
        for key in AXES:
            if r["cell"].get(key) is not None:
                suite.add_property(key, r["cell"][key])
        suite.add_property("run", r["cell"]["run"])
        suite.add_property("node", str(r["node"]))
        suite.add_property("attempts", str(len(r["attempts"])))
        suite.add_property("infra_retries", str(r["infra_retries"]))
        tests = r["tests"] or [{"name": r["id"], "status": r["status"], "seconds": r["seconds"],
                                "message": r["message"], "output": ""}]
        for t in tests:
            case = TestCase(t["name"], classname=f"matrix.{r['id']}", time=float(t["seconds"]))
            status = t["status"] if r["status"] != INFRA else INFRA
            message = t["message"] if status != INFRA else f"infrastructure: {r['message']}"
            if status == FAIL:
                case.result = [Failure(message or "failed")]
            elif status in (ERROR, INFRA):
                case.result = [Error(message or "error")]
            elif status == SKIP:
                case.result = [Skipped(message or "skipped")]
            if t.get("output"):
                case.system_out = t["output"]
            suite.add_testcase(case)
        suite.time = float(r["seconds"])
        xml.add_testsuite(suite)
    xml.update_statistics()
    xml.write(str(path), pretty=True)


# ---------------------------------------------------------------- KCIDB

def _path_part(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_-]+", "_", text).strip("_") or "_"


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def kcidb(table: list[dict], name: str, origin: str = ORIGIN, started: float | None = None) -> dict:
    """The run as KCIDB data (latest schema of kcidb-io), validated; raises LabError if it is not."""
    import kcidb_io

    if not re.fullmatch(r"[a-z0-9_]+", origin):
        raise LabError(f"KCIDB origin {origin!r}: use lower-case letters, digits and '_'", f"e.g. {ORIGIN}")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(started or time.time()))
    run_id = f"{origin}:{_path_part(name)}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(started or time.time()))}"
    checkout = {"id": run_id, "origin": origin, "start_time": stamp, "valid": True,
                "comment": f"vfio-cxl matrix {name}", "misc": {"vfio_cxl_commit": _commit() or "unknown"}}
    builds: dict[str, dict] = {}
    tests = []
    for r in table:
        kernel = r["cell"].get("kernel") or "default"
        build_id = f"{run_id}:{_path_part(kernel)}"
        builds.setdefault(kernel, {
            "id": build_id, "origin": origin, "checkout_id": run_id, "architecture": "x86_64",
            "config_name": kernel, "status": "PASS", "start_time": stamp,
            "comment": {"debian": "the guest image's Debian kernel", "lab": "the lab kernel (tinyconfig + "
                        "qemu/kernel/lab.config)", "default": "the kernels the run boots itself"}.get(kernel, kernel),
            "misc": {"recipe": r["recipes"].get("kernel", "")}})
        env = " ".join(f"{k}={r['cell'][k]}" for k in ("topology", "backend") if r["cell"].get(k))
        tests_of = r["tests"] or [{"name": r["id"], "status": r["status"], "seconds": r["seconds"],
                                   "message": r["message"], "output": ""}]
        for i, t in enumerate(tests_of):
            status = INFRA if r["status"] == INFRA else t["status"]
            test = {"id": f"{run_id}:{r['id']}:{i}", "origin": origin, "build_id": build_id,
                    "path": ".".join(["vfio_cxl", _path_part(r["kind"]), _path_part(r["cell"]["run"]),
                                      *([_path_part(t["name"])] if r["tests"] else [])]),
                    "status": KCIDB_STATUS[status], "duration": float(t["seconds"]),
                    "environment": {"comment": f"{env} node={r['node']}".strip(),
                                    "misc": {"node": str(r["node"]), "attempts": len(r["attempts"]),
                                             "infra_retries": r["infra_retries"]}},
                    "misc": {"cell": r["label"]}}
            if r["start_time"]:
                test["start_time"] = r["start_time"]
            excerpt = "\n".join(x for x in (t["message"], t.get("output", "")) if x).replace("\0", "")
            if excerpt:
                test["log_excerpt"] = excerpt[-EXCERPT:]
            tests.append(test)
    schema = kcidb_io.schema.LATEST
    data = {"version": {"major": schema.major, "minor": schema.minor}, "checkouts": [checkout],
            "builds": list(builds.values()), "tests": tests}
    try:
        schema.validate(data)
    except Exception as err:   # jsonschema.ValidationError: a bug of ours, said plainly
        raise LabError(f"the KCIDB report does not validate against kcidb-io {schema}: "
                       f"{str(err).splitlines()[0]}", "report it; the other reports are written") from None
    return data


def write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")
