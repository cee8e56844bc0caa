"""Byte-exact wire layouts, checked with hand-written bytes, not the server's structs.

The client harness shares vfio_cxl.devices.vfio_user.wire with the server, so a wrong
layout there would pass every other test; these tests pin the layouts to the
vfio-user spec and QEMU 11.1's behaviour (lab notes) independently.
"""

import json
import socket
import struct

from vfio_user_client import gpu_server  # noqa: F401  (fixture)

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.vfio_user import wire

HDR = struct.Struct("<HHIII")  # id, command, size, flags, error -- written out on purpose


def test_header_and_payload_sizes_match_the_spec():
    assert wire.HEADER.size == 16
    assert wire.Header(0x1234, 9, 32, 0x10, 0).pack() == bytes.fromhex(
        "3412" "0900" "20000000" "10000000" "00000000")
    sizes = {wire.DMA_MAP_REQ: 32, wire.DMA_UNMAP_REQ: 24, wire.DEVICE_INFO: 16,
             wire.REGION_INFO: 32, wire.CAP_HEADER: 8, wire.SPARSE_MMAP: 8,
             wire.SPARSE_AREA: 16, wire.IRQ_INFO: 16, wire.IRQ_SET: 20,
             wire.REGION_ACCESS: 16, wire.DMA_ACCESS: 16}
    for st, size in sizes.items():
        assert st.size == size, st.format
        assert st.format.startswith("<")


def test_command_numbers_match_the_spec():
    assert (wire.VERSION, wire.DMA_MAP, wire.DMA_UNMAP, wire.DEVICE_GET_INFO,
            wire.DEVICE_GET_REGION_INFO, wire.DEVICE_GET_REGION_IO_FDS, wire.DEVICE_GET_IRQ_INFO,
            wire.DEVICE_SET_IRQS, wire.REGION_READ, wire.REGION_WRITE, wire.DMA_READ,
            wire.DMA_WRITE, wire.DEVICE_RESET) == tuple(range(1, 14))
    assert (wire.FLAG_NO_REPLY, wire.FLAG_ERROR, wire.TYPE_REPLY) == (0x10, 0x20, 0x1)


class Raw:
    """Hand-rolled peer: literal structs only."""

    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(5)
        self.s.connect(path)
        self.next_id = 100

    def recv_exact(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            assert chunk, "server closed the connection"
            buf += chunk
        return buf

    def recv_msg(self):
        hdr = HDR.unpack(self.recv_exact(16))
        return hdr, self.recv_exact(hdr[2] - 16)

    def request(self, command, payload):
        self.next_id += 1
        self.s.sendall(HDR.pack(self.next_id, command, 16 + len(payload), 0, 0) + payload)
        return self.next_id

    def close(self):
        self.s.close()


def test_version_reply_is_short_nul_terminated_json(gpu_server):
    raw = Raw(gpu_server.path)
    caps = json.dumps({"capabilities": {"max_msg_fds": 16, "max_data_xfer_size": 1048576,
                                        "pgsizes": 4096, "max_dma_maps": 65535,
                                        "migration": {"pgsize": 4096, "max_bitmap_size": 1 << 20},
                                        "write_multiple": True}}).encode() + b"\0"
    request = struct.pack("<HH", 0, 0) + caps
    msg_id = raw.request(1, request)
    (rid, cmd, size, flags, err), body = raw.recv_msg()
    assert (rid, cmd, flags, err) == (msg_id, 1, 1, 0)
    assert size <= 16 + len(request), "QEMU receives the reply into a buffer of its request's size"
    assert struct.unpack_from("<HH", body) == (0, 0)
    assert body.endswith(b"\0")
    reply_caps = json.loads(body[4:-1])["capabilities"]
    assert reply_caps == {"max_msg_fds": 8, "max_data_xfer_size": 1 << 20}
    assert "write_multiple" not in reply_caps  # we do not do REGION_WRITE_MULTI
    raw.close()


def test_server_dma_messages_use_the_qemu_11_layout(gpu_server):
    """Ring fetch -> DMA_READ, data -> DMA_WRITE: u64 address @16, u64 count @24, data @32."""
    raw = Raw(gpu_server.path)
    raw.request(1, struct.pack("<HH", 0, 0) + b'{"capabilities":{"max_data_xfer_size":65536}}\0')
    assert raw.recv_msg()[0][3] == 1
    ring, compl, host = 0x4000_0000, 0x4000_1000, 0x5000_0000
    for iova in (ring, host):  # DMA_MAP without fd: the message path
        raw.request(2, struct.pack("<IIQQQ", 32, 3, 0, iova, 0x10000))
        assert raw.recv_msg()[0][3] == 1
    vram = gpu_server.device.vram
    vram[0:100] = bytes(range(100))
    raw.request(10, struct.pack("<QII", 4, 7, 2) + struct.pack("<H", 6))  # Bus Master Enable
    for reg, value in ((regs.REG_RING_BASE_LO, ring), (regs.REG_RING_SIZE, 8),
                       (regs.REG_COMPL_BASE_LO, compl), (regs.REG_CONTROL, 1),
                       (regs.REG_RING_TAIL, 1)):
        raw.request(10, struct.pack("<QII", reg, 0, 4) + struct.pack("<I", value))
    descriptor = struct.pack("<QQIBBHQ", 0, host + 8, 100, 1, 0, 0, 0xC00C1E)
    seen = []
    while len(seen) < 3:  # (the config write's reply is skipped below too)
        (mid, cmd, size, flags, err), body = raw.recv_msg()
        if flags & 0xF == 1:
            assert cmd == 10 and not flags & 0x20  # the REGION_WRITE replies
            continue
        addr, count = struct.unpack_from("<QQ", body)
        seen.append((cmd, addr, count, size))
        if cmd == 11:  # DMA_READ: reply carries addr, count, data
            assert size == 32
            assert (addr, count) == (ring, 32)
            reply = struct.pack("<QQ", addr, count) + descriptor
            raw.s.sendall(HDR.pack(mid, 11, 16 + len(reply), 1, 0) + reply)
        else:
            assert cmd == 12 and size == 32 + count
            data = body[16:]
            if addr == host + 8:
                assert data == bytes(range(100))
            else:
                assert addr == compl
                cookie, status, done, index, seq, _ = struct.unpack("<QIIIIQ", data)
                assert (cookie, status, done, index, seq) == (0xC00C1E, 0, 100, 0, 1)
            raw.s.sendall(HDR.pack(mid, 12, 32, 1, 0) + struct.pack("<QQ", addr, count))
    assert [s[0] for s in seen] == [11, 12, 12]
    raw.close()
