"""pytest-xdist's scheduling for this suite (scripts/test runs ``-n 3``).

The VM tests (under tests/vm/) are two units of work, each run by one worker in collection order,
so each worker runs one lab at a time and boots each of its labs once:
- ``vm-registered``: the files whose tests run labs the fabric manager registers (``vfio-cxl vm up
  --detach``, the plugin's ``lab`` fixture, ``detached``) or type commands that act on "the" running
  lab (``vfio-cxl fm status`` with no ``--lab`` needs exactly one registered);
- ``vm-in-process``: the rest, on in-process labs (``labs.get``), which nothing registers.
So while the two run side by side, the registered labs are only ever one worker's.  The fast tests
go to any worker, a module (or class) at a time.  A VM test leaves about half of two cores idle
while it waits on its guest (vmstat during the VM tests: 25-66 % idle), which the other unit and
the fast tests use.

tests/vm/conftest.py refuses a test outside REGISTERED that asks for a registered lab's fixture.
Only for ``--dist load``, what ``-n N`` means; another ``--dist`` keeps its own scheduling.
Not ``--dist loadgroup`` with an ``xdist_group`` marker: pytest-xdist 3.8 puts a test in its group
by rewriting ``item._nodeid``, which pytest 9.2 no longer reads, so the VM tests spread over every
worker."""

from __future__ import annotations

VM_TESTS = "tests/vm/"
REGISTERED = frozenset({
    "test_documented_commands.py", "test_fm_hostile.py", "test_guest_library.py", "test_lab_fabric.py",
    "test_lab_fm.py", "test_lab_single.py", "test_matrix.py", "test_pytest_plugin.py",
    "test_redfish.py",
})
# the fixtures that give a test a registered lab, or clear the way for commands that need the only one
REGISTERED_FIXTURES = frozenset({"lab", "detached", "kept_detached", "quiet_host"})


def unit_of(nodeid: str) -> str | None:
    """``vm-registered`` or ``vm-in-process`` for a VM test's node id; None for a fast test."""
    if not nodeid.startswith(VM_TESTS):
        return None
    return "vm-registered" if nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in REGISTERED else "vm-in-process"


def make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VmUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid) or super()._split_scope(nodeid)

    return VmUnits(config, log)
