"""A plain (non-editable) ``pip install`` carries everything the lab reads at run time.

Builds the wheel from a copy of the source as pip does for a user (an isolated build with the
build backend pyproject.toml names), checks that every non-Python file of the package is in it
with its mode (the guest image's init scripts are executable), then installs it with
``pip install --target`` and, from outside the checkout, loads the shipped topology ``single``
(the error a wheel without its data gave: "unknown topology 'single'"), the image recipe and
the lab kernel's config, and makes the copy of the package a lab shares into its guests."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import vfio_cxl
from vfio_cxl.lab import image, kernel, topology
from vfio_cxl.lab.recipe import recipe_hash
from vfio_cxl.paths import DATA, REPO_ROOT

PACKAGE_DIR = Path(vfio_cxl.__file__).parent
SKIP = shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__", "build", "dist", ".pytest_cache",
                              ".hypothesis", "_native")


def package_data() -> dict[str, int]:
    """Every file a wheel must carry that is not Python source: its path in the wheel, and its mode.
    The package's own non-Python files, and the run-time data the checkout keeps outside it
    (paths.DATA: qemu/topologies, images, qemu/kernel), which a wheel carries at vfio_cxl/_data/NAME."""
    out = {}
    for path in PACKAGE_DIR.rglob("*"):
        rel = path.relative_to(PACKAGE_DIR.parent)
        if path.is_file() and path.suffix not in (".py", ".pyc") and not {"__pycache__", "_native"} & set(rel.parts):
            out[rel.as_posix()] = path.stat().st_mode
    for name, source in DATA.items():
        for path in (REPO_ROOT / source).rglob("*"):
            if path.is_file():
                out[f"vfio_cxl/_data/{name}/{path.relative_to(REPO_ROOT / source).as_posix()}"] = path.stat().st_mode
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "vfio-cxl"
    shutil.copytree(REPO_ROOT, src, ignore=SKIP)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist"),
                            str(src)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (whl,) = (root / "dist").glob("vfio_cxl-*.whl")
    return whl


def test_the_package_data_the_lab_reads_is_known():
    data = package_data()
    assert "vfio_cxl/_data/topologies/single.toml" in data
    assert "vfio_cxl/_data/images/guest.toml" in data and "vfio_cxl/_data/images/rootfs/sbin/vfio-cxl-init" in data
    assert "vfio_cxl/_data/kernel-config/lab.config" in data and "vfio_cxl/guest/cacheline.c" in data
    # a checkout reads them where the repository keeps them
    assert topology.TOPOLOGY_DIR == REPO_ROOT / "qemu/topologies" and image.IMAGES_DIR == REPO_ROOT / "images"
    assert kernel.FRAGMENT == REPO_ROOT / "qemu/kernel/lab.config"


def test_the_wheel_carries_every_data_file_with_its_mode(wheel):
    with zipfile.ZipFile(wheel) as whl:
        infos = {i.filename: i for i in whl.infolist()}
    missing = sorted(set(package_data()) - set(infos))
    assert not missing, f"not in the wheel: {missing}"
    for name, mode in package_data().items():
        shipped = infos[name].external_attr >> 16
        assert bool(shipped & stat.S_IXUSR) == bool(mode & stat.S_IXUSR), name
    sources = {p.relative_to(PACKAGE_DIR.parent).as_posix() for p in PACKAGE_DIR.rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sources <= set(infos)
    assert not [n for n in infos if n.startswith(("tests/", "selftests/", "docs/"))]


def test_an_installed_wheel_finds_its_topologies_recipe_and_guest_source(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from vfio_cxl import paths\n"
        "from vfio_cxl.lab import image, kernel, topology\n"
        "from vfio_cxl.lab.recipe import recipe_hash\n"
        "topo = topology.load('single')\n"
        "source = paths.guest_source(Path(sys.argv[1]))\n"
        "print(json.dumps({'package': paths.PACKAGE_DIR.as_posix(), 'checkout': paths.is_checkout(),\n"
        "    'vms': [vm.name for vm in topo.vms], 'available': topology.available(),\n"
        "    'topologies': topology.TOPOLOGY_DIR.as_posix(), 'image': image.image_path().name, 'kernel': recipe_hash(kernel.LAB_RECIPE, kernel.FRAGMENT),\n"
        "    'source': source.as_posix(), 'guest_cli': (source / 'vfio_cxl/guest/cmd/cli.py').is_file(),\n"
        "    'only_the_package': sorted(p.name for p in source.iterdir())}))\n")
    rundir = tmp_path / "run"
    rundir.mkdir()
    out = subprocess.run([sys.executable, "-c", script, str(rundir)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin",
                                            "VFIO_CXL_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["package"] == (target / "vfio_cxl").as_posix() and got["checkout"] is False
    assert got["topologies"] == (target / "vfio_cxl/_data/topologies").as_posix()
    assert got["vms"] == ["host0"] and set(got["available"]) == set(topology.available())
    # the same recipe, so the same cached guest image and lab kernel as the checkout's
    assert got["image"] == image.image_path().name
    assert got["kernel"] == recipe_hash(kernel.LAB_RECIPE, kernel.FRAGMENT)
    # the guest gets a copy of the package alone, not site-packages with the host's cffi
    assert got["source"] == (rundir / "guest-source").as_posix()
    assert got["guest_cli"] and got["only_the_package"] == ["vfio_cxl"]
