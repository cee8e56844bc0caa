"""The guest's VFIO stack on both backends: type1 (container/group) and iommufd (/dev/iommu + cdev).

Debian's kernel has no IOMMUFD: there the stack runs type1.  The lab kernel
has both, so the same demo and isolation check run on each backend there.
The driver and demos are the same code either way; only the guest's
VFIO_CXL_VFIO_BACKEND differs.
"""

import json
import re

import pytest

from vfio_cxl.demos.dma import run_in_lab
from vfio_cxl.devices.gpu import regs


def isolation(vm, backend):
    return json.loads(vm.run(f"VFIO_CXL_VFIO_BACKEND={backend} vfio-cxl-m vfio_cxl.guest.cmd.gpu_checks isolation",
                             timeout=300).stdout)


def gpu_ls(vm):
    """`vfio-cxl gpu ls` once the GPU is bound to vfio-pci (the demo hands it back unbound)."""
    vm.run("vfio-cxl gpu bind")
    return json.loads(vm.run("vfio-cxl gpu ls --json").stdout)["gpus"]


def check_isolation(result):
    fault = result["fault"]
    assert fault is not None, "a DMA to an unmapped IOVA succeeded"
    assert fault["status"] in ("DMA_REFUSED", "DMA_UNMAPPED") and fault["cookie"] == 0xBAD, fault
    assert result["dax_unchanged"] and result["canary_unchanged"] and result["recovered"]


def test_debian_kernel_has_no_iommufd_and_auto_means_type1(single_lab):
    vm = single_lab["host0"]
    assert vm.run("test -e /dev/iommu", check=False).exited != 0
    result = run_in_lab(single_lab, 1 << 20, 0)
    assert result["vfio_backend"] == "type1" and result["match"] and result["host_file_match"]
    assert [g["vfio_backend"] for g in gpu_ls(vm)] == ["type1"]


def test_lab_kernel_boots_with_iommufd_and_the_vfio_cdev(lab_kernel_lab):
    vm = lab_kernel_lab["host0"]
    assert "vfio-cxl-lab" in vm.run("uname -r").stdout
    assert vm.run("test -c /dev/iommu && zcat /proc/config.gz | grep -x CONFIG_IOMMUFD=y", check=False).exited == 0
    memdevs = json.loads(vm.run("cxl list -M").stdout or "[]")
    assert len(memdevs) == 1, memdevs   # the Type3 device, found by the built-in CXL drivers


def test_the_lab_kernel_is_given_its_apic_timer_period_and_keeps_time_with_it(lab_kernel_lab):
    """Under TCG the lab kernel is told its local APIC timer period (lapic_timer_period=,
    10**9 / HZ: QEMU's TCG APIC counts nanoseconds) instead of calibrating it: the lapic clock
    event's mult (/proc/timer_list) is the one made from that period exactly, not from a
    measured one, and a timer armed through it fires when due by the TSC clock."""
    vm = lab_kernel_lab["host0"]
    hz = int(vm.run("zcat /proc/config.gz | grep ^CONFIG_HZ=").stdout.strip().split("=")[1])
    period = 10**9 // hz
    cmdline = vm.run("cat /proc/cmdline").stdout.split()
    assert f"lapic_timer_period={period}" in cmdline and "initmem_poison=off" in cmdline
    # the kernel took both: an unknown parameter would be handed to init, and dmesg says so
    assert "Unknown kernel command line parameters" not in vm.run("dmesg").stdout
    tick_nsec = (10**9 + hz // 2) // hz
    mults = set(re.findall(r"Clock Event Device: lapic\n(?:.*\n)*? mult:\s+(\d+)",
                           vm.run("cat /proc/timer_list").stdout))
    assert mults == {str(((period // 16) << 32) // tick_nsec)}, mults   # div_sc(period / 16, TICK_NSEC, 32)
    slept = json.loads(vm.run("python3 -c 'import json, time\n"
                              "def nap():\n t = time.monotonic(); time.sleep(0.2); return time.monotonic() - t\n"
                              "print(json.dumps([nap() for _ in range(3)]))'").stdout)
    assert 0.2 <= min(slept) < 0.24, slept   # a period off by a fifth would show here


@pytest.mark.parametrize("backend", ["iommufd", "type1"])
def test_dma_demo_on_the_lab_kernel(lab_kernel_lab, backend):
    result = run_in_lab(lab_kernel_lab, 16 << 20, 0, backend)
    assert result["vfio_backend"] == backend
    assert result["message"] == "DMA FROM GPU TO CXL MEMORY" and result["bytes"] == 16 << 20
    assert result["match"], result
    assert result["host_file_match"]


def test_auto_picks_iommufd_on_the_lab_kernel(lab_kernel_lab):
    result = run_in_lab(lab_kernel_lab, 1 << 20, 0, "auto")
    assert result["vfio_backend"] == "iommufd" and result["match"] and result["host_file_match"]
    gpus = gpu_ls(lab_kernel_lab["host0"])
    assert gpus, "vfio-cxl gpu ls found no GPU"
    for gpu in gpus:
        assert gpu["vfio_backend"] == "iommufd" and gpu["vfio_paths"][0].startswith("/dev/vfio/devices/vfio"), gpu


@pytest.mark.parametrize("backend", ["iommufd", "type1"])
def test_iommu_isolation_on_the_lab_kernel(lab_kernel_lab, backend):
    result = isolation(lab_kernel_lab["host0"], backend)
    assert result["vfio_backend"] == backend
    check_isolation(result)


@pytest.mark.parametrize("backend", ["iommufd", "type1"])
def test_routes_a_and_b_on_the_lab_kernel(lab_kernel_lab, backend):
    size = 1 << 20
    vm = lab_kernel_lab["host0"]
    rows = json.loads(vm.run(f"VFIO_CXL_VFIO_BACKEND={backend} vfio-cxl-m vfio_cxl.guest.cmd.bench_routes "
                             f"--sizes 1M --runs 1", timeout=300).stdout)
    assert [(r["copies"], r["size"]) for r in rows] == [(2, size), (1, size)]
    assert all(r["mb_per_s"] > 0 for r in rows)
    # Route B ran last: devdax (and so the host's backend file) holds the GPU's PRNG fill.
    assert lab_kernel_lab.read_backend("cxl0", 0, size) == regs.prng_bytes(size, size)
