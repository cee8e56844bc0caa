"""VFIO_USER_DMA_MAP and VFIO_USER_DMA_UNMAP (spec sections of those names).

Whether the server holds a client memfd is read from the server's
/proc/PID/fd and /proc/PID/maps, so "release before replying" is checked at
the moment the reply arrives.
"""

from __future__ import annotations

import os

import pytest

from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import assert_error_reply, assert_ok_reply

IOVA = 0x4000_0000
SIZE = 4 * vu.PAGE
QEMU_HUGE_UNMAP = (0xFEF00000, 0xFFFFFFFF01100000)  # seen from QEMU 11.1 at boot


@pytest.fixture
def windows():
    made = []

    def make(iova=IOVA, size=SIZE, direct=True, **kw):
        w = vu.Window(iova, size, direct=direct, **kw)
        made.append(w)
        return w
    yield make
    for w in made:
        w.close()


def map_request(argsz, flags, offset, iova, size):
    return vu.DMA_MAP_REQ.pack(argsz, flags, offset, iova, size)


RW = vu.DMA_MAP_FLAG_READ | vu.DMA_MAP_FLAG_WRITE


# ---------------------------------------------------------------- DMA_MAP
def test_map_with_fd_succeeds_with_an_empty_reply_and_the_server_maps_it(peer, gpu_server, windows):
    """DMA_MAP: "If the DMA region being added can be directly mapped by the server,
    a file descriptor must be sent as part of the message meta-data" and Reply:
    "There is no payload in the reply message."""
    w = windows()
    reply = peer.dma_map(w)
    assert_ok_reply(reply, vu.DMA_MAP)
    assert reply.payload == b"" and not reply.fds
    assert gpu_server.proc.holds(w.name), "the server neither kept nor mapped the fd"


def test_map_without_fd_succeeds_with_an_empty_reply(peer, windows):
    """DMA_MAP: "if the DMA region cannot be directly mapped by the server, no file
    descriptor must be sent ... and the DMA region can be accessed by the server
    using VFIO_USER_DMA_READ and VFIO_USER_DMA_WRITE messages"."""
    reply = peer.dma_map(windows(direct=False))
    assert_ok_reply(reply, vu.DMA_MAP)
    assert reply.payload == b""


@pytest.mark.parametrize("body, why", [
    (map_request(32, RW, 0, IOVA, SIZE)[:24], "payload shorter than 32 bytes"),
    (map_request(16, RW, 0, IOVA, SIZE), "argsz smaller than the structure"),
    (map_request(32, RW | 0x4, 0, IOVA, SIZE), "undefined flag bit 2"),
    (map_request(32, RW, 0, IOVA, 0), "size 0"),
    (map_request(32, RW, 0, 2 ** 64 - vu.PAGE, 2 * vu.PAGE), "range wraps past 2^64"),
    (map_request(32, RW, 0, IOVA + 0x10, SIZE), "address not aligned to the 4 KiB page size"),
    (map_request(32, RW, 0, IOVA, SIZE + 0x10), "size not a multiple of the 4 KiB page size"),
], ids=["short", "argsz", "flags", "size0", "wrap", "unaligned-addr", "unaligned-size"])
def test_malformed_map_is_refused_and_maps_nothing(peer, windows, body, why):
    """DMA_MAP request: "argsz is the size of the above structure", flags bit 0
    readable / bit 1 writeable (no others), "This structure is 32 bytes in size";
    pgsizes: "Page sizes supported in DMA map operations ... default value of
    supporting only 4k pages".  A malformed map gets an error reply (header only)
    and creates nothing: the window can then be mapped normally."""
    msg_id = peer.send(vu.DMA_MAP, body)
    assert_error_reply(peer.next_reply(), vu.DMA_MAP, msg_id)  # refused: {why}
    assert_ok_reply(peer.dma_map(windows(direct=False)), vu.DMA_MAP)


