"""The options of every command that boots VMs: --kernel/--modules/--append.  Apart from
lab/kernel.py, so that building the CLI's parser (every vfio-cxl command, fm assign included)
does not import the kernel build's machinery."""

from __future__ import annotations

import argparse


def add_kernel_options(parser: argparse.ArgumentParser) -> None:
    """--kernel/--modules/--append, for every command that boots VMs."""
    parser.add_argument("--kernel", metavar="PATH|lab",
                        help="boot this bzImage instead of the image's Debian kernel; 'lab' is the lab "
                             "kernel (IOMMUFD; built by 'vfio-cxl provision --kernel lab')")
    parser.add_argument("--modules", metavar="DIR",
                        help="the kernel's modules tree (lib/modules/<release>), shared read-only to the guest")
    parser.add_argument("--append", metavar="ARGS", help="extra kernel command line")
