"""Register map of the vfio-cxl shared-memory controller (SMC), as Python.

docs/smc-device.md is the contract; this module writes its numbers down.
The device model (``vfio_cxl.devices.smc``) and the guest driver
(``vfio_cxl.guest.drivers.smc``) both import it, so it uses the standard
library (and the GPU's map, for the MSI-X BAR layout) only (the guest has Python 3.13).

One SMC is shared by up to MAX_HOSTS hosts; each host sees its own PCI
function (one vfio-user connection per host).  Registers marked "per host"
hold that host's own copy; everything else is one state shared by all.
All registers are 32 bits, little-endian.
"""

from __future__ import annotations

from enum import IntEnum

# The lab's devices share one MSI-X BAR layout, written down in the GPU's map (a file that
# loads on its own, standard library only).
from ..gpu.regs import (BAR_MSIX, MSIX_BAR_SIZE, MSIX_ENTRY_SIZE,  # noqa: F401 (part of this map)
                        MSIX_PBA_OFFSET, MSIX_TABLE_OFFSET)

# --------------------------------------------------------------------------
# PCI identity
# --------------------------------------------------------------------------
PCI_VENDOR_ID = 0x0601
PCI_DEVICE_ID = 0x5C01
PCI_SUBSYSTEM_VENDOR_ID = 0x0601
PCI_SUBSYSTEM_ID = 0x0001
PCI_REVISION = 0x01
PCI_CLASS_CODE = 0x058000  # base 0x05 memory controller, sub 0x80 "other", prog-if 0

# --------------------------------------------------------------------------
# BARs
# --------------------------------------------------------------------------
BAR_REGS = 0  # 4 KiB, 32-bit, non-prefetchable, trapped (reads have side effects)
# BAR4: 4 KiB, 32-bit, MSI-X table and PBA (BAR_MSIX, MSIX_*: the GPU's, imported above)
REGS_SIZE = 0x1000

# --------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------
MAX_HOSTS = 16
NUM_SEMAPHORES = 16
MAILBOX_SLOTS = 4          # messages a host's mailbox holds before sends to it fail
MAILBOX_MSG_SIZE = 64      # bytes per message
DOORBELL_FIFO_DEPTH = 16   # doorbells a host's FIFO holds before rings to it are dropped
LOST_FIFO_DEPTH = MAX_HOSTS
NO_HOST = 0xFF             # owner field of a free semaphore

# Why every action with a side effect is a *read* (ACQUIRE, TX_SEND, RX_POP, DB_POP, LOST_POP,
# DOORBELL[h]) and writes only stage values: a guest's BAR write may reach the device more than
# once (seen in the lab: each 4-byte BAR0 write from guest userspace arrived twice), so every
# write must be idempotent.  RELEASE is a write, made idempotent (see docs/smc-device.md).

# --------------------------------------------------------------------------
# MSI-X vectors (per host)
# --------------------------------------------------------------------------
MSIX_VECTORS = 4
VEC_DOORBELL = 0   # a doorbell entered this host's doorbell FIFO
VEC_MAILBOX = 1    # a message entered this host's mailbox
VEC_PEER_LOST = 2  # another host's connection dropped (LOST_POP says which)
VEC_SEM_FREE = 3   # a semaphore this host was refused (BUSY) since its last grant was released

# --------------------------------------------------------------------------
# BAR0: global and per-host registers
# --------------------------------------------------------------------------
REG_ID = 0x000           # RO  ID_MAGIC
REG_VERSION = 0x004      # RO  DEVICE_VERSION
REG_HOST_ID = 0x008      # RO  per host: this host's ID (0 .. NUM_HOSTS-1)
REG_NUM_HOSTS = 0x00C    # RO  hosts this controller serves
REG_NUM_SEMS = 0x010     # RO  NUM_SEMAPHORES
REG_HOSTS_ALIVE = 0x014  # RO  bit h set = host h is connected now
REG_INTR_STATUS = 0x018  # W1C per host: INTR_* bits, set when the matching vector is raised
REG_CONTROL = 0x01C      # WO  per host: CONTROL_RESET resets this host's state (reads 0)
REG_LAST_ERROR = 0x020   # RW  per host: Error of this host's last failed operation; any write clears
REG_ERROR_REG = 0x024    # RO  per host: BAR0 offset of that operation (cleared with LAST_ERROR)
REG_SCRATCH = 0x028      # RW  per host: free for the driver

ID_MAGIC = 0x31434D53        # b"SMC1" read as a little-endian u32
DEVICE_VERSION = 0x00010000  # 1.0

CONTROL_RESET = 1 << 0

INTR_DOORBELL = 1 << VEC_DOORBELL
INTR_MAILBOX = 1 << VEC_MAILBOX
INTR_PEER_LOST = 1 << VEC_PEER_LOST
INTR_SEM_FREE = 1 << VEC_SEM_FREE

