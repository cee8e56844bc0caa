"""The pytest plugin from a user's side: a project outside this repository that only installs
vfio-cxl with pip, writes a test with ``@pytest.mark.lab("single")`` and runs pytest.

The project gets a fresh venv and a plain (non-editable) ``pip install`` of a copy of this
checkout, as a user installs a release: the wheel carries the topologies and the image recipe,
and the lab shares a copy of the installed package with its guests (its dependencies come from
pip's cache or the package index; see docs/pytest-plugin.md for the time it takes).  The inner pytest boots its own lab, so this test first stops whatever lab the
session pool holds (one lab at a time)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vfio_cxl.lab.fm import registry
from vfio_cxl.paths import REPO_ROOT



def doc_example() -> str:
    """The example test of docs/pytest-plugin.md, as a user copies it."""
    text = (REPO_ROOT / "docs" / "pytest-plugin.md").read_text()
    after = text.split("<!-- example: test_my_module.py -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


FAILING_TEST = '''\
import pytest


@pytest.mark.lab("single")
def test_fails(lab):
    assert lab.ssh("host0", "uname -r")
    assert False, "fails on purpose"
'''


def copy_checkout(dest: Path) -> Path:
    """This checkout's source, as a user would download it (no venv, no git, no build output)."""
    ignore = shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__", "build", "dist",
                                    ".pytest_cache", ".hypothesis", "_native")
    shutil.copytree(REPO_ROOT, dest, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user")
    src = copy_checkout(root / "vfio-cxl")
    venv = root / "venv"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # --no-compile: byte-compiling numpy, matplotlib and the rest is most of pip's CPU here; Python
    # compiles what the test imports on first use, as it does for any user
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", str(src), "pytest"],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    print(f"\nfresh venv + pip install vfio-cxl pytest: {time.monotonic() - t0:.1f} s")
    # Installed, not linked: the package the user's pytest imports is the venv's copy.
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import vfio_cxl; print(vfio_cxl.__file__)"],
                           capture_output=True, text=True, cwd=root, timeout=60)
    assert where.stdout.strip().startswith(str(venv / "lib")), where.stdout + where.stderr
    shutil.rmtree(src)   # nothing of the source is left to fall back on
    return venv


def run_user_pytest(venv: Path, project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-s", *args],
                          cwd=project, env=env, capture_output=True, text=True, timeout=1800)


def write_project(root: Path, fail: bool) -> Path:
    project = root / ("project-fail" if fail else "project")
    (project / "tests").mkdir(parents=True)
    if fail:
        (project / "tests" / "test_mine.py").write_text(FAILING_TEST)
    else:
        (project / "tests" / "test_my_module.py").write_text(doc_example())
    return project


def test_a_user_project_boots_a_lab_with_the_marker_and_keeps_it_on_failure(labs, user_venv, tmp_path):
    labs.close_all()   # the inner pytest boots its own lab
    before = {r.name for r in registry.records()}

    project = write_project(tmp_path, fail=False)
    t0 = time.monotonic()
    result = run_user_pytest(user_venv, project)
    print(f"user pytest (boot single, the doc's example test, down): {time.monotonic() - t0:.1f} s")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\b1 passed\b", result.stdout), result.stdout
    assert "guest kernel" in result.stdout
    assert {r.name for r in registry.records()} == before, "the passing run left a lab up"

    failing = write_project(tmp_path, fail=True)
    result = run_user_pytest(user_venv, failing, "--lab-keep")
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\b1 failed\b", result.stdout) and "fails on purpose" in result.stdout
    left = [r for r in registry.records() if r.name not in before]
    assert len(left) == 1 and left[0].fm_alive(), f"--lab-keep left {[r.name for r in left]}"
    name = left[0].name
    try:
        assert "vfio-cxl labs left up (--lab-keep)" in result.stdout, result.stdout
        ssh = re.search(rf"vfio-cxl vm ssh --lab {name} host0\b", result.stdout)
        assert ssh and f"vfio-cxl vm down {name}" in result.stdout, result.stdout
        # The printed way in works, as a user types it (the venv's vfio-cxl).
        cli = str(user_venv / "bin" / "vfio-cxl")
        reached = subprocess.run([cli, "vm", "ssh", "--lab", name, "host0", "--", "uname -r"],
                                 capture_output=True, text=True, timeout=600)
        assert reached.returncode == 0 and re.match(r"\d+\.\d+", reached.stdout), reached.stderr
    finally:
        down = subprocess.run([str(user_venv / "bin" / "vfio-cxl"), "vm", "down", name],
                              capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stderr
    assert name not in {r.name for r in registry.records()}
