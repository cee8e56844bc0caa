"""The test command's tiers (scripts/test): --quick's smoke list names real tests, one per area."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

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
