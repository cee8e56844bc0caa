"""vfio-cxl selftest vfio: the parts that need no VM (plan, TAP parsing, classification,
the C driver's register header against regs.py).  Case lists come from a fake build
with the real selftests' names; the VM tests run the real binaries."""

import re

import pytest

from vfio_cxl.devices.gpu import regs
from vfio_cxl.errors import LabError
from vfio_cxl.lab import selftests
from vfio_cxl.lab.selftests import Build, Case, Plan, classify, parse_tap

MODES = selftests.MODES


def fake_build(tmp_path) -> Build:
    cases = {
        "vfio_pci_device_test": [Case("vfio_pci_device_test", "vfio_pci_device_test", "", "reset", 30),
                                 Case("vfio_pci_device_test", "vfio_pci_irq_test", "msi", "enable_trigger_disable", 30)],
        "vfio_dma_mapping_test": [Case("vfio_dma_mapping_test", "vfio_dma_map_limit_test", m, "overflow", 30)
                                  for m in MODES]
        + [Case("vfio_dma_mapping_test", "vfio_dma_mapping_test", f"{m}_anonymous_hugetlb_2mb", "dma_map_unmap", 30)
           for m in MODES],
        "vfio_iommufd_setup_test": [Case("vfio_iommufd_setup_test", "vfio_cdev", "", "bind", 30)],
    }
    return Build(tmp_path, "7.3.4", cases)


def test_case_mode_and_label():
    c = Case("vfio_dma_mapping_test", "vfio_dma_mapping_test", "iommufd_compat_type1v2_anonymous", "dma_map_unmap", 30)
    assert c.mode == "iommufd_compat_type1v2" and c.label == "anonymous.dma_map_unmap"
    assert c.harness_name == "vfio_dma_mapping_test.iommufd_compat_type1v2_anonymous.dma_map_unmap"
    d = Case("vfio_pci_device_test", "vfio_pci_irq_test", "msix", "enable_trigger_disable", 30)
    assert d.mode is None and d.label == "vfio_pci_irq_test.msix.enable_trigger_disable"
    assert Case("t", "f", "vfio_type1_iommu", "x", 30).mode == "vfio_type1_iommu"


def test_plan_selects_modes_and_filters(tmp_path):
    build = fake_build(tmp_path)
    plan = Plan.make(build, "type1")
    assert plan.modes == MODES[:2]
    assert {c.mode for c in plan.cases["vfio_dma_mapping_test"]} == set(MODES[:2])
    assert "vfio_iommufd_setup_test" not in plan.cases   # the cdev test is iommufd's own
    plan = Plan.make(build, "all", ["overflow"])
    assert list(plan.cases) == ["vfio_dma_mapping_test"] and len(plan.cases["vfio_dma_mapping_test"]) == 5
    assert Plan.make(build, "iommufd", ["*hugetlb*"]).count() == 3


def test_bad_backend_and_filter_are_errors_before_anything_runs(tmp_path):
    build = fake_build(tmp_path)
    with pytest.raises(LabError, match="unknown backend 'type2'.*type1, iommufd, all"):
        Plan.make(build, "type2")
    with pytest.raises(LabError, match="no case matches -k nosuch.*tests: vfio_dma_mapping_test"):
        Plan.make(build, "all", ["nosuch"])


TAP = """TAP version 13
1..3
# Starting 3 tests from 2 test cases.
#  RUN           vfio_dma_map_limit_test.vfio_type1_iommu.overflow ...
# vfio_dma_mapping_test.c:297:overflow:Expected rc (-22) == -EOVERFLOW (-75)
# overflow: Test terminated by assertion
#          FAIL  vfio_dma_map_limit_test.vfio_type1_iommu.overflow
not ok 1 vfio_dma_map_limit_test.vfio_type1_iommu.overflow
#  RUN           vfio_pci_irq_test.msi.enable_trigger_disable ...
#      SKIP      MSI: not supported
#            OK  vfio_pci_irq_test.msi.enable_trigger_disable
ok 2 vfio_pci_irq_test.msi.enable_trigger_disable # SKIP MSI: not supported
#  RUN           vfio_pci_device_test.reset ...
#            OK  vfio_pci_device_test.reset
ok 3 vfio_pci_device_test.reset
# Totals: pass:1 fail:1 xfail:0 xpass:0 skip:1 error:0
# exit 1
"""


def test_tap_parsing_and_classification():
    tap = parse_tap(TAP)
    assert tap["vfio_pci_device_test.reset"][0] == "ok"
    assert tap["vfio_pci_irq_test.msi.enable_trigger_disable"][1:] == ("SKIP", "MSI: not supported")
    overflow = Case("vfio_dma_mapping_test", "vfio_dma_map_limit_test", "vfio_type1_iommu", "overflow", 30)
    entry = tap[overflow.harness_name]
    # 6.12 returns EINVAL: a known kernel difference there, a failure on a 7.x kernel
    assert classify("vfio_dma_mapping_test", overflow, "vfio_type1_iommu", entry, iommufd=False,
                    kernel="6.12.117+deb13-amd64")[0] == selftests.KERNEL_DIFFERENCE
    result, note = classify("vfio_dma_mapping_test", overflow, "vfio_type1_iommu", entry, iommufd=True,
                            kernel="7.3.4-vfio-cxl-lab")
    assert result == selftests.FAIL and "EOVERFLOW" in note
    # another failure of the same case is not hidden as a difference
    other = ("not ok", "", "# vfio_dma_mapping_test.c:297:overflow:Expected rc (-12) == -EOVERFLOW (-75)")
    assert classify("vfio_dma_mapping_test", overflow, "vfio_type1_iommu", other, iommufd=False,
                    kernel="6.12.117")[0] == selftests.FAIL
    msi = Case("vfio_pci_device_test", "vfio_pci_irq_test", "msi", "enable_trigger_disable", 30)
    assert classify("vfio_pci_device_test", msi, "iommufd", tap[msi.harness_name], iommufd=True,
                    kernel="7.3.4") == (selftests.SKIP, "MSI: not supported")


