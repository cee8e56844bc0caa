"""The server's own messages: VFIO_USER_DMA_READ / VFIO_USER_DMA_WRITE (spec sections
of those names, "Read and Write Operations", "VFIO_USER_DMA_UNMAP").

The device is made to move data with its descriptor ring (docs/gpu-device.md);
the client answers every DMA request from its own memfds and records each
request and each rule it breaks (``Peer.violations``)."""

from __future__ import annotations

import os

import pytest

from vfio_cxl.bench import gpu_doc as gpu
from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import DATA_IOVA, Rig, assert_ok_reply

PATTERN = 0x0123456789ABCDEF


def pattern(length: int) -> bytes:
    unit = PATTERN.to_bytes(8, "little")
    return (unit * (length // 8 + 1))[:length]


@pytest.fixture
def rig(peer):
    r = Rig(peer)
    yield r
    r.close()


def data_window(peer, size, direct=False, iova=DATA_IOVA, sealed=True):
    w = vu.Window(iova, size, direct=direct, name="data", sealed=sealed)
    w.write(iova, bytes([vu.FILL]) * size)
    assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
    return w


def run(rig, *descs, timeout=20.0) -> int:
    rig.submit(*descs)
    return rig.wait_idle(timeout)


def test_dma_write_requests_stay_in_the_window_and_carry_their_data(peer, rig):
    """DMA_WRITE: "address is the client DMA memory address being accessed. This
    address must have been previously exported to the server with a
    VFIO_USER_DMA_MAP message", count "the size of the data to be transferred",
    data "the data to write".  Every request lies inside the window, counts add up
    to the descriptor's length, nothing outside the target bytes changes.  (The
    client answers in QEMU 11.1's reply form: address and count as two u64.)"""
    w = data_window(peer, 512 * 1024)
    length, dst = 200 * 1024 + 24, DATA_IOVA + 3 * 4096
    status = run(rig, gpu.descriptor(gpu.OP_FILL_PATTERN, PATTERN, 0, length),
                 gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, dst, length, cookie=2))
    assert not status & gpu.STATUS_HALTED, f"ring halted: ERR_STATUS {peer.read32(gpu.ERR_STATUS)}"
    assert peer.violations == []
    writes = [r for r in peer.dma_log if r.command == vu.DMA_WRITE]
    assert writes and sum(r.count for r in writes) == length
    assert all(dst <= r.address and r.address + r.count <= dst + length for r in writes)
    body = w.body()
    off = dst - DATA_IOVA
    assert body[off:off + length] == pattern(length)
    assert body[:off] == bytes([vu.FILL]) * off
    assert body[off + length:] == bytes([vu.FILL]) * (len(body) - off - length)
    assert w.canaries_intact()
    assert rig.completion(1)[1] == gpu.ST_OK


def test_dma_read_requests_carry_no_data_and_stay_in_the_window(peer, rig):
    """DMA_READ request: address (exported with DMA_MAP) and count, no data; the
    reply brings the data.  VRAM receives exactly the window's bytes."""
    w = data_window(peer, 512 * 1024)
    src = os.urandom(300 * 1024)
    w.write(DATA_IOVA, src)
    status = run(rig, gpu.descriptor(gpu.OP_HOST_TO_VRAM, DATA_IOVA, 0x10000, len(src)))
    assert not status & gpu.STATUS_HALTED
    assert peer.violations == []
    reads = [r for r in peer.dma_log if r.command == vu.DMA_READ]
    assert reads and sum(r.count for r in reads) == len(src)
    assert all(r.data_len == 0 for r in reads)
    got = peer.region_read(gpu.BAR_VRAM, 0x10000, len(src))
    assert got.payload[16:] == src


@pytest.mark.parametrize("limit", [1024, 6000])
def test_client_max_data_xfer_size_is_honoured_both_ways(gpu_server, limit):
    """VERSION: max_data_xfer_size is the "Maximum count for data transfer messages"
    and Read and Write Operations: "The count field must not exceed the value of
    max_data_xfer_size of the peer, for both reads and writes."  A client that
    says 1024 (or 6000) gets no DMA_READ / DMA_WRITE above it (issue 9 item 6: the
    server raises it to >= 4096 today)."""
    with gpu_server.connect() as p:
        assert_ok_reply(p.handshake({"max_msg_fds": 8, "max_data_xfer_size": limit}), vu.VERSION)
        p.request(vu.DEVICE_RESET)
        rig = Rig(p)
        try:
            w = data_window(p, 64 * 1024)
            src = os.urandom(20000)
            w.write(DATA_IOVA, src)
            status = run(rig, gpu.descriptor(gpu.OP_HOST_TO_VRAM, DATA_IOVA, 0, len(src)),
                         gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA + 32768, len(src)))
            assert not status & gpu.STATUS_HALTED
            assert p.violations == []
            assert max(r.count for r in p.dma_log) <= limit
            assert w.read(DATA_IOVA + 32768, len(src)) == src
        finally:
            rig.close()


