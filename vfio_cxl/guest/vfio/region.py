"""A device region (a BAR, config space, ...) and typed access to it.

Where the region allows mmap (only inside its sparse areas, if it lists any:
the MSI-X table of a BAR is usually carved out), accesses go through the
mapping as single loads and stores of the requested width -- what a device
register needs.  Everywhere else they go through pread/pwrite on the device
fd, which vfio-pci also turns into accesses of the requested width.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from . import caps, uapi
from .errors import RegionError
from .uapi import ffi

_WIDTHS = {1: ("uint8_t *", "<B"), 2: ("uint16_t *", "<H"), 4: ("uint32_t *", "<I"), 8: ("uint64_t *", "<Q")}

PCI_REGION_NAMES = {
    uapi.VFIO_PCI_BAR0_REGION_INDEX + n: f"BAR{n}" for n in range(6)
} | {uapi.VFIO_PCI_ROM_REGION_INDEX: "ROM", uapi.VFIO_PCI_CONFIG_REGION_INDEX: "config",
     uapi.VFIO_PCI_VGA_REGION_INDEX: "VGA"}


@dataclass(frozen=True)
class RegionInfo:
    index: int
    flags: int
    size: int
    offset: int  # of the region within the device fd
    sparse_areas: tuple[tuple[int, int], ...] | None = None  # (offset, size); None: no sparse cap
    type: tuple[int, int] | None = None  # (type, subtype) of a device-specific region
    msix_mappable: bool = False

    @property
    def readable(self) -> bool:
        return bool(self.flags & uapi.VFIO_REGION_INFO_FLAG_READ)

    @property
    def writable(self) -> bool:
        return bool(self.flags & uapi.VFIO_REGION_INFO_FLAG_WRITE)

    @property
    def mmappable(self) -> bool:
        return bool(self.flags & uapi.VFIO_REGION_INFO_FLAG_MMAP) and self.size > 0

    def mmap_areas(self) -> list[tuple[int, int]]:
        """(offset, size) within the region of each part we may mmap."""
        if not self.mmappable:
            return []
        if self.sparse_areas is None:
            return [(0, self.size)]
        return [(off, size) for off, size in self.sparse_areas if size > 0]

    @classmethod
    def from_buffer(cls, buf: bytes) -> "RegionInfo":
        """Decode a VFIO_DEVICE_GET_REGION_INFO buffer, capability chain included."""
        head = caps.read_struct(buf, "struct vfio_region_info")
        sparse = region_type = None
        msix_mappable = False
        if head["flags"] & uapi.VFIO_REGION_INFO_FLAG_CAPS:
            for cap in caps.capability_chain(buf, head["cap_offset"]):
                if cap.id == uapi.VFIO_REGION_INFO_CAP_SPARSE_MMAP:
                    sparse = tuple(caps.sparse_mmap_areas(buf, cap))
                elif cap.id == uapi.VFIO_REGION_INFO_CAP_TYPE:
                    region_type = caps.region_type(buf, cap)
                elif cap.id == uapi.VFIO_REGION_INFO_CAP_MSIX_MAPPABLE:
                    msix_mappable = True
        return cls(head["index"], head["flags"], head["size"], head["offset"], sparse, region_type,
                   msix_mappable)


class _MappedArea:
    """One mmap of part of a region, with a cffi pointer for width-exact loads and stores."""

    def __init__(self, fd: int, info: RegionInfo, start: int, size: int):
        prot = (mmap.PROT_READ if info.readable else 0) | (mmap.PROT_WRITE if info.writable else 0)
        self.start = start
        self.size = size
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot, offset=info.offset + start)
        try:
            self.base = ffi.from_buffer(self.map)
        except BaseException:
            self.map.close()
            raise

    def covers(self, offset: int, length: int) -> bool:
        return self.start <= offset and offset + length <= self.start + self.size

    def close(self) -> None:
        ffi.release(self.base)  # the mmap refuses to close while a cffi pointer exports it
        self.map.close()


class Region:
    """Access to one region of an open device fd.  ``close()`` unmaps it (safe to repeat)."""

    def __init__(self, device_fd: int, info: RegionInfo, *, name: str | None = None):
        self.fd = device_fd
        self.info = info
        self.name = name or PCI_REGION_NAMES.get(info.index, f"region {info.index}")
        self._areas: list[_MappedArea] | None = None  # mapped on first access

    @property
    def size(self) -> int:
        return self.info.size

    def map(self) -> None:
        """mmap every area the region allows (done lazily by the accessors)."""
        if self._areas is not None:
            return
        areas: list[_MappedArea] = []
        try:
            for start, size in self.info.mmap_areas():
                areas.append(_MappedArea(self.fd, self.info, start, size))
        except OSError as error:
            for area in reversed(areas):
                area.close()
            raise RegionError(f"cannot mmap {self.name} ({error.strerror})",
                              "the region claims mmap support: check the device's BAR sizes "
                              "(mmap needs page-sized BARs) and dmesg") from None
        self._areas = areas

    def is_mapped(self, offset: int, length: int = 1) -> bool:
        """True when [offset, offset+length) is reached through mmap rather than pread/pwrite."""
        self.map()
        return self._area(offset, length) is not None

    def view(self, offset: int, length: int) -> memoryview:
        """A memoryview straight onto the mapped region, for bulk copies (release it before close)."""
        self._check(offset, length, 1)
        self.map()
        area = self._area(offset, length)
        if area is None:
            raise RegionError(f"{self.name} [{offset:#x}, {offset + length:#x}) is not mmap-able",
                              "use read()/write(), or stay inside RegionInfo.mmap_areas()")
        return memoryview(area.map)[offset - area.start: offset - area.start + length]

    def mmap_object(self):
        """The one mmap covering the whole region (e.g. to DMA-map a BAR for a peer device).

        RegionError when the region is not mmappable as a whole (no mmap flag,
        or sparse areas that leave holes)."""
        if not self.info.mmappable:
            raise RegionError(f"{self.name} is not mmappable (the device did not set VFIO_REGION_INFO_FLAG_MMAP)",
                              "map a BAR the device offers for mmap (the GPU's BAR2, its VRAM)")
        self.map()
        area = self._area(0, self.size)
        if area is None:
            raise RegionError(f"{self.name} is mmappable only in parts ({self.info.mmap_areas()})",
                              "map a region that is mmappable as a whole")
        return area.map

    # -- byte access ---------------------------------------------------------

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length, 1, reading=True)
        self.map()
        area = self._area(offset, length)
        if area is not None:
            return area.map[offset - area.start: offset - area.start + length]
        return self._pread(offset, length)

    def write(self, offset: int, data: bytes) -> None:
        self._check(offset, len(data), 1, reading=False)
        self.map()
        area = self._area(offset, len(data))
        if area is not None:
            area.map[offset - area.start: offset - area.start + len(data)] = data
        else:
            self._pwrite(offset, bytes(data))

    # -- register access: one load or store of exactly the given width ----------

    def read8(self, offset: int) -> int:
        return self._read_width(offset, 1)

    def read16(self, offset: int) -> int:
        return self._read_width(offset, 2)

    def read32(self, offset: int) -> int:
        return self._read_width(offset, 4)

    def read64(self, offset: int) -> int:
        return self._read_width(offset, 8)

    def write8(self, offset: int, value: int) -> None:
        self._write_width(offset, 1, value)

    def write16(self, offset: int, value: int) -> None:
        self._write_width(offset, 2, value)

    def write32(self, offset: int, value: int) -> None:
        self._write_width(offset, 4, value)

    def write64(self, offset: int, value: int) -> None:
        self._write_width(offset, 8, value)

    def _read_width(self, offset: int, width: int) -> int:
        self._check(offset, width, width, reading=True)
        self.map()
        area = self._area(offset, width)
        ctype, fmt = _WIDTHS[width]
        if area is not None:
            return ffi.cast(ctype, area.base + (offset - area.start))[0]
        return struct.unpack(fmt, self._pread(offset, width))[0]

    def _write_width(self, offset: int, width: int, value: int) -> None:
        self._check(offset, width, width, reading=False)
        if not 0 <= value < 1 << (8 * width):
            raise ValueError(f"{value:#x} does not fit in {8 * width} bits")
        self.map()
        area = self._area(offset, width)
        ctype, fmt = _WIDTHS[width]
        if area is not None:
            ffi.cast(ctype, area.base + (offset - area.start))[0] = value
        else:
            self._pwrite(offset, struct.pack(fmt, value))

    # -- helpers ---------------------------------------------------------------

    def _area(self, offset: int, length: int) -> _MappedArea | None:
        return next((a for a in self._areas or () if a.covers(offset, length)), None)

    def _check(self, offset: int, length: int, align: int, reading: bool | None = None) -> None:
        if self.fd < 0:
            raise RegionError(f"{self.name} is closed", "open the device again")
        if offset < 0 or length < 0 or offset + length > self.info.size:
            raise RegionError(f"[{offset:#x}, {offset + length:#x}) is outside {self.name} "
                              f"(size {self.info.size:#x})", "stay inside the region")
        if offset % align:
            raise RegionError(f"{8 * align}-bit access to {self.name} at {offset:#x} is not aligned",
                              f"use an offset that is a multiple of {align}")
        if reading is True and not self.info.readable:
            raise RegionError(f"{self.name} is not readable", "this region only takes writes")
        if reading is False and not self.info.writable:
            raise RegionError(f"{self.name} is not writable", "this region is read-only")

    def _pread(self, offset: int, length: int) -> bytes:
        try:
            data = os.pread(self.fd, length, self.info.offset + offset)
        except OSError as error:
            raise RegionError(f"reading {length} bytes of {self.name} at {offset:#x} failed ({error.strerror})",
                              "check that the device is still bound and its memory decoding is on") from None
        if len(data) != length:
            raise RegionError(f"short read of {self.name} at {offset:#x}: {len(data)} of {length} bytes",
                              "check the region's size")
        return data

    def _pwrite(self, offset: int, data: bytes) -> None:
        try:
            done = os.pwrite(self.fd, data, self.info.offset + offset)
        except OSError as error:
            raise RegionError(f"writing {len(data)} bytes of {self.name} at {offset:#x} failed "
                              f"({error.strerror})",
                              "check that the device is still bound and its memory decoding is on") from None
        if done != len(data):
            raise RegionError(f"short write to {self.name} at {offset:#x}: {done} of {len(data)} bytes",
                              "check the region's size")

    def close(self) -> None:
        for area in reversed(self._areas or []):
            area.close()
        self._areas = None
        self.fd = -1

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Region {self.name} size={self.info.size:#x} flags={self.info.flags:#x}>"
