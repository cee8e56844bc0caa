"""``vfio-cxl matrix run FILE``: expand, check, run on Ray, report."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path


def add_parser(sub) -> None:
    matrix = sub.add_parser("matrix", help="run a kernel x topology x test matrix of labs on Ray (docs/matrix.md)")
    cmds = matrix.add_subparsers(dest="matrix_command", required=True)
    run = cmds.add_parser("run", help="run every cell of a matrix file and report")
    run.add_argument("file", help="the matrix file (.toml; see docs/matrix.md)")
    run.add_argument("--address", metavar="auto|HOST:PORT",
                     help="a Ray cluster's head (GCS address), or 'auto' for one started on this machine; "
                          "default: a local Ray started for this run")
    run.add_argument("--max-parallel", type=int, metavar="N",
                     help="at most N jobs at once (default: the cluster's tcg_vm slots; locally the "
                          "local node gets N slots, default cores/2)")
    run.add_argument("--provision", action="store_true",
                     help="a node that lacks QEMU, the guest image or the lab kernel builds it from the same "
                          "recipes before the jobs start (default: refuse, naming the node)")
    run.add_argument("--junit", metavar="FILE", help="write the merged JUnit XML here")
    run.add_argument("--kcidb", metavar="FILE", help="write KCIDB JSON here (validated with kcidb-io)")
    run.add_argument("--origin", default="vfio_cxl", help="the KCIDB origin (default vfio_cxl)")
    run.add_argument("--json", action="store_true", help="print the report as JSON (the table goes to stderr)")
    run.add_argument("--out", metavar="DIR",
                     help="where every job's logs come back to (DIR/JOB/attempt-N/), with report.json; "
                          "default: <cache>/matrix/NAME-TIME")
    run.add_argument("--dry-run", action="store_true", help="print the cells and their jobs' resources, run nothing")
    run.set_defaults(func=run_command)


def jobs_of(matrix) -> list[dict]:
    """The matrix's jobs as the dicts the engine ships, with their recipe hashes."""
    from . import job, spec

    out = []
    for j in spec.expand(matrix):
        kernel_hash = job.file_hash(Path(j.kernel_path)) if j.kernel_path else None
        j.recipes = job.recipes(j.cell.kernel, kernel_hash)
        out.append({**j.to_dict(), "cell_label": j.cell.label})
    return out


def run_command(args) -> int:
    from ..errors import LabError
    from ..paths import cache_root
    from . import engine, report, spec

    started = time.time()
    # Everything that can be wrong with the file fails here, before Ray or any lab starts.
    matrix = spec.load(args.file)
    jobs = jobs_of(matrix)
    if args.max_parallel is not None and args.max_parallel < 1:
        raise LabError(f"--max-parallel {args.max_parallel}: must be 1 or more")
    if args.dry_run:
        for j in jobs:
            res = j["resources"]
            print(f"{j['cell_label']}: {j['kind']}, tcg_vm {res['resources']['tcg_vm']}, {res['num_cpus']} CPU, "
                  f"{res['memory'] >> 20} MiB, timeout {j['timeout']:.0f} s, retries {j['retries']}; "
                  f"recipes {' '.join(f'{k}={v}' for k, v in j['recipes'].items())}")
        return 0
    out_dir = Path(args.out) if args.out else \
        cache_root() / "matrix" / f"{matrix.name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(started))}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.address:
        engine.check_address(args.address)
    # Ray prints its cluster's error messages ("(raylet) Raylet is terminated ..." when a node dies)
    # on the driver's sys.stdout, up to ray.shutdown(): while Ray runs, stdout is stderr, so that
    # stdout holds the report alone (--json: one JSON document).
    with contextlib.redirect_stdout(sys.stderr):
        ray_engine = engine.RayEngine(args.address, slots=args.max_parallel,
                                      log=lambda m: print(m, file=sys.stderr, flush=True))
        try:
            states = engine.run(jobs, ray_engine, max_parallel=args.max_parallel, provision=args.provision,
                                out_dir=out_dir)
        finally:
            ray_engine.close()
    table = report.rows(states)
    data = report.summary(table, matrix.name, time.time() - started)
    data["logs"] = str(out_dir)
    report.write_json(data, out_dir / "report.json")
    if args.junit:
        report.junit(table, Path(args.junit))
    if args.kcidb:
        report.write_json(report.kcidb(table, matrix.name, args.origin, started), Path(args.kcidb))
    shown = report.text(table) + (f"{data['passed']} passed, {data['failed']} failed, {data['infra_failed']} lost "
                                  f"({data['infra_retries']} infrastructure retries) in {data['seconds']:.0f} s; "
                                  f"logs in {out_dir}\n")
    if args.json:
        print(shown, end="", file=sys.stderr, flush=True)
        print(json.dumps(data, indent=1), flush=True)
    else:
        print(shown, end="", flush=True)
    return 0 if data["failed"] == 0 and data["infra_failed"] == 0 else 1

