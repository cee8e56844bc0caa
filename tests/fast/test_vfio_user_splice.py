"""Zero-copy sends (vfio_user/splice.py through Transport.send(zero_copy=True)):
exact bytes, page references rather than copies, poisoning on a stall, and the
sendmsg fallback when the kernel refuses vmsplice."""

import mmap
import os
import platform
import socket
import threading

import pytest

from vfio_cxl.devices.vfio_user import splice, transport as tp
from vfio_cxl.devices.vfio_user.transport import ConnectionClosed, Transport

MIB = 1 << 20


def kernel_at_least(major: int, minor: int) -> bool:
    parts = platform.release().split(".")
    return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ta, tb = Transport(a, send_timeout=0.5), Transport(b)
    yield ta, tb
    ta.close()
    tb.close()


@pytest.fixture
def vram():
    """A memfd mapping, like the GPU's VRAM."""
    fd = os.memfd_create("test-vram", os.MFD_CLOEXEC)
    os.ftruncate(fd, 8 * MIB)
    mm = mmap.mmap(fd, 8 * MIB, flags=mmap.MAP_SHARED)
    os.close(fd)
    view = memoryview(mm)
    yield view
    view.release()
    mm.close()


def receive(tb: Transport, n: int) -> bytes:
    buf = bytearray(n)
    tb.recv_into(memoryview(buf), [])
    return bytes(buf)


def test_zero_copy_send_delivers_exact_bytes_in_order(pair, vram):
    ta, tb = pair
    payload = os.urandom(MIB) * 6 + os.urandom(12345)
    vram[:len(payload)] = payload
    sent = vram[5:len(payload)]  # odd offset and length: pages are spliced partly
    total = 16 + len(sent) + 3
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("b", receive(tb, total)))
    reader.start()
    ta.send([b"H" * 16, sent], zero_copy=True)
    ta.send([b"end"])
    reader.join(10)
    assert got["b"] == b"H" * 16 + payload[5:] + b"end"
    assert ta.page_sender is not None and ta.page_sender.available, "the zero-copy path was not used"
    assert not ta.poisoned


@pytest.mark.skipif(not kernel_at_least(6, 5),
                    reason="UNIX sockets take spliced pages by reference since Linux 6.5")
def test_zero_copy_queues_page_references_not_copies(pair, vram):
    """What callers must know: the receiver reads the source pages as they are
    when it reads them, so the source must stay put until the peer answered."""
    ta, tb = pair
    vram[:MIB] = b"\x11" * MIB
    ta.send([b"H" * 16, vram[:MIB]], zero_copy=True)  # fits the send buffer: returns at once
    vram[:MIB] = b"\x22" * MIB  # changed after the send, before the peer read it
    got = receive(tb, 16 + MIB)
    assert got[16:] == b"\x22" * MIB


def test_small_parts_are_copied(pair, vram):
    ta, tb = pair
    vram[:4096] = b"\x33" * 4096
    ta.send([b"H" * 16, vram[:4096]], zero_copy=True)  # under ZERO_COPY_MIN
    vram[:4096] = b"\x44" * 4096
    assert receive(tb, 16 + 4096)[16:] == b"\x33" * 4096
    assert ta.page_sender is None


def test_stalled_zero_copy_send_poisons_the_transport(pair, vram):
    """The peer never reads: the send times out part way, the stream is cut, and
    the transport is poisoned (never used again), as with sendmsg."""
    ta, tb = pair
    ta.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)  # fills quickly
    with pytest.raises(ConnectionClosed, match="poisoned"):
        ta.send([b"H" * 16, vram[:8 * MIB]], zero_copy=True)
    assert ta.poisoned
    with pytest.raises(ConnectionClosed, match="poisoned"):
        ta.send([b"x"])


def test_refused_vmsplice_falls_back_to_sendmsg(pair, vram, monkeypatch):
    """Our fallback logic, with a stand-in for a kernel that refuses vmsplice
    (a fake: the real call is replaced for this test only): the rest of the message goes by sendmsg,
    whole, and the sender is not tried again."""
    ta, tb = pair

    def refuse(fd, iov, n, flags):
        return -1

    monkeypatch.setattr(splice.PageSender, "vmsplice", staticmethod(refuse))
    vram[:2 * MIB] = os.urandom(2 * MIB)
    expect = bytes(vram[:2 * MIB])
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("b", receive(tb, 16 + 2 * MIB)))
    reader.start()
    ta.send([b"H" * 16, vram[:2 * MIB]], zero_copy=True)
    reader.join(10)
    assert got["b"] == b"H" * 16 + expect
    assert not ta.poisoned
    assert ta.page_sender is not None and not ta.page_sender.available


def test_send_buffer_is_raised():
    a, b = socket.socketpair()
    try:
        t = Transport(a)
        limit = int(open("/proc/sys/net/core/wmem_max").read())
        want = min(tp.SEND_BUFFER, limit) * 2  # the kernel doubles what it grants
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == want
        t.close()
    finally:
        b.close()