def test_default_max_data_xfer_size_applies_when_the_client_names_none(gpu_server):
    """VERSION: max_data_xfer_size "Optional, with a default value of 1048576
    bytes."  A client that proposes no value gets no DMA message above 1 MiB."""
    with gpu_server.connect(timeout=20) as p:
        assert_ok_reply(p.handshake({"max_msg_fds": 8}), vu.VERSION)
        p.request(vu.DEVICE_RESET)
        rig = Rig(p)
        try:
            length = 3 * (1 << 20) + 4096
            data_window(p, 4 << 20)
            status = run(rig, gpu.descriptor(gpu.OP_FILL_PATTERN, PATTERN, 0, length),
                         gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA, length), timeout=60)
            assert not status & gpu.STATUS_HALTED
            assert p.violations == []
            assert max(r.count for r in p.dma_log) <= vu.DEFAULT_MAX_DATA_XFER
        finally:
            rig.close()


@pytest.mark.parametrize("op", [gpu.OP_VRAM_TO_HOST, gpu.OP_HOST_TO_VRAM])
def test_no_dma_message_for_an_iova_never_mapped(peer, rig, op):
    """DMA_READ / DMA_WRITE: "This address must have been previously exported to the
    server with a VFIO_USER_DMA_MAP message."  A descriptor aimed at an IOVA no
    DMA_MAP exported fails in the device; no DMA message for it reaches the
    client (issue 9 item 6: it is sent to the client today)."""
    far = 0x5000_0000
    src, dst = (0, far) if op == gpu.OP_VRAM_TO_HOST else (far, 0)
    status = run(rig, gpu.descriptor(op, src, dst, 8192))
    assert status & gpu.STATUS_HALTED, "a DMA to an unmapped IOVA succeeded"
    assert peer.violations == [], peer.violations
    assert not [r for r in peer.dma_log if far <= r.address < far + 8192]


def test_no_dma_message_after_the_window_was_unmapped(peer, rig):
    """DMA_UNMAP: the region "is no longer available for DMA", so DMA_READ/WRITE
    ("address must have been previously exported") may not name it any more."""
    w = data_window(peer, 64 * 1024)
    assert_ok_reply(peer.dma_unmap(w.iova, w.size), vu.DMA_UNMAP)
    status = run(rig, gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA, 4096))
    assert status & gpu.STATUS_HALTED
    assert peer.violations == [], peer.violations


def test_direct_path_writes_only_the_target_bytes(peer, rig):
    """DMA_MAP with an fd: the server "can mmap()" the region; it may write only
    inside the mapped range, and only where the device was told to (guard pages
    of the memfd around the mapped part stay as they were)."""
    w = data_window(peer, 256 * 1024, direct=True)
    length, dst = 100 * 1024, DATA_IOVA + 5000
    status = run(rig, gpu.descriptor(gpu.OP_FILL_PATTERN, PATTERN, 0, length),
                 gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, dst, length))
    assert not status & gpu.STATUS_HALTED
    body, off = w.body(), dst - DATA_IOVA
    assert body[off:off + length] == pattern(length)
    assert body[:off] == bytes([vu.FILL]) * off
    assert body[off + length:] == bytes([vu.FILL]) * (len(body) - off - length)
    assert w.canaries_intact()


