"""IOVA space for the driver's DMA buffers: first fit over one window, freed ranges merged."""

from __future__ import annotations

from .errors import NvmeError
from .spec import PAGE


class IovaWindow:
    def __init__(self, base: int, size: int):
        if base % PAGE or size % PAGE or size <= 0:
            raise NvmeError(f"IOVA window {base:#x}+{size:#x}", "use a page-aligned base and size")
        self.base, self.size = base, size
        self._free = [(base, size)]          # sorted, disjoint, never adjacent

    def alloc(self, size: int, align: int = PAGE) -> int:
        size = -(-size // PAGE) * PAGE
        for i, (start, length) in enumerate(self._free):
            at = -(-start // align) * align
            if at + size <= start + length:
                pieces = [(start, at - start), (at + size, start + length - at - size)]
                self._free[i:i + 1] = [p for p in pieces if p[1]]
                return at
        raise NvmeError(f"no {size:#x} bytes of IOVA space left in {self.base:#x}+{self.size:#x}",
                        "free DMA buffers the driver no longer needs")

    def free(self, iova: int, size: int) -> None:
        size = -(-size // PAGE) * PAGE
        ranges = sorted(self._free + [(iova, size)])
        merged: list[tuple[int, int]] = []
        for start, length in ranges:
            if merged and merged[-1][0] + merged[-1][1] > start:
                raise NvmeError(f"IOVA {iova:#x}+{size:#x} freed twice or never allocated",
                                "free each buffer once")
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged
