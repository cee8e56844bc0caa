"""The GPU's programming interface as docs/gpu-device.md states it.

Transcribed from the document, not imported from the device, so black-box
checks (the vfio-user conformance suite, ``scripts/bench chaos``) test the
server against its spec.  Only what those checks use is here; if the
document changes, this is the one place to follow it.
"""

from __future__ import annotations

import struct

BAR_REGS = 0  # BAR0: registers, 4 KiB
BAR_VRAM = 2  # BAR2: VRAM (mappable)
REGS_SIZE = 4096

# BAR0 registers (docs/gpu-device.md "BAR0 registers"), all u32
ID = 0x000
ID_VALUE = 0x31555047  # b"GPU1"
VERSION = 0x004
VRAM_SIZE_LO = 0x008
SCRATCH = 0x018
CONTROL = 0x020
CONTROL_ENABLE = 1 << 0
CONTROL_RESET = 1 << 1
STATUS = 0x024
STATUS_ENABLED = 1 << 0
STATUS_BUSY = 1 << 1
STATUS_HALTED = 1 << 2
INTR_STATUS = 0x028
INTR_DMA_DONE = 1 << 0
INTR_ERROR = 1 << 1
RING_BASE_LO = 0x040
RING_BASE_HI = 0x044
RING_SIZE = 0x048
RING_HEAD = 0x04C
RING_TAIL = 0x050
COMPL_BASE_LO = 0x058
COMPL_BASE_HI = 0x05C
COMPLETED = 0x060
ERR_STATUS = 0x080
ERR_DESC_INDEX = 0x084
ERR_ADDR_LO = 0x088
ERR_ADDR_HI = 0x08C
ERR_ERRNO = 0x090

# descriptor / completion record (32 bytes each)
DESC = struct.Struct("<QQIBBHQ")  # src, dst, length, op, flags, reserved, cookie
COMPL = struct.Struct("<QIIIIQ")  # cookie, status, bytes_done, index, seq, duration_ns
DESC_SIZE = COMPL_SIZE = 32
DESC_FLAG_INTERRUPT = 1 << 0

OP_NOP = 0
OP_VRAM_TO_HOST = 1
OP_HOST_TO_VRAM = 2
OP_FILL_PATTERN = 3
OP_FILL_PRNG = 4

# status codes
ST_OK = 0
ST_DMA_UNMAPPED = 4
ST_DMA_REFUSED = 6
ST_DMA_ABORTED = 8
ST_RING_FETCH = 9
ST_BAD_TAIL = 11

# MSI-X vectors
VEC_DMA_DONE = 0
VEC_ERROR = 1
MSIX_VECTORS = 4


def descriptor(op: int, src: int, dst: int, length: int, flags: int = 0, cookie: int = 0) -> bytes:
    return DESC.pack(src, dst, length, op, flags, 0, cookie)
