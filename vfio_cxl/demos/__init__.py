"""Demos, run from the host: each boots what it needs and drives the guests over SSH.

    vfio-cxl demo tour    what the single-host lab's guest sees
    vfio-cxl demo dma     the GPU DMAs into CXL devdax through VFIO (route B)
    vfio-cxl demo share   two hosts, one CXL memory: A's GPU writes, B reads
    vfio-cxl demo p2p     one GPU DMAs straight into another GPU's VRAM (p2p topology)
"""

from __future__ import annotations

import importlib

from ..errors import LabError

DEMOS = {
    "tour": "vfio_cxl.demos.tour",
    "dma": "vfio_cxl.demos.dma",
    "share": "vfio_cxl.demos.share",
    "p2p": "vfio_cxl.demos.p2p",
}


def run_demo(name: str, argv: list[str]) -> int:
    if name not in DEMOS:
        raise LabError(f"unknown demo {name!r}", f"use one of: {', '.join(DEMOS)}")
    return importlib.import_module(DEMOS[name]).main(argv)
