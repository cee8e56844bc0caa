"""DEVICE_GET_INFO, DEVICE_GET_REGION_INFO, DEVICE_GET_IRQ_INFO (spec sections of
those names, and "Message sizes" for argsz)."""

from __future__ import annotations

import mmap
import os

import pytest

from vfio_cxl.bench import gpu_doc as gpu
from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import assert_error_reply, assert_ok_reply

VRAM = 16 << 20  # the fixture's --vram-mib 16
# region sizes per docs/gpu-device.md ("BARs"; config space 4 KiB)
REGION_SIZES = {0: 4096, 1: 0, 2: VRAM, 3: 0, 4: 4096, 5: 0, 6: 0, 7: 4096, 8: 0}


def device_info(peer, argsz=16):
    return peer.request(vu.DEVICE_GET_INFO, vu.DEVICE_INFO.pack(argsz, 0, 0, 0))


def region_info(peer, index, argsz=256):
    return peer.request(vu.DEVICE_GET_REGION_INFO, vu.REGION_INFO.pack(argsz, 0, index, 0, 0, 0))


def irq_info(peer, index, argsz=16):
    return peer.request(vu.DEVICE_GET_IRQ_INFO, vu.IRQ_INFO.pack(argsz, 0, index, 0))


# ---------------------------------------------------------------- DEVICE_GET_INFO
def test_device_info_reply(peer):
    """DEVICE_GET_INFO Reply: "argsz is the size required for the full reply payload
    (16 bytes today)", flags VFIO_DEVICE_FLAGS_PCI ("This version of the protocol
    only supports PCI devices") and RESET (the device takes DEVICE_RESET);
    num_regions "can be equal to, or higher than, VFIO_PCI_NUM_REGIONS"."""
    reply = device_info(peer)
    assert_ok_reply(reply, vu.DEVICE_GET_INFO)
    assert len(reply.payload) == 16
    argsz, flags, num_regions, num_irqs = vu.DEVICE_INFO.unpack(reply.payload)
    assert argsz == 16
    assert flags & vu.DEVICE_FLAGS_PCI and flags & vu.DEVICE_FLAGS_RESET
    assert num_regions >= vu.PCI_NUM_REGIONS
    assert num_irqs >= vu.PCI_NUM_IRQS


def test_device_info_with_a_larger_argsz_replies_with_the_size_needed(peer):
    """Message sizes: "In a reply, the server sets argsz field to the size needed for
    a full payload size. This may be less than the requested maximum size."""
    reply = device_info(peer, argsz=4096)
    assert_ok_reply(reply, vu.DEVICE_GET_INFO)
    assert len(reply.payload) == 16 and vu.DEVICE_INFO.unpack(reply.payload)[0] == 16


def test_device_info_short_payload_is_refused(peer):
    """DEVICE_GET_INFO request layout is 16 bytes (argsz, flags, num_regions,
    num_irqs); a shorter payload is an error, header only."""
    msg_id = peer.send(vu.DEVICE_GET_INFO, (16).to_bytes(4, "little"))
    assert_error_reply(peer.next_reply(), vu.DEVICE_GET_INFO, msg_id)


# ---------------------------------------------------------------- GET_REGION_INFO
@pytest.mark.parametrize("index", range(vu.PCI_NUM_REGIONS))
def test_region_info_of_every_pci_region(peer, index):
    """GET_REGION_INFO Reply: argsz "is the size required for the full reply payload
    (region info structure plus the size of any region capabilities)", index
    echoed, size as the device spec says; MMAP "When this flag is set, the reply
    will include a file descriptor"; with CAPS, cap_offset points at a
    vfio_info_cap_header chain inside argsz, sparse areas inside the region."""
    reply = region_info(peer, index)
    try:
        assert_ok_reply(reply, vu.DEVICE_GET_REGION_INFO)
        argsz, flags, idx, cap_offset, size, offset = vu.REGION_INFO.unpack_from(reply.payload)
        assert idx == index
        assert argsz >= vu.REGION_INFO.size and len(reply.payload) == argsz
        assert size == REGION_SIZES[index], f"region {index} size {size:#x}"
        if flags & vu.REGION_INFO_FLAG_MMAP:
            assert len(reply.fds) == 1, "MMAP flag without exactly one fd"
            st = os.fstat(reply.fds[0])
            assert st.st_size >= offset + size
            mm = mmap.mmap(reply.fds[0], size, flags=mmap.MAP_SHARED, offset=offset)
            mm.close()
        else:
            assert not reply.fds, "fd sent for a region without the MMAP flag"
        if flags & vu.REGION_INFO_FLAG_CAPS:
            assert vu.REGION_INFO.size <= cap_offset < argsz
            at, seen = cap_offset, 0
            while at:
                cap_id, _version, nxt = vu.CAP_HEADER.unpack_from(reply.payload, at)
                if cap_id == vu.REGION_INFO_CAP_SPARSE_MMAP:
                    nr, _ = vu.SPARSE_MMAP.unpack_from(reply.payload, at + vu.CAP_HEADER.size)
                    base = at + vu.CAP_HEADER.size + vu.SPARSE_MMAP.size
                    assert base + nr * vu.SPARSE_AREA.size <= argsz
                    for i in range(nr):
                        a_off, a_size = vu.SPARSE_AREA.unpack_from(reply.payload,
                                                                   base + i * vu.SPARSE_AREA.size)
                        assert a_off + a_size <= size
                seen += 1
                assert seen < 16 and (nxt == 0 or cap_offset <= nxt < argsz)
                at = nxt
        else:
            assert cap_offset == 0
    finally:
        reply.close_fds()


