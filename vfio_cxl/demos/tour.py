"""A tour of the single-host lab: boot it and show what the guest sees."""

from __future__ import annotations

import argparse

from ..lab import topology
from ..lab.kernel import add_kernel_options, resolve
from ..lab.lab import Lab

SECTIONS = [
    ("vIOMMU (intel-iommu DMAR)", "ls /sys/class/iommu; dmesg | grep -m2 -E 'DMAR: (Intel|IOMMU enabled)' || true"),
    ("IOMMU groups", "ls /sys/kernel/iommu_groups | wc -l"),
    ("PCI devices", "lspci -nn"),
    ("CXL tree (cxl list -M -P)", "cxl list -M -P"),
    ("The GPU (0601:1991)", "lspci -vv -d 0601:1991 | grep -E '3D|Region|MSI-X|Express'"),
]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vfio-cxl demo tour", description=__doc__)
    add_kernel_options(parser)
    args = parser.parse_args(argv)
    kernel = resolve(args.kernel, args.modules, args.append or "")
    with Lab(topology.load("single"), kernel=kernel) as lab:
        vm = lab["host0"]
        for title, command in SECTIONS:
            print(f"\n== {title}\n{vm.run(command).stdout.rstrip()}")
    return 0
