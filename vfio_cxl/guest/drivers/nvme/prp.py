"""Data pointers: PRPs (admin and I/O commands) and SGLs (I/O commands only, when the controller
says so in Identify Controller SGLS), built into the page a request owns.

Both describe device addresses (IOVAs): guest RAM the driver mapped, or a peer's BAR (a GPU's
VRAM) mapped into the controller's IOMMU context.  Pure functions: the page is a writable
buffer the caller owns and ``list_iova`` is where the controller finds it."""

from __future__ import annotations

import struct

from .errors import NvmeError
from .spec import PAGE, SGL_DATA_BLOCK, SGL_DESC_SIZE, SGL_LAST_SEGMENT

PRP_LIST_ENTRIES = PAGE // 8            # one page of PRP entries, no chaining
MAX_PRP_BYTES = PAGE * PRP_LIST_ENTRIES  # what one list page describes (2 MiB at 4 KiB pages)
SGL_LIST_ENTRIES = PAGE // SGL_DESC_SIZE


def prp(iova: int, length: int, list_page, list_iova: int) -> tuple[int, int]:
    """PRP1 and PRP2 for ``length`` bytes at ``iova`` (contiguous in IOVA space).

    PRP1 may start inside a page (dword aligned); every further entry is a page.  Up to two
    pages: PRP2 is the second page.  More: PRP2 points at a PRP list written into ``list_page``."""
    if length <= 0:
        raise NvmeError(f"a transfer of {length} bytes", "transfer at least one block")
    if iova & 3:
        raise NvmeError(f"data address {iova:#x} is not dword aligned",
                        "PRP entries must be 4-byte aligned: align the buffer offset to 4 bytes (a block is best)")
    first = PAGE - (iova % PAGE)
    if length <= first:
        return iova, 0
    rest = length - first
    pages = -(-rest // PAGE)
    second = iova + first
    if pages == 1:
        return iova, second
    if pages > PRP_LIST_ENTRIES:
        raise NvmeError(f"{length} bytes need {pages} PRP list entries, more than one page holds "
                        f"({PRP_LIST_ENTRIES})", f"split the transfer into pieces of at most {MAX_PRP_BYTES} bytes")
    if list_iova % PAGE:
        raise NvmeError(f"PRP list at {list_iova:#x} is not page aligned", "give each request a page of its own")
    struct.pack_into(f"<{pages}Q", list_page, 0, *(second + i * PAGE for i in range(pages)))
    return iova, list_iova


def sgl(segments: list[tuple[int, int]], list_page, list_iova: int) -> tuple[int, int]:
    """The 16-byte SGL descriptor for DPTR (as two 64-bit words) describing ``segments``
    ((iova, length) pairs, any alignment): one Data Block descriptor for one segment, else a
    Last Segment descriptor pointing at Data Block descriptors written into ``list_page``."""
    if not segments or any(length <= 0 for _, length in segments):
        raise NvmeError(f"SGL segments {segments}", "give one or more (iova, length) pairs with length > 0")
    if len(segments) == 1:
        (iova, length), = segments
        return iova, length | SGL_DATA_BLOCK << 56
    if len(segments) > SGL_LIST_ENTRIES:
        raise NvmeError(f"{len(segments)} SGL segments, more than one page of descriptors holds "
                        f"({SGL_LIST_ENTRIES})", "merge segments or split the transfer")
    for i, (iova, length) in enumerate(segments):
        struct.pack_into("<QI3xB", list_page, i * SGL_DESC_SIZE, iova, length, SGL_DATA_BLOCK)
    return list_iova, (len(segments) * SGL_DESC_SIZE) | SGL_LAST_SEGMENT << 56


def sgl_descriptor(dptr: tuple[int, int]) -> tuple[int, int, int]:
    """(address, length, identifier) of a DPTR SGL descriptor (for tests and traces)."""
    return dptr[0], dptr[1] & 0xFFFFFFFF, dptr[1] >> 56