def test_overlapping_map_fails_with_eexist(peer, windows):
    """DMA_MAP: "A command to map over an existing region must be failed by the
    server with EEXIST set in error field in the reply."  (partial overlap)"""
    assert_ok_reply(peer.dma_map(windows()), vu.DMA_MAP)
    other = windows(iova=IOVA + 2 * vu.PAGE, size=SIZE, direct=False)
    reply = peer.dma_map(other)
    assert_error_reply(reply, vu.DMA_MAP)
    assert reply.error == 17, f"errno {reply.error}, expected EEXIST (17)"


def test_exact_remap_fails_with_eexist(peer, windows):
    """DMA_MAP: "A command to map over an existing region must be failed by the
    server with EEXIST".  Mapping the very same window again is mapping over an
    existing region (issue 9 item 6: it is accepted as a replacement today)."""
    w = windows()
    assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    again = windows(direct=False)
    reply = peer.dma_map(again)
    assert_error_reply(reply, vu.DMA_MAP)
    assert reply.error == 17, f"errno {reply.error}, expected EEXIST (17)"


def test_map_after_unmap_of_the_same_window_succeeds(peer, windows):
    """DMA_UNMAP makes the region "no longer available for DMA"; the same IOVA range
    can then be mapped again."""
    w = windows()
    assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    assert_ok_reply(peer.dma_unmap(IOVA, SIZE), vu.DMA_UNMAP)
    assert_ok_reply(peer.dma_map(windows(direct=False)), vu.DMA_MAP)


def test_map_with_two_fds_is_refused_and_neither_kept(peer, gpu_server, windows):
    """DMA_MAP: "a file descriptor must be sent" -- one region, one fd.  Two fds are
    an error, and the server keeps neither."""
    a, b = windows(), windows(iova=IOVA + 0x10_0000)
    msg_id = peer.send(vu.DMA_MAP, map_request(32, RW, vu.PAGE, IOVA, SIZE), fds=[a.fd, b.fd])
    assert_error_reply(peer.next_reply(), vu.DMA_MAP, msg_id)
    assert not gpu_server.proc.holds(a.name) and not gpu_server.proc.holds(b.name)


def test_map_with_an_fd_that_cannot_be_mapped_is_refused(peer, windows):
    """DMA_MAP: the fd is sent when the region "can be directly mapped by the
    server ... The region can be mapped via the mmap() system call."  An fd that
    cannot be mmapped (an eventfd) is an error, not a silent downgrade to the
    message path (issue 9 item 6), and creates no mapping."""
    efd = vu.new_eventfd()
    try:
        msg_id = peer.send(vu.DMA_MAP, map_request(32, RW, 0, IOVA, SIZE), fds=[efd])
        assert_error_reply(peer.next_reply(), vu.DMA_MAP, msg_id)
    finally:
        os.close(efd)
    assert_ok_reply(peer.dma_map(windows(direct=False)), vu.DMA_MAP)


# ---------------------------------------------------------------- DMA_UNMAP
def test_unmap_echoes_the_entry_and_releases_the_fd_before_replying(peer, gpu_server, windows):
    """DMA_UNMAP Reply: "if the file descriptor is mapped then the server must
    release all references to that DMA region before replying" and "The server
    responds with the original DMA entry in the request."""
    w = windows()
    assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    assert gpu_server.proc.holds(w.name)
    entry = vu.DMA_UNMAP_REQ.pack(vu.DMA_UNMAP_REQ.size, 0, IOVA, SIZE)
    reply = peer.request(vu.DMA_UNMAP, entry)
    assert_ok_reply(reply, vu.DMA_UNMAP)
    assert not gpu_server.proc.holds(w.name), "the server still maps the region after replying"
    assert reply.payload == entry, f"reply payload {reply.payload.hex()} != request entry"


