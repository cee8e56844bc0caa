"""VM tests: real QEMU, the real guest kernel, real SSH.

One lab runs at a time per worker (two cores under TCG): the ``labs`` pool keeps the
lab of the topology the current test needs and stops the previous one.  Tests are
ordered by topology so each boots once per session.  scripts/test runs the tests of
registered labs (tests/xdist_units.py REGISTERED: detached, the plugin's ``lab``,
the documented commands) on one worker and the in-process labs on another, so two
labs run side by side; a test that asks for a registered lab's fixture in another
file is refused at collection.

A boot costs tens of seconds, so a new VM test reuses a lab that is booted anyway:
- ask for a topology's fixture (``single_lab``, ``shared_lab``, ``p2p_lab``, ``smc_lab``,
  ``pool_lab``, ``fabric_lab``, ``lab_kernel_lab``; a new one goes in TOPOLOGY_ORDER and,
  for the agreement test, NAME_ORDER), never ``Lab(...).start()`` for one check;
- a test that kills part of its lab or stops it asks for that fixture *and* ``labs``: it then
  runs last of its topology; it ends with ``labs.close()``, or takes the lab over with
  ``labs.hand_over(lab)`` and stops it itself;
- detached labs (`vm up --detach`, test_lab_fm.py's ``detached`` fixture): ``detached(T,
  shared=True)`` hands a healthy lab of topology T on to the next test that asks for it
  (``kept_detached`` below); the test that breaks or brings it down runs last (file order);
- the pytest plugin's ``lab`` fixture (``@pytest.mark.lab(T)``, vfio_cxl/pytest_plugin.py,
  docs/pytest-plugin.md) is a detached lab too, driven through ``lab.ssh`` and ``lab.fm``: a
  test that needs no QEMU internals (QMP, backend files) is written against it, as a user would.

The pool (``labs``) is the plugin's ``lab_pool``: one lab at a time for all of them
(per worker).

Kernels: a test that is not about a kernel gets its lab on the suite's kernel, the lab kernel
when it is cached (tests/suite_kernel.py); ``single_lab`` and ``selftest_lab`` stay on the image's
Debian kernel (DEBIAN_GROUPS), whose tests are about it.
"""

from __future__ import annotations

import inspect
import json

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab.kernel import lab_kernel
from vfio_cxl.lab.lab import Lab
from vfio_cxl.pytest_plugin import LabPool, lab_key

from suite_kernel import DEBIAN_GROUPS, suite_kernel
from xdist_units import REGISTERED_FIXTURES, unit_of

# A topology's lab on the suite's kernel and on the lab kernel is one lab when the lab kernel is
# cached: their fixtures share a rank, so that lab boots once.
TOPOLOGY_ORDER = {"single_lab": 0, "shared_lab": 1, "p2p_lab": 2, "lab_kernel_lab": 2, "smc_lab": 3,
                  "pool_lab": 4, "fabric_lab": 6, "selftest_lab": 7, "selftest_lab_kernel_lab": 8,
                  "storage_lab": 9, "storage_lab_kernel_lab": 9, "nic2_lab": 11, "nic2_lab_kernel_lab": 11}
# Tests parametrised by topology name (the agreement test) run with the other
# tests of the same topology, so each topology boots once per session.
NAME_ORDER = {"single": 0, "shared": 1, "p2p": 2, "smc": 3, "pool": 4, "fabric": 6, "selftest": 7, "storage": 9,
              "nic2": 11}


def kernel_of(topology: str):
    """The kernel of ``topology``'s in-process lab: Debian's for DEBIAN_GROUPS, else the suite's."""
    return None if topology in DEBIAN_GROUPS else suite_kernel()


@pytest.fixture(scope="session")
def labs(lab_pool) -> LabPool:
    """The session's pool of labs (vfio_cxl.pytest_plugin.LabPool, the plugin's ``lab_pool``):
    ``labs.get(TOPOLOGY)`` an in-process lab; the plugin's ``lab`` fixture and ``detached``
    draw on the same pool, so one lab runs at a time."""
    return lab_pool


@pytest.fixture
def single_lab(labs) -> Lab:
    """``single`` on the image's Debian kernel (DEBIAN_GROUPS)."""
    return labs.get("single")


@pytest.fixture
def shared_lab(labs) -> Lab:
    return labs.get("shared", kernel_of("shared"))


@pytest.fixture
def p2p_lab(labs) -> Lab:
    return labs.get("p2p", kernel_of("p2p"))


@pytest.fixture
def fabric_lab(labs) -> Lab:
    """``fabric`` in the pool (no fabric manager): two VMs, each GPU with MSI (irq = "msi")."""
    return labs.get("fabric", kernel_of("fabric"))


def lab_kernel_or_skip():
    """The cached lab kernel, or a skip saying how to get it (it is never built here)."""
    try:
        return lab_kernel(provision=False)
    except LabError:
        pytest.skip("the lab kernel is not built: run 'vfio-cxl provision --kernel lab' "
                    "(or VFIO_CXL_LAB_KERNEL=1 scripts/test)")


@pytest.fixture
def lab_kernel_lab(labs) -> Lab:
    """``p2p`` booted on the lab kernel (IOMMUFD).  p2p rather than single: it has the same
    CXL RAM region on backend cxl0 and a GPU on a root port of its own, which the backend
    tests use, plus the three GPUs the iommufd peer-to-peer case needs -- one boot for
    all lab-kernel tests.  Built by ``VFIO_CXL_LAB_KERNEL=1 scripts/test`` when missing
    (``vfio-cxl provision --kernel lab``); a bare pytest run without it skips, saying so."""
    return labs.get("p2p", lab_kernel_or_skip())


