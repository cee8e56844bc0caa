"""The frames ``vfio-cxl nic send`` sends and ``recv`` checks: IPv4/UDP, so the receiver's
header split falls on the UDP payload (the L5 offset, 42 bytes), and a payload each frame
carries its own check of: an 8-byte sequence number, then bytes only (seed, sequence) make."""

from __future__ import annotations

import random
import struct

ETH_HEADER = 14
IPV4_HEADER = 20
UDP_HEADER = 8
HEADERS = ETH_HEADER + IPV4_HEADER + UDP_HEADER     # where QEMU's igb splits a UDP/IPv4 frame
ETHERTYPE_IPV4 = 0x0800
UDP_PORT = 4791                                     # RoCEv2's port: these frames stand for its writes
SEQ = struct.Struct("<Q")
MAX_PAYLOAD = 1514 - HEADERS                        # a standard frame without FCS


def payload(seed: int, seq: int, size: int) -> bytes:
    """``size`` bytes (8 at least): ``seq``, then Random((seed, seq)) bytes."""
    if not SEQ.size <= size <= MAX_PAYLOAD:
        raise ValueError(f"a payload of {size} bytes: give {SEQ.size} to {MAX_PAYLOAD}")
    return SEQ.pack(seq) + random.Random(seed << 32 | seq).randbytes(size - SEQ.size)


def check_payload(seed: int, data: bytes) -> int | None:
    """The sequence number of ``data`` if it is ``payload(seed, seq, len(data))``, else None."""
    if len(data) < SEQ.size:
        return None
    (seq,) = SEQ.unpack_from(data)
    return seq if seq < 1 << 32 and payload(seed, seq, len(data)) == data else None


def _checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def udp_frame(dst: bytes, src: bytes, data: bytes, *, src_ip: bytes = bytes([10, 0, 0, 1]),
              dst_ip: bytes = bytes([10, 0, 0, 2])) -> bytes:
    """An Ethernet + IPv4 + UDP frame carrying ``data`` (UDP checksum 0: none, as IPv4 allows)."""
    length = IPV4_HEADER + UDP_HEADER + len(data)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, length, 0, 0x4000, 64, 17, 0, src_ip, dst_ip)
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    udp = struct.pack("!HHHH", UDP_PORT, UDP_PORT, UDP_HEADER + len(data), 0)
    return dst + src + struct.pack("!H", ETHERTYPE_IPV4) + ip + udp + data


def frame(dst: bytes, src: bytes, seed: int, seq: int, size: int) -> bytes:
    """Frame ``seq`` of a run: ``udp_frame`` of ``payload(seed, seq, size)``."""
    return udp_frame(dst, src, payload(seed, seq, size))
