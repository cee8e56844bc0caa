"""The suite's own client (vfio_cxl.bench.vfio_user_spec) catches what it must.

These check our own checking logic, so the "server" here is a stand-in: the
other end of a socketpair driven by the test, sending exactly the bytes a
rule-breaking server would.  A conformance test that passes must pass because
the server behaved, not because the client looked away.
"""

from __future__ import annotations

import socket

import pytest

from vfio_cxl.bench import vfio_user_spec as vu

IOVA = 0x3000_0000


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = vu.Peer(None, sock=a)
    w = vu.Window(IOVA, 2 * vu.PAGE, direct=False)
    peer.windows[IOVA] = w
    w.mapped = True
    peer.max_data_xfer = 4096
    yield peer, b, w
    peer.close()
    b.close()


def server_request(b, command, address, count, data=b""):
    body = vu.DMA_RW.pack(address, count) + data
    b.sendall(vu.header(5, command, len(body)) + body)


def test_dma_write_inside_the_window_is_applied_and_answered_in_qemu_form(pair):
    peer, b, w = pair
    server_request(b, vu.DMA_WRITE, IOVA + 8, 4, b"abcd")
    peer.serve_dma(peer.recv(2))
    reply = b.recv(64)
    assert vu.HEADER.unpack_from(reply)[2:4] == (32, vu.TYPE_REPLY)
    assert vu.DMA_WRITE_REPLY_QEMU.unpack_from(reply, 16) == (IOVA + 8, 4)
    assert w.read(IOVA + 8, 4) == b"abcd" and peer.violations == []


@pytest.mark.parametrize("address, count, data, why", [
    (0x9000_0000, 4, b"abcd", "outside every live DMA_MAP window"),
    (IOVA + 2 * vu.PAGE - 2, 4, b"abcd", "outside every live DMA_MAP window"),
    (IOVA, 8192, bytes(8192), "max_data_xfer_size"),
    (IOVA, 8, b"abcd", "but 4 data bytes"),
])
def test_rule_breaking_dma_write_is_recorded_and_refused(pair, address, count, data, why):
    peer, b, w = pair
    server_request(b, vu.DMA_WRITE, address, count, data)
    peer.serve_dma(peer.recv(2))
    assert any(why in v for v in peer.violations), peer.violations
    if "window" in why:
        assert vu.HEADER.unpack_from(b.recv(64))[3] & vu.FLAG_ERROR
        assert w.body() == bytes(w.size)


def test_dma_after_unmap_and_forbidden_dma_are_recorded(pair):
    peer, b, w = pair
    w.mapped = False
    server_request(b, vu.DMA_READ, IOVA, 16)
    peer.serve_dma(peer.recv(2))
    w.mapped = True
    peer.dma_forbidden = "after a reset"
    server_request(b, vu.DMA_READ, IOVA, 16)
    peer.serve_dma(peer.recv(2))
    assert len(peer.violations) == 2 and "after a reset" in peer.violations[1]


def test_guard_pages_detect_a_stray_write(pair):
    peer, b, w = pair
    assert w.canaries_intact()
    w.mm[w.guard + w.size] = 0  # one byte past the exported part
    assert not w.canaries_intact()
