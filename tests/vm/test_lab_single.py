"""Issue: the single-host lab boots and the guest sees the vIOMMU, the CXL switch,
the Type3 memdev, IOMMU groups and a free PCIe root port."""

from pathlib import PurePosixPath

from .conftest import guest_json


def test_guest_sees_intel_iommu_dmar(single_lab):
    vm = single_lab["host0"]
    assert "dmar0" in vm.run("ls /sys/class/iommu").stdout.split()
    assert "intel_iommu=on" in vm.run("cat /proc/cmdline").stdout


def test_guest_sees_cxl_switch_with_one_memdev(single_lab):
    listing = guest_json(single_lab["host0"], "cxl list -M -P")
    (root,) = listing                          # the host bridge's port
    (switch,) = root[f"ports:{root['port']}"]  # the switch's upstream port
    assert switch["depth"] == 2
    (memdev,) = switch[f"memdevs:{switch['port']}"]
    assert memdev["memdev"] == "mem0" and memdev["ram_size"] == 256 << 20
    # Our pyudev discovery agrees with cxl-cli.
    ours = guest_json(single_lab["host0"], "python3 -m vfio_cxl.guest.cxltool list")
    assert ours["switches"] == [switch["port"]]
    assert [(m["name"], m["ram_size"]) for m in ours["memdevs"]] == [("mem0", 256 << 20)]


def test_guest_has_iommu_groups(single_lab):
    vm = single_lab["host0"]
    groups = vm.run("ls /sys/kernel/iommu_groups").stdout.split()
    assert len(groups) >= 5
    # The Type3 device and the GPU each sit in an IOMMU group.
    for bdf in ("0000:0f:00.0", "0000:01:00.0"):
        group = vm.run(f"readlink /sys/bus/pci/devices/{bdf}/iommu_group").stdout.strip()
        assert PurePosixPath(group).name in groups


def test_a_pcie_root_port_is_free(single_lab):
    vm = single_lab["host0"]
    # QEMU root ports (1b36:000c) on bus 0 whose secondary bus holds no device.
    script = (
        "for p in /sys/bus/pci/devices/0000:00:*; do "
        "  [ \"$(cat $p/vendor):$(cat $p/device)\" = 0x1b36:0x000c ] || continue; "
        "  n=$(ls -d $p/0000:??:??.? 2>/dev/null | wc -l); echo \"${p##*/} $n\"; "
        "done")
    ports = dict(line.split() for line in vm.run(script).stdout.splitlines())
    assert len(ports) >= 2, ports
    assert "0" in ports.values(), f"no free root port: {ports}"
