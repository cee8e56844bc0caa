"""The GPU's BAR0 register file: the values, their reset state, and byte-lane decoding.

It holds data only.  What a write *means* (CONTROL, the doorbell, the ring
registers' lock) is decided by the engine, which owns this object and reads
and writes it under its own lock.
"""

from __future__ import annotations


from . import regs


# ring configuration registers: offset -> (attribute, bit shift)
RING_CONFIG = {
    regs.REG_RING_BASE_LO: ("ring_base", 0),
    regs.REG_RING_BASE_HI: ("ring_base", 32),
    regs.REG_RING_SIZE: ("ring_size", 0),
    regs.REG_COMPL_BASE_LO: ("compl_base", 0),
    regs.REG_COMPL_BASE_HI: ("compl_base", 32),
}


# message window registers (interface 1.2): offset -> (attribute, bit shift)
MSG_WINDOW = {
    regs.REG_MSGWIN_BASE_LO: ("msgwin_base", 0),
    regs.REG_MSGWIN_BASE_HI: ("msgwin_base", 32),
    regs.REG_MSGWIN_SIZE_LO: ("msgwin_size", 0),
    regs.REG_MSGWIN_SIZE_HI: ("msgwin_size", 32),
}


class RegisterFile:
    def __init__(self, vram_size: int):
        self.vram_size = vram_size
        self.reset()

    def reset(self) -> None:
        """Every register to its value in the spec's register table."""
        self.scratch = 0
        self.intr_status = 0
        self.ring_base = self.ring_size = self.head = self.tail = 0
        self.compl_base = self.completed = 0
        self.err_status = self.err_index = self.err_addr = self.err_errno = 0
        self.p2p_control = 0
        self.msgwin_base = self.msgwin_size = 0

    def latch_error(self, status: int, index: int, addr: int, err: int) -> None:
        self.err_status, self.err_index = int(status), index & 0xFFFFFFFF
        self.err_addr, self.err_errno = addr & 0xFFFFFFFFFFFFFFFF, err & 0xFFFFFFFF

    def set_ring_config(self, reg: int, value: int, mask: int) -> None:
        attr, shift = RING_CONFIG[reg]
        old = getattr(self, attr)
        part = (((old >> shift) & 0xFFFFFFFF) & ~mask) | (value & mask)
        setattr(self, attr, (old & ~(0xFFFFFFFF << shift)) | (part << shift))

    def set_msg_window(self, reg: int, value: int, mask: int) -> None:
        attr, shift = MSG_WINDOW[reg]
        old = getattr(self, attr)
        part = (((old >> shift) & 0xFFFFFFFF) & ~mask) | (value & mask)
        setattr(self, attr, (old & ~(0xFFFFFFFF << shift)) | (part << shift))

    def ring_config_valid(self) -> bool:
        size = self.ring_size
        return (regs.RING_SIZE_MIN <= size <= regs.RING_SIZE_MAX and not size & (size - 1)
                and self.ring_base % regs.DESC_ALIGN == 0
                and self.compl_base % regs.COMPL_ALIGN == 0
                and self.ring_base + size * regs.DESC_SIZE <= 1 << 64
                and self.compl_base + size * regs.COMPL_SIZE <= 1 << 64
                and self.head < size and self.tail < size)

    def value(self, reg: int, status: int, control: int) -> int:
        """The 32-bit value of ``reg``; STATUS and CONTROL come from the engine state."""
        if reg == regs.REG_STATUS:
            return status
        if reg == regs.REG_CONTROL:
            return control
        values = {
            regs.REG_ID: regs.ID_MAGIC,
            regs.REG_VERSION: regs.DEVICE_VERSION,
            regs.REG_VRAM_SIZE_LO: self.vram_size & 0xFFFFFFFF,
            regs.REG_VRAM_SIZE_HI: self.vram_size >> 32,
            regs.REG_CAPS: regs.CAPS_OPS,
            regs.REG_RING_MAX: regs.RING_SIZE_MAX,
            regs.REG_SCRATCH: self.scratch,
            regs.REG_INTR_STATUS: self.intr_status,
            regs.REG_RING_BASE_LO: self.ring_base & 0xFFFFFFFF,
            regs.REG_RING_BASE_HI: self.ring_base >> 32,
            regs.REG_RING_SIZE: self.ring_size,
            regs.REG_RING_HEAD: self.head,
            regs.REG_RING_TAIL: self.tail,
            regs.REG_COMPL_BASE_LO: self.compl_base & 0xFFFFFFFF,
            regs.REG_COMPL_BASE_HI: self.compl_base >> 32,
            regs.REG_COMPLETED: self.completed,
            regs.REG_ERR_STATUS: self.err_status,
            regs.REG_ERR_DESC_INDEX: self.err_index,
            regs.REG_ERR_ADDR_LO: self.err_addr & 0xFFFFFFFF,
            regs.REG_ERR_ADDR_HI: (self.err_addr >> 32) & 0xFFFFFFFF,
            regs.REG_ERR_ERRNO: self.err_errno,
            regs.REG_P2P_CONTROL: self.p2p_control,
            regs.REG_MSGWIN_BASE_LO: self.msgwin_base & 0xFFFFFFFF,
            regs.REG_MSGWIN_BASE_HI: self.msgwin_base >> 32,
            regs.REG_MSGWIN_SIZE_LO: self.msgwin_size & 0xFFFFFFFF,
            regs.REG_MSGWIN_SIZE_HI: self.msgwin_size >> 32,
        }
        return values.get(reg, 0)