def test_unmap_must_match_a_mapping_exactly_not_bisect_it(peer, gpu_server, windows):
    """DMA_UNMAP: "The address and size of the DMA region being unmapped must match
    exactly a previous mapping."  Unmapping half of a mapping is refused (header
    only) and the mapping stays whole (its fd still held)."""
    w = windows()
    assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    reply = peer.dma_unmap(IOVA, SIZE // 2, keep_exported=True)
    assert_error_reply(reply, vu.DMA_UNMAP)
    assert gpu_server.proc.holds(w.name)
    assert_ok_reply(peer.dma_unmap(IOVA, SIZE), vu.DMA_UNMAP)


def test_unmap_spanning_whole_mappings_removes_them_qemu_allowance(peer, gpu_server, windows):
    """Departure forced by QEMU 11.1: it sends DMA_UNMAP of huge ranges (e.g.
    0xfef00000 + 0xffffffff01100000) that cover several whole mappings instead of
    matching one ("must match exactly a previous mapping").  The allowance: a range
    made of whole mappings removes each of them, fds released before the reply,
    entry echoed."""
    a = windows(iova=0xFF00_0000, size=SIZE)
    b = windows(iova=0x1_0000_0000, size=SIZE, direct=False)
    c = windows(iova=0x2_0000_0000, size=SIZE)
    for w in (a, b, c):
        assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    entry = vu.DMA_UNMAP_REQ.pack(24, 0, *QEMU_HUGE_UNMAP)
    reply = peer.request(vu.DMA_UNMAP, entry)
    assert_ok_reply(reply, vu.DMA_UNMAP)
    assert reply.payload == entry
    assert not gpu_server.proc.holds(a.name) and not gpu_server.proc.holds(c.name)
    for w in (a, b, c):  # all gone: each can be mapped again
        assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)


def test_unmap_all_with_zero_address_and_size_removes_everything(peer, gpu_server, windows):
    """Departure forced by QEMU 11.1: its vfio_user_dma_unmap sets
    VFIO_DMA_UNMAP_FLAG_ALL (linux/vfio.h, bit 1) with address 0 and size 0 where
    the spec says flags "is unused in this version".  The allowance, as in the
    kernel's VFIO: FLAG_ALL with 0/0 removes every mapping and echoes the entry."""
    a, b = windows(), windows(iova=IOVA + 0x100_0000, direct=False)
    for w in (a, b):
        assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    entry = vu.DMA_UNMAP_REQ.pack(24, vu.DMA_UNMAP_FLAG_ALL, 0, 0)
    reply = peer.request(vu.DMA_UNMAP, entry)
    assert_ok_reply(reply, vu.DMA_UNMAP)
    assert reply.payload == entry
    assert not gpu_server.proc.holds(a.name)
    for w in (a, b):
        assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)


@pytest.mark.parametrize("address, size", [(IOVA, 0), (0, SIZE), (IOVA, SIZE)])
def test_unmap_all_with_an_address_or_size_is_refused(peer, gpu_server, windows, address, size):
    """The FLAG_ALL allowance exists for QEMU's address 0 / size 0 form only (as in
    linux/vfio.h: "iova and size must be 0"); with an address or a size it is an
    error and nothing is unmapped (issue 9 item 6)."""
    w = windows()
    assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    reply = peer.dma_unmap(address, size, flags=vu.DMA_UNMAP_FLAG_ALL, keep_exported=True)
    assert_error_reply(reply, vu.DMA_UNMAP)
    assert gpu_server.proc.holds(w.name)


@pytest.mark.parametrize("flags", [vu.DMA_UNMAP_FLAG_GET_DIRTY_BITMAP, 0x4, 0x80000000])
def test_unmap_with_flags_not_negotiated_is_refused(peer, gpu_server, windows, flags):
    """DMA_UNMAP: "flags is unused in this version" -- dirty bitmaps were not
    negotiated and other bits are undefined: error, nothing unmapped."""
    w = windows()
    assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    reply = peer.dma_unmap(IOVA, SIZE, flags=flags, keep_exported=True)
    assert_error_reply(reply, vu.DMA_UNMAP)
    assert gpu_server.proc.holds(w.name)


def test_short_unmap_payload_is_refused(peer, windows):
    """DMA_UNMAP request layout: argsz, flags, address, size (24 bytes); less is an
    error (header only)."""
    assert_ok_reply(peer.dma_map(windows()), vu.DMA_MAP)
    msg_id = peer.send(vu.DMA_UNMAP, vu.DMA_UNMAP_REQ.pack(24, 0, IOVA, SIZE)[:16])
    assert_error_reply(peer.next_reply(), vu.DMA_UNMAP, msg_id)
