"""The CLI: dry runs need nothing provisioned; errors are one clear line."""

import subprocess
import sys

from vfio_cxl.lab import topology
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
        "vfio-cxl: error: unknown topology 'nosuch' -- use one of: fabric, hb2, interleave2, mhmld, nic2, p2p, pmem, "
        "pool, selftest, shared, single, smc, storage (or a path to a .toml file)"]


def test_malformed_topology_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[vm]\n")
    result = vfio_cxl("vm", "up", str(bad), "--dry-run")
    assert result.returncode == 1 and "malformed TOML" in result.stderr and "Traceback" not in result.stderr


def test_topologies_listing():
    result = vfio_cxl("vm", "topologies")
    assert result.returncode == 0
    assert [line.split()[0] for line in result.stdout.splitlines()] == [
        "fabric", "hb2", "interleave2", "mhmld", "nic2", "p2p", "pmem", "pool", "selftest", "shared", "single",
        "smc", "storage"]


def test_dry_run_names_the_qemu_version_or_says_it_is_not_provisioned():
    from vfio_cxl.lab.qemu_runtime import provisioned_runtime

    runtime = provisioned_runtime()
    first = vfio_cxl("vm", "up", "single", "--dry-run").stdout.splitlines()[0]
    if runtime:
        assert first == f"# host0: {runtime.version_string}" and "0.0.0" not in first
    else:
        assert first == "# host0: QEMU not provisioned yet (run: vfio-cxl provision)"


def test_vm_up_takes_a_path(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text((topology.TOPOLOGY_DIR / "single.toml").read_text().replace('"host0"', '"box"'))
    result = vfio_cxl("vm", "up", str(mine), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "-name box" in result.stdout


def test_bad_topology_file_is_one_line_naming_file_key_and_rule(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text((topology.TOPOLOGY_DIR / "hb2.toml").read_text().replace(
        'granularity = "8K"', 'granularity = "3K"'))
    result = vfio_cxl("vm", "up", str(mine), "--dry-run")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"vfio-cxl: error: {mine}: vm[0].window[0].granularity: interleave granularity 3K is not a CXL "
        "granularity: use a power of two from 256 to 16K (256, 512, 1K, 2K, 4K, 8K, 16K) -- see "
        "docs/topologies.md for every key"]


def test_topology_tree():
    result = vfio_cxl("vm", "topology", "fabric")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "│  ├─ gpu0-port: root port\n│  │  └─ gpu0: GPU (64M VRAM, msi)" in out
    assert "mem0: Type3 (volatile shared 256M, shared with b)" in out
    assert "gpu1: GPU (64M VRAM, msi)" in out and "unowned" not in out
    assert "link 0: a <-> b" in out


def test_demo_dma_checks_its_arguments_before_booting():
    # No VM boots: each of these fails in well under a second with the rule in words.
    cases = {
        ("--size", "0"): "vfio-cxl: error: --size 0 is too small: the payload starts with the 26-byte message "
                         "'DMA FROM GPU TO CXL MEMORY' -- use --size 27 or more (default 1 MiB)",
        ("--offset", "100"): "vfio-cxl: error: --offset 100 is not a multiple of 4096 -- the GPU DMAs into "
                             "devdax at page granularity: use 0, 4096, 8192, ...",
        ("--size", str(128 << 20)): "vfio-cxl: error: --size 134217728 is larger than the GPU's VRAM (64M) -- "
                                    "use --size 67108864 or less",
        ("--size", str(64 << 20), "--offset", str(255 << 20)):
            "vfio-cxl: error: --size 67108864 at --offset 267386880 runs past the end of the 256M devdax "
            "region -- keep offset + size <= 268435456",
    }
    for args, message in cases.items():
        result = vfio_cxl("demo", "dma", *args)
        assert result.returncode == 1 and result.stderr.strip() == message, result.stderr
