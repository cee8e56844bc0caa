"""The GPU in a real guest: PCI identity, DMA into CXL devdax, IOMMU isolation, many transfers."""

import json
import re

from vfio_cxl.demos.dma import run_in_lab
from vfio_cxl.devices.gpu import regs


def test_guest_sees_the_gpu_as_specified(single_lab):
    vm = single_lab["host0"]
    lspci = vm.run("lspci -nn -vv -d 0601:1991").stdout
    assert re.search(r"3D controller \[0302\]: .*\[0601:1991\]", lspci), lspci
    assert "MSI-X: Enable" in lspci and f"Count={regs.MSIX_VECTORS}" in lspci
    assert "Express (v2) Endpoint" in lspci or "Express Endpoint" in lspci
    sizes = dict(re.findall(r"Region (\d): Memory at \S+ \([^)]*\) \[size=(\w+)\]", lspci))
    assert sizes == {"0": "4K", "2": "64M", "4": "4K"}, sizes
    assert re.search(r"Region 2: Memory at \S+ \(64-bit, prefetchable\)", lspci)


def test_demo_dma_lands_byte_exact_in_devdax_and_the_host_file(single_lab):
    result = run_in_lab(single_lab, 1 << 20, 0)
    assert result["message"] == "DMA FROM GPU TO CXL MEMORY"
    assert result["bytes"] == 1 << 20
    assert result["match"], result          # read back through the devdax mapping
    assert result["host_file_match"]        # and in the CXL memory backend file


def test_unmapped_iova_faults_without_touching_memory(single_lab):
    vm = single_lab["host0"]
    result = json.loads(vm.run("vfio-cxl-m vfio_cxl.guest.cmd.gpu_checks isolation", timeout=300).stdout)
    fault = result["fault"]
    assert fault is not None, "a DMA to an unmapped IOVA succeeded"
    # the device checks QEMU's DMA_MAPs itself, like an IOMMU: only the fault's 4-byte report
    # reaches QEMU, whose vIOMMU refuses it (tests/vm/test_iommu_faults.py)
    assert fault["status"] == "DMA_UNMAPPED" and fault["cookie"] == 0xBAD, fault
    assert fault["address"] == 0x7000_0000 and fault["errno"] == 0, fault
    assert result["dax_unchanged"] and result["canary_unchanged"]
    assert result["recovered"]


def test_100_random_transfers_verify_and_leave_nothing_mapped(single_lab):
    vm = single_lab["host0"]
    result = json.loads(vm.run("vfio-cxl-m vfio_cxl.guest.cmd.gpu_checks random --count 100 --seed 7",
                               timeout=600).stdout)
    assert result["verified"] == 100, result["failures"]
    assert result["mappings_after_unmap"] == 0
    assert result["fds_leaked"] == []


def test_msi_mode_runs_the_demo(fabric_lab):
    """Stretch: the GPU with --irq-mode msi (needed for hot-remove with QEMU 11.1.3):
    the guest sees MSI, no MSI-X, and the DMA demo completes on MSI vectors.  The fabric
    topology's GPUs run so (irq = "msi"): gpu0 in VM a, whose RAM region is on "shared"
    (the pool boots fabric once, for this and the topology agreement test)."""
    vm = fabric_lab["a"]
    lspci = vm.run("lspci -vv -d 0601:1991").stdout
    assert re.search(r"MSI: Enable[+-] Count=\d+/4 .*64bit\+", lspci) and "MSI-X" not in lspci, lspci
    sizes = dict(re.findall(r"Region (\d): Memory at \S+ \([^)]*\) \[size=(\w+)\]", lspci))
    assert sizes == {"0": "4K", "2": "64M"}, sizes
    result = run_in_lab(fabric_lab, 1 << 20, 0, vm="a", backend="shared")
    assert result["match"] and result["host_file_match"], result
