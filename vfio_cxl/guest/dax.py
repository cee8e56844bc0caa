"""/dev/dax mappings: devdax supports mmap only (no read/write), at its alignment."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from .cxl import SYS_DAX_DEVICES, CxlError, DaxDevice, dax_geometry

__all__ = ["DaxMapping", "open_dax"]


class DaxMapping:
    """A whole-device shared mapping of ``/dev/daxN.M``; close() unmaps and closes."""

    def __init__(self, dax: DaxDevice):
        self.dax = dax
        if dax.size % dax.align:
            raise CxlError(f"{dax.name}: size {dax.size:#x} is not a multiple of its alignment {dax.align:#x}")
        self._fd = os.open(dax.path, os.O_RDWR)
        try:
            self.map = mmap.mmap(self._fd, dax.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self._fd)
            raise
        self.view = memoryview(self.map)

    @property
    def size(self) -> int:
        return self.dax.size

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.dax.size:
            raise CxlError(f"{self.dax.name}: range {offset:#x}+{length:#x} is outside its {self.dax.size:#x} bytes",
                           "use a smaller offset or size")

    def write(self, offset: int, data: bytes) -> None:
        self._check(offset, len(data))
        self.view[offset:offset + len(data)] = data

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        return bytes(self.view[offset:offset + length])

    def close(self) -> None:
        if self._fd >= 0:
            self.view.release()
            self.map.close()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "DaxMapping":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_dax(path: str | Path) -> DaxMapping:
    """Map a devdax device by path, reading its size and alignment from sysfs."""
    path = Path(path)
    if not (SYS_DAX_DEVICES / path.name).exists():
        raise CxlError(f"{path} is not a dax device", "run: python3 -m vfio_cxl.guest.cmd.cxltool up")
    size, align = dax_geometry(path.name)
    return DaxMapping(DaxDevice(path.name, size, align, path, region="", resource=0))
