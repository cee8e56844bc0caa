"""A tour of the single-host lab: boot it and show what the guest sees."""

from __future__ import annotations

from ..lab import topology
from ..lab.lab import Lab

SECTIONS = [
    ("vIOMMU (intel-iommu DMAR)", "ls /sys/class/iommu; dmesg | grep -m2 -E 'DMAR: (Intel|IOMMU enabled)' || true"),
    ("IOMMU groups", "ls /sys/kernel/iommu_groups | wc -l"),
    ("PCI devices", "lspci -nn"),
    ("CXL tree (cxl list -M -P)", "cxl list -M -P"),
    ("The GPU (0601:1991)", "lspci -vv -d 0601:1991 | grep -E '3D|Region|MSI-X|Express'"),
]


def main(argv: list[str]) -> int:
    with Lab(topology.load("single")) as lab:
        vm = lab["host0"]
        for title, command in SECTIONS:
            print(f"\n== {title}\n{vm.run(command).stdout.rstrip()}")
    return 0
