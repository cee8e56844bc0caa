"""`--qemu PATH`: a user's own QEMU build gets the lab's capability checks before anything boots.
The "QEMU" binaries here are FAKE shell scripts that print what a QEMU would (version, device
list): the checks are our own logic.  Booting with a real user build is the same code path as the
system QEMU (the lab runs `binary argv...` directly)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab.qemu_runtime import QEMU_ENV, find_runtime, user_runtime
from vfio_cxl.paths import REPO_ROOT

DEVICES = ('name "cxl-type3", bus PCI\nname "vfio-user-pci", bus PCI\n'
           'name "intel-iommu", bus System\n')


def fake_qemu(tmp_path: Path, version: str, devices: str) -> Path:
    path = tmp_path / "qemu-system-x86_64"
    path.write_text(f"""#!/bin/sh
case "$1" in
  --version) echo "QEMU emulator version {version}" ;;
  -device) printf '%s' '{devices}' ;;
esac
""")
    path.chmod(0o755)
    return path


def test_a_good_build_passes_the_checks_and_is_used(tmp_path, monkeypatch):
    binary = fake_qemu(tmp_path, "11.0.50 (v11.0.0-1234-gabc)", DEVICES)
    runtime = user_runtime(str(binary))
    assert runtime.version == (11, 0, 50) and runtime.binary == str(binary) and runtime.tree is None
    assert runtime.command(["-S"]) == [str(binary), "-S"]   # run directly, no bwrap'd tree
    monkeypatch.setenv(QEMU_ENV, str(binary))
    assert find_runtime(provision=False).binary == str(binary)


@pytest.mark.parametrize("version,devices,what", [
    ("9.2.0", DEVICES, "too old"),
    ("11.1.0", DEVICES.replace("vfio-user-pci", "vfio-pci"), "lacks devices: vfio-user-pci"),
])
def test_a_build_the_lab_cannot_use_is_refused_naming_why(tmp_path, version, devices, what):
    with pytest.raises(LabError) as err:
        user_runtime(str(fake_qemu(tmp_path, version, devices)))
    assert what in err.value.what and "--qemu" in err.value.fix


def test_cli_refuses_a_missing_binary_before_anything_starts(tmp_path):
    env = {**os.environ, "VFIO_CXL_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "vfio_cxl", "vm", "up", "fabric", "--detach",
                             "--qemu", str(tmp_path / "nope")], capture_output=True, text=True,
                            cwd=REPO_ROOT, env=env, timeout=60)
    assert result.returncode == 1 and "no executable file there" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "cache" / "logs").exists() or not any((tmp_path / "cache" / "logs").iterdir())
