"""The GPU's MSI-X table and PBA (BAR4).

QEMU emulates the table and masking itself; what reaches the device is kept
so that reads return what was written.  The PBA reads 0: a vector that
cannot be sent is lost, never pending (see the spec).
"""

from __future__ import annotations

from . import regs


class MsixTable:
    def __init__(self):
        self._reset = bytearray(regs.MSIX_VECTORS * regs.MSIX_ENTRY_SIZE)
        for v in range(regs.MSIX_VECTORS):  # vector control: masked at reset
            self._reset[v * regs.MSIX_ENTRY_SIZE + 12] = 1
        self.table = bytearray(self._reset)

    def reset(self) -> None:
        self.table[:] = self._reset

    def read(self, offset: int, count: int) -> bytes:
        # the PBA (and everything past the table) reads 0
        image = bytes(self.table) + bytes(regs.MSIX_BAR_SIZE - len(self.table))
        return image[offset:offset + count]

    def write(self, offset: int, data) -> None:
        end = min(offset + len(data), len(self.table))
        if offset < end:
            self.table[offset:end] = bytes(data)[:end - offset]
