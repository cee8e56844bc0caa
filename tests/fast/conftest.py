"""Fixtures shared by the fast tests."""

import pytest

from vfio_cxl.lab import topology
from vfio_cxl.lab.lab import Lab


@pytest.fixture
def vm(tmp_path):
    """The ``single`` topology's VM, planned under ``tmp_path`` with its run directory made; a
    test sets ``vm.process`` to a stand-in for QEMU, which is killed at the end if still up."""
    vm = Lab(topology.load("single")).plan(tmp_path)[0]
    vm.res.rundir.mkdir()
    yield vm
    if vm.process and vm.process.poll() is None:
        vm.process.kill()
        vm.process.wait()