# `./scripts/test --quick` (pytest -m "not vm or smoke"): the fast tests and one VM test per area,
# on as few labs as the areas allow (in-process single, detached single, shared, p2p, storage,
# detached fabric).  Each names a test id below tests/vm/ (tests/fast/test_test_tiers.py checks they exist).
SMOKE = {
    "boot, and the plugin's lab fixture": "test_lab_single.py::test_guest_sees_intel_iommu_dmar",
    "DMA demo": "test_gpu_dma.py::test_demo_dma_lands_byte_exact_in_devdax_and_the_host_file",
    "GPU memory over CXL": "test_gpumem.py::test_the_readme_commands",
    "sharing": "test_share.py::test_gpu_in_a_writes_what_b_reads_with_no_copy",
    "P2P": "test_p2p.py::test_p2p_both_ways_every_byte[1MiB]",
    "storage": "test_storage.py::test_nvme_to_vram_and_back_verified_through_the_bar[p2p]",
    # the README's fabric session as typed (32 s) rather than test_lab_fabric's moves with their
    # leak checks and a holder's forced release (~120 s)
    "FM moves": "test_documented_commands.py::test_fabric_session_as_the_readme_shows_it",
}


def mark_smoke(items) -> None:
    """The SMOKE tests get the ``smoke`` marker (tests/fast/test_test_tiers.py checks that each
    entry names one collected test)."""
    wanted = set(SMOKE.values())
    for item in items:
        if item.nodeid.split("tests/vm/", 1)[-1] in wanted:
            item.add_marker(pytest.mark.smoke)


def check_registered(items) -> None:
    """A test that asks for a registered lab runs in one of xdist_units.REGISTERED's files: those
    run on one worker, while another runs the in-process labs (tests/xdist_units.py)."""
    for item in items:
        asked = REGISTERED_FIXTURES & set(getattr(item, "fixturenames", ()))
        if asked and unit_of(item.nodeid) == "vm-in-process":   # the scheduler's own split
            raise pytest.UsageError(
                f"{item.nodeid} asks for {', '.join(sorted(asked))} (a lab the fabric manager registers) "
                f"but {item.path.name} is not in REGISTERED in tests/xdist_units.py: move the test to "
                "a file there, or add its file (its tests then run on the registered labs' worker)")


def pytest_collection_modifyitems(config, items):
    mark_smoke(items)
    check_registered(items)

    def rank(item):
        fixtures = getattr(item, "fixturenames", ())
        ranks = [TOPOLOGY_ORDER[f] for f in fixtures if f in TOPOLOGY_ORDER]
        key = lab_key(item) if "lab" in fixtures else None
        if key is not None:   # the plugin's detached labs: after the in-process ones, before
            # the ``detached`` tests (which may reuse them), by topology
            return len(TOPOLOGY_ORDER) - 0.5, NAME_ORDER.get(key[0], len(NAME_ORDER)), False
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


def pci_ids(vm) -> set[str]:
    """The qdev ids of the VM's PCI devices, as QEMU lists them (query-pci)."""
    ids = set()

    def walk(devices):
        for dev in devices:
            ids.add(dev.get("qdev_id", ""))
            walk(dev.get("pci_bridge", {}).get("devices", []))
    for bus in vm.connect_qmp().cmd_obj({"execute": "query-pci"})["return"]:
        walk(bus["devices"])
    return ids


def guest_json(vm, command: str):
    return json.loads(vm.run(command).stdout)


@pytest.fixture
def smc_lab(labs) -> Lab:
    return labs.get("smc", kernel_of("smc"))


@pytest.fixture
def pool_lab(labs) -> Lab:
    return labs.get("pool", kernel_of("pool"))


@pytest.fixture(scope="session")
def kept_detached(labs) -> dict:
    """Detached (`vm up --detach`) labs that tests hand on to the next test, by (topology,
    kernel): see ``detached(TOPOLOGY, shared=True)`` in test_lab_fm.py.  The pool's ``kept``:
    shared with the plugin's ``lab`` fixture (a healthy lab either left up serves the other).
    Each boot costs tens of seconds under TCG.  Whatever is still up at the end is brought down
    with the pool."""
    return labs.kept


@pytest.fixture
def selftest_lab(labs) -> Lab:
    """The VFIO selftests' topology (the GPU and an igb) on the image's Debian kernel."""
    return labs.get("selftest")


@pytest.fixture
def selftest_lab_kernel_lab(labs) -> Lab:
    """The VFIO selftests' topology on the lab kernel (IOMMUFD); skips, saying so, when it is not built."""
    return labs.get("selftest", lab_kernel_or_skip())


@pytest.fixture
def storage_lab(labs) -> Lab:
    """``storage``: gpu0 and nvme0 behind one PCIe switch, nvme1 on a root port (docs/storage.md)."""
    return labs.get("storage", kernel_of("storage"))


@pytest.fixture
def storage_lab_kernel_lab(labs) -> Lab:
    """``storage`` on the lab kernel (IOMMUFD); skips, saying so, when it is not built."""
    return labs.get("storage", lab_kernel_or_skip())


@pytest.fixture
def nic2_lab(labs) -> Lab:
    """``nic2``: host0 and host1, each a GPU and an igb behind one PCIe switch, the igbs on one
    point-to-point link (docs/nic.md)."""
    return labs.get("nic2", kernel_of("nic2"))


@pytest.fixture
def nic2_lab_kernel_lab(labs) -> Lab:
    """``nic2`` on the lab kernel (IOMMUFD); skips, saying so, when it is not built."""
    return labs.get("nic2", lab_kernel_or_skip())
