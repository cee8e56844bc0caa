"""The guest's bytecode cache (``VFIO_CXL_PYC``, vfio_cxl.guest.bytecode): the package's modules
keep their bytecode there, every other module (the standard library) beside its own source; an
edited source is compiled anew; a cache that cannot be written costs a compile, never an error.
Real Python processes over a copy of the package (the guest sees it on a read-only share)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vfio_cxl

PROBE = "import json, vfio_cxl.guest.vfio.backend; print(vfio_cxl.guest.vfio.backend.IOMMUFD_PATH)"


@pytest.fixture
def source(tmp_path) -> Path:
    """A copy of the package with no bytecode in it, as the guest's share holds it."""
    root = tmp_path / "src"
    shutil.copytree(Path(vfio_cxl.__file__).parent, root / "vfio_cxl",
                    ignore=shutil.ignore_patterns("__pycache__", "_native"))
    return root


def start(source: Path, cache: Path, code: str = PROBE) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(source), VFIO_CXL_PYC=str(cache))
    out = subprocess.run([sys.executable, "-c", code], cwd=cache.parent, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def cached(cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in cache.rglob("*.pyc")}


def test_the_package_is_cached_apart_and_the_standard_library_is_not(source, tmp_path):
    cache = tmp_path / "pyc"
    assert start(source, cache) == "/dev/iommu"
    names = cached(cache)
    tag = sys.implementation.cache_tag
    assert {f"backend.{tag}.pyc", f"bind.{tag}.pyc"} <= set(names)
    assert not any(name.startswith(("json", "decoder", "encoder")) for name in names)   # json's own
    # beside the shared source at most the package's own __init__ (loaded before its finder
    # exists; on the guest's read-only share it is compiled at each start, all 70 lines of it)
    beside = [p.relative_to(source).as_posix() for p in source.rglob("*.pyc")]
    assert beside in ([], [f"vfio_cxl/__pycache__/__init__.{tag}.pyc"]), beside
    assert start(source, cache) == "/dev/iommu"
    assert cached(cache) == names   # the second start read every file, wrote none


def test_an_edited_source_is_compiled_anew(source, tmp_path):
    cache = tmp_path / "pyc"
    start(source, cache)
    backend = source / "vfio_cxl/guest/vfio/backend.py"
    text = backend.read_text().replace('IOMMUFD_PATH = "/dev/iommu"', 'IOMMUFD_PATH = "/dev/iommu-edited"')
    assert "iommu-edited" in text
    backend.write_text(text)
    assert start(source, cache) == "/dev/iommu-edited"


def test_a_cache_that_cannot_be_written_compiles_and_runs(source, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")   # a "directory" that is a file: nothing can be written below it
    assert start(source, blocked) == "/dev/iommu"


def test_without_the_variable_nothing_changes(source, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VFIO_CXL_PYC"))}
    env["PYTHONPATH"] = str(source)
    code = "import sys, vfio_cxl; print(len(sys.path_hooks))"
    bare = subprocess.run([sys.executable, "-c", "import sys; print(len(sys.path_hooks))"], env=env,
                          capture_output=True, text=True, check=True).stdout
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout == bare
