"""``vfio-cxl vm down``: stop a lab through its fabric manager, or clean up after one that died.

A lab's processes are children of its fabric manager and die with it
(PR_SET_PDEATHSIG, bwrap --die-with-parent), so after the manager was
SIGKILLed there is normally nothing left to kill -- but "normally" is not
enough: a child forked in the instant the manager died, or a process that
ignored the signal, would be orphaned.  So down kills, in this order, the
recorded processes (pid + start time, so a reused pid is never hit) and any
QEMU, bwrap or vfio_cxl process whose command line names the run
directory; waits for them to be gone (pidfd); keeps the logs; removes the run
directory; and removes the record last.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ...errors import LabError
from ..logs import archive_logs
from .client import FmClient
from .procs import ProcessId, cmdline, comm, kill, processes_mentioning, terminate, wait_gone
from .registry import LabRecord, records


def lab_processes(record: LabRecord) -> list[ProcessId]:
    """Every live process that belongs to the lab, manager excluded."""
    found = {ProcessId.from_json(p) for p in record.processes.values()}
    for pid in processes_mentioning(record.rundir):
        name, line = comm(pid), cmdline(pid)
        if name.startswith("qemu-system") or name == "bwrap" or "vfio_cxl" in line:
            ident = ProcessId.of(pid)
            if ident and ident != record.fm_id():
                found.add(ident)
    return [p for p in found if p.alive()]


def down(record: LabRecord, *, timeout: float = 60, log=print) -> None:
    """Stop a lab: ask its manager (op ``stop``); if it cannot take requests (still booting,
    or hung), SIGTERM it (it stops what it started), then SIGKILL; then sweep what is left."""
    fm = record.fm_id()
    if fm.alive():
        try:
            with FmClient(record.socket, lab=record.name, timeout=min(10, timeout)) as client:
                client.stop()
        except LabError as err:
            log(f"lab {record.name}: the fabric manager does not take requests ({err.what}); "
                f"sending it SIGTERM")
            terminate(fm)
        if wait_gone([fm], timeout):
            log(f"lab {record.name}: the fabric manager did not stop within {timeout:.0f} s; killing it")
            kill(fm, group=False)
            wait_gone([fm], 10)
    else:
        log(f"lab {record.name}: its fabric manager (pid {fm.pid}) is gone; cleaning up after it")
    remove_leftovers(record, log=log)


def owner(pid: int) -> int | None:
    try:
        return Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return None


def remove_leftovers(record: LabRecord, log=print) -> None:
    """Kill what is left of a lab whose manager is gone; keep its logs; remove its files."""
    fm = record.fm_id()
    if fm.alive():
        raise LabError(f"lab {record.name}'s fabric manager (pid {fm.pid}) is still running",
                       f"stop it first: vfio-cxl vm down {record.name}")
    leftovers, skipped = lab_processes(record), []
    for ident in leftovers:
        try:
            kill(ident)
        except PermissionError:   # another user's process (vm down run by a user, not root)
            skipped.append(ident)
    for ident in skipped:
        log(f"lab {record.name}: skipping pid {ident.pid} ({comm(ident.pid)}, uid {owner(ident.pid)}): "
            f"it names the lab's run directory but is not yours to signal; vm down as its owner "
            f"or root stops it")
    leftovers = [p for p in leftovers if p not in skipped]
    stuck = wait_gone(leftovers, 10)
    if stuck:
        raise LabError(f"lab {record.name}: processes {', '.join(str(p.pid) for p in stuck)} survived SIGKILL",
                       "look at them with ps; the run directory is left in place")
    rundir = Path(record.rundir)
    archive_logs(rundir, Path(record.logdir))
    shutil.rmtree(rundir, ignore_errors=True)
    if rundir.exists():
        raise LabError(f"lab {record.name}: could not remove {rundir}", "remove it by hand")
    record.remove()


def down_all(*, log=print) -> list[str]:
    names = []
    for record in records():
        down(record, log=log)
        names.append(record.name)
    return names
