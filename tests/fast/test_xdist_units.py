"""scripts/test's scheduling under pytest-xdist (tests/xdist_units.py), in a pytester run: the VM
tests of the registered labs' files run on one worker, in collection order, the other VM tests on
another, and the fast tests beside them."""

from __future__ import annotations

import sys
from pathlib import Path

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from xdist_units import REGISTERED, unit_of  # noqa: E402

RECORDING = '''
import os

def test_{n}():
    with open(os.environ["RAN_LOG"], "a") as log:
        log.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{__name__.rsplit('.', 1)[-1]}}::test_{n}\\n")
'''


def test_each_vm_unit_runs_on_one_worker_in_order_and_the_fast_tests_beside_them(pytester, monkeypatch):
    assert "test_lab_single.py" in REGISTERED and "test_p2p.py" not in REGISTERED
    pytester.makeconftest(f'''
import sys
sys.path.insert(0, {str(TESTS)!r})
from xdist_units import make_scheduler

def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log)
''')
    files = (("vm/test_lab_single", 4), ("vm/test_p2p", 3), ("vm/test_lab_fm", 3), ("vm/test_smc", 4),
             ("fast/test_f1", 2), ("fast/test_f2", 2))
    for name, count in files:
        path = pytester.path / "tests" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(RECORDING.format(n=n) for n in range(count)))
    log = pytester.path / "ran.log"
    monkeypatch.setenv("RAN_LOG", str(log))
    pytester.runpytest_subprocess("-n", "3", "-p", "no:cacheprovider", "tests").assert_outcomes(passed=18)

    ran = [line.split() for line in log.read_text().splitlines()]

    def unit(*modules):
        return [(worker, test) for worker, test in ran if test.split("::")[0] in modules]
    registered, in_process = unit("test_lab_single", "test_lab_fm"), unit("test_p2p", "test_smc")
    assert [t for _, t in registered] == [f"test_lab_fm::test_{n}" for n in range(3)] + \
        [f"test_lab_single::test_{n}" for n in range(4)]
    assert [t for _, t in in_process] == [f"test_p2p::test_{n}" for n in range(3)] + \
        [f"test_smc::test_{n}" for n in range(4)]
    (one,), (other,) = {w for w, _ in registered}, {w for w, _ in in_process}
    assert one != other
    assert any(worker not in (one, other) for worker, test in ran if test.startswith("test_f")), ran


def test_unit_of_names_the_vm_units_and_leaves_the_fast_tests_alone():
    assert unit_of("tests/vm/test_lab_fm.py::test_x[a::b]") == "vm-registered"
    assert unit_of("tests/vm/test_storage.py::test_y") == "vm-in-process"
    assert unit_of("tests/fast/test_lab_fm.py::test_x") is None
    assert all((TESTS / "vm" / name).exists() for name in REGISTERED)
