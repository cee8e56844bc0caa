"""Header, framing, ordering and error-reply rules of the vfio-user spec
(docs/interop/vfio-user.rst, sections "Header", "Command Concurrency",
"Connection Initiation")."""

from __future__ import annotations

import os
import socket
import time

import pytest

from vfio_cxl.bench import gpu_doc as gpu
from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import (DATA_IOVA, Rig, assert_error_reply, assert_ok_reply, expect_closed,
                       fresh_client_works)


def test_reply_echoes_id_and_command_and_has_reply_type(peer):
    """Header: "Message ID identifies the message, and is echoed in the command's
    reply message." / "Command ... is also set in the reply header." / "Reply
    (value 0x1) indicates a reply message" / "Message size contains the size of
    the entire message, including the header"."""
    msg_id = peer.send(vu.DEVICE_GET_INFO, vu.DEVICE_INFO.pack(vu.DEVICE_INFO.size, 0, 0, 0),
                       msg_id=0xBEEF)
    reply = peer.next_reply()
    assert reply.msg_id == msg_id == 0xBEEF
    assert reply.command == vu.DEVICE_GET_INFO
    assert reply.type == vu.TYPE_REPLY
    assert reply.size == vu.HEADER_SIZE + len(reply.payload)
    assert not reply.flags & vu.FLAG_NO_REPLY


def test_message_ids_may_be_reused(peer):
    """Header: "Message IDs belong entirely to the sender, can be re-used (even
    concurrently) and the receiver must not make any assumptions about their
    uniqueness."  Three pipelined reads with one ID get three replies, in order."""
    offsets = (gpu.ID, gpu.VERSION, gpu.SCRATCH)
    for off in offsets:
        peer.send(vu.REGION_READ, vu.REGION_RW.pack(off, vu.PCI_BAR0_REGION, 4), msg_id=7)
    for off in offsets:
        reply = peer.next_reply()
        assert_ok_reply(reply, vu.REGION_READ)
        assert reply.msg_id == 7
        assert vu.REGION_RW.unpack_from(reply.payload)[0] == off


def test_pipelined_commands_are_processed_and_answered_in_order(peer):
    """Command Concurrency: "A client may pipeline multiple commands without waiting
    for previous command replies.  The server will process commands in the order
    they are received."  Interleaved writes and reads of SCRATCH see each write."""
    expected = []
    for value in (0x11, 0x22, 0x33, 0x44):
        peer.send(vu.REGION_WRITE, vu.REGION_RW.pack(gpu.SCRATCH, 0, 4) + value.to_bytes(4, "little"))
        peer.send(vu.REGION_READ, vu.REGION_RW.pack(gpu.SCRATCH, 0, 4))
        expected += [(vu.REGION_WRITE, None), (vu.REGION_READ, value)]
    for command, value in expected:
        reply = peer.next_reply()
        assert_ok_reply(reply, command)
        if value is not None:
            assert int.from_bytes(reply.payload[vu.REGION_RW.size:], "little") == value


def test_no_reply_command_is_processed_and_not_answered(peer):
    """Header: "No_reply in a command message indicates that no reply is needed for
    this command." and Command Concurrency: "if a client issues a command with the
    No_reply bit, then subsequently issues a command without No_reply, the older
    command will have been processed before the reply to the younger command is
    sent by the server."  The first message back is the read's reply and it sees
    the write."""
    peer.write32(gpu.SCRATCH, 0x5A5A0001, posted=True)
    read_id = peer.send(vu.REGION_READ, vu.REGION_RW.pack(gpu.SCRATCH, 0, 4))
    reply = peer.next_reply()
    assert reply.msg_id == read_id and reply.command == vu.REGION_READ, \
        f"first message after a No_reply write is {reply!r}, not the read's reply"
    assert int.from_bytes(reply.payload[vu.REGION_RW.size:], "little") == 0x5A5A0001


def test_no_reply_is_honoured_even_when_the_command_fails(peer):
    """Header: "Each command message in Commands_ must be replied to with a reply
    message, unless the message sets the No_Reply bit."  A failing No_reply command
    (a write to a region that does not exist) gets no reply either: QEMU 11.1
    treats a reply it did not wait for as "unexpected reply"."""
    peer.send(vu.REGION_WRITE, vu.REGION_RW.pack(0, 99, 4) + b"\0\0\0\0", flags=vu.FLAG_NO_REPLY)
    peer.send(vu.DMA_MAP, b"short", flags=vu.FLAG_NO_REPLY)
    read_id = peer.send(vu.REGION_READ, vu.REGION_RW.pack(gpu.ID, 0, 4))
    reply = peer.next_reply()
    assert reply.msg_id == read_id and reply.command == vu.REGION_READ, \
        f"a No_reply command was answered: {reply!r}"


@pytest.mark.parametrize("command", [0, 14, vu.REGION_WRITE_MULTI, vu.DEVICE_FEATURE,
                                     vu.MIG_DATA_READ, vu.MIG_DATA_WRITE, 99, 0xFFFF])
