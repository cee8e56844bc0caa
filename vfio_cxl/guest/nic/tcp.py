"""The reference for RDMA-shaped writes: the same writes, VRAM to VRAM, over TCP between the
two guests on the lab's virtio-net link (the kernel's stack both ends).

    TcpResponder(port).serve(gpu, region_offset, region_length)      # host1
    TcpRequester(peer, port).write(gpu, vram_offset, length, remote_offset, imm)   # host0

The requester reads the bytes out of its VRAM through BAR2 and sends a 24-byte header
(remote offset, length, immediate) and them; the responder checks the range against its
region, receives into guest RAM and writes into VRAM through BAR2, then answers with the
immediate and a status (0: placed; else ``rdma.Status``).  Every byte goes through both CPUs.
"""

from __future__ import annotations

import socket
import struct
import time

from .rdma import RdmaError, Status, refusal

PORT = 18515                       # perftest's (ib_write_bw's) default port
_REQUEST = struct.Struct("!QQII")  # remote offset, length, immediate, 0
_ANSWER = struct.Struct("!II")     # immediate, status


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if not n:
            raise RdmaError("the peer closed the TCP connection mid-write", "is the peer's command still running?")
        view = view[n:]


class TcpResponder:
    def __init__(self, port: int = PORT, timeout: float = 60.0):
        self._server = socket.create_server(("0.0.0.0", port))
        self.port = self._server.getsockname()[1]          # port 0: the one the kernel chose
        self._server.settimeout(timeout)
        self._conn: socket.socket | None = None
        self.timeout = timeout
        self.payload_bytes_copied = 0

    def serve(self, gpu, region_offset: int, region_length: int) -> dict:
        """One write into VRAM [region_offset, region_offset + region_length) -> what happened."""
        if self._conn is None:
            self._conn, _ = self._server.accept()
            self._conn.settimeout(self.timeout)
            self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(_REQUEST.size)
        _recv_exact(self._conn, memoryview(head))
        offset, length, imm, _ = _REQUEST.unpack(head)
        t0, c0 = time.perf_counter(), time.process_time()
        buffer = bytearray(length)
        _recv_exact(self._conn, memoryview(buffer))
        status = Status.OK if 0 < length and offset + length <= region_length else Status.OUT_OF_RANGE
        if status is Status.OK:
            gpu.vram.write(region_offset + offset, buffer)
            self.payload_bytes_copied += length                 # into BAR2 (the kernel's copies not counted)
        self._conn.sendall(_ANSWER.pack(imm, status))
        return {"offset": offset, "length": length, "imm": imm, "status": status,
                "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._server.close()


class TcpRequester:
    def __init__(self, peer: str, port: int = PORT, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._sock = socket.create_connection((peer, port), timeout=min(5.0, timeout))
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise RdmaError(f"no TCP connection to {peer}:{port} within {timeout:g} s ({err})",
                                    "start the responder first (vfio-cxl nic rdma-recv --path tcp)") from None
                time.sleep(0.2)         # the responder is not listening yet: retry, bounded by the deadline
        self._sock.settimeout(timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload_bytes_copied = 0

    def write(self, gpu, vram_offset: int, length: int, remote_offset: int, imm: int = 0) -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        data = gpu.vram.read(vram_offset, length)
        self.payload_bytes_copied += length                     # out of BAR2
        self._sock.sendall(_REQUEST.pack(remote_offset, length, imm, 0) + data)
        answer = bytearray(_ANSWER.size)
        _recv_exact(self._sock, memoryview(answer))
        got_imm, status = _ANSWER.unpack(answer)
        if status != Status.OK:
            raise refusal(Status(status), f"the peer refused the TCP write of {length} bytes at {remote_offset:#x}")
        return {"length": length, "imm": got_imm, "seconds": time.perf_counter() - t0,
                "cpu_seconds": time.process_time() - c0}

    def close(self) -> None:
        self._sock.close()
