"""The pytest plugin's own logic, in a pytester run: the marker, the grouping of tests by lab,
reuse per (topology, kernel), --lab-kernel, --lab-keep's report and what a failed test's lab
becomes.  The pool's boot is replaced by a FAKE lab (no QEMU); tests/vm/test_pytest_plugin.py
runs the real thing from a user's project."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = '''
import pytest
from vfio_cxl import pytest_plugin

BOOTS, DOWNS = [], []


class FakeLab(pytest_plugin.RunningLab):
    def healthy(self):
        return self.name not in DOWNS

    def ssh(self, vm, command, *, check=True, timeout=600):
        return f"{vm}: {command}"

    def down(self):
        DOWNS.append(self.name)

    def disconnect(self):
        pass


@pytest.fixture(autouse=True, scope="session")
def fake_boot():
    def boot(cls, topology, kernel=None, echo=print):
        BOOTS.append((topology, kernel))
        return FakeLab(f"{topology}-{len(BOOTS)}", topology, kernel, vms=["host0"], ports={"host0": 40001})
    saved = pytest_plugin.RunningLab.boot
    pytest_plugin.RunningLab.boot = classmethod(boot)
    yield
    pytest_plugin.RunningLab.boot = saved
    print("BOOTS", BOOTS, "DOWNS", sorted(DOWNS))
'''


@pytest.fixture
def project(pytester):
    pytester.makeconftest(CONFTEST)
    return pytester


def test_tests_of_one_lab_run_together_and_share_its_boot(project):
    project.makepyfile(test_a='''
        import pytest

        @pytest.mark.lab("single")
        def test_one(lab):
            assert lab.ssh("host0", "uname -r") == "host0: uname -r" and lab.ports == {"host0": 40001}

        @pytest.mark.lab("shared")
        def test_two(lab):
            assert lab.topology == "shared"

        def test_plain():
            pass

        @pytest.mark.lab("single")
        def test_three(lab):
            assert lab.name == "single-1"

        @pytest.mark.lab("single", kernel="lab")
        def test_four(lab):
            assert lab.kernel == "lab"
    ''')
    result = project.runpytest("-v", "-s")
    result.assert_outcomes(passed=5)
    # grouped by lab in the order each first appears (tests without one first), one boot each
    result.stdout.re_match_lines([r".*test_plain PASSED", r".*test_one PASSED", r".*test_three PASSED",
                                  r".*test_two PASSED", r".*test_four PASSED"])
    assert ("BOOTS [('single', None), ('shared', None), ('single', 'lab')] "
            "DOWNS ['shared-2', 'single-1', 'single-3']") in result.stdout.str()


def test_lab_kernel_option_is_the_default_kernel(project):
    project.makepyfile(test_k='''
        import pytest

        @pytest.mark.lab("single")
        def test_k(lab):
            assert lab.kernel == "/boot/mine"
    ''')
    project.runpytest("--lab-kernel", "/boot/mine").assert_outcomes(passed=1)


def test_a_failed_tests_lab_is_brought_down_or_kept_with_lab_keep(project):
    project.makepyfile(test_f='''
        import pytest

        @pytest.mark.lab("single")
        def test_fails(lab):
            assert False, "on purpose"

        @pytest.mark.lab("single")
        def test_after(lab):
            assert lab.name == "single-2"   # a fresh lab: the failed test's is nobody's to reuse
    ''')
    result = project.runpytest("-s")
    result.assert_outcomes(passed=1, failed=1)
    assert "BOOTS [('single', None), ('single', None)] DOWNS ['single-1', 'single-2']" in result.stdout.str()
    assert "left up" not in result.stdout.str()

    result = project.runpytest("-s", "--lab-keep")
    result.assert_outcomes(passed=1, failed=1)
    assert "BOOTS [('single', None), ('single', None)] DOWNS ['single-2']" in result.stdout.str()
    result.stdout.fnmatch_lines(["*vfio-cxl labs left up (--lab-keep)*",
                                 "test_f.py::test_fails failed; lab single-1 (single) is up: VMs host0 (ssh port 40001)",
                                 "*vfio-cxl vm ssh --lab single-1 host0*",
                                 "*vfio-cxl vm down single-1*"])


def test_lab_keep_under_xdist_reports_the_workers_labs_on_the_controller(project):
    """A worker's kept lab is printed by the controller (the worker's own summary is never shown)."""
    project.makepyfile(test_x='''
        import pytest

        @pytest.mark.lab("single")
        def test_fails(lab):
            assert False, "on purpose"
    ''')
    result = project.runpytest_subprocess("-n", "1", "--lab-keep")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*vfio-cxl labs left up (--lab-keep)*",
                                 "test_x.py::test_fails failed; lab single-1 (single) is up: VMs host0 (ssh port 40001)",
                                 "*vfio-cxl vm down single-1*"])


def test_the_fixture_without_a_marker_or_with_a_bad_one_says_how_to_write_it(project):
    project.makepyfile(test_u='''
        import pytest

        def test_no_marker(lab):
            pass
    ''')
    result = project.runpytest()
    result.stdout.fnmatch_lines(['*uses the `lab` fixture without a lab marker*@pytest.mark.lab("TOPOLOGY")*'])
    project.makepyfile(test_u='''
        import pytest

        @pytest.mark.lab("single", "shared")
        def test_two_topologies(lab):
            pass
    ''')
    result = project.runpytest()
    assert result.ret != 0
    result.stderr.fnmatch_lines(['*write @pytest.mark.lab("TOPOLOGY")*'])


def test_the_marker_and_options_are_registered(project):
    result = project.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.lab(topology, kernel=None)*"])
    result = project.runpytest("--help")
    result.stdout.fnmatch_lines(["*--lab-kernel=PATH*", "*--lab-keep*"])


@pytest.mark.parametrize("change, healthy", [
    ({}, True),
    ({"state": "degraded"}, True),        # a death the test repaired (fm restart) leaves this
    ({"vms": {"a": {"state": "dead"}}}, False),
    ({"gpus": {"gpu0": {"state": "failed"}}}, False),
    ({"gpus": {"gpu0": {"state": "moving"}}}, False),
    ({"gpus": {"gpu0": {"state": "free"}}}, True),
    ({"smcs": {"smc0": {"state": "failed"}}}, False),
])
def test_a_lab_is_reused_only_when_fit(change, healthy):
    from vfio_cxl.pytest_plugin import RunningLab

    status = {"state": "running", "vms": {"a": {"state": "running"}}, "gpus": {"gpu0": {"state": "attached"}},
              "smcs": {"smc0": {"state": "running"}}}
    for key, value in change.items():
        if isinstance(value, dict):
            for name, fields in value.items():
                status[key][name].update(fields)
        else:
            status[key] = value

    class Fm:
        def status(self):
            return status

    class Lab(RunningLab):
        fm = Fm()

        def alive(self):
            return True
    assert Lab("fabric-1", "fabric", vms=["a"], ports={"a": 1}).healthy() is healthy