def test_unknown_or_unsupported_command_gets_an_error_reply(peer, command):
    """Header: "Each command message ... must be replied to with a reply message"
    and "If an error occurs, the reply message must only include the reply header."
    Commands the server does not implement (or did not negotiate, like
    REGION_WRITE_MULTI without write_multiple) are refused, header only, and the
    connection stays usable."""
    msg_id = peer.send(command, b"\0" * 8)
    assert_error_reply(peer.next_reply(), command, msg_id)
    assert peer.read32(gpu.ID) == gpu.ID_VALUE


@pytest.mark.parametrize("command", [vu.DMA_READ, vu.DMA_WRITE])
def test_server_to_client_commands_sent_by_the_client_are_refused(peer, command):
    """Commands table: DMA_READ and DMA_WRITE are "server -> client"; sent the other
    way they are an error (header-only reply), and nothing is read or written."""
    msg_id = peer.send(command, vu.DMA_RW.pack(0x1000, 4) + (b"\0" * 4 if command == vu.DMA_WRITE else b""))
    assert_error_reply(peer.next_reply(), command, msg_id)


def test_command_before_version_is_refused(raw, gpu_server):
    """Connection Initiation: "After the client connects to the server, the initial
    client message is VFIO_USER_VERSION".  Anything else first gets no successful
    reply (an error reply, or the connection closed)."""
    raw.send(vu.DEVICE_GET_INFO, vu.DEVICE_INFO.pack(16, 0, 0, 0))
    try:
        reply = raw.next_reply()
    except vu.PeerClosed:
        return
    assert_error_reply(reply, vu.DEVICE_GET_INFO)


def test_header_with_size_below_16_closes_the_connection(peer, gpu_server):
    """Header: "Message size contains the size of the entire message, including the
    header" (16 bytes).  A smaller size cannot be framed: the stream can no longer
    be trusted, so the server must drop the connection, and serve the next client."""
    peer.send_bytes(vu.HEADER.pack(1, vu.DEVICE_GET_INFO, 8, 0, 0))
    seen = expect_closed(peer)
    assert all(m.is_error for m in seen), f"success reply to a malformed header: {seen}"
    peer.close()
    fresh_client_works(gpu_server)


def test_absurd_message_size_closes_the_connection(peer, gpu_server):
    """Security Considerations: "Standard tools and mechanisms should be used on both
    sides to validate input and prevent against denial of service scenarios".  A
    header claiming ~4 GiB is not buffered: the server hangs up and serves the
    next client."""
    peer.send_bytes(vu.HEADER.pack(1, vu.REGION_WRITE, 0xFFFFFFF0, 0, 0) + b"\0" * 64)
    seen = expect_closed(peer)
    assert all(m.is_error for m in seen), f"success reply to a 4 GiB message: {seen}"
    peer.close()
    fresh_client_works(gpu_server)


@pytest.mark.parametrize("msg_type", [vu.TYPE_REPLY, 0x2, 0xF])
def test_message_that_is_not_a_command_is_not_executed(peer, gpu_server, msg_type):
    """Header: Type "Command (value 0x0) indicates a command message" and "Reply
    (value 0x1) indicates a reply message acknowledging a previous command with
    the same message ID".  A reply the server never asked for, or an undefined
    type, is not executed as a command and never gets a success reply."""
    peer.write32(gpu.SCRATCH, 1)
    peer.send(vu.REGION_WRITE, vu.REGION_RW.pack(gpu.SCRATCH, 0, 4) + (2).to_bytes(4, "little"),
              flags=msg_type)
    try:
        read_id = peer.send(vu.REGION_READ, vu.REGION_RW.pack(gpu.SCRATCH, 0, 4))
        while True:
            reply = peer.next_reply()
            if reply.msg_id == read_id and reply.command == vu.REGION_READ:
                break
            assert reply.is_error, f"success reply to a message of type {msg_type}: {reply!r}"
        assert int.from_bytes(reply.payload[vu.REGION_RW.size:], "little") == 1, \
            f"a message of type {msg_type} was executed as a command"
    except vu.PeerClosed:
        peer.close()
        fresh_client_works(gpu_server)


def test_message_sent_one_byte_at_a_time_is_assembled(peer):
    """Header/framing: the socket is a byte stream; a message that arrives in pieces
    (short writes by the client) is the same message."""
    body = vu.REGION_RW.pack(gpu.SCRATCH, 0, 4) + (0xC0FFEE).to_bytes(4, "little")
    msg = vu.header(9, vu.REGION_WRITE, len(body)) + body
    peer.send_bytes(msg, pieces=[1] * len(msg))
    assert_ok_reply(peer.next_reply(), vu.REGION_WRITE)
    assert peer.read32(gpu.SCRATCH) == 0xC0FFEE


