"""Bad input to the lab fails early, with one clear line, and starts nothing.

Where these tests fake something (the QEMU device list, the effective uid) it
is to test our own checks, not the kernel or QEMU."""

import os
import socket
import subprocess

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import apt, topology
from vfio_cxl.lab.lab import Lab, remove_stale_rundirs
from vfio_cxl.lab.qemu_runtime import QemuRuntime


def test_taken_port_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("VFIO_CXL_RUNDIR", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LabError, match=f"port {port} on 127.0.0.1 is already in use"):
            Lab(topology.load("single"), ssh_port=port).start()
    assert list(tmp_path.iterdir()) == []


def test_qemu_missing_features_is_named(monkeypatch):
    runtime = QemuRuntime(tree=None, version=(11, 1, 3))
    monkeypatch.setattr(runtime, "devices", lambda: 'name "cxl-type3"\nname "intel-iommu"\n')
    with pytest.raises(LabError, match="lacks devices: vfio-user-pci"):
        runtime.check_features()


def test_old_qemu_is_named():
    with pytest.raises(LabError, match="too old"):
        QemuRuntime(tree=None, version=(7, 2, 0)).check_features()


def test_host_packages_without_root(monkeypatch):
    monkeypatch.setattr(apt.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(apt, "missing_host_packages", lambda names: ["mmdebstrap"])
    with pytest.raises(LabError) as err:
        apt.ensure_host_packages(["mmdebstrap"])
    assert "run as root" in str(err.value) and "sudo apt-get install mmdebstrap" in str(err.value)


def test_a_dead_labs_directory_is_removed_by_the_next_lab(tmp_path, monkeypatch):
    monkeypatch.setenv("VFIO_CXL_RUNDIR", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / "vfio-cxl-stale"
    stale.mkdir()
    (stale / "lab.pid").write_text(str(dead.pid))
    alive = tmp_path / "vfio-cxl-alive"
    alive.mkdir()
    (alive / "lab.pid").write_text(str(os.getpid()))
    remove_stale_rundirs()
    assert not stale.exists() and alive.exists()
