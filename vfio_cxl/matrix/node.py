"""The child process of a guest-command job: boot the cell's lab, run the command in its VM.

    python -m vfio_cxl.matrix.node JOB.json

Writes ``result.json`` (exit status, output, seconds) beside JOB.json; the lab's logs go to
``lab/``.  SIGINT or SIGTERM stops the lab (the ``with`` block), as Ctrl-C does for
``vfio-cxl vm up``.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from ..errors import LabError
from ..lab import topology
from ..lab.kernel import resolve
from ..lab.lab import Lab
from .job import OUTPUT_KEEP


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    job = json.loads(Path(argv[0]).read_text())
    workdir = Path(job["workdir"])
    cell, spec = job["cell"], job["spec"]
    topo = topology.parse(spec["topology"]["toml"], spec["topology"]["name"], f"{spec['topology']['name']}.toml")
    kernel = cell.get("kernel")
    chosen = None if kernel in (None, "debian") else \
        resolve(job.get("kernel_local") or kernel, provision=bool(job.get("provision")))
    command = spec["command"]
    if cell.get("backend"):
        command = f"export VFIO_CXL_BACKEND={cell['backend']}; {command}"
    started = time.monotonic()
    lab = Lab(topo, kernel=chosen, logdir=workdir / "lab", log=lambda m: print(m, file=sys.stderr, flush=True))
    # The job's timeout bounds the boot too (the lab's own default is 180 s; the supervisor
    # stops the whole job at its timeout anyway).
    with lab.start(timeout=job["timeout"]):
        booted = time.monotonic()
        result = lab[spec["vm"]].run(command, check=False, timeout=job["timeout"])
        ran = time.monotonic() - booted
    (workdir / "result.json").write_text(json.dumps({
        "exit": result.exited, "stdout": result.stdout[-OUTPUT_KEEP:], "stderr": result.stderr[-OUTPUT_KEEP:],
        "seconds": round(ran, 2), "boot_seconds": round(booted - started, 1)}))
    print(result.stdout, end="")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except LabError as err:
        print(f"vfio-cxl matrix: error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("vfio-cxl matrix: interrupted; lab stopped", file=sys.stderr)
        sys.exit(130)
