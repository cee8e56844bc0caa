"""The CLI: dry runs need nothing provisioned; errors are one clear line."""

import subprocess
import sys

from vfio_cxl.paths import REPO_ROOT


def vfio_cxl(*args):
    return subprocess.run([sys.executable, "-m", "vfio_cxl", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60)


def test_dry_run_prints_the_qemu_command_lines():
    result = vfio_cxl("vm", "up", "shared", "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("qemu-system-x86_64")]
    assert len(lines) == 2
    assert all("intel-iommu" in line and "cxl-type3" in line for line in lines)
    assert "vfio-user-pci" in lines[0] and "vfio-user-pci" not in lines[1]


def test_unknown_topology_is_one_line():
    result = vfio_cxl("vm", "up", "nosuch", "--dry-run")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "vfio-cxl: error: unknown topology 'nosuch' -- use one of: shared, single, smc, smc3 (or a path to a .toml file)"]


def test_malformed_topology_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[vm]\n")
    result = vfio_cxl("vm", "up", str(bad), "--dry-run")
    assert result.returncode == 1 and "malformed TOML" in result.stderr and "Traceback" not in result.stderr


def test_topologies_listing():
    result = vfio_cxl("vm", "topologies")
    assert result.returncode == 0 and result.stdout.split()[0] == "shared"