def test_iommufd_cases_on_a_kernel_without_it_need_iommufd():
    bind = Case("vfio_iommufd_setup_test", "vfio_cdev", "", "bind", 30)
    # main() failed before the harness ran anything
    assert classify("vfio_iommufd_setup_test", bind, "iommufd", None, iommufd=False, kernel="6.12",
                    main_output="Assertion Failure\n# exit 1")[0] == selftests.NEEDS_IOMMUFD
    assert classify("vfio_iommufd_setup_test", bind, "iommufd", None, iommufd=True, kernel="7.3",
                    main_output="boom\n# exit 1") == (selftests.FAIL, "boom")
    assert classify("t", bind, "vfio_type1_iommu", None, iommufd=True, kernel="7.3",
                    main_output="No driver found for device 0000:01:00.0\n# exit 4") == \
        (selftests.SKIP, "No driver found for device 0000:01:00.0")


def test_summary_counts_only_passes_and_fails():
    r = [selftests.Result("t", "c", "gpu0 (0601:1991)", m, res) for m, res in
         zip(MODES, [selftests.PASS, selftests.FAIL, selftests.SKIP, selftests.NEEDS_IOMMUFD,
                     selftests.KERNEL_DIFFERENCE])]
    s = selftests.summary(r)
    assert (s["passed"], s["failed"]) == (1, 1) and len(s["results"]) == 5
    assert set(s["results"][0]) >= {"test", "case", "device", "backend", "result"}
    assert "1 pass, 1 fail, 1 skip, 1 needs IOMMUFD, 1 kernel difference, 0 lab limit" in selftests.table(r)


class FakeVm:
    def __init__(self):
        self.commands = []

    def run(self, command, **kwargs):
        self.commands.append(command)
        raise AssertionError("a limited case must not run")


def test_lab_limit_cases_are_reported_not_run(tmp_path, monkeypatch):
    # LAB_LIMITS is empty today; this checks the mechanism with a limit of our own
    monkeypatch.setattr(selftests, "LAB_LIMITS", (selftests.LabLimit(
        "vfio_pci_driver_test", "iommufd_compat_type1", selftests.GPU_PCI_ID, "262144 reasons"),))
    gpu = selftests.Device("gpu0", selftests.GPU_PCI_ID, "0000:01:00.0")
    case = Case("vfio_pci_driver_test", "vfio_pci_driver_test", "iommufd_compat_type1", "memcpy_success", 30)
    vm = FakeVm()
    (result,) = selftests.run_test_binary(vm, "vfio_pci_driver_test", gpu, "iommufd",
                                      [(case, "iommufd_compat_type1")], {}, tmp_path, print)
    assert result.result == selftests.LAB_LIMIT and "262144" in result.note and vm.commands == []
    # on a kernel without IOMMUFD the case needs IOMMUFD first of all
    (result,) = selftests.run_test_binary(vm, "vfio_pci_driver_test", gpu, "vfio_type1v2_iommu",
                                          [(case, "iommufd_compat_type1")], {"iommufd": False}, tmp_path, print)
    assert result.result == selftests.NEEDS_IOMMUFD and vm.commands == []


def test_c_register_header_agrees_with_regs_py():
    text = (selftests.DRIVER_DIR / "registers.h").read_text()
    defs = {name: int(value, 0) for name, value in re.findall(r"#define (GPU_\w+)\s+\(?(0x[0-9a-fA-F]+|\d+)", text)}
    for name in ("ID", "VERSION", "CAPS", "RING_MAX", "CONTROL", "STATUS", "INTR_STATUS", "RING_BASE_LO",
                 "RING_BASE_HI", "RING_SIZE", "RING_HEAD", "RING_TAIL", "COMPL_BASE_LO", "COMPL_BASE_HI",
                 "COMPLETED", "ERR_STATUS", "ERR_DESC_INDEX", "ERR_ADDR_LO", "ERR_ADDR_HI", "ERR_ERRNO"):
        assert defs[f"GPU_REG_{name}"] == getattr(regs, f"REG_{name}"), name
    for op in regs.Op:
        assert defs[f"GPU_OP_{op.name}"] == op
    assert defs["GPU_ID_MAGIC"] == regs.ID_MAGIC
    assert (defs["GPU_VEC_DMA_DONE"], defs["GPU_VEC_ERROR"], defs["GPU_VECTORS"]) == \
        (regs.VEC_DMA_DONE, regs.VEC_ERROR, regs.MSIX_VECTORS)
    assert f'{defs["GPU_PCI_VENDOR_ID"]:04x}:{defs["GPU_PCI_DEVICE_ID"]:04x}' == selftests.GPU_PCI_ID
    assert (regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID) == (defs["GPU_PCI_VENDOR_ID"], defs["GPU_PCI_DEVICE_ID"])
    status_names = re.search(r"gpu_status_names\[\] = \{(.*?)\};", (selftests.DRIVER_DIR / "gpu.c").read_text(), re.S)
    assert re.findall(r'"(\w+)"', status_names.group(1)) == [s.name for s in regs.Status]
