"""``python -m vfio_cxl.lab.fm serve ...``: the fabric-manager process (started by ``vm up --detach``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ...errors import LabError
from ...paths import runtime_root
from .. import topology
from ..kernel import resolve
from ..lab import Lab
from .manager import FabricManager
from .procs import ProcessId
from .reallab import RealLab
from .registry import RUNDIR_MARKER, LabRecord


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.lab.fm")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one lab's fabric manager (vfio-cxl vm up --detach does)")
    serve.add_argument("--name", required=True)
    serve.add_argument("--logdir", required=True, type=Path)
    topology.add_handoff_options(serve)
    serve.add_argument("--accel", default="tcg")
    serve.add_argument("--ssh-port", type=int)
    serve.add_argument("--no-gpu", action="store_true")
    serve.add_argument("--timeout", type=float, default=300)
    serve.add_argument("--kernel", help="a bzImage path or 'lab' (default: the image's kernel)")
    serve.add_argument("--modules")
    serve.add_argument("--append", default="")
    args = parser.parse_args(argv)

    try:
        topo = topology.load_handed(args.topology, args.topology_sha256)
        kernel = resolve(args.kernel, args.modules, args.append, provision=False)
    except LabError as err:
        print(f"error: {json.dumps({'what': err.what, 'fix': err.fix})}", flush=True)
        return 1
    rundir = Path(tempfile.mkdtemp(prefix="vfio-cxl-", dir=runtime_root()))
    (rundir / RUNDIR_MARKER).write_text(args.name + "\n")
    record = LabRecord(name=args.name, topology=topo.name, rundir=str(rundir), logdir=str(args.logdir),
                       fm=ProcessId.of(os.getpid()).to_json(), created=time.time())
    record.save()
    lab = Lab(topo, accel=args.accel, ssh_port=args.ssh_port, gpu=not args.no_gpu, rundir=rundir,
              logdir=args.logdir, kernel=kernel)
    return FabricManager(RealLab(lab, args.timeout), record, progress=sys.stdout).run()


if __name__ == "__main__":
    sys.exit(main())
