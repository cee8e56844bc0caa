"""The guest-kernel option the benchmarks that boot a lab share."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_kernel_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernel", choices=("distro", "lab"), default="distro",
                        help="the guest kernel: Debian's 6.12 (no IOMMUFD) or the lab kernel (7.3)")


def guest_kernel(args: argparse.Namespace) -> Path | None:
    """The kernel ``--kernel`` names: None for the guest image's own, else the cached lab kernel
    (an error naming the provision command when it is not built)."""
    if args.kernel != "lab":
        return None
    from ..lab.kernel import lab_kernel
    return lab_kernel(provision=False)
