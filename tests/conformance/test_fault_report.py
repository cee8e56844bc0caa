"""The one DMA message the spec's rule forbids on purpose: the report of an unmapped-DMA
fault (docs/gpu-device.md, "IOMMU faults the guest sees", and departure 5).

DMA_READ / DMA_WRITE: "This address must have been previously exported to the server with a
VFIO_USER_DMA_MAP message."  By default the device breaks that rule for exactly one message
per fault -- 4 bytes at the faulting IOVA, in the access's direction -- so that QEMU's vIOMMU
sees the access; the client refuses it (ENODEV, as QEMU does) and the device halts DMA_UNMAPPED at that IOVA.  This
module runs the server without ``--local-dma-faults``."""

from __future__ import annotations

import pytest

from vfio_cxl.bench import gpu_doc as gpu
from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import Rig, Server

FAR = 0x5000_0000


@pytest.fixture(scope="module")
def server():
    srv = Server(extra=())
    yield srv
    srv.close()


@pytest.fixture
def rig(peer):
    r = Rig(peer)
    yield r
    r.close()


@pytest.mark.parametrize("op, command", [(gpu.OP_VRAM_TO_HOST, vu.DMA_WRITE),
                                         (gpu.OP_HOST_TO_VRAM, vu.DMA_READ)])
def test_an_unmapped_iova_gets_one_4_byte_report_then_the_device_halts(peer, rig, op, command):
    src, dst = (0, FAR) if op == gpu.OP_VRAM_TO_HOST else (FAR, 0)
    rig.submit(gpu.descriptor(op, src, dst, 8192))
    assert rig.wait_idle(20.0) & gpu.STATUS_HALTED
    assert peer.read32(gpu.ERR_STATUS) == gpu.ST_DMA_UNMAPPED
    assert peer.read32(gpu.ERR_ADDR_LO) | peer.read32(gpu.ERR_ADDR_HI) << 32 == FAR
    reports = [r for r in peer.dma_log if r.address == FAR]
    assert [(r.command, r.count, r.refused) for r in reports] == [(command, 4, True)]
    # the departure, and nothing else: the harness's record of the broken rule is that message
    name = "DMA_WRITE" if command == vu.DMA_WRITE else "DMA_READ"
    assert peer.violations == [f"{name} {FAR:#x}+0x4 outside every live DMA_MAP window"]
