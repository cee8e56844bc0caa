"""The test command's tiers (scripts/test): --quick's smoke list names real tests, one per area; the VM
tests' kernel (tests/suite_kernel.py) is named in the session's header and can be Debian's for all."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from vfio_cxl.lab.kernel import cached_lab_kernel  # noqa: E402
from vm.conftest import SMOKE  # noqa: E402


def collect(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_every_smoke_entry_is_one_collected_vm_test():
    smoke = collect("-m", "smoke", "tests/vm")
    assert sorted(line.split("tests/vm/", 1)[1] for line in smoke) == sorted(SMOKE.values())


def test_quick_is_the_fast_tests_plus_the_smoke_tests():
    quick = collect("-m", "not vm or smoke")
    assert sum("tests/vm/" in line for line in quick) == len(SMOKE)
    assert sum("tests/vm/" not in line for line in quick) == len(collect("-m", "not vm"))


def session_with_test_kernel(value: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider",
                           "tests/vm/test_p2p.py"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "VFIO_CXL_TEST_KERNEL": value})


def test_the_header_names_the_vm_tests_kernel_and_debian_can_be_chosen_for_every_group():
    default = session_with_test_kernel("lab")
    assert default.returncode == 0, default.stdout + default.stderr
    if cached_lab_kernel() is not None:
        assert f"VM tests' kernel: the lab kernel ({cached_lab_kernel()}/" in default.stdout, default.stdout
        assert "Debian's for the in-process selftest and single labs" in default.stdout, default.stdout
    else:
        assert "Debian kernel for every lab (the lab kernel is not built" in default.stdout, default.stdout
    debian = session_with_test_kernel("debian")
    assert debian.returncode == 0, debian.stdout + debian.stderr
    assert "VM tests' kernel: the image's Debian kernel for every lab (VFIO_CXL_TEST_KERNEL=debian)" in debian.stdout


def test_a_vm_tests_kernel_that_is_neither_is_refused_naming_both():
    ran = session_with_test_kernel("lab7")
    assert ran.returncode != 0 and "collected" not in ran.stdout
    assert "VFIO_CXL_TEST_KERNEL='lab7': write 'lab'" in ran.stderr and "or 'debian'" in ran.stderr, ran.stderr


def test_a_fast_test_runs_niced_on_an_xdist_worker_as_root(request):
    """tests/conftest.py: fast tests yield the cores to the VM tests' QEMUs (scripts/test's workers)."""
    niced = hasattr(request.config, "workerinput") and os.geteuid() == 0
    assert os.getpriority(os.PRIO_PROCESS, 0) == (19 if niced else os.getpriority(os.PRIO_PROCESS, os.getppid())), niced
