"""Device-independent pieces of a trapped BAR: byte-lane decoding of 32-bit
registers and an MSI-X table/PBA BAR that keeps what the client writes.

Any device model may use these (the GPU and the SMC do).
"""

from __future__ import annotations

import struct

_U32 = struct.Struct("<I")


def read_bytes(value_of, offset: int, count: int) -> bytes:
    """Bytes ``offset .. offset+count`` of a BAR, given ``value_of(reg)`` per 32-bit register.
    ``value_of`` is called once per register touched, in address order."""
    first, last = offset & ~3, (offset + count + 3) & ~3
    raw = b"".join(_U32.pack(value_of(r) & 0xFFFFFFFF) for r in range(first, last, 4))
    return raw[offset - first:offset - first + count]


def split_write(offset: int, data: bytes) -> list[tuple[int, int, int]]:
    """A BAR write as (register, value, byte mask) per 32-bit register touched."""
    first = offset & ~3
    padded = bytes(offset - first) + bytes(data)
    padded += bytes(-len(padded) % 4)
    out = []
    for i in range(0, len(padded), 4):
        lo, hi = max(offset - first - i, 0), min(offset - first + len(data) - i, 4)
        mask = sum(0xFF << (8 * b) for b in range(lo, hi))
        if mask:
            out.append((first + i, _U32.unpack_from(padded, i)[0], mask))
    return out


class MsixBar:
    """MSI-X table + PBA in a BAR of ``bar_size`` bytes.  QEMU emulates masking itself;
    the table keeps what was written (vector control masked at reset), the PBA reads 0."""

    ENTRY_SIZE = 16

    def __init__(self, vectors: int, bar_size: int):
        self.bar_size = bar_size
        self._reset = bytearray(vectors * self.ENTRY_SIZE)
        for v in range(vectors):
            self._reset[v * self.ENTRY_SIZE + 12] = 1
        self.table = bytearray(self._reset)

    def reset(self) -> None:
        self.table[:] = self._reset

    def read(self, offset: int, count: int) -> bytes:
        image = bytes(self.table) + bytes(self.bar_size - len(self.table))
        return image[offset:offset + count]

    def write(self, offset: int, data) -> None:
        end = min(offset + len(data), len(self.table))
        if offset < end:
            self.table[offset:end] = bytes(data)[:end - offset]
