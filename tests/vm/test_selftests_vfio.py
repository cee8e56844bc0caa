"""Issue: the kernel's own VFIO selftests run in the lab, on the GPU and an emulated igb, on both
IOMMU backends (``vfio-cxl selftest vfio``).

The real selftests (built from the lab kernel's source, with the GPU's selftests driver linked
in) run in the ``selftest`` topology: on the image's Debian kernel (no IOMMUFD: type1 cases
pass, iommufd cases say "needs IOMMUFD"), and on the lab kernel (every mode).  One boot per
kernel; the Debian run shares its boot with the topology agreement test.  Filters keep the runs
to the cases that matter for the issue (a full run is the CLI's job: see docs/selftests.md).
"""

from __future__ import annotations

from collections import Counter

import pytest

from vfio_cxl.lab import selftests
from vfio_cxl.lab.selftests import FAIL, KERNEL_DIFFERENCE, LAB_LIMIT, NEEDS_IOMMUFD, PASS, SKIP

GPU, IGB = "gpu0 (0601:1991)", "igb (8086:10c9)"
TYPE1 = set(selftests.BACKENDS["type1"])


@pytest.fixture(scope="module")
def build():
    return selftests.build_selftests()


def run(lab, build, backend, filters, tmp_path):
    plan = selftests.Plan.make(build, backend, filters)
    results, guest = selftests.run(lab, "host0", build, plan, tmp_path)
    print(selftests.table(results))
    # every planned case on every device it applies to has exactly one row
    assert len(results) == len({(r.test, r.case, r.device, r.backend) for r in results})
    return results, guest


def rows(results, test, device=None, result=None):
    return [r for r in results if r.test == test and (device is None or r.device == device)
            and (result is None or r.result == result)]


# mix_and_match is vfio_pci_driver_test in one case: ten rounds of memcpy (checked), memcpy from an
# unmapped IOVA (the device's error path) and an MSI, after one 1 GiB setup (the slow part under TCG).
DEBIAN_FILTERS = ["vfio_pci_driver_test.*mix_and_match", "vfio_pci_device_test.*", "*dma_map_limit_test*",
                  "vfio_iommufd_setup_test.vfio_cdev.bind"]


def test_debian_kernel_type1_passes_and_iommufd_needs_iommufd(selftest_lab, build, tmp_path):
    results, guest = run(selftest_lab, build, "all", DEBIAN_FILTERS, tmp_path)
    assert not guest["iommufd"] and guest["kernel"].startswith("6.")
    assert not [r for r in results if r.result == FAIL], selftests.table(results)
    for r in results:
        if r.backend in TYPE1:
            allowed = {PASS}
            if r.case == "vfio_pci_irq_test.msi.enable_trigger_disable" and r.device == GPU:
                allowed = {SKIP}                    # the GPU has MSI-X, no MSI capability
            if r.case == "vfio_dma_map_limit_test.overflow":
                allowed = {KERNEL_DIFFERENCE}       # 6.x: EINVAL where the test expects EOVERFLOW
            assert r.result in allowed, r
        else:
            assert r.result == NEEDS_IOMMUFD, r
    # the DMA engines: the GPU's (our driver, HOST_TO_HOST descriptors) and igb's
    for device in (GPU, IGB):
        passed = {r.backend for r in rows(results, "vfio_pci_driver_test", device, PASS)}
        assert passed == TYPE1, device
    assert rows(results, "vfio_iommufd_setup_test") and \
        all(r.result == NEEDS_IOMMUFD for r in rows(results, "vfio_iommufd_setup_test"))
    # TAP logs are kept, one per run
    assert len(list(tmp_path.glob("vfio_pci_driver_test--gpu0--*.tap.log"))) == 1


LAB_TESTS = ["vfio_pci_device_test", "vfio_dma_mapping_test", "vfio_dma_mapping_mmio_test",
             "vfio_iommufd_setup_test", "vfio_pci_driver_test"]
LAB_FILTERS = [f"{t}.*" for t in LAB_TESTS[:4]] + ["vfio_pci_driver_test.*mix_and_match"]


def test_lab_kernel_every_backend(selftest_lab_kernel_lab, build, tmp_path):
    results, guest = run(selftest_lab_kernel_lab, build, "all", LAB_FILTERS, tmp_path)
    assert guest["iommufd"] and guest["kernel"].startswith("7.")
    assert not [r for r in results if r.result in (FAIL, NEEDS_IOMMUFD, KERNEL_DIFFERENCE)], \
        selftests.table(results)
    assert not [r for r in results if r.result == LAB_LIMIT], selftests.table(results)
    skips = Counter((r.device, r.case, r.note) for r in results if r.result == SKIP)
    for (device, case, note) in skips:
        assert note, (device, case)             # every skip says why
        assert case in ("vfio_pci_irq_test.msi.enable_trigger_disable", "anonymous_hugetlb_1gb.dma_map_unmap"), \
            (device, case, note)
    for device in (GPU, IGB):
        driver = rows(results, "vfio_pci_driver_test", device)
        assert {r.backend for r in driver} == set(selftests.MODES)
        for r in driver:    # the GPU's iommufd_compat_type1: 262144 4 KiB DMA_MAPs (docs/kernels.md)
            assert r.result == PASS, r
    for test in LAB_TESTS:
        assert {r.backend for r in rows(results, test, GPU)} >= ({"iommufd"} if test == "vfio_iommufd_setup_test"
                                                               else set(selftests.MODES)), test
