"""Where the lab keeps its files.

Heavy artefacts (QEMU runtime, guest image) are cached under
``~/.cache/vfio-cxl`` (or ``$VFIO_CXL_CACHE``), each in a directory named after
the hash of its recipe, so a changed recipe builds anew and an unchanged one
is reused.  Per-lab runtime files (sockets, console logs, CXL backing files)
live in a fresh private directory per lab, removed when the lab stops.
"""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_root() -> Path:
    env = os.environ.get("VFIO_CXL_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "vfio-cxl"
    root.mkdir(parents=True, exist_ok=True)
    return root


def runtime_root() -> Path:
    """Parent of per-lab run directories (short: UNIX socket paths are limited to 107 bytes)."""
    env = os.environ.get("VFIO_CXL_RUNDIR")
    root = Path(env) if env else Path("/tmp")
    root.mkdir(parents=True, exist_ok=True)
    return root
