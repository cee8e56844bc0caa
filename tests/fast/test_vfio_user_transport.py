"""Transport receive and send-buffer behaviour the message path's speed rests on
(vfio_user/transport.py, connection.py): a reader waiting for a message is
woken by data only, and the send buffer holds a whole window of DMA_WRITE
pieces when the process may raise it."""

import socket
import threading
import time

import pytest

from vfio_cxl.devices.vfio_user import connection as conn_module, transport as tp, wire
from vfio_cxl.devices.vfio_user.connection import Connection
from vfio_cxl.devices.vfio_user.transport import MessageTimeout, Transport

MIB = 1 << 20


def thread_status(tid: int) -> dict:
    fields = {}
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def wait_until(what, check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)  # polling a condition with a deadline, not a synchronisation


def can_force_send_buffer() -> bool:
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, tp.SO_SNDBUFFORCE, 1 << 20)
        return True
    except OSError:
        return False
    finally:
        a.close()
        b.close()


def test_waiting_reader_is_not_woken_by_send_space_being_freed():
    """A thread waiting for the next message while the same socket's sends are
    being drained by the peer: the kernel wakes the socket's waiters for every
    consumed skb once the send queue is low, and a reader asleep in recvmsg
    would wake (and sleep again) for each.  Ours sleeps in poll(POLLIN) and
    must wake only when its message comes."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ta = Transport(a, partial_timeout=5, send_timeout=5)
    b.settimeout(10)
    got = {}

    def reader():
        got["tid"] = threading.get_native_id()
        got["header"] = ta.recv_header([])

    t = threading.Thread(target=reader)
    t.start()
    try:
        wait_until("the reader to be asleep",
                   lambda: "tid" in got and thread_status(got["tid"])["State"].startswith("S"))
        before = int(thread_status(got["tid"])["voluntary_ctxt_switches"])
        payload = bytes(8 * MIB)
        drained = bytearray()

        def drain():
            view = memoryview(bytearray(64 * 1024))
            while len(drained) < len(payload):
                n = b.recv_into(view)
                assert n, "sender closed early"
                drained.extend(view[:n])

        consumer = threading.Thread(target=drain)
        consumer.start()
        ta.send([payload])
        consumer.join(10)
        assert len(drained) == len(payload)
        woken = int(thread_status(got["tid"])["voluntary_ctxt_switches"]) - before
        assert woken <= 2, f"the waiting reader was woken {woken} times by no data"
        b.sendall(wire.HEADER.pack(3, wire.REGION_READ, 16, wire.TYPE_REPLY, 0))
        t.join(5)
        assert got["header"].msg_id == 3
    finally:
        ta.close()
        b.close()
        t.join(5)


def test_a_message_cut_off_still_times_out():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ta = Transport(a, partial_timeout=0.2)
    try:
        b.sendall(b"\x01" * 10)  # 10 of a 16-byte header
        started = time.monotonic()
        with pytest.raises(MessageTimeout):
            ta.recv_header([])
        assert time.monotonic() - started < 2
    finally:
        ta.close()
        b.close()


def test_set_send_buffer_raises_and_never_lowers():
    a, b = socket.socketpair()
    t = Transport(a)
    try:
        have = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        got = t.set_send_buffer(32 * MIB)
        if can_force_send_buffer():
            assert got == 64 * MIB  # the kernel doubles what it grants
        else:
            limit = int(open("/proc/sys/net/core/wmem_max").read())
            assert got == max(have, 2 * min(32 * MIB, limit))
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == got
        assert t.set_send_buffer(1 * MIB) == got  # smaller asks leave it alone
    finally:
        t.close()
        b.close()


@pytest.mark.parametrize("max_xfer", [1 * MIB, 64 * MIB])
def test_connection_send_buffer_holds_a_window_of_dma_writes(max_xfer):
    """After VERSION the socket can take every DMA_WRITE piece of a window
    without the engine sleeping for room (where the process may raise it)."""
    a, b = socket.socketpair()
    c = Connection(a)
    try:
        c.set_client_limits(max_xfer)
        window_bytes = c.window * c.max_write
        assert c.max_write == min(max_xfer, conn_module.DMA_PIECE_MAX)
        assert c.send_buffer == a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        limit = int(open("/proc/sys/net/core/wmem_max").read())
        if can_force_send_buffer() or window_bytes <= limit:
            assert c.send_buffer >= 2 * window_bytes
        else:
            assert c.send_buffer >= 2 * min(tp.SEND_BUFFER, limit)
    finally:
        c.close()
        b.close()
