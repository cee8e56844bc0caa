"""pytest-xdist's scheduling for this suite: every VM test (under tests/vm/) goes to one worker as
one unit of work, in collection order, so one lab runs at a time and each boots once; the fast
tests go to any worker, a module (or class) at a time.  A VM test leaves about half of two cores
idle while it waits on its guest, so the fast tests run in that time instead of after.

Only for ``--dist load``, what ``-n N`` means; another ``--dist`` keeps its own scheduling.
Not ``--dist loadgroup`` with an ``xdist_group`` marker: pytest-xdist 3.8 puts a test in its group
by rewriting ``item._nodeid``, which pytest 9.2 no longer reads, so the VM tests spread over the
workers and two labs ran at once."""

from __future__ import annotations

VM_TESTS = "tests/vm/"
VM_UNIT = "vm"


def make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VmTestsOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return VM_UNIT if nodeid.startswith(VM_TESTS) else super()._split_scope(nodeid)

    return VmTestsOnOneWorker(config, log)
