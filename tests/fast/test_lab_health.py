"""A pooled lab is handed to the next test only when it is as it booted (Lab.unhealthy): its
QEMUs and device servers running, each guest answering with its regions' devdax devices and its
GPUs.  The guest here is the loopback SSH server (its "guest" is this host's bash and /sys)."""

import subprocess
from pathlib import Path

import pytest
from ssh_loopback import LoopbackSsh

from vfio_cxl.lab import topology
from vfio_cxl.lab.lab import Lab


class Vm:
    def __init__(self, name, shell, regions):
        self.name, self.shell, self.regions = name, shell, regions
        self.process = subprocess.Popen(["sleep", "60"])

    def run(self, command, **kwargs):
        return self.shell.run(command, **kwargs)


@pytest.fixture
def lab(tmp_path):
    server = LoopbackSsh(tmp_path)
    lab = Lab(topology.load("single"), gpu=False)   # no GPU: the count to match is 0
    present = next(p.name for p in Path("/dev").iterdir() if p.name.startswith("null"))
    lab.vms = {"host0": Vm("host0", server.shell(), {"r0": {"dax": present}})}
    yield lab
    for vm in lab.vms.values():
        vm.process.kill()
        vm.process.wait()
    server.close()


def test_a_lab_as_it_booted_is_healthy(lab):
    assert lab.unhealthy() is None


def test_a_missing_devdax_device_is_named(lab):
    lab.vms["host0"].regions["r0"]["dax"] = "dax9.9"
    assert lab.unhealthy() == "VM host0: no /dev/dax9.9"


def test_a_gpu_count_off_by_one_is_named(lab):
    lab.gpu = True   # single's gpu0 is host0's: one expected, this host has none
    assert lab.unhealthy() == "VM host0: 0 GPUs, not 1"


def test_an_exited_qemu_is_named(lab):
    lab.vms["host0"].process.kill()
    lab.vms["host0"].process.wait()
    assert lab.unhealthy() == "VM host0's QEMU has exited"


def test_a_stopped_lab_is_not_healthy():
    assert Lab(topology.load("single")).unhealthy() == "not running"
