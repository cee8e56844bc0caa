"""A topology is loaded once per process; a child gets its file and SHA-256 and refuses a file
that changed (vfio_cxl.lab.topology.handoff / load_handed), e.g. the detached fabric manager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import topology
from vfio_cxl.paths import REPO_ROOT


def copy_of(name: str, directory: Path) -> Path:
    path = directory / f"{name}.toml"
    path.write_bytes(topology.resolve(name).read_bytes())
    return path


def test_a_handed_topology_is_the_one_loaded(tmp_path):
    topo = topology.load(str(copy_of("fabric", tmp_path)))
    option, path, hash_option, sha256 = topology.handoff(topo)
    assert (option, hash_option, Path(path)) == ("--topology", "--topology-sha256", tmp_path / "fabric.toml")
    handed = topology.load_handed(Path(path), sha256)
    assert handed == topo and handed.source == topo.source
    assert topology.handoff(handed) == topology.handoff(topo)


def test_a_topology_from_the_lab_directory_keeps_its_short_source():
    topo = topology.load("fabric")
    assert topo.source == "fabric.toml"
    assert topology.load_handed(*_args(topology.handoff(topo))).source == "fabric.toml"


def _args(argv: list[str]) -> tuple[Path, str]:
    return Path(argv[1]), argv[3]


def test_a_changed_file_is_refused_with_both_hashes(tmp_path):
    path = copy_of("fabric", tmp_path)
    topo = topology.load(str(path))
    path.write_text(path.read_text() + "\n# edited\n")
    with pytest.raises(LabError) as err:
        topology.load_handed(*_args(topology.handoff(topo)))
    assert err.value.what.startswith(f"topology file {path} changed after it was loaded (SHA-256 ")
    assert "expected " + topology.handoff(topo)[3][:12] in err.value.what
    assert "put the file back as it was" in err.value.fix


def test_a_missing_file_is_refused(tmp_path):
    path = copy_of("fabric", tmp_path)
    topo = topology.load(str(path))
    path.unlink()
    with pytest.raises(LabError, match=f"topology file {path}: No such file or directory"):
        topology.load_handed(*_args(topology.handoff(topo)))


def test_a_topology_parsed_from_text_cannot_be_handed_on():
    topo = topology.parse(topology.resolve("single").read_text(), "single")
    with pytest.raises(LabError, match="topology single was not loaded from a file"):
        topology.handoff(topo)


def test_a_file_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(b"\xff\xfe[[vm]]\n")
    with pytest.raises(LabError, match="not UTF-8 text"):
        topology.load(str(path))


def test_the_fabric_manager_refuses_a_topology_that_changed(tmp_path):
    """`python -m vfio_cxl.lab.fm serve` (what `vm up --detach` starts) checks the hash before it
    starts anything, and answers its launcher with the error."""
    path = copy_of("single", tmp_path)
    argv = topology.handoff(topology.load(str(path)))
    path.write_text(path.read_text() + "\n")
    out = subprocess.run([sys.executable, "-m", "vfio_cxl.lab.fm", "serve", "--name", "x", "--logdir",
                          str(tmp_path), *argv], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 1, out.stderr
    kind, _, data = out.stdout.strip().partition(": ")
    assert kind == "error" and "changed after it was loaded" in json.loads(data)["what"]
