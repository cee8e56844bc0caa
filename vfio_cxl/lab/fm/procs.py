"""Processes by pid, safely: identity across pid reuse, exit via pidfd, descendants.

A pid alone names a process only while it lives; a recorded pid is paired with
the process's start time (``/proc/PID/stat`` field 22) so that a later process
that happens to get the same pid is never mistaken for it, let alone killed.
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])   # field 22 overall; fields[0] is field 3 (state)


def has_exited(pid: int) -> bool:
    """True for a zombie (Z) or a task being torn down (X: seen for QEMU in bwrap's dying
    pid namespace); both still have /proc entries but run nothing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] in "ZX"


@dataclass(frozen=True)
class ProcessId:
    """A pid and the start time that makes it unique."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> "ProcessId | None":
        start = start_time(pid)
        return cls(pid, start) if start is not None else None

    def alive(self) -> bool:
        return start_time(self.pid) == self.start and not has_exited(self.pid)

    def to_json(self) -> dict:
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, data: dict) -> "ProcessId":
        return cls(int(data["pid"]), int(data["start"]))


def children(pid: int) -> list[int]:
    kids = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return kids
    for task in tasks:
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for kid in children(todo.pop()):
            found.append(kid)
            todo.append(kid)
    return found


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def find_qemu(pid: int) -> int | None:
    """The qemu-system process at or below ``pid`` (QEMU itself, or QEMU inside bwrap)."""
    for candidate in (pid, *descendants(pid)):
        if comm(candidate).startswith("qemu-system"):
            return candidate
    return None


def processes_mentioning(text: str, exclude: set[int] = frozenset()) -> list[int]:
    """Pids whose command line contains ``text`` (cleanup's safety net, never supervision)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) not in exclude and int(proc.name) != os.getpid():
            if text in cmdline(int(proc.name)) and not has_exited(int(proc.name)):
                found.append(int(proc.name))
    return found


def kill(ident: ProcessId, group: bool = True) -> bool:
    """SIGKILL the process (and its process group, if it leads one); False if it was already gone."""
    if not ident.alive():
        return False
    try:
        if group and os.getpgid(ident.pid) == ident.pid:
            os.killpg(ident.pid, signal.SIGKILL)
        else:
            os.kill(ident.pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def terminate(ident: ProcessId) -> None:
    """SIGTERM the process if it is still the one we mean."""
    if ident.alive():
        try:
            os.kill(ident.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def wait_gone(idents: list[ProcessId], timeout: float) -> list[ProcessId]:
    """Wait until every process has exited (pidfd; works for non-children); returns those left."""
    deadline = time.monotonic() + timeout
    left = []
    for ident in idents:
        if not ident.alive():
            continue
        try:
            fd = os.pidfd_open(ident.pid)
        except ProcessLookupError:
            continue
        try:
            if start_time(ident.pid) != ident.start:
                continue   # the pid was reused after we looked: ours is gone
            while not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]:
                if time.monotonic() >= deadline:
                    break
            # A pidfd is readable when the process exits; a non-child stays a zombie
            # only until its own parent reaps it.
            if ident.alive():
                left.append(ident)
        finally:
            os.close(fd)
    return left
