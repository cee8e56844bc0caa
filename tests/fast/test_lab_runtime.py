"""QEMU runtime: version parsing and the bwrap wrapper's layout."""

from pathlib import Path

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab.qemu_runtime import QemuRuntime, parse_version


def test_parse_version():
    assert parse_version("QEMU emulator version 11.1.3 (Debian 1:11.1.3+ds-1~bpo13+1)") == (11, 1, 3)
    with pytest.raises(LabError):
        parse_version("no version here")


def test_bwrap_binds_the_tree_and_only_the_named_paths(tmp_path):
    tree = tmp_path / "tree"
    for d in ("usr", "etc", "var", "proc", "tmp"):
        (tree / d).mkdir(parents=True)
    (tree / "bin").symlink_to("usr/bin")
    runtime = QemuRuntime(tree=tree)
    cmd = runtime.command(["-version"], rw=[Path("/run/lab")], ro=[Path("/img")], chdir=Path("/run/lab"),
                          env={"TMPDIR": "/run/lab"})
    assert cmd[0] == "bwrap"
    pairs = list(zip(cmd, cmd[1:], cmd[2:]))
    assert ("--ro-bind", str(tree / "usr"), "/usr") in pairs
    assert ("--symlink", "usr/bin", "/bin") in pairs
    assert ("--bind", "/run/lab", "/run/lab") in pairs
    assert ("--ro-bind", "/img", "/img") in pairs
    assert str(tree / "proc") not in cmd and str(tree / "tmp") not in cmd
    assert "--die-with-parent" in cmd
    assert cmd[-2:] == ["/usr/bin/qemu-system-x86_64", "-version"]


def test_system_qemu_runs_directly():
    assert QemuRuntime(tree=None).command(["-version"]) == ["qemu-system-x86_64", "-version"]
