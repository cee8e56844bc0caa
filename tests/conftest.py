"""Shared test configuration: every test under tests/vm/ is a VM test; ``--soak`` runs the long
repetitions (the ``soak`` fixture says which count a test takes); the session counts the labs it
boots and the guest commands it runs (vfio_cxl.lab.usage) and says so at its end.

Under pytest-xdist (scripts/test runs ``-n 3``) tests/xdist_units.py schedules: the VM tests in two
units of work, each on one worker in order (the labs the fabric manager registers, the in-process
ones), the fast tests beside them."""

import os
import tempfile
from collections import Counter

import pytest

import suite_kernel
from vfio_cxl.lab import usage

USAGE_LOG = pytest.StashKey[str]()
FILE_SECONDS = pytest.StashKey["FileSeconds"]()


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="the long repetitions (GPU moves, fake moves, fuzz requests) instead of the "
                          "default counts, which are still enough to show a leak")


def pytest_report_header(config):
    return suite_kernel.describe()


@pytest.fixture(scope="session")
def soak(request):
    """``soak(default, long)``: the repetition count of this run (``long`` under --soak)."""
    return lambda default, long: long if request.config.getoption("--soak") else default


def is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


class FileSeconds:
    """Seconds of setup, call and teardown by test file (on pytest-xdist's controller too: it
    replays its workers' reports there)."""

    def __init__(self):
        self.by_file: Counter = Counter()

    def pytest_runtest_logreport(self, report):
        self.by_file[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_configure(config):
    try:   # the plugin's `lab` fixture boots the suite's kernel unless --lab-kernel names one
        if config.getoption("--lab-kernel") is None:
            config.option.lab_kernel = suite_kernel.suite_kernel_name()
    except suite_kernel.BadChoice as err:
        raise pytest.UsageError(str(err)) from None
    config.stash[FILE_SECONDS] = FileSeconds()
    config.pluginmanager.register(config.stash[FILE_SECONDS], "vfio-cxl-file-seconds")
    if is_xdist_worker(config):
        return   # the controller made the log; its workers inherit $VFIO_CXL_USAGE_LOG
    # every process the session starts (detached labs, documented commands) inherits it
    # not "vfio-cxl-*": that is the lab's run directories' pattern in the same /tmp
    fd, path = tempfile.mkstemp(prefix="usage-of-vfio-cxl-tests-", suffix=".jsonl")
    os.close(fd)
    os.environ[usage.ENV] = path
    config.stash[USAGE_LOG] = path


def pytest_unconfigure(config):
    path = config.stash.get(USAGE_LOG, None)
    if path:
        os.environ.pop(usage.ENV, None)
        os.unlink(path)


def pytest_terminal_summary(terminalreporter, config):
    if USAGE_LOG not in config.stash:
        return
    by_file = config.stash[FILE_SECONDS].by_file
    # vm/test_x.py and fast/test_x.py both exist: named from below tests/
    slow = [f"{path.split('tests/', 1)[-1]} {seconds:.0f}" for path, seconds in by_file.most_common() if seconds >= 10]
    if slow:   # summed over the workers, which run side by side: more than the wall clock
        terminalreporter.write_line(f"test seconds by file (10 s and more): {', '.join(slow)}")
    from xdist_units import unit_of

    by_unit: Counter = Counter()
    for path, seconds in by_file.items():
        by_unit[unit_of(path) or "fast"] += seconds
    if len(by_unit) > 1:   # one worker runs each VM unit: its seconds are about that worker's wall clock
        terminalreporter.write_line("test seconds by unit of work: " + ", ".join(
            f"{unit} {seconds:.0f}" for unit, seconds in by_unit.most_common()))
    counted = usage.summary(config.stash[USAGE_LOG])
    boots = counted["boots"]
    if not boots and not counted["guest_commands"]:
        return
    by_topology = ", ".join(f"{name} {n}" for name, n in sorted(boots.items()))
    terminalreporter.write_line(
        f"vfio-cxl usage: {sum(boots.values())} lab boots ({by_topology or 'none'}); "
        f"{counted['guest_commands']} guest commands, {counted['guest_python']} of them starting "
        "the guest's Python")
    if counted["boot_s"] or counted["stop_s"]:
        terminalreporter.write_line(f"vfio-cxl usage: the labs took {counted['boot_s']:.0f} s to come up "
                                    f"(SSH and regions) and {counted['stop_s']:.0f} s to stop")
    by_file = ", ".join(f"{name} {n}" for name, n in counted["boots_by_file"].most_common())
    if by_file:
        terminalreporter.write_line(f"vfio-cxl usage: lab boots by test file: {by_file}")
    for why in counted["reboots"]:
        terminalreporter.write_line(f"vfio-cxl usage: a pooled lab was booted again: {why}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/vm/" in str(item.fspath):
            item.add_marker(pytest.mark.vm)


# Under pytest-xdist the fast tests share two cores with the VM tests' QEMUs, and the VM tests set
# the session's length: a worker runs a fast test at this niceness (what it starts inherits it)
# and a VM test at 0 again, so the fast tests take the cycles the guests leave idle.  Only as root
# (CI): back to 0 needs it, and a VM test must not run at a fast test's niceness.
FAST_NICE = 19


def pytest_runtest_setup(item):
    if not is_xdist_worker(item.config) or os.geteuid() != 0:
        return
    want = 0 if item.get_closest_marker("vm") else FAST_NICE
    if os.getpriority(os.PRIO_PROCESS, 0) != want:
        os.setpriority(os.PRIO_PROCESS, 0, want)


@pytest.hookimpl(optionalhook=True)   # pytest-xdist's hook
def pytest_xdist_make_scheduler(config, log):
    from xdist_units import make_scheduler

    return make_scheduler(config, log)


@pytest.fixture(autouse=True)
def _lab_environment_unchanged():
    """A test leaves the lab's environment variables (VFIO_CXL_*) as it found them: every later
    `vfio-cxl` the session runs reads them (one test's VFIO_CXL_QEMU once failed every VM test
    after it)."""
    before = {k: v for k, v in os.environ.items() if k.startswith("VFIO_CXL_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("VFIO_CXL_")}
    assert after == before, (f"the test changed the lab's environment: {sorted(set(before.items()) ^ set(after.items()))}; "
                             "use monkeypatch.setenv/delenv (delenv of an unset name restores nothing)")
