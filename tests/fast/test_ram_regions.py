"""vfio_cxl/guest/ram_regions.sh, the guest init's ram regions straight through sysfs, run by a
POSIX shell over a FAKE sysfs tree ($SYSFS) laid out as the CXL core lays it out after the
writes (the region directory create_ram_region names, its dax device): what is ours is checked
-- the values written where, the endpoint decoder and the size picked, the JSON printed, and a
step that fails taking the region apart.  The real kernel runs it at every VM test's boot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from vfio_cxl.lab.lab import ram_regions_plan
from vfio_cxl.paths import REPO_ROOT

SH = shutil.which("dash") or shutil.which("sh")
SCRIPT = REPO_ROOT / "vfio_cxl/guest/ram_regions.sh"
MIB = 1 << 20


def tree(root: Path, rams=(256 * MIB, 256 * MIB)) -> Path:
    """mem0 (serial 0x1000) and mem1 (0x1001) with their endpoint ports (two decoders each), one
    root decoder whose next region is region0, that region's files and its dax device."""
    cxl = root / "bus/cxl/devices"

    def attrs(path: Path, **values: str) -> None:
        path.mkdir(parents=True, exist_ok=True)
        for name, value in values.items():
            (path / name).write_text(value + "\n")

    attrs(cxl / "root0" / "decoder0.0", create_ram_region="region0", delete_region="")
    for i, ram in enumerate(rams):
        attrs(cxl / f"mem{i}", serial=hex(0x1000 + i))
        attrs(cxl / f"mem{i}" / "ram", size=hex(ram))
        port = cxl / f"endpoint{i + 2}"
        port.mkdir()
        (port / "uport").symlink_to(f"../mem{i}")
        for d in range(2):
            attrs(port / f"decoder{i + 2}.{d}", mode="none", dpa_size="0x0")
    attrs(cxl / "region0", interleave_ways="0", interleave_granularity="0", size="0x0", commit="0",
          target0="", target1="")
    (cxl / "region0" / "dax_region0" / "dax0.0").mkdir(parents=True)
    (root / "bus/dax/devices/dax0.0").mkdir(parents=True)
    attrs(root / "bus/dax/drivers/device_dax", new_id="", bind="")
    attrs(root / "bus/cxl/drivers/cxl_region", bind="", unbind="")
    return cxl


def run(root: Path, plan: str) -> subprocess.CompletedProcess:
    return subprocess.run([SH, str(SCRIPT)], input=plan, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SYSFS": str(root)})


def read(path: Path) -> str:
    return path.read_text().strip()


def test_the_lab_writes_a_text_plan_for_ram_regions_only():
    ram = {"name": "r0", "type": "ram", "window": 0, "granularity": 8192, "use": "devdax", "serials": [4096, 4097]}
    assert ram_regions_plan({"pmem": False, "regions": [ram]}) == "r0 0 8192 4096,4097\n"
    assert ram_regions_plan({"pmem": True, "regions": [ram]}) is None
    assert ram_regions_plan({"pmem": False, "regions": [{**ram, "use": "fsdax"}]}) is None


def test_a_two_way_region_takes_the_smaller_free_ram_and_the_first_free_decoders(tmp_path):
    cxl = tree(tmp_path, rams=(512 * MIB, 256 * MIB + 4096))
    (cxl / "endpoint2/decoder2.0/dpa_size").write_text("0x10000000\n")   # taken: 256 MiB of mem0's ram
    (cxl / "endpoint2/decoder2.0/mode").write_text("ram\n")
    ran = run(tmp_path, "r0 0 4096 0x1001,4096\n")
    assert ran.returncode == 0, ran.stderr
    # as the kernel would report them once committed (the fake's files hold what was written)
    (made,) = json.loads(ran.stdout)
    assert made == {"name": "r0", "region": "region0", "type": "ram", "memdevs": ["mem1", "mem0"],
                    "size": 512 * MIB, "ways": 2, "granularity": 4096, "use": "devdax", "dax": "dax0.0"}
    region = cxl / "region0"
    assert [read(region / f"target{i}") for i in range(2)] == ["decoder3.0", "decoder2.1"]
    assert (read(region / "commit"), read(region / "size")) == ("1", str(512 * MIB))
    assert read(cxl / "endpoint2/decoder2.1/dpa_size") == str(256 * MIB) == read(cxl / "endpoint3/decoder3.0/dpa_size")
    assert read(cxl / "endpoint3/decoder3.0/mode") == "ram"
    assert read(cxl / "root0/decoder0.0/create_ram_region") == "region0"
    assert read(tmp_path / "bus/cxl/drivers/cxl_region/bind") == "region0"
    assert read(tmp_path / "bus/dax/drivers/device_dax/new_id") == "dax0.0"


def test_a_failed_step_takes_the_region_apart_and_says_which(tmp_path):
    cxl = tree(tmp_path)
    (cxl / "region0" / "commit").unlink()
    (cxl / "region0" / "commit").mkdir()          # a write that fails, as a refused commit does
    ran = run(tmp_path, "r0 0 8192 4096\n")
    assert ran.returncode == 1 and ran.stdout == "["
    assert f"writing '1' to {cxl}/region0/commit failed" in ran.stderr
    assert "region r0: region0 taken apart again" in ran.stderr
    assert read(cxl / "region0/target0") == "" and read(cxl / "endpoint2/decoder2.0/dpa_size") == "0"
    assert read(cxl / "root0/decoder0.0/delete_region") == "region0"
    assert read(tmp_path / "bus/cxl/drivers/cxl_region/unbind") == "region0"


@pytest.mark.parametrize("plan, error", [
    ("r0 1 8192 4096\n", "no root decoder for window 1 (the guest has 1)"),
    ("r0 0 8192 4096\n", "region r0: no free ram on its memdevs"),
])
def test_what_cannot_be_made_is_named_before_anything_is_written(tmp_path, plan, error):
    cxl = tree(tmp_path, rams=(128 * MIB, 128 * MIB))
    ran = run(tmp_path, plan)
    assert ran.returncode == 1 and error in ran.stderr, ran.stderr
    assert read(cxl / "root0/decoder0.0/create_ram_region") == "region0" and read(cxl / "region0/commit") == "0"
