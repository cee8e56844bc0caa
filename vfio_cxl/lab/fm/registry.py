"""Which labs are running: one JSON record per lab under ``<cache>/labs/``.

The fabric manager writes its lab's record (atomically, by rename) when it
starts and whenever a process it owns starts; it removes the record as the
last step of a clean stop.  A record whose fabric manager is gone (its pid
exited, or was reused by another process) is *stale*: ``vfio-cxl vm ls``
shows it as ``fm-dead`` and ``vfio-cxl vm down`` cleans it up.

Each lab's logs live in ``<cache>/logs/<lab name>/`` and outlive it; the
newest ``KEEP_LOGS`` log directories of stopped labs are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...errors import LabError
from ...paths import MANAGED_MARKER, cache_root
from .procs import ProcessId

RECORD_VERSION = 1
KEEP_LOGS = 10
RUNDIR_MARKER = MANAGED_MARKER   # in a lab's run directory: "vfio-cxl vm down" owns its cleanup
_NAME = re.compile(r"^([a-z][a-z0-9-]*)-(\d+)$")


def labs_dir() -> Path:
    path = cache_root() / "labs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def logs_root() -> Path:
    path = cache_root() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class LabRecord:
    name: str
    topology: str
    rundir: str
    logdir: str
    fm: dict                                  # ProcessId.to_json() of the fabric manager
    created: float                            # unix time
    state: str = "starting"                   # starting | running | stopping (as last written)
    processes: dict[str, dict] = field(default_factory=dict)   # role -> ProcessId json
    vms: dict[str, dict] = field(default_factory=dict)         # vm -> {"ssh_port": N}
    version: int = RECORD_VERSION

    @property
    def socket(self) -> Path:
        return Path(self.rundir) / "fm.sock"

    @property
    def path(self) -> Path:
        return labs_dir() / f"{self.name}.json"

    def fm_id(self) -> ProcessId:
        return ProcessId.from_json(self.fm)

    def fm_alive(self) -> bool:
        return self.fm_id().alive()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def load(path: Path) -> LabRecord | None:
    try:
        data = json.loads(path.read_text())
        if data.get("version") != RECORD_VERSION:
            return None
        return LabRecord(**data)
    except (OSError, ValueError, TypeError):
        return None


def records() -> list[LabRecord]:
    found = [load(p) for p in sorted(labs_dir().glob("*.json"))]
    return sorted((r for r in found if r), key=lambda r: r.created)


def find(name: str | None) -> LabRecord:
    """The lab called ``name``; with no name, the only lab there is."""
    labs = records()
    if name is None:
        if not labs:
            raise LabError("no lab is running", "start one with: vfio-cxl vm up TOPOLOGY --detach")
        if len(labs) > 1:
            raise LabError(f"{len(labs)} labs are running: {', '.join(r.name for r in labs)}",
                           "name one with --lab NAME (see vfio-cxl vm ls)")
        return labs[0]
    for record in labs:
        if record.name == name:
            return record
    raise LabError(f"no lab named {name!r}",
                   f"running labs: {', '.join(r.name for r in labs) or 'none'} (see vfio-cxl vm ls)")


NAME_MAX = 40   # characters of a lab name's topology part


def lab_stem(topology: str) -> str:
    """The topology part of a lab name: ``[a-z][a-z0-9-]*``, at most NAME_MAX characters.  A
    topology file's stem may be anything (``my_lab``, ``Fabric``, ``lab.v2``): lower case,
    every run of other characters becomes one ``-``, and a stem that does not start with a
    letter gets ``lab-`` in front (``my_lab.toml`` -> ``my-lab-1``, ``2x.toml`` -> ``lab-2x-1``)."""
    stem = re.sub(r"[^a-z0-9]+", "-", topology.lower()).strip("-")
    if not stem[:1].isalpha():
        stem = f"lab-{stem}".rstrip("-")
    return stem[:NAME_MAX].rstrip("-")


def reserve_name(topology: str) -> tuple[str, Path]:
    """A fresh lab name ``<topology>-<n>`` and its (new, empty) log directory.

    ``<topology>`` is :func:`lab_stem` of the topology's name.  ``n`` is one more than any
    number in use by a record or a kept log directory, so a name never repeats while its logs
    are kept.  The log directory's exclusive mkdir is the reservation, so two ``vm up`` at once
    cannot take the same name (the loser takes the next number).
    """
    prune_logs()
    stem = lab_stem(topology)
    used = [0]
    for path in [*labs_dir().glob("*.json"), *logs_root().iterdir()]:
        match = _NAME.match(path.stem if path.suffix == ".json" else path.name)
        if match:
            used.append(int(match.group(2)))
    for n in range(max(used) + 1, max(used) + 1000):
        name = f"{stem}-{n}"
        logdir = logs_root() / name
        try:
            logdir.mkdir()
        except FileExistsError:
            continue
        return name, logdir
    raise LabError(f"no free lab name {stem}-N in {logs_root()} after 1000 tries",
                   f"remove old log directories there (vfio-cxl vm ls shows the running labs)")


def prune_logs(keep: int = KEEP_LOGS) -> None:
    """Remove the log directories of all but the newest ``keep`` stopped labs."""
    running = {r.name for r in records()}
    stopped = [d for d in logs_root().iterdir() if d.is_dir() and d.name not in running]
    stopped.sort(key=lambda d: d.stat().st_mtime, reverse=True)
    for old in stopped[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def uptime(record: LabRecord) -> float:
    return max(time.time() - record.created, 0.0)