# --------------------------------------------------------------------------
# Semaphores: block i at SEM_BASE + i * SEM_STRIDE
# --------------------------------------------------------------------------
SEM_BASE = 0x100
SEM_STRIDE = 0x10
SEM_ACQUIRE = 0x0  # RO, read side effect: try to acquire (ACQ_* result word)
SEM_RELEASE = 0x4  # WO  write the epoch you were granted to release
SEM_STATE = 0x8    # RO  STATE_HELD | owner (bits 0..7, NO_HOST when free)
SEM_EPOCH = 0xC    # RO  the semaphore's current epoch

# ACQUIRE result word
ACQ_GRANTED = 1 << 31    # granted: bits 0..30 are the new epoch (the fencing token)
ACQ_BUSY = 1 << 30       # held by another host: bits 0..7 are its host ID
ACQ_EPOCH_MASK = 0x7FFFFFFF
ACQ_OWNER_MASK = 0xFF
# (the semaphore block holds exactly NUM_SEMAPHORES blocks, so an ACQUIRE always names one)

STATE_HELD = 1 << 31
EPOCH_MASK = 0x7FFFFFFF  # epochs count 1, 2, ... modulo 2**31, never 0 after the first grant

# --------------------------------------------------------------------------
# Mailbox: send (per-host staging) and receive (per-host mailbox)
# --------------------------------------------------------------------------
REG_TX_DATA = 0x200      # RW  per host: 64-byte staging buffer of the next message
REG_TX_FENCE = 0x240     # RW  per host: epoch a fenced send must match
REG_TX_CTRL = 0x244      # RW  per host: target, length, fence of the staged message (TX_* fields)
REG_TX_SEND = 0x248      # RO, read side effect: send the staged message; returns its Error (0 = delivered)
REG_TX_STATUS = 0x24C    # RO  per host: Error of the last send
REG_RX_COUNT = 0x300     # RO  per host: messages waiting in this host's mailbox
REG_RX_SRC = 0x304       # RO  per host: head message's sender host ID (NO_HOST when empty)
REG_RX_SEQ = 0x308       # RO  per host: head message's sequence (1, 2, ... per receiver)
REG_RX_LEN = 0x30C       # RO  per host: head message's length in bytes
REG_RX_POP = 0x310       # RO, read side effect: drop the head message; returns how many are left
REG_RX_DATA = 0x340      # RO  per host: head message's 64 bytes (zero past its length)

# TX_CTRL fields
TX_TARGET_MASK = 0xFF            # bits 0..7: receiving host ID
TX_FENCED = 1 << 8               # the send is fenced by semaphore TX_SEM with epoch TX_FENCE
TX_SEM_SHIFT = 16                # bits 16..23: the fencing semaphore
TX_LEN_SHIFT = 24                # bits 24..30: length 1..64


def tx_send_word(target: int, length: int, fence_sem: int | None = None) -> int:
    word = (target & TX_TARGET_MASK) | (length & 0x7F) << TX_LEN_SHIFT
    if fence_sem is not None:
        word |= TX_FENCED | (fence_sem & 0xFF) << TX_SEM_SHIFT
    return word


# --------------------------------------------------------------------------
# Doorbells and the peer-lost FIFO
# --------------------------------------------------------------------------
REG_DOORBELL_BASE = 0x400  # DOORBELL[h] at 0x400 + 4*h: write stages a 32-bit payload for host h (per
                           # host); a read rings host h with it and returns the Error (0 = queued)
REG_DB_POP = 0x480         # RO, read side effect: pop this host's doorbell FIFO head
REG_DB_PAYLOAD = 0x484     # RO  per host: payload of the doorbell the last DB_POP returned
REG_DB_COUNT = 0x488       # RO  per host: doorbells waiting
REG_DB_DROPPED = 0x48C     # RO  per host: rings to this host lost to a full FIFO (since reset)
REG_LOST_POP = 0x500       # RO, read side effect: pop this host's peer-lost FIFO head
REG_LOST_COUNT = 0x504     # RO  per host: peer-lost events waiting

POP_VALID = 1 << 31        # DB_POP / LOST_POP: an entry was popped; bits 0..7 = host ID


def doorbell_reg(host: int) -> int:
    return REG_DOORBELL_BASE + 4 * host


def sem_reg(index: int, field: int) -> int:
    return SEM_BASE + index * SEM_STRIDE + field


class Error(IntEnum):
    """LAST_ERROR / TX_STATUS codes."""
    OK = 0
    BAD_INDEX = 1      # semaphore or host index out of range
    NOT_OWNER = 2      # release of a semaphore this host does not hold
    STALE_EPOCH = 3    # release or fenced send with an epoch that is not the current one
    MBOX_FULL = 4      # the target's mailbox holds MAILBOX_SLOTS messages
    DB_FULL = 5        # the target's doorbell FIFO was full: this ring was dropped
    BAD_LENGTH = 6     # TX_CTRL length not in 1..64
    HOST_ABSENT = 7    # the target host is not connected (nothing delivered)
    BAD_REGISTER = 8   # write to a read-only or unassigned offset
