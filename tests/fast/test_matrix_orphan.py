"""A guest-command job (vfio_cxl.matrix.node) ends with its supervisor: SupervisorWatch, behind
the parent-death signal, interrupts it when its parent exits and ends it after a grace if it does
not stop, removing its work directory (nobody is left to collect it).  Real processes: a
supervisor that starts the job and is SIGKILLed, as a lost Ray node's worker is."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from vfio_cxl.lab.fm import procs
from vfio_cxl.lab.fm.procs import ProcessId

# The job: node.supervised, as node.main runs it, around a body that either stops when
# interrupted, or swallows the interrupt and goes on waiting (a stop that hangs), or loses the
# first interrupt and stops on the next.  A signal that comes just before the main thread blocks
# in a lock wait (no EINTR then) is lost that way: seen once in a full test run, as a "stops"
# job that was never interrupted and ended after its grace.
JOB = textwrap.dedent('''
    import signal, sys, threading
    from pathlib import Path
    from vfio_cxl.matrix import node
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, node.interrupted)
    node.ORPHAN_GRACE = float(sys.argv[3])
    mode = sys.argv[2]

    def body():
        if mode == "loses-first":   # as when it comes just before the main thread blocks in a lock
            signal.signal(signal.SIGINT, lambda *_: signal.signal(signal.SIGINT, node.interrupted))
        try:
            print("running", flush=True)   # inside the try: the interrupt may come as it returns
            threading.Event().wait()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            if mode == "hangs":
                threading.Event().wait()   # a stop that never ends
            raise
    node.supervised(Path(sys.argv[1]), body, int(sys.argv[4]))
''')
# The supervisor: starts the job in a session of its own (as supervise() does) and prints its
# pid; "gone" exits at once, before the job has even started its watch.
SUPERVISOR = textwrap.dedent('''
    import os, subprocess, sys, threading
    job = subprocess.Popen([sys.executable, "-c", *sys.argv[1:], str(os.getpid())], stdout=sys.stdout,
                           stderr=subprocess.STDOUT, start_new_session=True)
    print(job.pid, flush=True)
    if sys.argv[3] == "gone":
        os._exit(0)
    threading.Event().wait()
''')


def start(tmp_path, mode: str, grace: float):
    """The supervisor, its job (a ProcessId: pid reuse cannot fool the checks), the job's work
    directory, and the file that gets the supervisor's stderr."""
    workdir = tmp_path / "matrix-job-1-1"
    (workdir / "lab").mkdir(parents=True)
    (workdir / "lab" / "console.log").write_text("booting\n")
    log = tmp_path / "job.log"
    with open(log, "w") as stderr:   # the supervisor keeps its own copy
        supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, JOB, str(workdir), mode, str(grace)],
                                      stdout=subprocess.PIPE, stderr=stderr, text=True)
    job_pid = int(read_line(supervisor.stdout, 60))
    return supervisor, ProcessId.of(job_pid) or ProcessId(job_pid, -1), workdir, log   # -1: gone already


def read_line(stream, timeout: float) -> str:
    """The next line of a pipe, or an assertion after ``timeout`` s."""
    ready = select.select([stream], [], [], timeout)[0]
    assert ready, f"no line within {timeout:.0f} s"
    return stream.readline().strip()


def gone(job: ProcessId, timeout: float) -> bool:
    return not procs.wait_gone([job], timeout)


def end(supervisor, job: ProcessId) -> None:
    """Whatever a failed check left: the job, then its supervisor, killed and gone."""
    if procs.kill(job):   # its group too: it leads its session
        gone(job, 30)
    supervisor.kill()
    supervisor.wait()


def job_output(supervisor, log) -> str:
    return supervisor.communicate()[0] + log.read_text()   # to its end, and the pipe closed


@pytest.mark.parametrize("mode", ["stops", "hangs", "loses-first"])
def test_a_job_whose_supervisor_is_killed_ends_and_removes_its_work_directory(tmp_path, mode):
    supervisor, job, workdir, log = start(tmp_path, mode, grace=1.0)
    try:
        assert read_line(supervisor.stdout, 60) == "running"   # its watch is started
        supervisor.kill()                      # SIGKILL: the supervisor cannot stop its job
        supervisor.wait()
        assert gone(job, 30), f"the orphaned job (pid {job.pid}) is still running"
    finally:
        end(supervisor, job)
    out = job_output(supervisor, log)
    assert "interrupted" in out, out
    assert "supervisor (pid" in out and "is gone; stopping" in out, out
    if mode == "hangs":   # ended by the watch after its grace, saying where the main thread was
        assert "did not stop within 1 s" in out and "Current thread" not in out.split("Where it was:")[0], out
        assert "File " in out.split("Where it was:")[1], out
    else:
        assert "did not stop" not in out, out
    assert not workdir.exists(), sorted(workdir.rglob("*"))


def test_a_job_whose_supervisor_is_alive_keeps_running(tmp_path):
    supervisor, job, workdir, log = start(tmp_path, "stops", grace=1.0)
    try:
        assert read_line(supervisor.stdout, 60) == "running"
        assert not gone(job, 2.0)              # longer than the grace: nothing ends it
        assert workdir.is_dir()
        os.kill(job.pid, signal.SIGTERM)       # as the supervisor's stop does
        assert gone(job, 30)
    finally:
        end(supervisor, job)
    assert "interrupted" in job_output(supervisor, log)
    assert workdir.is_dir()                    # not orphaned: the supervisor collects it


def test_a_job_whose_supervisor_is_gone_before_its_watch_starts_ends_and_removes_its_work_directory(tmp_path):
    supervisor, job, workdir, log = start(tmp_path, "gone", grace=1.0)
    try:
        supervisor.wait()                      # gone while the job is still starting
        assert gone(job, 60), f"the orphaned job (pid {job.pid}) is still running"
    finally:
        end(supervisor, job)
    assert "is gone; stopping" in job_output(supervisor, log)
    assert not workdir.exists(), sorted(workdir.rglob("*"))
