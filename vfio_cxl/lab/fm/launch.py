"""``vfio-cxl vm up TOPOLOGY --detach``: start a lab's fabric manager and wait until the lab is ready.

The manager runs in its own session (no terminal, no SIGHUP), writes its log
to ``<logs>/<lab>/fm.log`` and talks to the launcher over a pipe on its
stdout: ``progress: TEXT`` lines while booting, then one ``ready: {json}``
or ``error: {"what", "fix"}``.  The launcher then returns; the lab stays up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ...errors import LabError
from ...paths import REPO_ROOT
from .. import topology
from ..kernel import resolve
from ..qemu_runtime import QEMU_ENV, user_runtime
from . import registry
from .cleanup import remove_leftovers


def _cleanup_after(name: str) -> None:
    for record in registry.records():
        if record.name == name and not record.fm_alive():
            remove_leftovers(record)


def launch(topo: topology.Topology | str, *, accel: str = "tcg", ssh_port: int | None = None, gpu: bool = True,
           timeout: float = 300, echo=print, kernel: str | None = None, modules: str | None = None,
           append: str = "") -> dict:
    """Start a detached lab; returns ``{"name", "socket"}`` once every VM answers SSH.
    ``topo``: the loaded topology (or its name or path, loaded here); the manager gets its file
    and hash (topology.handoff).  ``kernel``/``modules``/``append``: as ``vm up --kernel/--modules/--append``."""
    if isinstance(topo, str):
        topo = topology.load(topo)   # a bad topology fails here, before anything starts
    # so does a kernel the lab cannot boot (checked again by the manager, which boots it)
    resolve(kernel, modules, append, provision=False)
    if os.environ.get(QEMU_ENV):         # so does a --qemu PATH that the lab could not use
        user_runtime(os.environ[QEMU_ENV])
    name, logdir = registry.reserve_name(topo.name)
    cmd = [sys.executable, "-m", "vfio_cxl.lab.fm", "serve", "--name", name, "--logdir", str(logdir),
           *topology.handoff(topo), "--accel", accel, "--timeout", str(timeout)]
    if ssh_port is not None:
        cmd += ["--ssh-port", str(ssh_port)]
    if not gpu:
        cmd.append("--no-gpu")
    for option, value in (("--kernel", kernel), ("--modules", modules), ("--append", append)):
        if value:
            cmd += [option, str(Path(value).expanduser().resolve()) if option != "--append" and value != "lab"
                    else value]
    fm_log = logdir / "fm.log"
    with open(fm_log, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                start_new_session=True, text=True)
    try:
        for line in proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(": ")
            if kind == "progress":
                echo(rest)
            elif kind == "ready":
                return json.loads(rest)
            elif kind == "error":
                err = json.loads(rest)
                proc.wait()
                raise LabError(err["what"], f"{err['fix']} (logs: {logdir})")
        code = proc.wait()
        _cleanup_after(name)
        raise LabError(f"the fabric manager of lab {name} exited ({code}) before the lab was ready",
                       f"see {fm_log}")
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)   # the manager stops what it started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _cleanup_after(name)
        raise
    finally:
        proc.stdout.close()
