"""What a run costs in labs and guest commands, counted across processes.

With ``$VFIO_CXL_USAGE_LOG`` naming an existing file, every lab boot (``Lab.start``) and every guest
command the host runs (``GuestShell``, ``vfio-cxl vm ssh``) in this process and its children
appends one JSON line to it; nothing is written without it.  The project's own test session
sets it and prints a summary at its end (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import re
from collections import Counter

ENV = "VFIO_CXL_USAGE_LOG"
# a guest command that starts the guest's Python: python3 itself, or the image's vfio-cxl and
# vfio-cxl-m wrappers (a fork of the warm server, once it runs)
_PYTHON = re.compile(r"(^|[\s;&|(`'\"=])(python3?|vfio-cxl|vfio-cxl-m)(\s|$)")


def record(kind: str, detail: str) -> None:
    """One line for a ``boot`` (detail: the topology), a ``guest`` command (detail: the command),
    a ``reboot`` of a pooled lab (detail: why), or the seconds a lab took to come up (``booted``:
    until SSH and its regions) or to stop (``stopped``)."""
    path = os.environ.get(ENV)
    if not path:
        return
    # pytest names the running test in the environment, which its children inherit
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    line = json.dumps({"kind": kind, "detail": detail[:300], "pid": os.getpid(), "test": test}) + "\n"
    try:   # one write of one line with O_APPEND: lines of several processes never interleave;
        # no O_CREAT: a process that outlives the session (a lab left up) makes no stray file
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass   # counting must never fail a lab


def starts_python(command: str) -> bool:
    return bool(_PYTHON.search(command))


def summary(path: str) -> dict:
    """{"boots": Counter(topology), "boots_by_file": Counter(test file), "guest_commands": N,
    "guest_python": N, "reboots": [why], "boot_s": S, "stop_s": S} of a usage log (a reboot: a
    pooled lab that a test left changed, booted again; boot_s and stop_s: the seconds every lab
    took to come up and to stop, summed)."""
    boots: Counter = Counter()
    by_file: Counter = Counter()
    reboots: list[str] = []
    commands = python = 0
    seconds = {"booted": 0.0, "stopped": 0.0}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("kind") == "boot":
            boots[entry.get("detail", "?")] += 1
            by_file[(entry.get("test") or "?").split("::", 1)[0].rsplit("/", 1)[-1]] += 1
        elif entry.get("kind") == "reboot":
            reboots.append(entry.get("detail", "?"))
        elif entry.get("kind") in seconds:
            try:
                seconds[entry["kind"]] += float(entry.get("detail", 0))
            except ValueError:
                pass
        elif entry.get("kind") == "guest":
            commands += 1
            python += starts_python(entry.get("detail", ""))
    return {"boots": boots, "boots_by_file": by_file, "guest_commands": commands, "guest_python": python,
            "reboots": reboots, "boot_s": seconds["booted"], "stop_s": seconds["stopped"]}
