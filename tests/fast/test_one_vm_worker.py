"""scripts/test's scheduling under pytest-xdist (tests/one_vm_worker.py), in a pytester run: every
test under tests/vm/ runs on one worker, in collection order, while the fast tests run on the other."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parents[1]

RECORDING = '''
import os

def test_{n}():
    with open(os.environ["RAN_LOG"], "a") as log:
        log.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{__name__.rsplit('.', 1)[-1]}}::test_{n}\\n")
'''


def test_the_vm_tests_run_on_one_worker_in_order_and_the_fast_tests_beside_them(pytester, monkeypatch):
    pytester.makeconftest(f'''
import sys
sys.path.insert(0, {str(TESTS)!r})
from one_vm_worker import make_scheduler

def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log)
''')
    for name, count in (("vm/test_v1", 4), ("vm/test_v2", 3), ("fast/test_f1", 3), ("fast/test_f2", 3)):
        path = pytester.path / "tests" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(RECORDING.format(n=n) for n in range(count)))
    log = pytester.path / "ran.log"
    monkeypatch.setenv("RAN_LOG", str(log))
    pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "tests").assert_outcomes(passed=13)

    ran = [line.split() for line in log.read_text().splitlines()]
    vm = [(worker, test) for worker, test in ran if test.startswith("test_v")]
    assert [test for _, test in vm] == [f"test_v1::test_{n}" for n in range(4)] + [f"test_v2::test_{n}" for n in range(3)]
    (vm_worker,) = {worker for worker, _ in vm}
    assert any(worker != vm_worker for worker, test in ran if test.startswith("test_f")), ran