def test_unmap_during_a_direct_transfer_releases_before_the_reply(peer, rig, gpu_server):
    """DMA_UNMAP Reply: "if the file descriptor is mapped then the server must release
    all references to that DMA region before replying, which potentially includes
    in-flight DMA transactions."  A 12 MiB device write into a direct window is
    unmapped at once: when the reply arrives the server no longer maps the fd, and
    not one byte of the window changes after it."""
    size = 12 << 20
    w = data_window(peer, size, direct=True)
    run(rig, gpu.descriptor(gpu.OP_FILL_PATTERN, PATTERN, 0, size))
    rig.submit(gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA, size))
    assert_ok_reply(peer.dma_unmap(w.iova, w.size), vu.DMA_UNMAP)
    after_reply = w.body()
    assert not gpu_server.proc.holds(w.name), "fd still mapped when DMA_UNMAP was answered"
    rig.wait_idle()
    assert w.body() == after_reply, "the window changed after its DMA_UNMAP reply"
    assert w.canaries_intact()


def test_unmap_during_a_message_transfer_stops_dma_to_the_window(peer, rig):
    """DMA_UNMAP: after the reply the region is not exported; DMA_WRITE pieces of an
    in-flight transfer may arrive before the reply, none after it."""
    size = 4 << 20
    data_window(peer, size)
    run(rig, gpu.descriptor(gpu.OP_FILL_PATTERN, PATTERN, 0, size))
    rig.submit(gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA, size))
    held = peer.recv(10)
    assert held.command == vu.DMA_WRITE, f"expected the first DMA_WRITE piece, got {held!r}"
    unmap_id = peer.send(vu.DMA_UNMAP, vu.DMA_UNMAP_REQ.pack(24, 0, DATA_IOVA, size))
    peer.serve_dma(held)
    reply = peer.next_reply()
    assert reply.msg_id == unmap_id and not reply.is_error, reply
    peer.windows[DATA_IOVA].mapped = False
    rig.wait_idle()
    assert peer.violations == [], peer.violations


def test_error_reply_to_a_dma_request_keeps_the_connection_in_step(peer, rig):
    """Header: "If an error occurs, the reply message must only include the reply
    header" -- the client's header-only error reply to a DMA_WRITE is consumed as
    such: the device reports the refusal (DMA_REFUSED, ERR_ERRNO = the errno,
    docs/gpu-device.md) and the next command is answered normally."""
    data_window(peer, 64 * 1024)
    peer.refuse_dma = True
    status = run(rig, gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA, 8192))
    assert status & gpu.STATUS_HALTED
    assert peer.read32(gpu.ERR_STATUS) == gpu.ST_DMA_REFUSED
    assert peer.read32(gpu.ERR_ERRNO) == 19
    assert peer.read32(gpu.ID) == gpu.ID_VALUE


@pytest.mark.parametrize("op", [gpu.OP_VRAM_TO_HOST, gpu.OP_HOST_TO_VRAM])
def test_fd_truncated_after_dma_map_cannot_crash_the_server(peer, rig, gpu_server, op):
    """Security Considerations: "vfio-user clients should not trust servers, and vice
    versa".  A client shrinks the memfd it gave with DMA_MAP; the server lives (the
    fixture checks) and keeps answering, and a read from the vanished memory fails
    (the ring halts) instead of completing with bytes that were never there -- issue
    9 item 5 (SIGBUS kills the server today).  (A write there may fail too, or land
    in the file again if the server writes with pwrite: both are fine.)  A server may instead refuse
    an fd that is not sealed against shrinking (F_SEAL_SHRINK): then there is
    nothing to truncate and the test ends there."""
    w = vu.Window(DATA_IOVA, 1 << 20, direct=True, name="unsealed", sealed=False)
    reply = peer.dma_map(w)
    if reply.is_error:
        w.close()
        return  # refused: the server protects itself from shrinking fds
    w.truncated = True
    os.ftruncate(w.fd, 0)
    src, dst = (0, DATA_IOVA) if op == gpu.OP_VRAM_TO_HOST else (DATA_IOVA, 0)
    try:
        status = run(rig, gpu.descriptor(op, src, dst, 64 * 1024))
        assert gpu_server.proc.alive(), "the server died of a truncated DMA fd"
        assert peer.read32(gpu.ID) == gpu.ID_VALUE
        if op == gpu.OP_HOST_TO_VRAM:
            assert status & gpu.STATUS_HALTED, "a read from a truncated fd reported success"
    finally:
        w.close()