def test_region_info_with_a_small_argsz_reports_the_size_needed(peer):
    """Message sizes: argsz "may be larger than the requested maximum size: in that
    case, the full payload is not included in the reply, but the argsz field in the
    reply indicates the needed size".  BAR2 (with its sparse-mmap capability) asked
    with argsz 32."""
    full = region_info(peer, gpu.BAR_VRAM)
    full.close_fds()
    needed = vu.REGION_INFO.unpack_from(full.payload)[0]
    assert needed > vu.REGION_INFO.size, "BAR2 has no capability: this test needs one"
    reply = region_info(peer, gpu.BAR_VRAM, argsz=vu.REGION_INFO.size)
    reply.close_fds()
    assert_ok_reply(reply, vu.DEVICE_GET_REGION_INFO)
    assert len(reply.payload) <= vu.REGION_INFO.size
    assert vu.REGION_INFO.unpack_from(reply.payload)[0] == needed


@pytest.mark.parametrize("index", [vu.PCI_NUM_REGIONS + 7, 0xFFFFFFFF])
def test_region_info_of_a_region_that_does_not_exist_is_refused(peer, index):
    """GET_REGION_INFO: "index is the index of memory region being queried"; one the
    device does not have is an error, header only (no fd)."""
    assert_error_reply(region_info(peer, index), vu.DEVICE_GET_REGION_INFO)


def test_region_info_short_payload_is_refused(peer):
    """GET_REGION_INFO request layout is 32 bytes; a shorter one is an error."""
    msg_id = peer.send(vu.DEVICE_GET_REGION_INFO, vu.REGION_INFO.pack(32, 0, 0, 0, 0, 0)[:12])
    assert_error_reply(peer.next_reply(), vu.DEVICE_GET_REGION_INFO, msg_id)


# ---------------------------------------------------------------- GET_IRQ_INFO
@pytest.mark.parametrize("index, count", [(vu.PCI_INTX_IRQ, 0), (vu.PCI_MSI_IRQ, 0),
                                          (vu.PCI_MSIX_IRQ, 4), (vu.PCI_ERR_IRQ, 1),
                                          (vu.PCI_REQ_IRQ, 0)])
def test_irq_info_of_every_pci_irq_index(peer, index, count):
    """GET_IRQ_INFO Reply: "argsz is the size required for the full reply payload (16
    bytes today)", index echoed, "count describes the number of interrupts of the
    queried type" (docs/gpu-device.md: MSI-X 4, ERR 1, INTx/MSI/REQ 0); an index
    with interrupts can signal through eventfds."""
    reply = irq_info(peer, index)
    assert_ok_reply(reply, vu.DEVICE_GET_IRQ_INFO)
    argsz, flags, idx, n = vu.IRQ_INFO.unpack(reply.payload)
    assert (argsz, idx, n) == (16, index, count)
    if count:
        assert flags & vu.IRQ_INFO_EVENTFD


@pytest.mark.parametrize("index", [vu.PCI_NUM_IRQS, 1000])
def test_irq_info_of_an_index_that_does_not_exist_is_refused(peer, index):
    """GET_IRQ_INFO: "index is the index of IRQ type being queried"; an index past
    num_irqs is an error, header only."""
    assert_error_reply(irq_info(peer, index), vu.DEVICE_GET_IRQ_INFO)


def test_irq_info_short_payload_is_refused(peer):
    """GET_IRQ_INFO request layout is 16 bytes; a shorter one is an error."""
    msg_id = peer.send(vu.DEVICE_GET_IRQ_INFO, vu.IRQ_INFO.pack(16, 0, 2, 0)[:8])
    assert_error_reply(peer.next_reply(), vu.DEVICE_GET_IRQ_INFO, msg_id)
