"""A tour of the single-host lab: boot it and show what the guest sees."""

from __future__ import annotations

import argparse

from ..lab import topology
from ..lab.borrow import add_lab_option, asked_kernel, booted_or_borrowed
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
    add_lab_option(parser, "single")
    args = parser.parse_args(argv)

    def boot():
        return Lab(topology.load("single"), kernel=resolve(args.kernel, args.modules, args.append or ""))

    with booted_or_borrowed(args, "single", boot, command="vfio-cxl demo tour", kernel=asked_kernel(args.kernel)) as lab:
        vm = lab["host0"]
        for title, command in SECTIONS:
            print(f"\n== {title}\n{vm.run(command).stdout.rstrip()}")
    return 0
