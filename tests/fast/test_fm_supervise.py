"""Process supervision (vfio_cxl.lab.fm.supervise): a pidfd per child reports its exit in one
loop turn, a child already gone is reported at once, and the record keeps process ids."""

from __future__ import annotations

import selectors
import subprocess
import sys
from types import SimpleNamespace

from vfio_cxl.lab.fm.state import Child
from vfio_cxl.lab.fm.supervise import Supervisor


def supervisor():
    record = SimpleNamespace(processes={}, saves=0)
    record.save = lambda: setattr(record, "saves", record.saves + 1)
    exited: list[tuple[str, int]] = []
    sup = Supervisor(record, lambda child: exited.append((child.name, child.returncode)))
    return sup, record, exited


def test_an_exit_is_seen_through_the_pidfd():
    sup, _, exited = supervisor()
    sup.sel = selectors.DefaultSelector()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"],
                            stdin=subprocess.PIPE)
    child = Child("gpu", "gpu0", proc)
    sup.watch(child)
    assert child.pidfd is not None and sup.sel.select(timeout=0) == []
    proc.stdin.close()   # it exits now
    [(key, _)] = sup.sel.select(timeout=30)
    assert key.data == ("exit", child)
    sup.ready(child, key.fd)
    assert exited == [("gpu0", 3)] and child.pidfd is None
    assert sup.sel.get_map() == {}
    sup.sel.close()


def test_a_stale_pidfd_of_a_replaced_server_is_ignored():
    sup, _, exited = supervisor()
    child = Child("gpu", "gpu0", None, pidfd=5)
    sup.ready(child, 4)   # the worker gave it a fresh server (a new pidfd) meanwhile
    assert exited == []


def test_a_child_gone_before_it_is_watched_is_reported_at_once():
    sup, _, exited = supervisor()
    sup.sel = selectors.DefaultSelector()
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    proc.wait()   # reaped: pidfd_open fails
    sup.watch(Child("vm", "a", proc))
    assert exited == [("a", 4)]
    sup.sel.close()


def test_before_the_loop_nothing_is_watched():
    sup, _, exited = supervisor()
    child = Child("gpu", "gpu0", subprocess.Popen([sys.executable, "-c", "pass"]))
    sup.watch(child)
    assert child.pidfd is None and exited == []
    child.popen.wait()


def test_note_keeps_the_process_ids_for_vm_down():
    sup, record, _ = supervisor()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        sup.note(Child("vm", "a", proc, qemu_pid=proc.pid), save=False)
        assert set(record.processes) == {"vm:a", "qemu:a"} and record.processes["vm:a"]["pid"] == proc.pid
        assert record.saves == 0
        sup.note(Child("gpu", "gpu0", None))   # no process: nothing to keep
        assert record.saves == 0
    finally:
        proc.stdin.close()
        proc.wait()
