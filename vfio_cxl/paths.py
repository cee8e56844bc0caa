"""Where the lab keeps its files.

Heavy artefacts (QEMU runtime, guest image) are cached under
``~/.cache/vfio-cxl`` (or ``$VFIO_CXL_CACHE``), each in a directory named after
the hash of its recipe, so a changed recipe builds anew and an unchanged one
is reused.  Per-lab runtime files (sockets, console logs, CXL backing files)
live in a fresh private directory per lab, removed when the lab stops.
"""

import hashlib
import os
import shutil
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent   # the checkout; for an installed (non-editable) package, site-packages


# What the lab reads at run time besides Python: where a checkout keeps it, by name.  A wheel
# carries a copy of each under vfio_cxl/_data/NAME (setup.py copies them at build time), so a
# plain `pip install` works without the checkout.
DATA = {"topologies": "qemu/topologies", "images": "images", "kernel-config": "qemu/kernel"}


def is_checkout() -> bool:
    """The package runs from a source checkout (``pip install -e``, or ``PYTHONPATH``), not from a wheel."""
    return (REPO_ROOT / "pyproject.toml").is_file()


def data_dir(name: str) -> Path:
    """The directory of the run-time data ``name`` (a key of DATA): the checkout's, or the wheel's copy."""
    return REPO_ROOT / DATA[name] if is_checkout() else PACKAGE_DIR / "_data" / name


def guest_source(rundir: Path) -> Path:
    """The directory the lab shares read-only into its VMs as /opt/vfio-cxl (``vfio_cxl`` inside).

    A checkout is shared as it is (the guest's 9p mount caches what it read, cache=loose:
    boot again to be sure an edit runs).  An installed package
    is copied into the lab's run directory first: its parent, site-packages, also holds the
    host's own compiled packages (cffi, ...), which must not shadow the guest's."""
    if is_checkout():
        return REPO_ROOT
    dest = rundir / "guest-source"
    shutil.copytree(PACKAGE_DIR, dest / PACKAGE_DIR.name,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_native"), dirs_exist_ok=True)
    return dest


def guest_bytecode_dir() -> Path:
    """Where the guests' Python keeps the bytecode of the shared source, shared writable into
    every VM as /var/cache/vfio-cxl/pyc: ``VFIO_CXL_PYC`` (see ``vfio_cxl.guest.bytecode``; the
    standard library keeps its own ``__pycache__`` on the guest's disk).

    The source reaches the guests over a read-only 9p share, where Python cannot write a
    ``__pycache__``: without this every guest command compiles the package again (about
    2.5 s under TCG).  One directory per shared source tree (keyed by its path here), for
    every lab and every boot: the first guest command to import a module writes its
    bytecode, later ones in any VM of any lab read it.  Python itself decides whether a
    file here is still good -- the interpreter's magic number and the source's mtime and
    size are in every ``.pyc`` -- so an edited source or another Python is compiled anew,
    never served stale.  The lab's guests all write here: they trust each other, as they
    share the checkout and the CXL memory."""
    key = hashlib.sha256(str(PACKAGE_DIR).encode()).hexdigest()[:16]
    return cache_root() / "guest-pyc" / key


def cache_root() -> Path:
    env = os.environ.get("VFIO_CXL_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "vfio-cxl"
    root.mkdir(parents=True, exist_ok=True)
    return root


# Shared objects built on the host from C sources in the package (guest/cacheline.c), never
# committed: the guests have no compiler but import the checkout, so they load the host's build.
NATIVE_DIR = PACKAGE_DIR / "_native"


# A run directory holding this file belongs to a fabric-manager lab: `vfio-cxl vm down`
# keeps its logs, then removes it; lab.remove_stale_rundirs() leaves it alone.
MANAGED_MARKER = "fm.json"


def runtime_root() -> Path:
    """Parent of per-lab run directories (short: UNIX socket paths are limited to 107 bytes)."""
    env = os.environ.get("VFIO_CXL_RUNDIR")
    root = Path(env) if env else Path("/tmp")
    root.mkdir(parents=True, exist_ok=True)
    return root
