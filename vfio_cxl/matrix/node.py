"""The child process of a guest-command job: boot the cell's lab, run the command in its VM.

    python -m vfio_cxl.matrix.node JOB.json

Writes ``result.json`` (exit status, output, seconds) beside JOB.json; the lab's logs go to
``lab/``.  SIGINT or SIGTERM stops the lab (the ``with`` block), as Ctrl-C does for
``vfio-cxl vm up``.

The job ends with the process that supervises it (vfio_cxl.matrix.job.supervise): its parent.
PR_SET_PDEATHSIG sends the SIGINT when that parent dies; ``SupervisorWatch`` stands behind it,
watching the parent's pidfd, so no orphaned job outlives its supervisor by more than
ORPHAN_GRACE seconds, whatever it was doing (seen once in a full test run: a killed node's job
still up 6 minutes later, single-threaded in epoll_wait).  An orphan removes its own work
directory as it goes: nobody is left to collect its logs.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ..errors import LabError
from ..lab import topology
from ..lab.kernel import resolve
from ..lab.lab import Lab
from .job import OUTPUT_KEEP

ORPHAN_GRACE = 60   # seconds an orphaned job gets to stop its lab before it ends itself
INTERRUPT_AGAIN = 0.2   # seconds between the orphan's interrupts, until its main thread took one


class SupervisorWatch:
    """Once started: interrupt this process (SIGINT to the main thread, as Ctrl-C; again every
    INTERRUPT_AGAIN s, as one can be lost) when ``supervisor`` exits, and end it ``grace``
    seconds later if it is still there, removing ``workdir`` first.  A daemon thread blocks on
    the supervisor's pidfd: readable once it has exited.  ``orphaned`` is set before the
    interrupt."""

    def __init__(self, supervisor: int, workdir: Path, grace: float | None = None):
        self.supervisor, self.workdir = supervisor, workdir
        self.grace = ORPHAN_GRACE if grace is None else grace
        self.orphaned = threading.Event()
        try:
            self._pidfd = os.pidfd_open(supervisor)
        except ProcessLookupError:
            self._pidfd = None   # gone already
        if os.getppid() != supervisor:   # it died before the pidfd (or the pid is another's now)
            if self._pidfd is not None:
                os.close(self._pidfd)
            self._pidfd = None

    def start(self) -> None:
        threading.Thread(target=self._watch, name="supervisor-watch", daemon=True).start()

    def _watch(self) -> None:
        if self._pidfd is not None:
            select.select([self._pidfd], [], [])
            os.close(self._pidfd)
        self.orphaned.set()
        print(f"vfio-cxl matrix: the job's supervisor (pid {self.supervisor}) is gone; stopping",
              file=sys.stderr, flush=True)
        main, deadline = threading.main_thread(), time.monotonic() + self.grace
        while True:
            # Again every INTERRUPT_AGAIN s while the main thread lives: one that comes just before
            # the main thread blocks in a lock (no EINTR then) is lost to it.  ``interrupted``
            # ignores every one after the first it took.
            signal.pthread_kill(main.ident, signal.SIGINT)
            main.join(max(0.0, min(INTERRUPT_AGAIN, deadline - time.monotonic())))
            if not main.is_alive() or time.monotonic() >= deadline:
                break
        if main.is_alive():
            print(f"vfio-cxl matrix: the lab did not stop within {self.grace:.0f} s of the supervisor's "
                  "end; ending now (its QEMU and device servers die with this process). Where it was:",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(all_threads=True)
            shutil.rmtree(self.workdir, ignore_errors=True)
            os._exit(1)


def interrupted(*_) -> None:
    """SIGINT or SIGTERM: KeyboardInterrupt once, which stops the lab; a second signal (the
    parent-death signal and SupervisorWatch's both come when the supervisor dies) would cut that
    stop short, so later ones are ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):   # SIGINT even if this process started with it ignored
        signal.signal(sig, interrupted)
    job = json.loads(Path(argv[0]).read_text())
    workdir = Path(job["workdir"])
    # the supervisor's pid, from the job file: by the time this runs the parent may be gone,
    # and the parent's pid then is init's
    return supervised(workdir, lambda: run(job, workdir), job.get("supervisor") or os.getppid())


def supervised(workdir: Path, body: Callable[[], int], supervisor: int) -> int:
    """``body()`` under a SupervisorWatch of ``supervisor`` (this process's parent); an orphan's
    ``workdir`` goes as it ends, however early the supervisor went (the interrupt can come while
    the watch starts: it is started inside the ``try``)."""
    watch = SupervisorWatch(supervisor, workdir)
    try:
        watch.start()
        return body()
    finally:
        if watch.orphaned.is_set():   # nobody is left to collect the logs
            shutil.rmtree(workdir, ignore_errors=True)


def guest_command(command: str, cell: dict) -> str:
    """The cell's command as it runs in the guest: with a backend axis, $VFIO_CXL_BACKEND names
    the cell's backend for the command, and $VFIO_CXL_VFIO_BACKEND makes the guest library drive
    its devices with it (vfio_cxl.guest.vfio.backend) rather than pick one."""
    backend = cell.get("backend")
    if not backend:
        return command
    return f"export VFIO_CXL_BACKEND={backend} VFIO_CXL_VFIO_BACKEND={backend}; {command}"


def run(job: dict, workdir: Path) -> int:
    cell, spec = job["cell"], job["spec"]
    topo = topology.parse(spec["topology"]["toml"], spec["topology"]["name"], f"{spec['topology']['name']}.toml")
    kernel = cell.get("kernel")
    chosen = None if kernel in (None, "debian") else \
        resolve(job.get("kernel_local") or kernel, provision=bool(job.get("provision")))
    command = guest_command(spec["command"], cell)
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