def test_slow_reader_gets_whole_messages(gpu_server):
    """Header/framing: replies are whole messages even when the client reads them
    slowly through a tiny receive buffer (the server's sends are short): a 256 KiB
    (or the server's max_data_xfer_size) REGION_READ reply followed by small replies stays in step (issue item 1)."""
    with gpu_server.connect(timeout=20) as p:
        p.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        assert_ok_reply(p.handshake(), vu.VERSION)
        limit = p.server_caps.get("max_data_xfer_size", vu.DEFAULT_MAX_DATA_XFER)
        pattern = os.urandom(min(256 * 1024, limit))
        for off in range(0, len(pattern), 4096):
            assert_ok_reply(p.region_write(gpu.BAR_VRAM, off, pattern[off:off + 4096]),
                            vu.REGION_WRITE)
        p.read_chunk = 97
        p.send(vu.REGION_READ, vu.REGION_RW.pack(0, gpu.BAR_VRAM, len(pattern)))
        for off in (gpu.ID, gpu.VERSION):
            p.send(vu.REGION_READ, vu.REGION_RW.pack(off, 0, 4))
        big = p.next_reply(20)
        assert_ok_reply(big, vu.REGION_READ)
        assert big.payload[vu.REGION_RW.size:] == pattern
        assert int.from_bytes(p.next_reply().payload[16:], "little") == gpu.ID_VALUE
        p.next_reply()


def test_fds_sent_with_a_command_that_takes_none_are_not_kept(peer, gpu_server):
    """DMA_MAP and SET_IRQS are the only client commands whose fds the spec defines;
    an fd attached to anything else must not stay open in the server (Security
    Considerations: "prevent against denial of service scenarios")."""
    w = vu.Window(0x7000_0000, vu.PAGE, direct=True, name="stray")
    try:
        reply = peer.request(vu.DEVICE_GET_INFO, vu.DEVICE_INFO.pack(16, 0, 0, 0), fds=[w.fd])
        assert reply.is_reply and reply.command == vu.DEVICE_GET_INFO
        assert not gpu_server.proc.holds(w.name), "the server kept an fd it was not meant to get"
    finally:
        w.close()


STALL = 11.0  # two of the server's 5 s send timeouts (a partial send, then none): it gives up


def test_stalled_reader_never_gets_a_cut_message(gpu_server):
    """Header: "Message size contains the size of the entire message" -- a message is
    all of its bytes or nothing.  A client that stops reading (tiny receive buffer,
    nothing read for longer than the server's send timeout) while the device sends
    it a 16 MiB DMA_WRITE must afterwards find either the whole message followed by
    whole messages, or a closed connection: never a cut message with the next
    one's header taken as its data (issue 9 item 1, "the connection must be
    poisoned").  The stall is the stimulus here, not a synchronisation."""
    with gpu_server.connect(timeout=20) as p:
        p.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        # pieces as large as the whole transfer: far beyond any socket buffer
        assert_ok_reply(p.handshake({"max_msg_fds": 8, "max_data_xfer_size": 64 << 20}),
                        vu.VERSION)
        p.request(vu.DEVICE_RESET)
        rig = Rig(p)
        try:
            length = 16 << 20
            w = vu.Window(DATA_IOVA, length, direct=False, name="stall")
            assert_ok_reply(p.dma_map(w), vu.DMA_MAP)
            rig.submit(gpu.descriptor(gpu.OP_FILL_PATTERN, 0x0102030405060708, 0, length))
            rig.wait_idle()
            rig.submit(gpu.descriptor(gpu.OP_VRAM_TO_HOST, 0, DATA_IOVA, length))
            time.sleep(STALL)  # the stimulus: a reader that stalls
            try:
                # a poisoned server has hung up: the client may notice it right here
                p.send(vu.REGION_READ, vu.REGION_RW.pack(gpu.ID, 0, 4))
                while True:
                    msg = p.recv(3)
                    if msg.type == vu.TYPE_COMMAND and msg.command == vu.DMA_WRITE:
                        address, count = vu.DMA_RW.unpack_from(msg.payload)
                        assert msg.size == vu.HEADER_SIZE + vu.DMA_RW.size + count
                        if address == DATA_IOVA:
                            unit = (0x0102030405060708).to_bytes(8, "little")
                            assert msg.payload[16:] == (unit * (count // 8 + 1))[:count], \
                                "DMA_WRITE data corrupted: a cut message was continued"
                        p.serve_dma(msg)
                        continue
                    assert msg.is_reply and msg.command == vu.REGION_READ, \
                        f"stream out of step after the stall: {msg!r}"
                    assert int.from_bytes(msg.payload[16:], "little") == gpu.ID_VALUE
                    break
            except vu.PeerClosed:
                pass  # poisoned and closed: the other correct outcome
            except vu.PeerTimeout as exc:
                pytest.fail(f"a cut message: the stream stopped inside a message the header "
                            f"announced ({exc}), and the connection was not closed",
                            pytrace=False)
        finally:
            rig.close()
    fresh_client_works(gpu_server)
