"""The options the benchmarks that boot a lab share: the guest kernel, the QEMU build."""

from __future__ import annotations

import argparse
import os
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


def kernel_asked(args: argparse.Namespace) -> str | None:
    """The kernel a borrowed lab (``--lab``) must run: "lab" when ``--kernel lab`` was given; the
    default asks for none."""
    return "lab" if args.kernel == "lab" else None


def add_qemu_build_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--qemu", metavar="PATH",
                        help="another qemu-system-x86_64 build (e.g. a stock one), checked as the lab's is; "
                             "the same as VFIO_CXL_QEMU=PATH")


def use_qemu_build(args: argparse.Namespace) -> str:
    """Boot with ``--qemu`` when given (VFIO_CXL_QEMU, which the lab reads); -> what to report: its
    path, or "stock" (the lab's own runtime: Debian's QEMU package, unpatched)."""
    if not args.qemu:
        return "stock"
    from ..lab.qemu_runtime import QEMU_ENV
    os.environ[QEMU_ENV] = os.path.abspath(os.path.expanduser(args.qemu))
    return os.environ[QEMU_ENV]
