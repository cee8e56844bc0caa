"""Item 1: after a short or failed send the connection is poisoned.

A *fake socket* (our own logic is what is checked here) wraps the server's
real socket and lets only ``budget`` bytes through; the send that would pass
it delivers the bytes up to the budget (a short write) and every later
sendmsg fails.  For every byte offset of a reply, and of a device DMA
message, the peer must receive exactly the bytes before the cut and then
EOF, the server must never try to send on that connection again, and the
device must stay consistent for the next client.
"""

import socket
import struct

import pytest
from vfio_user_client import DATA_IOVA, Rig, ServerThread, gpu_server, no_leaks  # noqa: F401

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.gpu.regs import DESC_FLAG_INTERRUPT as IRQ, Op, Status, pack_descriptor
from vfio_cxl.devices.vfio_user import server as server_module, wire
from vfio_cxl.devices.vfio_user.transport import ConnectionClosed, Transport

HDR = struct.Struct("<HHIII")
MESSAGE_IOVA = 0x3000_0000
VERSION_REQ = struct.pack("<HH", 0, 0) + b'{"capabilities":{"max_data_xfer_size":1048576}}\0'


class CuttingSocket:
    """Delegates to a real socket, but sendmsg stops after ``budget`` bytes."""

    def __init__(self, sock, budget: int):
        self._sock, self.budget = sock, budget
        self.cut = False  # the short write happened: the next call fails
        self.failed = False
        self.attempts_after_cut = 0  # sendmsg calls after the failure was reported

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def sendmsg(self, buffers, ancdata=(), flags=0):
        if self.failed:
            self.attempts_after_cut += 1
            raise BrokenPipeError(32, "injected: the stream is broken")
        if self.cut:
            self.failed = True
            raise BrokenPipeError(32, "injected: the stream is broken")
        data = b"".join(bytes(b) for b in buffers)
        if len(data) <= self.budget:
            self.budget -= len(data)
            return self._sock.sendmsg([data], ancdata, flags)
        self.cut = True
        n, self.budget = self.budget, 0
        if n == 0:
            self.failed = True
            raise BlockingIOError(11, "injected: send timed out")
        return self._sock.sendmsg([data[:n]], ancdata, flags)  # short write


def test_transport_poisoned_at_every_offset():
    message = [wire.HEADER.pack(7, wire.REGION_READ, 36, wire.TYPE_REPLY, 0), bytes(range(20))]
    size = sum(len(p) for p in message)
    for cut in range(size):
        a, b = socket.socketpair()
        fake = CuttingSocket(a, cut)
        t = Transport(fake, partial_timeout=1, send_timeout=1)
        with pytest.raises(ConnectionClosed):
            t.send(message)
        assert t.poisoned
        with pytest.raises(ConnectionClosed):
            t.send(message)
        b.settimeout(2)
        got = b""
        while chunk := b.recv(4096):
            got += chunk
        assert got == b"".join(message)[:cut], cut  # then EOF: the socket was shut down
        assert fake.attempts_after_cut == 0
        t.close()
        b.close()


@pytest.fixture
def cut_first_connection(monkeypatch):
    """The server's next connection gets a CuttingSocket; returns a setter for its budget."""
    made = []
    real = server_module.Connection

    def connection(sock, **kw):
        if not made:
            sock = CuttingSocket(sock, made_budget[0])
            made.append(sock)
        return real(sock, **kw)

    made_budget = [1 << 62]
    monkeypatch.setattr(server_module, "Connection", connection)
    return made, made_budget


def raw_exchange(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def read_to_eof(s) -> bytes:
    """Everything until the server hung up (a reset counts: it left unread requests)."""
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_reply_cut_at_every_offset(tmp_path, monkeypatch):
    with no_leaks():
        srv = ServerThread(tmp_path)
        try:
            c = srv.client()
            c.reg_write(regs.REG_SCRATCH, 0x5CA7C4)
            c.close()
            srv.wait_idle()
            version_reply = 16 + len(wire.version_payload(0, 0, {
                "max_msg_fds": wire.SERVER_MAX_MSG_FDS,
                "max_data_xfer_size": wire.SERVER_MAX_DATA_XFER}))
            read_reply = 16 + 16 + 4
            for cut in range(read_reply):
                conns = []
                real = server_module.Connection

                def connection(sock, _cut=cut, **kw):
                    fake = CuttingSocket(sock, version_reply + _cut)
                    conns.append(fake)
                    return real(fake, **kw)

                monkeypatch.setattr(server_module, "Connection", connection)
                s = raw_exchange(srv.path)
                # VERSION, the read whose reply is cut, and a read the server must
                # never answer on this stream: one write, before the server hangs up
                s.sendall(HDR.pack(1, wire.VERSION, 16 + len(VERSION_REQ), 0, 0) + VERSION_REQ
                          + HDR.pack(2, wire.REGION_READ, 32, 0, 0)
                          + wire.REGION_ACCESS.pack(regs.REG_SCRATCH, 0, 4)
                          + HDR.pack(3, wire.REGION_READ, 32, 0, 0)
                          + wire.REGION_ACCESS.pack(regs.REG_ID, 0, 4))
                got = read_to_eof(s)
                assert len(got) == version_reply + cut, (cut, len(got))
                s.close()
                srv.wait_idle()
                assert conns[0].attempts_after_cut == 0, cut
                monkeypatch.setattr(server_module, "Connection", real)
                # the device is consistent for the next client
                c = srv.client()
                assert c.reg_read(regs.REG_SCRATCH) == 0x5CA7C4 and c.reg_read(regs.REG_ID) == regs.ID_MAGIC
                c.close()
                srv.wait_idle()
        finally:
            srv.stop()


@pytest.mark.parametrize("cut", [0, 1, 15, 16, 17, 31, 32, 33, 95])
def test_dma_message_cut_poisons_the_connection(tmp_path, monkeypatch, cut):
    """The device's own DMA_WRITE (16 + 16 + 64 bytes) is cut: nothing more may follow
    on that stream (before the fix, the completion record's DMA_WRITE did, and its
    header bytes were taken as the first message's payload)."""
    with no_leaks():
        srv = ServerThread(tmp_path)
        try:
            fakes = []
            real = server_module.Connection

            def connection(sock, **kw):
                fake = CuttingSocket(sock, 1 << 62)
                fakes.append(fake)
                return real(fake, **kw)

            monkeypatch.setattr(server_module, "Connection", connection)
            rig = Rig(srv, direct=True, entries=16)  # ring and completions: no messages
            try:
                far = rig.memory.add(MESSAGE_IOVA, 1 << 20, shared=False)
                rig.client.map_area(far, direct=False)  # the data: the message path
                srv.device.vram[:64] = bytes(range(64))
                fakes[0].budget = cut  # the next message the server sends is cut here
                rig.submit([pack_descriptor(Op.VRAM_TO_HOST, 0, MESSAGE_IOVA, 64, IRQ)], posted=True)
                assert rig.client.closed.wait(5), "the server kept the connection"
            finally:
                rig.close()
            srv.wait_idle()
            assert fakes[0].attempts_after_cut == 0
            monkeypatch.setattr(server_module, "Connection", real)
            c = srv.client()
            status = c.reg_read(regs.REG_STATUS)
            assert status == regs.STATUS_HALTED, status
            assert c.reg_read(regs.REG_ERR_STATUS) == Status.DMA_ABORTED
            assert c.reg_read(regs.REG_COMPLETED) == 0
            c.close()
        finally:
            srv.stop()
