"""Logs that outlive a lab: copies of its run directory's logs under the cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def archive_logs(rundir: Path, logdir: Path) -> None:
    """Copy every ``*.log`` of a run directory into ``logdir``, keeping the layout
    (``<vm>/console.log``, ``<vm>/qemu.log``, ``<vm>/gpu.log``)."""
    if not rundir.is_dir():
        return
    logdir.mkdir(parents=True, exist_ok=True)
    for log in rundir.rglob("*.log"):
        dest = logdir / log.relative_to(rundir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(log, dest)
        except OSError:
            pass   # a log that vanished meanwhile has nothing to keep
    os.utime(logdir)   # the newest lab's logs are pruned last
