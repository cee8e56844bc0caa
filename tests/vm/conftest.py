"""VM tests: real QEMU, the real guest kernel, real SSH.

One lab runs at a time (two cores under TCG): the ``labs`` pool keeps the lab
of the topology the current test needs and stops the previous one.  Tests are
ordered by topology so each boots once per session.
"""

from __future__ import annotations

import inspect
import json

import pytest

from vfio_cxl.lab import topology
from vfio_cxl.lab.image import find_image
from vfio_cxl.lab.kernel import GuestKernel, cached_lab_kernel
from vfio_cxl.lab.lab import Lab
from vfio_cxl.lab.qemu_runtime import find_runtime

TOPOLOGY_ORDER = {"single_lab": 0, "shared_lab": 1, "p2p_lab": 2, "smc_lab": 3, "pool_lab": 4,
                  "lab_kernel_lab": 5}
# Tests parametrised by topology name (the agreement test) run with the other
# tests of the same topology, so each topology boots once per session.
NAME_ORDER = {"single": 0, "shared": 1, "p2p": 2, "smc": 3, "pool": 4}


class LabPool:
    def __init__(self):
        self.runtime = find_runtime()
        self.image = find_image()
        self.current: Lab | None = None

    def get(self, name: str, kernel=None) -> Lab:
        if self.current and self.current.topology.name == name and self.current.kernel == kernel:
            return self.current
        self.close()
        lab = Lab(topology.load(name), runtime=self.runtime, image=self.image, kernel=kernel)
        self.current = lab.start()
        return lab

    def close(self) -> None:
        if self.current:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="session")
def labs():
    pool = LabPool()
    yield pool
    pool.close()


@pytest.fixture
def single_lab(labs) -> Lab:
    return labs.get("single")


@pytest.fixture
def shared_lab(labs) -> Lab:
    return labs.get("shared")


@pytest.fixture
def p2p_lab(labs) -> Lab:
    return labs.get("p2p")


@pytest.fixture
def lab_kernel_lab(labs) -> Lab:
    """``single`` booted on the lab kernel (IOMMUFD).  Built by ``VFIO_CXL_LAB_KERNEL=1 scripts/test`` when missing
    (``vfio-cxl provision --kernel lab``); a bare pytest run without it skips, saying so."""
    found = cached_lab_kernel()
    if found is None:
        pytest.skip("the lab kernel is not built: run 'vfio-cxl provision --kernel lab' (or VFIO_CXL_LAB_KERNEL=1 scripts/test)")
    return labs.get("single", GuestKernel(found / "bzImage", label="lab"))


def pytest_collection_modifyitems(config, items):
    def rank(item):
        fixtures = getattr(item, "fixturenames", ())
        ranks = [TOPOLOGY_ORDER[f] for f in fixtures if f in TOPOLOGY_ORDER]
        name = getattr(getattr(item, "callspec", None), "params", {}).get("topology_name")
        if name is not None:
            ranks.append(NAME_ORDER.get(name, len(TOPOLOGY_ORDER)))
        first = min(ranks) if ranks else len(TOPOLOGY_ORDER)
        # A test that asks for its topology's lab and for ``labs`` itself kills part of the
        # lab and closes it: it runs last of its topology, or the lab would boot again.
        args = inspect.signature(item.function).parameters if hasattr(item, "function") else {}
        kills = "labs" in args and any(f in args for f in TOPOLOGY_ORDER)
        return first, kills
    items.sort(key=rank)   # stable: file order within a topology


def guest_json(vm, command: str):
    return json.loads(vm.run(command).stdout)


@pytest.fixture
def smc_lab(labs) -> Lab:
    return labs.get("smc")


@pytest.fixture
def pool_lab(labs) -> Lab:
    return labs.get("pool")
