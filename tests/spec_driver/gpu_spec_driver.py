#!/usr/bin/env python3
"""An independent driver for the vfio-cxl GPU, written only from docs/gpu-device.md.

It runs in the guest, opens the GPU through the guest VFIO library (container/
group type1, region access, DMA maps, MSI-X eventfds: the generic VFIO layer),
and checks the device against its specification: PCI identity, every BAR0
register, ring configuration, every descriptor op and its data, completion
records, MSI-X vectors, every error a driver can provoke, halt, reset, Bus
Master Enable and ring wrap-around.

Every offset, bit, layout and status code below is defined here, from the
spec; nothing is imported from the device's own register map.

    python3 tests/spec_driver/gpu_spec_driver.py [--bdf 0000:01:00.0] [--no-cxl]

Prints one line per check (PASS/FAIL), INFO lines for what the environment
decided, and a summary "N passed, M failed"; exit status 0 only when every
check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import random
import struct
import sys
import time
import traceback

from vfio_cxl.guest.vfio import InterruptTimeout, VfioPciDevice, find_pci_devices, uapi

# --------------------------------------------------------------------------------------------
# The specification, transcribed (docs/gpu-device.md)
# --------------------------------------------------------------------------------------------

VENDOR_ID, DEVICE_ID = 0x0601, 0x1991
SUBSYS_VENDOR, SUBSYS_ID = 0x0601, 0x0001
REVISION = 0x01
CLASS_CODE = 0x030200

# config space
CFG_VENDOR, CFG_DEVICE, CFG_COMMAND, CFG_STATUS = 0x00, 0x02, 0x04, 0x06
CFG_REVISION, CFG_CLASS, CFG_HEADER_TYPE = 0x08, 0x09, 0x0E
CFG_BAR0, CFG_SUBSYS_VENDOR, CFG_SUBSYS_ID, CFG_ROM = 0x10, 0x2C, 0x2E, 0x30
CFG_CAP_PTR, CFG_INT_PIN = 0x34, 0x3D
CMD_MEMORY, CMD_MASTER = 1 << 1, 1 << 2
CMD_KEPT_MASK = 0x0546
STATUS_CAP_LIST = 1 << 4
PCIE_CAP_OFF, MSIX_CAP_OFF = 0x40, 0x80
CAP_ID_PCIE, CAP_ID_MSIX = 0x10, 0x11
PCIE_DEVCAP, PCIE_DEVCTL, PCIE_LNKCAP = 0x04, 0x08, 0x0C
DEVCAP_RBER, DEVCAP_FLR = 1 << 15, 1 << 28
DEVCTL_FLR = 1 << 15
MSIX_VECTORS = 4
MSIX_TABLE_BIR, MSIX_TABLE_OFF, MSIX_PBA_BIR, MSIX_PBA_OFF = 4, 0x000, 4, 0x800

# BAR0 registers
ID, VERSION, VRAM_SIZE_LO, VRAM_SIZE_HI = 0x000, 0x004, 0x008, 0x00C
CAPS, RING_MAX, SCRATCH = 0x010, 0x014, 0x018
CONTROL, STATUS, INTR_STATUS = 0x020, 0x024, 0x028
RING_BASE_LO, RING_BASE_HI, RING_SIZE, RING_HEAD, RING_TAIL = 0x040, 0x044, 0x048, 0x04C, 0x050
COMPL_BASE_LO, COMPL_BASE_HI, COMPLETED = 0x058, 0x05C, 0x060
ERR_STATUS, ERR_DESC_INDEX, ERR_ADDR_LO, ERR_ADDR_HI, ERR_ERRNO = 0x080, 0x084, 0x088, 0x08C, 0x090

ID_VALUE = 0x31555047          # b"GPU1"
VERSION_VALUE = 0x00010000
CAPS_VALUE = 0x3F
# Written for interface 1.0; the spec's compatibility rule: a later minor (1.n) keeps every 1.0
# register, bit and op, and may add CAPS bits and registers at offsets 1.0 left unassigned
# (1.1 uses 0x100-0x1FF).  So VERSION's major and the 1.0 CAPS bits are what this driver needs.
FIRST_MINOR_OFFSET = 0x100


def compatible(version: int, caps: int) -> tuple[int, int]:
    """(VERSION, CAPS) as this 1.0 driver expects them, if the device's are compatible."""
    return (VERSION_VALUE if version >> 16 == VERSION_VALUE >> 16 else version,
            CAPS_VALUE if caps & CAPS_VALUE == CAPS_VALUE else caps)
RING_MAX_VALUE = 65536

REGISTERS = {  # offset: (name, access)
    ID: ("ID", "RO"), VERSION: ("VERSION", "RO"), VRAM_SIZE_LO: ("VRAM_SIZE_LO", "RO"),
    VRAM_SIZE_HI: ("VRAM_SIZE_HI", "RO"), CAPS: ("CAPS", "RO"), RING_MAX: ("RING_MAX", "RO"),
    SCRATCH: ("SCRATCH", "RW"), CONTROL: ("CONTROL", "RW"), STATUS: ("STATUS", "RO"),
    INTR_STATUS: ("INTR_STATUS", "W1C"), RING_BASE_LO: ("RING_BASE_LO", "RW*"),
    RING_BASE_HI: ("RING_BASE_HI", "RW*"), RING_SIZE: ("RING_SIZE", "RW*"),
    RING_HEAD: ("RING_HEAD", "RO"), RING_TAIL: ("RING_TAIL", "RW"),
    COMPL_BASE_LO: ("COMPL_BASE_LO", "RW*"), COMPL_BASE_HI: ("COMPL_BASE_HI", "RW*"),
    COMPLETED: ("COMPLETED", "RO"), ERR_STATUS: ("ERR_STATUS", "RO"),
    ERR_DESC_INDEX: ("ERR_DESC_INDEX", "RO"), ERR_ADDR_LO: ("ERR_ADDR_LO", "RO"),
    ERR_ADDR_HI: ("ERR_ADDR_HI", "RO"), ERR_ERRNO: ("ERR_ERRNO", "RO"),
}
RO_REGS = [off for off, (_, acc) in REGISTERS.items() if acc == "RO"]
LOCKED_REGS = [off for off, (_, acc) in REGISTERS.items() if acc == "RW*"]

CONTROL_ENABLE, CONTROL_RESET = 1 << 0, 1 << 1
STATUS_ENABLED, STATUS_BUSY, STATUS_HALTED = 1 << 0, 1 << 1, 1 << 2
INTR_DMA_DONE, INTR_ERROR = 1 << 0, 1 << 1
VEC_DMA_DONE, VEC_ERROR = 0, 1

# descriptors and completion records
DESC = struct.Struct("<QQIBBHQ")     # src, dst, length, op, flags, reserved, cookie
COMPL = struct.Struct("<QIIIIQ")     # cookie, status, bytes_done, index, seq, duration_ns
DESC_SIZE = COMPL_SIZE = 32
OP_NOP, OP_VRAM_TO_HOST, OP_HOST_TO_VRAM, OP_FILL_PATTERN, OP_FILL_PRNG, OP_HOST_TO_HOST = range(6)
FLAG_INTERRUPT = 1 << 0
PRNG_BLOCK = 1 << 20

# status codes
OK, BAD_OPCODE, BAD_FLAGS, VRAM_RANGE, DMA_UNMAPPED, DMA_PERMISSION = 0, 1, 2, 3, 4, 5
DMA_REFUSED, DMA_TIMEOUT, DMA_ABORTED, RING_FETCH, COMPLETION_WRITE = 6, 7, 8, 9, 10
BAD_TAIL, BAD_RING_CONFIG, DMA_IO_ERROR = 11, 12, 13
STATUS_NAMES = {0: "OK", 1: "BAD_OPCODE", 2: "BAD_FLAGS", 3: "VRAM_RANGE", 4: "DMA_UNMAPPED",
                5: "DMA_PERMISSION", 6: "DMA_REFUSED", 7: "DMA_TIMEOUT", 8: "DMA_ABORTED",
                9: "RING_FETCH", 10: "COMPLETION_WRITE", 11: "BAD_TAIL", 12: "BAD_RING_CONFIG",
                13: "DMA_IO_ERROR"}

# --------------------------------------------------------------------------------------------
# The driver's own memory layout (IOVAs chosen by this driver)
# --------------------------------------------------------------------------------------------

RING_IOVA = 0x0100_0000          # 2 MiB: room for a 65536-entry ring
COMPL_IOVA = 0x0400_0000         # 2 MiB
HOST_IOVA = 0x1000_0000          # 40 MiB host buffer
HOST_SIZE = 40 << 20
RO_IOVA = 0x2000_0000            # 64 KiB mapped device-read-only
WO_IOVA = 0x2100_0000            # 64 KiB mapped device-write-only (if the IOMMU allows it)
PERM_SIZE = 64 << 10
CXL_IOVA = 0x4000_0000
UNMAPPED_IOVA = 0x40_0000_0000   # never mapped
RING_BYTES = COMPL_BYTES = 2 << 20

NEG_WAIT = 0.5                   # bounded wait used to show that something does NOT happen
TIMEOUT = 20.0                   # bound for things that must happen


def prng_bytes(seed: int, length: int, offset: int = 0) -> bytes:
    """The spec's PRNG stream: 1 MiB blocks, block k = shake_128(seed_le64 + k_le64)."""
    out = bytearray()
    pos = offset
    end = offset + length
    while pos < end:
        block = pos // PRNG_BLOCK
        data = hashlib.shake_128(seed.to_bytes(8, "little") + block.to_bytes(8, "little")).digest(PRNG_BLOCK)
        start = pos - block * PRNG_BLOCK
        take = min(PRNG_BLOCK - start, end - pos)
        out += data[start:start + take]
        pos += take
    return bytes(out)


def pattern_bytes(pattern: int, length: int) -> bytes:
    unit = pattern.to_bytes(8, "little")
    return (unit * (length // 8 + 1))[:length]


def desc(op: int, src: int = 0, dst: int = 0, length: int = 0, flags: int = 0, cookie: int = 0,
         reserved: int = 0) -> bytes:
    return DESC.pack(src, dst, length, op, flags, reserved, cookie)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------

class Report:
    def __init__(self):
        self.passed = 0
        self.failed: list[str] = []
        self.section = ""

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        line = f"[{self.section}] {what}"
        if ok:
            self.passed += 1
            print(f"PASS {line}" + (f" ({detail})" if detail else ""), flush=True)
        else:
            self.failed.append(line)
            print(f"FAIL {line}" + (f": {detail}" if detail else ""), flush=True)
        return ok

    def eq(self, what: str, got, want, fmt=hex) -> bool:
        def show(v):
            if isinstance(v, int) and fmt is not None:
                return fmt(v)
            return repr(v)
        return self.check(what, got == want, f"got {show(got)}, want {show(want)}" if got != want else "")

    def info(self, text: str) -> None:
        print(f"INFO [{self.section}] {text}", flush=True)


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------

class Gpu:
    def __init__(self, bdf: str, report: Report):
        self.report = report
        self.dev = VfioPciDevice.open(bdf)
        self.bar0 = self.dev.bar(0)
        self.bar2 = self.dev.bar(2)
        self.cfg = self.dev.config
        self.vectors = self.dev.msix(MSIX_VECTORS)
        self.ring_mem = mmap.mmap(-1, RING_BYTES)
        self.compl_mem = mmap.mmap(-1, COMPL_BYTES)
        self.host = mmap.mmap(-1, HOST_SIZE)
        self.ro_mem = mmap.mmap(-1, PERM_SIZE)
        self.maps = [self.dev.map_dma(self.ring_mem, RING_IOVA),
                     self.dev.map_dma(self.compl_mem, COMPL_IOVA),
                     self.dev.map_dma(self.host, HOST_IOVA),
                     self.dev.map_dma(self.ro_mem, RO_IOVA, readable=True, writable=False)]
        self.wo_mem = None
        self.ring_size = 0
        self.ring_iova = RING_IOVA
        self.compl_iova = COMPL_IOVA
        self.tail = 0
        self.vram_size = self.r(VRAM_SIZE_LO) | self.r(VRAM_SIZE_HI) << 32

    def close(self) -> None:
        self.dev.close()

    # registers
    def r(self, off: int) -> int:
        return self.bar0.read32(off)

    def w(self, off: int, value: int) -> None:
        self.bar0.write32(off, value & 0xFFFFFFFF)

    def r64(self, lo: int) -> int:
        return self.r(lo) | self.r(lo + 4) << 32

    def w64(self, lo: int, value: int) -> None:
        self.w(lo, value & 0xFFFFFFFF)
        self.w(lo + 4, value >> 32)

    def sync(self) -> int:
        """A BAR0 read: answered only after every earlier (posted) write took effect."""
        return self.r(STATUS)

    def err(self) -> dict:
        return {"status": self.r(ERR_STATUS), "index": self.r(ERR_DESC_INDEX),
                "addr": self.r64(ERR_ADDR_LO), "errno": self.r(ERR_ERRNO)}

    # config space
    def command(self) -> int:
        return self.cfg.read16(CFG_COMMAND)

    def set_bme(self, on: bool) -> None:
        cmd = self.command()
        self.cfg.write16(CFG_COMMAND, (cmd | CMD_MASTER | CMD_MEMORY) if on else (cmd & ~CMD_MASTER))

    # vectors
    def drain(self) -> None:
        for v in range(MSIX_VECTORS):
            self.vectors.pending(v)

    def wait_vector(self, vector: int, timeout: float = TIMEOUT) -> bool:
        try:
            self.vectors.wait(vector, timeout)
            return True
        except InterruptTimeout:
            return False

    def no_vector(self, timeout: float = NEG_WAIT) -> dict:
        """Wait ``timeout`` for any vector; returns what fired ({} when nothing did)."""
        try:
            return self.vectors.wait_any(timeout)
        except InterruptTimeout:
            return {}

    # ring
    def reset(self) -> None:
        self.w(CONTROL, CONTROL_RESET)
        self.sync()
        self.tail = 0
        self.ring_size = 0

    def configure(self, size: int, ring_iova: int = RING_IOVA, compl_iova: int = COMPL_IOVA,
                  enable: bool = True, clear: bool = True) -> None:
        self.ring_size, self.ring_iova, self.compl_iova = size, ring_iova, compl_iova
        if clear and ring_iova == RING_IOVA and compl_iova == COMPL_IOVA:
            self.ring_mem[:size * DESC_SIZE] = bytes(size * DESC_SIZE)
            self.compl_mem[:size * COMPL_SIZE] = bytes(size * COMPL_SIZE)
        self.w64(RING_BASE_LO, ring_iova)
        self.w(RING_SIZE, size)
        self.w64(COMPL_BASE_LO, compl_iova)
        self.tail = self.r(RING_TAIL)
        if enable:
            self.w(CONTROL, CONTROL_ENABLE)
            self.sync()

    def fresh(self, size: int = 16, bme: bool = True) -> None:
        """Reset, Bus Master Enable, configure and enable a ring of ``size``."""
        self.reset()
        self.set_bme(bme)
        self.drain()
        self.configure(size)

    def put(self, descriptors: list[bytes]) -> list[int]:
        """Write descriptors at TAIL (no doorbell); returns their slots."""
        slots = []
        for d in descriptors:
            slot = self.tail
            off = slot * DESC_SIZE
            self.ring_mem[off:off + DESC_SIZE] = d
            self.compl_mem[slot * COMPL_SIZE:(slot + 1) * COMPL_SIZE] = bytes(COMPL_SIZE)
            slots.append(slot)
            self.tail = (self.tail + 1) % self.ring_size
        return slots

    def doorbell(self, value: int | None = None) -> None:
        self.w(RING_TAIL, self.tail if value is None else value)

    def submit(self, descriptors: list[bytes]) -> list[int]:
        slots = self.put(descriptors)
        self.doorbell()
        return slots

    def wait_head(self, target: int, timeout: float = TIMEOUT) -> tuple[bool, int]:
        """Poll RING_HEAD until it equals ``target`` or the ring halts (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            head = self.r(RING_HEAD)
            if head == target:
                return True, head
            if self.r(STATUS) & STATUS_HALTED or time.monotonic() > deadline:
                return False, head
            time.sleep(0.0005)  # polling back-off; the condition is the register

    def wait_halted(self, timeout: float = TIMEOUT) -> bool:
        deadline = time.monotonic() + timeout
        while not self.r(STATUS) & STATUS_HALTED:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)  # polling back-off
        return True

    def record(self, slot: int, base: mmap.mmap | None = None) -> dict:
        mem = base if base is not None else self.compl_mem
        cookie, status, done, index, seq, duration = COMPL.unpack_from(mem, slot * COMPL_SIZE)
        return {"cookie": cookie, "status": status, "bytes_done": done, "index": index,
                "seq": seq, "duration_ns": duration}

    def vram(self, offset: int, length: int) -> bytes:
        view = self.bar2.view(offset, length)
        try:
            return bytes(view)
        finally:
            view.release()

    def vram_write(self, offset: int, data: bytes) -> None:
        view = self.bar2.view(offset, len(data))
        try:
            view[:] = data
        finally:
            view.release()


# --------------------------------------------------------------------------------------------
# Check helpers
# --------------------------------------------------------------------------------------------

def check_record(rep: Report, gpu: Gpu, slot: int, what: str, *, cookie: int, status: int,
                 bytes_done: int, seq: int, duration: bool = True) -> None:
    rec = gpu.record(slot)
    want = {"cookie": cookie, "status": status, "bytes_done": bytes_done, "index": slot, "seq": seq}
    got = {k: rec[k] for k in want}
    rep.check(f"{what}: completion record cookie/status/bytes_done/index/seq", got == want,
              f"got {got}, want {want}" if got != want else f"seq {rec['seq']}")
    if duration:
        rep.check(f"{what}: completion duration_ns plausible (0 < d < 60 s)",
                  0 < rec["duration_ns"] < 60_000_000_000, f"duration_ns={rec['duration_ns']}")


def check_halt(rep: Report, gpu: Gpu, what: str, *, status: int, index: int, addr: int, errno_: int,
               head: int, completed: int, vector: bool = True) -> None:
    """The ring halted with ``status``: ERR_*, STATUS, CONTROL, INTR_STATUS, HEAD, COMPLETED, vector 1."""
    ok = gpu.wait_halted()
    rep.check(f"{what}: STATUS == HALTED", ok and gpu.r(STATUS) == STATUS_HALTED, f"STATUS={gpu.r(STATUS):#x}")
    rep.eq(f"{what}: ERR_STATUS == {STATUS_NAMES[status]}", gpu.r(ERR_STATUS), status, fmt=lambda v: STATUS_NAMES.get(v, str(v)))
    rep.eq(f"{what}: ERR_DESC_INDEX", gpu.r(ERR_DESC_INDEX), index)
    rep.eq(f"{what}: ERR_ADDR", gpu.r64(ERR_ADDR_LO), addr)
    rep.eq(f"{what}: ERR_ERRNO", gpu.r(ERR_ERRNO), errno_, fmt=str)
    rep.eq(f"{what}: RING_HEAD stays at the failing descriptor", gpu.r(RING_HEAD), head)
    rep.eq(f"{what}: COMPLETED does not count it", gpu.r(COMPLETED), completed, fmt=str)
    rep.eq(f"{what}: CONTROL.ENABLE reads 0 in HALTED", gpu.r(CONTROL), 0)
    rep.check(f"{what}: INTR_STATUS.ERROR latched", bool(gpu.r(INTR_STATUS) & INTR_ERROR),
              f"INTR_STATUS={gpu.r(INTR_STATUS):#x}")
    if vector:
        rep.check(f"{what}: MSI-X vector 1 (ERROR) raised", gpu.wait_vector(VEC_ERROR))


@contextlib.contextmanager
def section(rep: Report, gpu: Gpu | None, name: str):
    rep.section = name
    try:
        yield
    except Exception as error:  # a broken step is a failed check, the rest still runs
        rep.check("section ran to the end", False, f"{type(error).__name__}: {error}")
        traceback.print_exc(file=sys.stdout)
    finally:
        if gpu is not None:
            with contextlib.suppress(Exception):
                gpu.set_bme(True)
                gpu.reset()
                gpu.drain()


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------

def pci_identity(rep: Report, gpu: Gpu) -> None:
    cfg = gpu.cfg
    rep.eq("vendor ID", cfg.read16(CFG_VENDOR), VENDOR_ID)
    rep.eq("device ID", cfg.read16(CFG_DEVICE), DEVICE_ID)
    rep.eq("subsystem vendor ID", cfg.read16(CFG_SUBSYS_VENDOR), SUBSYS_VENDOR)
    rep.eq("subsystem ID", cfg.read16(CFG_SUBSYS_ID), SUBSYS_ID)
    rep.eq("revision", cfg.read8(CFG_REVISION), REVISION)
    class_code = cfg.read8(CFG_CLASS) | cfg.read8(CFG_CLASS + 1) << 8 | cfg.read8(CFG_CLASS + 2) << 16
    rep.eq("class code 0x030200", class_code, CLASS_CODE)
    rep.eq("header type 0, single function", cfg.read8(CFG_HEADER_TYPE), 0)
    rep.eq("interrupt pin 0 (no INTx)", cfg.read8(CFG_INT_PIN), 0)
    rep.check("status: capability list bit", bool(cfg.read16(CFG_STATUS) & STATUS_CAP_LIST))
    rep.eq("capability pointer 0x40", cfg.read8(CFG_CAP_PTR) & 0xFC, PCIE_CAP_OFF)
    rep.eq("0x40: PCI Express capability", cfg.read8(PCIE_CAP_OFF), CAP_ID_PCIE)
    rep.eq("0x40: next capability 0x80", cfg.read8(PCIE_CAP_OFF + 1), MSIX_CAP_OFF)
    pcie_caps = cfg.read16(PCIE_CAP_OFF + 2)
    rep.eq("PCIe capability version 2", pcie_caps & 0xF, 2)
    rep.eq("PCIe device/port type: endpoint", (pcie_caps >> 4) & 0xF, 0)
    devcap = cfg.read32(PCIE_CAP_OFF + PCIE_DEVCAP)
    rep.check("DevCap: role-based error reporting", bool(devcap & DEVCAP_RBER), f"DevCap={devcap:#x}")
    rep.check("DevCap: FLR supported", bool(devcap & DEVCAP_FLR), f"DevCap={devcap:#x}")
    lnkcap = cfg.read32(PCIE_CAP_OFF + PCIE_LNKCAP)
    rep.eq("LnkCap: max speed 2.5 GT/s", lnkcap & 0xF, 1)
    rep.eq("LnkCap: max width x1", (lnkcap >> 4) & 0x3F, 1)
    rep.eq("0x80: MSI-X capability", cfg.read8(MSIX_CAP_OFF), CAP_ID_MSIX)
    rep.eq("0x80: last capability", cfg.read8(MSIX_CAP_OFF + 1), 0)
    rep.eq("MSI-X table size 4", (cfg.read16(MSIX_CAP_OFF + 2) & 0x7FF) + 1, MSIX_VECTORS, fmt=str)
    table = cfg.read32(MSIX_CAP_OFF + 4)
    rep.eq("MSI-X table in BAR4 at 0x000", (table & 7, table & ~7), (MSIX_TABLE_BIR, MSIX_TABLE_OFF), fmt=None)
    pba = cfg.read32(MSIX_CAP_OFF + 8)
    rep.eq("MSI-X PBA in BAR4 at 0x800", (pba & 7, pba & ~7), (MSIX_PBA_BIR, MSIX_PBA_OFF), fmt=None)
    rep.eq("config space is 4 KiB", gpu.cfg.size, 4096)
    rep.eq("no extended capabilities (0x100 reads 0)", cfg.read32(0x100), 0)


def vfio_view(rep: Report, gpu: Gpu) -> None:
    info = gpu.dev.info
    rep.check("VFIO device: PCI and resettable", info.is_pci and info.resettable, f"flags={info.flags:#x}")
    sizes = {}
    for index in range(min(info.num_regions, 7)):   # BARs and ROM
        sizes[index] = gpu.dev.device.region_info(index).size
    rep.eq("BAR0 is 4 KiB", sizes.get(0), 4096)
    rep.eq("BAR2 size == VRAM_SIZE", sizes.get(2), gpu.vram_size)
    rep.check("VRAM size is a power of two, 1 MiB..4 GiB",
              gpu.vram_size & (gpu.vram_size - 1) == 0 and (1 << 20) <= gpu.vram_size <= (4 << 30),
              f"{gpu.vram_size:#x}")
    rep.eq("BAR4 is 4 KiB", sizes.get(4), 4096)
    rep.check("BAR1, BAR3 (upper half of BAR2), BAR5 and ROM absent (size 0)",
              all(sizes.get(i) == 0 for i in (1, 3, 5, 6)), f"sizes={sizes}")
    bar2 = gpu.dev.device.region_info(2)
    rep.check("BAR2 (VRAM) is mmappable", bar2.mmappable and gpu.bar2.is_mapped(0, gpu.vram_size),
              f"flags={bar2.flags:#x}")
    irq = gpu.dev.device.irq_info(uapi.VFIO_PCI_MSIX_IRQ_INDEX)
    rep.eq("MSI-X: 4 vectors on eventfds", (irq.count, irq.eventfd), (MSIX_VECTORS, True), fmt=None)
    intx = gpu.dev.device.irq_info(uapi.VFIO_PCI_INTX_IRQ_INDEX)
    rep.eq("no INTx", intx.count, 0, fmt=str)
    msi = gpu.dev.device.irq_info(uapi.VFIO_PCI_MSI_IRQ_INDEX)
    rep.eq("MSI-X mode: no MSI vectors (VFIO IRQ index 1 count 0)", msi.count, 0, fmt=str)
    # BAR0 sizing through config space (guest vfio-pci virtualises BARs: this shows its view).
    cfg = gpu.cfg
    for bar, want in ((0, 0xFFFFF000), (4, 0xFFFFF000)):
        off = CFG_BAR0 + 4 * bar
        old = cfg.read32(off)
        cfg.write32(off, 0xFFFFFFFF)
        got = cfg.read32(off)
        cfg.write32(off, old)
        rep.eq(f"BAR{bar} sizing: 32-bit non-prefetchable 4 KiB mask", got, want)
    off = CFG_BAR0 + 8
    lo, hi = cfg.read32(off), cfg.read32(off + 4)
    cfg.write32(off, 0xFFFFFFFF)
    cfg.write32(off + 4, 0xFFFFFFFF)
    got = cfg.read32(off) | cfg.read32(off + 4) << 32
    cfg.write32(off, lo)
    cfg.write32(off + 4, hi)
    want = ((~(gpu.vram_size - 1)) & 0xFFFFFFFFFFFFFFF0) | 0xC   # 64-bit, prefetchable
    rep.eq("BAR2 sizing: 64-bit prefetchable VRAM-size mask", got, want)
    old = cfg.read32(CFG_ROM)
    cfg.write32(CFG_ROM, 0xFFFFFFFF)
    rep.eq("ROM BAR absent: reads 0 whatever is written", cfg.read32(CFG_ROM), 0)
    cfg.write32(CFG_ROM, old)
    cfg.write16(CFG_VENDOR, 0x1234)
    cfg.write16(CFG_DEVICE, 0x5678)
    rep.eq("IDs are read-only", (cfg.read16(CFG_VENDOR), cfg.read16(CFG_DEVICE)), (VENDOR_ID, DEVICE_ID), fmt=None)
    cmd = gpu.command()
    cfg.write16(CFG_COMMAND, cmd | 0x0008 | 0x0010 | 0x0080 | CMD_MASTER)  # special cycles, MWI, stepping: not kept
    got = gpu.command()
    cfg.write16(CFG_COMMAND, cmd)
    rep.check("command register keeps only bits 0x0546", got & ~CMD_KEPT_MASK & 0xFFFF == 0 and bool(got & CMD_MASTER),
              f"wrote {cmd | 0x98 | CMD_MASTER:#06x}, read {got:#06x}")
    pba = gpu.dev.bar(4).read32(MSIX_PBA_OFF)
    rep.eq("MSI-X PBA reads 0", pba, 0)


def bar0_registers(rep: Report, gpu: Gpu) -> None:
    gpu.w(SCRATCH, 0x5A5A5A5A)
    gpu.reset()
    reset_values = {ID: ID_VALUE, VERSION: VERSION_VALUE, VRAM_SIZE_LO: gpu.vram_size & 0xFFFFFFFF,
                    VRAM_SIZE_HI: gpu.vram_size >> 32, CAPS: CAPS_VALUE, RING_MAX: RING_MAX_VALUE}
    seen = {off: gpu.r(off) for off in REGISTERS}
    seen[VERSION], seen[CAPS] = compatible(seen[VERSION], seen[CAPS])
    for off, (name, _) in REGISTERS.items():
        rep.eq(f"{name} ({off:#05x}) reset value", seen[off], reset_values.get(off, 0))
    rep.eq("ID spells b'GPU1'", gpu.r(ID).to_bytes(4, "little"), b"GPU1", fmt=None)
    nonzero = [off for off in range(0, FIRST_MINOR_OFFSET, 4) if off not in REGISTERS and gpu.r(off) != 0]
    rep.check(f"every unassigned offset 0x000-{FIRST_MINOR_OFFSET - 4:#05x} reads 0", not nonzero, f"nonzero at {[hex(o) for o in nonzero[:8]]}")
    # writes to read-only registers are ignored
    for off in RO_REGS:
        before = gpu.r(off)
        gpu.w(off, 0xA5A5A5A5 if before != 0xA5A5A5A5 else 0x5A5A5A5A)
        rep.eq(f"{REGISTERS[off][0]} ignores writes (RO)", gpu.r(off), before)
    for off in (0x01C, 0x02C, 0x030, 0x054, 0x064, 0x07C, 0x094):
        gpu.w(off, 0xFFFFFFFF)
        rep.eq(f"unassigned {off:#05x} ignores writes and reads 0", gpu.r(off), 0)
    # RW: SCRATCH, partial writes touch only the bytes written
    gpu.w(SCRATCH, 0xDEADBEEF)
    rep.eq("SCRATCH is read/write", gpu.r(SCRATCH), 0xDEADBEEF)
    gpu.bar0.write8(SCRATCH + 1, 0x11)
    rep.eq("8-bit write touches one byte", gpu.r(SCRATCH), 0xDEAD11EF)
    gpu.bar0.write16(SCRATCH + 2, 0x2233)
    rep.eq("16-bit write touches two bytes", gpu.r(SCRATCH), 0x223311EF)
    rep.eq("8-bit read", gpu.bar0.read8(SCRATCH + 2), 0x33)
    rep.eq("16-bit read", gpu.bar0.read16(SCRATCH + 2), 0x2233)
    rep.eq("8-bit read of ID byte 3", gpu.bar0.read8(ID + 3), ord("1"))
    # 64-bit accesses to _LO/_HI pairs
    gpu.bar0.write64(RING_BASE_LO, 0x0000_0012_3456_7800)
    rep.eq("64-bit write to RING_BASE_LO/HI", (gpu.r(RING_BASE_LO), gpu.r(RING_BASE_HI)), (0x34567800, 0x12), fmt=None)
    rep.eq("64-bit read of RING_BASE", gpu.bar0.read64(RING_BASE_LO), 0x0000_0012_3456_7800)
    rep.eq("64-bit read of VRAM_SIZE", gpu.bar0.read64(VRAM_SIZE_LO), gpu.vram_size)
    gpu.bar0.write64(COMPL_BASE_LO, 0xFFFF_FFFF_FFFF_FFE0)
    rep.eq("64-bit write to COMPL_BASE_LO/HI", gpu.r64(COMPL_BASE_LO), 0xFFFF_FFFF_FFFF_FFE0)
    gpu.bar0.write8(RING_BASE_HI, 0x99)
    rep.eq("8-bit write to RING_BASE_HI byte 0", gpu.r64(RING_BASE_LO), 0x0000_0099_3456_7800)
    # RW* registers are writable in IDLE
    gpu.w(RING_SIZE, 1024)
    rep.eq("RING_SIZE writable in IDLE", gpu.r(RING_SIZE), 1024, fmt=str)
    gpu.w(RING_TAIL, 7)
    rep.eq("doorbell in IDLE is stored in RING_TAIL", gpu.r(RING_TAIL), 7, fmt=str)
    rep.eq("doorbell in IDLE: still IDLE, HEAD 0", (gpu.r(STATUS), gpu.r(RING_HEAD)), (0, 0), fmt=None)
    # CONTROL: RESET reads 0; RESET + ENABLE in one write -> IDLE
    gpu.w(CONTROL, CONTROL_RESET | CONTROL_ENABLE)
    rep.eq("CONTROL.RESET|ENABLE: ENABLE ignored, reads 0", gpu.r(CONTROL), 0)
    rep.eq("CONTROL.RESET|ENABLE: STATUS IDLE", gpu.r(STATUS), 0)
    rep.eq("CONTROL.RESET resets SCRATCH", gpu.r(SCRATCH), 0)
    rep.eq("CONTROL.RESET resets RING_SIZE/RING_TAIL/RING_BASE",
           (gpu.r(RING_SIZE), gpu.r(RING_TAIL), gpu.r64(RING_BASE_LO)), (0, 0, 0), fmt=None)


def enable_validation(rep: Report, gpu: Gpu) -> None:
    for size in (2, 64, RING_MAX_VALUE):
        gpu.fresh(size)
        rep.eq(f"ENABLE with RING_SIZE {size}: RUNNING (STATUS.ENABLED)", gpu.r(STATUS), STATUS_ENABLED)
        rep.eq(f"ENABLE with RING_SIZE {size}: CONTROL.ENABLE reads 1", gpu.r(CONTROL), CONTROL_ENABLE)
    # a 65536-entry ring actually runs
    slots = gpu.submit([desc(OP_NOP, cookie=0xBEEF, flags=FLAG_INTERRUPT)])
    rep.check("65536-entry ring runs a NOP", gpu.wait_vector(VEC_DMA_DONE) and gpu.r(RING_HEAD) == 1)
    check_record(rep, gpu, slots[0], "NOP on the 65536 ring", cookie=0xBEEF, status=OK, bytes_done=0, seq=1,
                 duration=False)
    bad = [
        ("RING_SIZE 0", dict(size=0)),
        ("RING_SIZE 1 (below 2)", dict(size=1)),
        ("RING_SIZE 3 (not a power of two)", dict(size=3)),
        ("RING_SIZE 48 (not a power of two)", dict(size=48)),
        ("RING_SIZE 131072 (above RING_MAX)", dict(size=2 * RING_MAX_VALUE)),
        ("RING_BASE not 32-byte aligned", dict(size=16, ring=RING_IOVA + 16)),
        ("RING_BASE 8-byte aligned", dict(size=16, ring=RING_IOVA + 8)),
        ("COMPL_BASE not 32-byte aligned", dict(size=16, compl=COMPL_IOVA + 4)),
    ]
    for what, case in bad:
        gpu.reset()
        gpu.set_bme(True)
        gpu.drain()
        ring = case.get("ring", RING_IOVA)
        gpu.configure(case["size"], ring, case.get("compl", COMPL_IOVA), clear=False)
        check_halt(rep, gpu, f"ENABLE, {what}", status=BAD_RING_CONFIG, index=0, addr=ring, errno_=0,
                   head=0, completed=0)
    # TAIL >= RING_SIZE at ENABLE: store TAIL with a big ring, then shrink it
    gpu.reset()
    gpu.set_bme(True)
    gpu.drain()
    gpu.configure(16, enable=False)
    gpu.w(RING_TAIL, 10)
    gpu.w(RING_SIZE, 8)
    gpu.w(CONTROL, CONTROL_ENABLE)
    check_halt(rep, gpu, "ENABLE with TAIL 10 >= RING_SIZE 8", status=BAD_RING_CONFIG, index=0,
               addr=RING_IOVA, errno_=0, head=0, completed=0)
    # HEAD >= RING_SIZE at ENABLE: run 5 NOPs, disable, shrink the ring to 4
    gpu.fresh(16)
    gpu.submit([desc(OP_NOP, cookie=i) for i in range(5)])
    ok, head = gpu.wait_head(5)
    gpu.w(CONTROL, 0)
    gpu.sync()
    rep.eq("ENABLE 1->0: IDLE", (gpu.r(STATUS), gpu.r(CONTROL)), (0, 0), fmt=None)
    rep.eq("ENABLE 1->0: HEAD and TAIL kept", (gpu.r(RING_HEAD), gpu.r(RING_TAIL)), (5, 5), fmt=None)
    gpu.w(RING_TAIL, 0)   # TAIL 0 < 4 so only HEAD is out of range
    gpu.w(RING_SIZE, 4)
    gpu.w(CONTROL, CONTROL_ENABLE)
    check_halt(rep, gpu, "ENABLE with HEAD 5 >= RING_SIZE 4", status=BAD_RING_CONFIG, index=5,
               addr=RING_IOVA, errno_=0, head=5, completed=5)


def locked_registers(rep: Report, gpu: Gpu) -> None:
    for state in ("RUNNING", "HALTED"):
        gpu.fresh(16)
        if state == "HALTED":
            gpu.w(RING_TAIL, 16)     # BAD_TAIL
            gpu.wait_halted()
        before = {off: gpu.r(off) for off in LOCKED_REGS}
        for off in LOCKED_REGS:
            gpu.w(off, 0x00000400 if off == RING_SIZE else 0x12340000)
        after = {off: gpu.r(off) for off in LOCKED_REGS}
        rep.check(f"RW* registers ignore writes in {state}", before == after,
                  f"before {before}, after {after}")
    gpu.fresh(16)
    gpu.w(CONTROL, 0)
    gpu.w(RING_SIZE, 32)
    rep.eq("RW* writable again in IDLE after ENABLE 1->0", gpu.r(RING_SIZE), 32, fmt=str)


def descriptor_ops(rep: Report, gpu: Gpu) -> None:
    gpu.fresh(16)
    vsize = gpu.vram_size
    # NOP
    completed = gpu.r(COMPLETED)
    slots = gpu.submit([desc(OP_NOP, src=0xFFFF_FFFF_FFFF_FFFF, dst=0x1234, length=4096,
                             flags=FLAG_INTERRUPT, cookie=0x1111_2222_3333_4444)])
    rep.check("NOP: vector 0 (DMA_DONE)", gpu.wait_vector(VEC_DMA_DONE))
    check_record(rep, gpu, slots[0], "NOP (src/dst ignored, length 4096)", cookie=0x1111_2222_3333_4444,
                 status=OK, bytes_done=0, seq=completed + 1, duration=False)
    rep.eq("NOP: COMPLETED +1, HEAD +1", (gpu.r(COMPLETED), gpu.r(RING_HEAD)), (completed + 1, 1), fmt=None)
    rep.check("NOP: INTR_STATUS.DMA_DONE latched", bool(gpu.r(INTR_STATUS) & INTR_DMA_DONE))
    gpu.w(INTR_STATUS, INTR_DMA_DONE)

    # FILL_PATTERN at an odd offset and length
    pattern = 0x0123_4567_89AB_CDEF
    off, length = 0x10003, 100_005
    gpu.vram_write(off - 8, b"\xEE" * 8)
    gpu.vram_write(off + length, b"\xEE" * 8)
    slots = gpu.submit([desc(OP_FILL_PATTERN, src=pattern, dst=off, length=length, flags=FLAG_INTERRUPT, cookie=3)])
    rep.check("FILL_PATTERN: vector 0", gpu.wait_vector(VEC_DMA_DONE))
    check_record(rep, gpu, slots[0], "FILL_PATTERN", cookie=3, status=OK, bytes_done=length, seq=completed + 2)
    rep.check("FILL_PATTERN: VRAM holds the pattern's LE bytes repeated from dst",
              gpu.vram(off, length) == pattern_bytes(pattern, length))
    rep.check("FILL_PATTERN: bytes around the range untouched",
              gpu.vram(off - 8, 8) == b"\xEE" * 8 and gpu.vram(off + length, 8) == b"\xEE" * 8)

    # FILL_PRNG across a 1 MiB block boundary
    seed = 0xC0FFEE_0000_0042
    off, length = 0x200000 + 5, PRNG_BLOCK + 70_001
    slots = gpu.submit([desc(OP_FILL_PRNG, src=seed, dst=off, length=length, flags=FLAG_INTERRUPT, cookie=4)])
    rep.check("FILL_PRNG: vector 0", gpu.wait_vector(VEC_DMA_DONE))
    check_record(rep, gpu, slots[0], "FILL_PRNG", cookie=4, status=OK, bytes_done=length, seq=completed + 3)
    got = gpu.vram(off, length)
    want = prng_bytes(seed, length)
    first_bad = next((i for i in range(length) if got[i] != want[i]), -1) if got != want else -1
    rep.check("FILL_PRNG: VRAM holds the PRNG stream from its start (2 blocks)", got == want,
              f"first wrong byte at {first_bad}")
    rep.check("PRNG sub-range regenerates on its own", prng_bytes(seed, 1000, PRNG_BLOCK - 500) == want[PRNG_BLOCK - 500:PRNG_BLOCK + 500])

    # HOST_TO_VRAM then VRAM_TO_HOST
    rnd = random.Random(9)
    length = 3 * (1 << 20) + 4097
    data = rnd.randbytes(length)
    gpu.host[0x1000:0x1000 + length] = data
    vram_off = 0x800000 + 1
    slots = gpu.submit([desc(OP_HOST_TO_VRAM, src=HOST_IOVA + 0x1000, dst=vram_off, length=length,
                             flags=FLAG_INTERRUPT, cookie=5)])
    rep.check("HOST_TO_VRAM: vector 0", gpu.wait_vector(VEC_DMA_DONE))
    check_record(rep, gpu, slots[0], "HOST_TO_VRAM", cookie=5, status=OK, bytes_done=length, seq=completed + 4)
    rep.check("HOST_TO_VRAM: VRAM equals the host buffer", gpu.vram(vram_off, length) == data)
    dst = HOST_IOVA + 0x80_0000 + 3
    gpu.host[0x80_0000:0x80_0000 + length + 16] = b"\xCC" * (length + 16)
    slots = gpu.submit([desc(OP_VRAM_TO_HOST, src=vram_off, dst=dst, length=length, flags=FLAG_INTERRUPT, cookie=6)])
    rep.check("VRAM_TO_HOST: vector 0", gpu.wait_vector(VEC_DMA_DONE))
    check_record(rep, gpu, slots[0], "VRAM_TO_HOST", cookie=6, status=OK, bytes_done=length, seq=completed + 5)
    rep.check("VRAM_TO_HOST: host buffer equals VRAM", gpu.host[0x80_0003:0x80_0003 + length] == data)
    rep.check("VRAM_TO_HOST: bytes around the range untouched",
              gpu.host[0x80_0000:0x80_0003] == b"\xCC" * 3 and gpu.host[0x80_0003 + length:0x80_0003 + length + 13] == b"\xCC" * 13)
    # HOST_TO_HOST: host memory to host memory through the device, VRAM untouched
    vram_before = gpu.vram(vram_off, 64)
    gpu.host[0x40_0000:0x40_0000 + length + 16] = b"\x5A" * (length + 16)
    slots = gpu.submit([desc(OP_HOST_TO_HOST, src=HOST_IOVA + 0x80_0003, dst=HOST_IOVA + 0x40_0001, length=length,
                             flags=FLAG_INTERRUPT, cookie=8)])
    rep.check("HOST_TO_HOST: vector 0", gpu.wait_vector(VEC_DMA_DONE))
    check_record(rep, gpu, slots[0], "HOST_TO_HOST", cookie=8, status=OK, bytes_done=length, seq=completed + 6)
    rep.check("HOST_TO_HOST: destination equals the source", gpu.host[0x40_0001:0x40_0001 + length] == data)
    rep.check("HOST_TO_HOST: bytes around the range untouched, VRAM unchanged",
              gpu.host[0x40_0000:0x40_0001] == b"\x5A" and gpu.host[0x40_0001 + length:0x40_0001 + length + 15] == b"\x5A" * 15
              and gpu.vram(vram_off, 64) == vram_before)
    # the last byte of VRAM is reachable
    gpu.submit([desc(OP_FILL_PATTERN, src=0xAB, dst=vsize - 1, length=1, flags=FLAG_INTERRUPT, cookie=7)])
    rep.check("FILL_PATTERN of the last VRAM byte", gpu.wait_vector(VEC_DMA_DONE) and gpu.vram(vsize - 1, 1) == b"\xAB")
    gpu.drain()
    # a batch: only the descriptor with INTERRUPT raises vector 0
    head = gpu.r(RING_HEAD)
    done = gpu.r(COMPLETED)
    slots = gpu.submit([desc(OP_NOP, cookie=10), desc(OP_FILL_PATTERN, src=1, dst=0, length=4096, cookie=11),
                        desc(OP_NOP, cookie=12, flags=FLAG_INTERRUPT)])
    rep.check("batch of 3, INTERRUPT on the last: vector 0", gpu.wait_vector(VEC_DMA_DONE))
    for i, slot in enumerate(slots):
        rec = gpu.record(slot)
        rep.eq(f"batch record {i}: (cookie, index, seq, status)",
               (rec["cookie"], rec["index"], rec["seq"], rec["status"]), (10 + i, slot, done + 1 + i, OK), fmt=None)
    rep.eq("batch: HEAD == TAIL, COMPLETED +3", (gpu.r(RING_HEAD), gpu.r(COMPLETED)),
           ((head + 3) % gpu.ring_size, done + 3), fmt=None)
    gpu.drain()
    gpu.w(INTR_STATUS, INTR_DMA_DONE | INTR_ERROR)
    gpu.submit([desc(OP_NOP, cookie=13)])
    ok, _ = gpu.wait_head((head + 4) % gpu.ring_size)
    fired = gpu.no_vector()
    rep.check("descriptor without INTERRUPT raises no vector", ok and not fired, f"fired {fired}")
    rep.eq("descriptor without INTERRUPT latches nothing in INTR_STATUS", gpu.r(INTR_STATUS), 0)
    rep.eq("STATUS RUNNING, not BUSY, when idle", gpu.r(STATUS), STATUS_ENABLED)
    # INTR_STATUS W1C
    gpu.submit([desc(OP_NOP, flags=FLAG_INTERRUPT)])
    gpu.wait_vector(VEC_DMA_DONE)
    rep.eq("INTR_STATUS.DMA_DONE set", gpu.r(INTR_STATUS) & INTR_DMA_DONE, INTR_DMA_DONE)
    gpu.w(INTR_STATUS, 0)
    rep.eq("INTR_STATUS: writing 0 clears nothing", gpu.r(INTR_STATUS) & INTR_DMA_DONE, INTR_DMA_DONE)
    gpu.w(INTR_STATUS, INTR_ERROR)
    rep.eq("INTR_STATUS: writing 1 to another bit leaves DMA_DONE", gpu.r(INTR_STATUS) & INTR_DMA_DONE, INTR_DMA_DONE)
    gpu.w(INTR_STATUS, INTR_DMA_DONE)
    rep.eq("INTR_STATUS: write 1 clears DMA_DONE", gpu.r(INTR_STATUS), 0)


def cxl_transfer(rep: Report, gpu: Gpu) -> None:
    from vfio_cxl.guest import cxl
    from vfio_cxl.guest.dax import open_dax
    dax_dev = cxl.ensure_ram_devdax()
    dax = open_dax(dax_dev.path)
    try:
        window = 4 << 20
        mapping = gpu.dev.map_dma(dax.map, CXL_IOVA)
        try:
            gpu.fresh(16)
            seed = 77
            gpu.submit([desc(OP_FILL_PRNG, src=seed, dst=0, length=window, cookie=1),
                        desc(OP_VRAM_TO_HOST, src=0, dst=CXL_IOVA + 0x1000, length=window,
                             flags=FLAG_INTERRUPT, cookie=2)])
            rep.check("FILL_PRNG + VRAM_TO_HOST into CXL devdax: vector 0", gpu.wait_vector(VEC_DMA_DONE))
            rep.check("CXL devdax holds the PRNG stream", dax.read(0x1000, window) == prng_bytes(seed, window))
            dax.write(0x80_0000, b"from CXL" * 1024)
            gpu.submit([desc(OP_HOST_TO_VRAM, src=CXL_IOVA + 0x80_0000, dst=0x100, length=8192,
                             flags=FLAG_INTERRUPT, cookie=3)])
            rep.check("HOST_TO_VRAM from CXL devdax", gpu.wait_vector(VEC_DMA_DONE)
                      and gpu.vram(0x100, 8192) == b"from CXL" * 1024)
            gpu.reset()
        finally:
            mapping.close()
    finally:
        dax.close()


def errors(rep: Report, gpu: Gpu) -> None:
    vsize = gpu.vram_size

    def start() -> tuple[int, int]:
        """A fresh ring with one good NOP retired, so index/seq/COMPLETED are not all 0."""
        gpu.fresh(16)
        gpu.submit([desc(OP_NOP, cookie=0xA0)])
        gpu.wait_head(1)
        gpu.drain()
        return gpu.r(RING_HEAD), gpu.r(COMPLETED)

    def case(what: str, bad: bytes, status: int, addr: int, bytes_done: int = 0, check_after=None):
        head, done = start()
        # the descriptor after the bad one must not run: it would fill VRAM[0x3F0000..] with 0x77
        gpu.vram_write(0x3F0000, b"\x00" * 64)
        cookie = DESC.unpack(bad)[6]
        slots = gpu.submit([bad, desc(OP_FILL_PATTERN, src=0x77, dst=0x3F0000, length=64, cookie=0xAF,
                                      flags=FLAG_INTERRUPT)])
        check_halt(rep, gpu, what, status=status, index=slots[0], addr=addr, errno_=0, head=head, completed=done)
        check_record(rep, gpu, slots[0], what, cookie=cookie, status=status, bytes_done=bytes_done, seq=done + 1,
                     duration=False)
        rep.check(f"{what}: later descriptors not executed",
                  gpu.vram(0x3F0000, 64) == b"\x00" * 64 and gpu.record(slots[1])["seq"] == 0)
        rep.check(f"{what}: no DMA_DONE vector", not gpu.vectors.pending(VEC_DMA_DONE))
        if check_after:
            check_after()

    case("BAD_OPCODE (op 127: ops 0-5 are 1.0, later minors assign more)", desc(127, cookie=0xB1), BAD_OPCODE, 0)
    case("BAD_OPCODE (op 255)", desc(255, length=16, cookie=0xB2), BAD_OPCODE, 0)
    case("BAD_FLAGS (flags bit 1)", desc(OP_NOP, flags=2, cookie=0xB3), BAD_FLAGS, 0)
    case("BAD_FLAGS (flags bit 7)", desc(OP_FILL_PATTERN, dst=0, length=8, flags=0x81, cookie=0xB4), BAD_FLAGS, 0)
    case("BAD_FLAGS (reserved field)", desc(OP_NOP, reserved=1, cookie=0xB5), BAD_FLAGS, 0)
    case("VRAM_RANGE (VRAM_TO_HOST src+length beyond VRAM)",
         desc(OP_VRAM_TO_HOST, src=vsize - 100, dst=HOST_IOVA, length=200, cookie=0xB6), VRAM_RANGE, vsize - 100)
    case("VRAM_RANGE (HOST_TO_VRAM dst beyond VRAM)",
         desc(OP_HOST_TO_VRAM, src=HOST_IOVA, dst=vsize, length=1, cookie=0xB7), VRAM_RANGE, vsize)
    case("VRAM_RANGE (FILL_PATTERN offset near 2^64)",
         desc(OP_FILL_PATTERN, src=1, dst=0xFFFF_FFFF_FFFF_FF00, length=0x200, cookie=0xB8),
         VRAM_RANGE, 0xFFFF_FFFF_FFFF_FF00)
    case("VRAM_RANGE (FILL_PRNG length beyond VRAM)",
         desc(OP_FILL_PRNG, src=1, dst=0x1000, length=vsize, cookie=0xB9), VRAM_RANGE, 0x1000)

    # DMA_UNMAPPED: never mapped; partly mapped (faults before the first byte moves)
    case("DMA_UNMAPPED (VRAM_TO_HOST to a never-mapped IOVA)",
         desc(OP_VRAM_TO_HOST, src=0, dst=UNMAPPED_IOVA, length=4096, cookie=0xBA), DMA_UNMAPPED, UNMAPPED_IOVA)
    gpu.vram_write(0x500000, b"\x55" * 8192)
    case("DMA_UNMAPPED (HOST_TO_VRAM from a never-mapped IOVA)",
         desc(OP_HOST_TO_VRAM, src=UNMAPPED_IOVA + 0x10, dst=0x500000, length=8192, cookie=0xBB),
         DMA_UNMAPPED, UNMAPPED_IOVA + 0x10,
         check_after=lambda: rep.check("HOST_TO_VRAM from unmapped: VRAM untouched",
                                       gpu.vram(0x500000, 8192) == b"\x55" * 8192))
    tail_off = HOST_SIZE - 4096
    gpu.host[tail_off:HOST_SIZE] = b"\x66" * 4096
    case("DMA_UNMAPPED (HOST_TO_HOST from a never-mapped IOVA)",
         desc(OP_HOST_TO_HOST, src=UNMAPPED_IOVA, dst=HOST_IOVA + tail_off, length=4096, cookie=0xC1),
         DMA_UNMAPPED, UNMAPPED_IOVA,
         check_after=lambda: rep.check("HOST_TO_HOST from unmapped: destination untouched",
                                       gpu.host[tail_off:HOST_SIZE] == b"\x66" * 4096))
    case("DMA_UNMAPPED (HOST_TO_HOST running off the end of a mapping)",
         desc(OP_HOST_TO_HOST, src=HOST_IOVA, dst=HOST_IOVA + tail_off, length=8192, cookie=0xC2),
         DMA_UNMAPPED, HOST_IOVA + HOST_SIZE,
         check_after=lambda: rep.check("partly-mapped HOST_TO_HOST: not a byte written (faults before moving)",
                                       gpu.host[tail_off:HOST_SIZE] == b"\x66" * 4096))
    case("DMA_UNMAPPED (VRAM_TO_HOST running off the end of a mapping)",
         desc(OP_VRAM_TO_HOST, src=0, dst=HOST_IOVA + tail_off, length=8192, cookie=0xBC),
         DMA_UNMAPPED, HOST_IOVA + HOST_SIZE,
         check_after=lambda: rep.check("partly-mapped VRAM_TO_HOST: not a byte written (faults before moving)",
                                       gpu.host[tail_off:HOST_SIZE] == b"\x66" * 4096))

    # DMA_PERMISSION: device-read-only mapping as a VRAM_TO_HOST destination
    gpu.ro_mem[:] = b"\x44" * PERM_SIZE
    case("DMA_PERMISSION (VRAM_TO_HOST into a read-only mapping)",
         desc(OP_VRAM_TO_HOST, src=0, dst=RO_IOVA + 0x100, length=4096, cookie=0xBD), DMA_PERMISSION, RO_IOVA + 0x100,
         check_after=lambda: rep.check("DMA_PERMISSION: read-only buffer untouched",
                                       gpu.ro_mem[:] == b"\x44" * PERM_SIZE))
    # ... but reading from it works
    gpu.fresh(16)
    gpu.submit([desc(OP_HOST_TO_VRAM, src=RO_IOVA, dst=0x600000, length=4096, flags=FLAG_INTERRUPT, cookie=1)])
    rep.check("HOST_TO_VRAM from a device-read-only mapping works",
              gpu.wait_vector(VEC_DMA_DONE) and gpu.vram(0x600000, 4096) == b"\x44" * 4096)
    # write-only mapping as a HOST_TO_VRAM source, if the guest IOMMU accepts one and QEMU passes it on
    wo_enforceable = False
    try:
        gpu.wo_mem = mmap.mmap(-1, PERM_SIZE)
        gpu.maps.append(gpu.dev.map_dma(gpu.wo_mem, WO_IOVA, readable=False, writable=True))
    except Exception as error:  # noqa: BLE001 - the guest IOMMU decides
        rep.info(f"a device-write-only mapping was refused by the guest ({error}); "
                 "DMA_PERMISSION for reads not tested")
    else:
        gpu.fresh(16)
        gpu.submit([desc(OP_HOST_TO_VRAM, src=WO_IOVA, dst=0x600000, length=4096, flags=FLAG_INTERRUPT)])
        ok, _ = gpu.wait_head(1)
        if ok:
            # QEMU's VFIO listener turns an IOMMU entry into DMA_MAP with only a read-only flag
            # (read_only = !(perm & IOMMU_WO)): a write-only guest mapping reaches the device as
            # read+write, so the device cannot refuse the read.
            rep.info("a device-write-only guest mapping reached the device readable (QEMU maps "
                     "IOMMU_WO entries read+write): DMA_PERMISSION on reads is not provokable here")
        else:
            wo_enforceable = True
    if wo_enforceable:
        case("DMA_PERMISSION (HOST_TO_VRAM from a write-only mapping)",
             desc(OP_HOST_TO_VRAM, src=WO_IOVA, dst=0x600000, length=4096, cookie=0xBE), DMA_PERMISSION, WO_IOVA)

    # RING_FETCH: the ring in unmapped IOVA space
    for what, ring in (("RING_FETCH (ring never mapped)", UNMAPPED_IOVA),):
        gpu.reset()
        gpu.set_bme(True)
        gpu.drain()
        gpu.configure(16, ring_iova=ring)
        gpu.tail = 3
        gpu.doorbell()
        check_halt(rep, gpu, what, status=RING_FETCH, index=0, addr=ring, errno_=0, head=0, completed=0)
    # RING_FETCH with HEAD != 0: ring moved (in IDLE) to unmapped space after 2 NOPs
    gpu.fresh(16)
    gpu.submit([desc(OP_NOP), desc(OP_NOP)])
    gpu.wait_head(2)
    gpu.w(CONTROL, 0)
    gpu.w64(RING_BASE_LO, UNMAPPED_IOVA)
    gpu.w(CONTROL, CONTROL_ENABLE)
    gpu.drain()
    gpu.w(RING_TAIL, 3)
    check_halt(rep, gpu, "RING_FETCH at HEAD 2", status=RING_FETCH, index=2, addr=UNMAPPED_IOVA + 2 * DESC_SIZE,
               errno_=0, head=2, completed=2)
    # RING_FETCH: ring in a write-only mapping (permission)
    if wo_enforceable:
        gpu.reset()
        gpu.set_bme(True)
        gpu.drain()
        gpu.configure(16, ring_iova=WO_IOVA)
        gpu.w(RING_TAIL, 1)
        check_halt(rep, gpu, "RING_FETCH (ring mapping not readable)", status=RING_FETCH, index=0, addr=WO_IOVA,
                   errno_=0, head=0, completed=0)

    # COMPLETION_WRITE: completion area unmapped / read-only
    for what, compl in (("COMPLETION_WRITE (completion area never mapped)", UNMAPPED_IOVA),
                        ("COMPLETION_WRITE (completion area read-only)", RO_IOVA)):
        gpu.reset()
        gpu.set_bme(True)
        gpu.drain()
        gpu.ro_mem[:] = b"\x44" * PERM_SIZE
        gpu.configure(16, compl_iova=compl)
        gpu.ring_mem[:32] = desc(OP_FILL_PATTERN, src=0x99, dst=0x700000, length=64, cookie=0xC1)
        gpu.ring_mem[32:64] = desc(OP_NOP, cookie=0xC2)
        gpu.tail = 2
        gpu.doorbell()
        check_halt(rep, gpu, what, status=COMPLETION_WRITE, index=0, addr=compl, errno_=0, head=0, completed=0)
        rep.check(f"{what}: the descriptor's data did move", gpu.vram(0x700000, 64) == pattern_bytes(0x99, 64))
        rep.check(f"{what}: read-only memory untouched", gpu.ro_mem[:] == b"\x44" * PERM_SIZE)
    # a failing descriptor whose record cannot be written reports its own status
    gpu.reset()
    gpu.set_bme(True)
    gpu.drain()
    gpu.configure(16, compl_iova=UNMAPPED_IOVA)
    gpu.ring_mem[:32] = desc(127, cookie=0xC3)
    gpu.tail = 1
    gpu.doorbell()
    check_halt(rep, gpu, "BAD_OPCODE with the completion area unmapped", status=BAD_OPCODE, index=0, addr=0,
               errno_=0, head=0, completed=0)

    # BAD_TAIL in IDLE and in RUNNING
    gpu.reset()
    gpu.set_bme(True)
    gpu.drain()
    gpu.configure(16, enable=False)
    gpu.w(RING_TAIL, 5)
    gpu.w(RING_TAIL, 16)
    check_halt(rep, gpu, "BAD_TAIL in IDLE (16 >= RING_SIZE 16)", status=BAD_TAIL, index=0, addr=16, errno_=0,
               head=0, completed=0)
    rep.eq("BAD_TAIL in IDLE: TAIL keeps its old value", gpu.r(RING_TAIL), 5, fmt=str)
    gpu.reset()
    gpu.set_bme(True)
    gpu.drain()
    gpu.w(RING_TAIL, 0)
    check_halt(rep, gpu, "BAD_TAIL with RING_SIZE 0 (doorbell before configuring)", status=BAD_TAIL, index=0,
               addr=0, errno_=0, head=0, completed=0)
    gpu.fresh(16)
    gpu.submit([desc(OP_NOP), desc(OP_NOP), desc(OP_NOP)])
    gpu.wait_head(3)
    gpu.drain()
    gpu.w(RING_TAIL, 0xFFFFFFFF)
    check_halt(rep, gpu, "BAD_TAIL in RUNNING (0xFFFFFFFF)", status=BAD_TAIL, index=3, addr=0xFFFFFFFF, errno_=0,
               head=3, completed=3)
    rep.eq("BAD_TAIL in RUNNING: TAIL keeps its old value", gpu.r(RING_TAIL), 3, fmt=str)
    rep.eq("64-bit read of ERR_ADDR_LO/HI", gpu.bar0.read64(ERR_ADDR_LO), 0xFFFFFFFF)
    # a batch whose first descriptor completes with INTERRUPT and whose second fails: both vectors
    gpu.fresh(16)
    slots = gpu.submit([desc(OP_NOP, flags=FLAG_INTERRUPT, cookie=0xD1), desc(OP_NOP, flags=4, cookie=0xD2)])
    rep.check("OK with INTERRUPT then a failure: vector 0 and vector 1",
              gpu.wait_vector(VEC_DMA_DONE) and gpu.wait_vector(VEC_ERROR))
    rep.eq("OK then failure: INTR_STATUS has DMA_DONE and ERROR", gpu.r(INTR_STATUS), INTR_DMA_DONE | INTR_ERROR)
    rep.eq("OK then failure: records (status, seq)", [(gpu.record(s)["status"], gpu.record(s)["seq"]) for s in slots],
           [(OK, 1), (BAD_FLAGS, 2)], fmt=None)
    rep.info("not provokable by a guest driver: DMA_REFUSED, DMA_TIMEOUT, DMA_ABORTED, DMA_IO_ERROR "
             "(they need a misbehaving vfio-user client, a disconnect or a truncated backing file)")


def halt_semantics(rep: Report, gpu: Gpu) -> None:
    gpu.fresh(16)
    gpu.submit([desc(OP_NOP), desc(127, cookie=0xDD)])    # NOP retires, then BAD_OPCODE halts
    gpu.wait_halted()
    gpu.wait_vector(VEC_ERROR)
    err = gpu.err()
    gpu.w(INTR_STATUS, INTR_ERROR | INTR_DMA_DONE)
    rep.eq("halted: INTR_STATUS W1C clears ERROR", gpu.r(INTR_STATUS), 0)
    head, tail, done = gpu.r(RING_HEAD), gpu.r(RING_TAIL), gpu.r(COMPLETED)
    # valid doorbell, out-of-range doorbell, ENABLE, ENABLE 1->0: all do nothing
    gpu.ring_mem[2 * 32:3 * 32] = desc(OP_NOP, flags=FLAG_INTERRUPT, cookie=0xDE)
    gpu.w(RING_TAIL, 3)
    gpu.w(RING_TAIL, 16)
    gpu.w(RING_TAIL, 0xFFFF)
    gpu.w(CONTROL, CONTROL_ENABLE)
    gpu.w(CONTROL, 0)
    gpu.w(CONTROL, CONTROL_ENABLE)
    fired = gpu.no_vector()
    rep.check("halted: doorbells (valid and >= RING_SIZE) and ENABLE raise no vector", not fired, f"fired {fired}")
    rep.eq("halted: INTR_STATUS stays 0", gpu.r(INTR_STATUS), 0)
    rep.eq("halted: TAIL, HEAD, COMPLETED unchanged", (gpu.r(RING_TAIL), gpu.r(RING_HEAD), gpu.r(COMPLETED)),
           (tail, head, done), fmt=None)
    rep.eq("halted: STATUS stays HALTED, CONTROL reads 0", (gpu.r(STATUS), gpu.r(CONTROL)), (STATUS_HALTED, 0), fmt=None)
    rep.eq("halted: ERR_* still describe the first error", gpu.err(), err, fmt=None)
    rep.eq("halted: nothing more executed (slot 2 record empty)", gpu.record(2)["seq"], 0, fmt=str)
    # only a reset leaves HALTED
    gpu.w(CONTROL, CONTROL_RESET)
    rep.eq("CONTROL.RESET leaves HALTED: IDLE, ERR_* cleared",
           (gpu.r(STATUS), gpu.err()), (0, {"status": 0, "index": 0, "addr": 0, "errno": 0}), fmt=None)
    fired = gpu.no_vector()
    rep.check("reset raises no vector", not fired, f"fired {fired}")


def enable_disable(rep: Report, gpu: Gpu) -> None:
    gpu.fresh(8, bme=True)
    gpu.w(CONTROL, 0)
    gpu.sync()
    # doorbells in IDLE are stored; the ring runs once enabled
    slots = gpu.put([desc(OP_NOP, cookie=1), desc(OP_NOP, cookie=2, flags=FLAG_INTERRUPT)])
    gpu.doorbell()
    fired = gpu.no_vector()
    rep.check("IDLE: a doorbell is stored and nothing runs", not fired and gpu.r(RING_HEAD) == 0
              and gpu.r(RING_TAIL) == 2 and gpu.record(0)["seq"] == 0, f"fired {fired}, HEAD {gpu.r(RING_HEAD)}")
    gpu.w(CONTROL, CONTROL_ENABLE)
    rep.check("ENABLE after a stored doorbell runs the ring", gpu.wait_vector(VEC_DMA_DONE) and gpu.r(RING_HEAD) == 2)
    check_record(rep, gpu, slots[1], "stored-doorbell NOP", cookie=2, status=OK, bytes_done=0, seq=2, duration=False)


def dropped_descriptor(rep: Report, gpu: Gpu, how: str) -> None:
    """Drop a long transfer in flight (ENABLE 1->0, CONTROL.RESET or BME clear); check what the spec promises."""
    length = 32 << 20
    gpu.fresh(8)
    gpu.submit([desc(OP_NOP, cookie=0xF0)])
    gpu.wait_head(1)
    gpu.drain()
    gpu.host[:length] = b"\x5A" * length
    slots = gpu.submit([desc(OP_HOST_TO_VRAM, src=HOST_IOVA, dst=0, length=length, flags=FLAG_INTERRUPT,
                             cookie=0xF1)])
    if how == "disable":
        gpu.w(CONTROL, 0)
    elif how == "badtail":
        gpu.w(RING_TAIL, 100)
    elif how == "reset":
        gpu.w(CONTROL, CONTROL_RESET)
    else:
        gpu.set_bme(False)
    status = gpu.sync()                       # acknowledged: the drop took effect
    head, done = gpu.r(RING_HEAD), gpu.r(COMPLETED)
    if how == "reset":
        rep.eq("reset in flight: IDLE, HEAD 0, COMPLETED 0, TAIL 0",
               (status, head, done, gpu.r(RING_TAIL)), (0, 0, 0, 0), fmt=None)
        outcome = "dropped"
    elif how == "badtail":
        outcome = "dropped" if head == 1 else "completed before the drop"
        rep.eq("BAD_TAIL in flight: HALTED", status, STATUS_HALTED)
        rep.eq("BAD_TAIL in flight: ERR_STATUS/ERR_DESC_INDEX (HEAD)/ERR_ADDR (value)",
               (gpu.r(ERR_STATUS), gpu.r(ERR_DESC_INDEX), gpu.r64(ERR_ADDR_LO)), (BAD_TAIL, head, 100), fmt=None)
        rep.check(f"BAD_TAIL in flight: HEAD/COMPLETED consistent ({outcome})",
                  (head, done) in ((1, 1), (2, 2)), f"HEAD {head}, COMPLETED {done}")
        rep.check("BAD_TAIL in flight: vector 1", gpu.wait_vector(VEC_ERROR))
    else:
        want_status = 0 if how == "disable" else STATUS_ENABLED
        rep.check(f"{how} in flight: STATUS {want_status:#x} after the drop", status == want_status,
                  f"STATUS={status:#x}")
        outcome = "dropped" if head == 1 else "completed before the drop"
        rep.check(f"{how} in flight: HEAD/COMPLETED consistent ({outcome})",
                  (head, done) in ((1, 1), (2, 2)), f"HEAD {head}, COMPLETED {done}")
    rep.info(f"{how}: the 32 MiB transfer was {outcome}")
    gpu.drain()
    before = gpu.record(slots[0])
    gpu.compl_mem[:8 * COMPL_SIZE] = bytes(8 * COMPL_SIZE)   # zero the area after the acknowledgement
    fired = gpu.no_vector(1.0)
    if outcome == "dropped":
        rep.check(f"{how} in flight: after the acknowledgement no record, no vector, HEAD/COMPLETED unchanged",
                  gpu.compl_mem[:8 * COMPL_SIZE] == bytes(8 * COMPL_SIZE) and not fired
                  and gpu.r(RING_HEAD) == head and gpu.r(COMPLETED) == done,
                  f"fired {fired}, HEAD {gpu.r(RING_HEAD)}, COMPLETED {gpu.r(COMPLETED)}, record {gpu.record(slots[0])}")
        if before["seq"] not in (0,):
            rep.info(f"{how}: a record written before the drop was in memory: {before}")
    if how in ("reset", "badtail") or outcome != "dropped":
        return
    # run it again: it executes from the start, completes once
    if how == "disable":
        gpu.w(CONTROL, CONTROL_ENABLE)
    else:
        gpu.set_bme(True)
    ok = gpu.wait_vector(VEC_DMA_DONE, 60)
    rep.check(f"{how}: the dropped descriptor runs again and completes", ok and gpu.r(RING_HEAD) == 2)
    check_record(rep, gpu, slots[0], f"{how}: re-run", cookie=0xF1, status=OK, bytes_done=length, seq=2)
    rep.eq(f"{how}: COMPLETED counts it once", gpu.r(COMPLETED), 2, fmt=str)
    rep.check(f"{how}: data correct after the re-run", gpu.vram(0, length) == b"\x5A" * length)


def bus_master(rep: Report, gpu: Gpu) -> None:
    gpu.vram_write(0x900000, b"\x00" * 4096)
    gpu.fresh(16, bme=False)
    rep.eq("BME clear: ENABLE still gives RUNNING", gpu.r(STATUS), STATUS_ENABLED)
    slots = gpu.submit([desc(OP_FILL_PATTERN, src=0x42, dst=0x900000, length=4096, cookie=0xE1),
                        desc(OP_NOP, cookie=0xE2, flags=FLAG_INTERRUPT)])
    fired = gpu.no_vector()
    rep.check("BME clear: doorbell stored, nothing executes (HEAD 0, no record, no vector)",
              not fired and gpu.r(RING_HEAD) == 0 and gpu.r(RING_TAIL) == 2 and gpu.record(0)["seq"] == 0
              and gpu.r(STATUS) == STATUS_ENABLED, f"fired {fired}, HEAD {gpu.r(RING_HEAD)}")
    rep.check("BME clear: no VRAM write either", gpu.vram(0x900000, 4096) == b"\x00" * 4096)
    rep.eq("BME clear: INTR_STATUS 0", gpu.r(INTR_STATUS), 0)
    gpu.set_bme(True)
    rep.check("BME set: the ring runs from HEAD, vector 0", gpu.wait_vector(VEC_DMA_DONE) and gpu.r(RING_HEAD) == 2)
    check_record(rep, gpu, slots[1], "after BME set", cookie=0xE2, status=OK, bytes_done=0, seq=2, duration=False)
    rep.check("after BME set: data written", gpu.vram(0x900000, 4096) == pattern_bytes(0x42, 4096))
    # BAD_TAIL while BME is clear: halts, latches INTR_STATUS.ERROR, no MSI-X, not remembered
    gpu.set_bme(False)
    gpu.drain()
    gpu.w(RING_TAIL, 100)
    gpu.sync()
    rep.eq("BME clear + BAD_TAIL: HALTED, ERR_STATUS BAD_TAIL", (gpu.r(STATUS), gpu.r(ERR_STATUS)),
           (STATUS_HALTED, BAD_TAIL), fmt=None)
    rep.check("BME clear + BAD_TAIL: INTR_STATUS.ERROR latched", bool(gpu.r(INTR_STATUS) & INTR_ERROR))
    fired = gpu.no_vector()
    rep.check("BME clear + BAD_TAIL: no MSI-X message", not fired, f"fired {fired}")
    gpu.set_bme(True)
    fired = gpu.no_vector()
    rep.check("BME set again: the lost vector is not sent later", not fired, f"fired {fired}")
    rep.eq("BME clear + error: MSI-X PBA stays 0", gpu.dev.bar(4).read32(MSIX_PBA_OFF), 0)
    # BAD_RING_CONFIG while BME is clear
    gpu.reset()
    gpu.set_bme(False)
    gpu.drain()
    gpu.configure(5, clear=False)
    rep.eq("BME clear + BAD_RING_CONFIG: HALTED", (gpu.r(STATUS), gpu.r(ERR_STATUS)),
           (STATUS_HALTED, BAD_RING_CONFIG), fmt=None)
    fired = gpu.no_vector()
    rep.check("BME clear + BAD_RING_CONFIG: INTR_STATUS.ERROR latched, no MSI-X",
              bool(gpu.r(INTR_STATUS) & INTR_ERROR) and not fired, f"fired {fired}")
    gpu.set_bme(True)


def no_eventfd(rep: Report, gpu: Gpu) -> None:
    gpu.fresh(16)
    gpu.vectors.close()
    try:
        gpu.submit([desc(OP_NOP, flags=FLAG_INTERRUPT, cookie=1)])
        ok, _ = gpu.wait_head(1)
        rep.check("MSI-X disabled: the descriptor completes", ok)
        rep.eq("MSI-X disabled: INTR_STATUS.DMA_DONE still latched", gpu.r(INTR_STATUS) & INTR_DMA_DONE, INTR_DMA_DONE)
    finally:
        gpu.vectors = gpu.dev.msix(MSIX_VECTORS)
    fired = gpu.no_vector()
    rep.check("MSI-X enabled again: the lost vector is not delivered late", not fired, f"fired {fired}")
    gpu.submit([desc(OP_NOP, flags=FLAG_INTERRUPT, cookie=2)])
    rep.check("MSI-X enabled again: vector 0 works", gpu.wait_vector(VEC_DMA_DONE))


def resets(rep: Report, gpu: Gpu) -> None:
    for how in ("CONTROL.RESET", "FLR (Device Control bit 15)", "VFIO_DEVICE_RESET"):
        gpu.fresh(16)
        gpu.w(SCRATCH, 0x12345678)
        gpu.vram_write(0xA00000, b"VRAM survives resets")
        gpu.submit([desc(OP_NOP), desc(OP_NOP, flags=FLAG_INTERRUPT)])
        gpu.wait_vector(VEC_DMA_DONE)
        gpu.w(RING_TAIL, 99)            # and halt it with BAD_TAIL so ERR_* and INTR_STATUS are set
        gpu.wait_halted()
        gpu.wait_vector(VEC_ERROR)
        gpu.drain()
        if how == "CONTROL.RESET":
            gpu.w(CONTROL, CONTROL_RESET)
        elif how.startswith("FLR"):
            devctl = gpu.cfg.read16(PCIE_CAP_OFF + PCIE_DEVCTL)
            gpu.cfg.write16(PCIE_CAP_OFF + PCIE_DEVCTL, devctl | DEVCTL_FLR)
        else:
            gpu.dev.reset()
        seen = {off: gpu.r(off) for off in REGISTERS}
        seen[VERSION], seen[CAPS] = compatible(seen[VERSION], seen[CAPS])
        regs = {REGISTERS[off][0]: seen[off] for off in REGISTERS}
        want = {REGISTERS[off][0]: 0 for off in REGISTERS} | {
            "ID": ID_VALUE, "VERSION": VERSION_VALUE, "VRAM_SIZE_LO": gpu.vram_size & 0xFFFFFFFF,
            "VRAM_SIZE_HI": gpu.vram_size >> 32, "CAPS": CAPS_VALUE, "RING_MAX": RING_MAX_VALUE}
        diff = {k: (hex(v), hex(want[k])) for k, v in regs.items() if v != want[k]}
        rep.check(f"{how}: every BAR0 register at its reset value (IDLE)", not diff, f"(got, want) {diff}")
        fired = gpu.no_vector()
        rep.check(f"{how}: raises no vector", not fired, f"fired {fired}")
        rep.check(f"{how}: VRAM not cleared", gpu.vram(0xA00000, 20) == b"VRAM survives resets")
        if how == "CONTROL.RESET":
            rep.check("CONTROL.RESET leaves config space alone (BME still set)", bool(gpu.command() & CMD_MASTER))
        else:
            rep.info(f"{how}: BME after reset = {bool(gpu.command() & CMD_MASTER)} (the guest kernel saves and "
                     "restores config space around a function reset, so the device's clearing is not visible)")
        # DMA mappings and eventfds kept: the same IOVAs and vectors work without redoing anything
        gpu.set_bme(True)
        gpu.tail = 0
        gpu.configure(16)
        slots = gpu.submit([desc(OP_FILL_PATTERN, src=0x31, dst=0xA10000, length=256, cookie=0x77,
                                 flags=FLAG_INTERRUPT)])
        rep.check(f"after {how}: same DMA mappings and eventfds work (vector 0)", gpu.wait_vector(VEC_DMA_DONE))
        check_record(rep, gpu, slots[0], f"after {how}", cookie=0x77, status=OK, bytes_done=256, seq=1)


def wrap_around(rep: Report, gpu: Gpu) -> None:
    gpu.fresh(4)
    seq = 0
    good = True
    detail = ""
    for batch in range(6):                      # 6 batches of 3 on a 4-entry ring: HEAD wraps 4 times
        cookies = [0x1000 + batch * 3 + i for i in range(3)]
        slots = gpu.submit([desc(OP_FILL_PATTERN, src=c, dst=0xB00000 + 64 * (c & 0xFF), length=64, cookie=c,
                                 flags=FLAG_INTERRUPT if i == 2 else 0) for i, c in enumerate(cookies)])
        if not gpu.wait_vector(VEC_DMA_DONE):
            good, detail = False, f"batch {batch}: no vector, HEAD {gpu.r(RING_HEAD)}"
            break
        for slot, cookie in zip(slots, cookies):
            seq += 1
            rec = gpu.record(slot)
            if (rec["cookie"], rec["index"], rec["seq"], rec["status"]) != (cookie, slot, seq, OK):
                good, detail = False, f"slot {slot}: {rec}, want cookie {cookie:#x} seq {seq}"
        if gpu.r(RING_HEAD) != gpu.tail:
            good, detail = False, f"HEAD {gpu.r(RING_HEAD)} != TAIL {gpu.tail}"
    rep.check("4-entry ring, 18 descriptors in batches of 3 (RING_SIZE-1): records and HEAD wrap", good, detail)
    rep.eq("wrap: COMPLETED == 18", gpu.r(COMPLETED), 18, fmt=str)
    rep.check("wrap: data of every descriptor", all(gpu.vram(0xB00000 + 64 * (c & 0xFF), 64) == pattern_bytes(c, 64)
                                                   for c in range(0x1000, 0x1000 + 18)))
    # a 128-entry ring: a batch of 127 (more than one 64-descriptor fetch), then a batch that wraps
    gpu.fresh(128)
    first = gpu.submit([desc(OP_NOP, cookie=i) for i in range(126)] + [desc(OP_NOP, cookie=126, flags=FLAG_INTERRUPT)])
    ok = gpu.wait_vector(VEC_DMA_DONE)
    recs_ok = all(gpu.record(s)["seq"] == i + 1 and gpu.record(s)["cookie"] == i for i, s in enumerate(first))
    rep.check("128-entry ring: 127 outstanding descriptors (a full ring) all complete in order", ok and recs_ok)
    second = gpu.submit([desc(OP_NOP, cookie=200 + i, flags=FLAG_INTERRUPT if i == 9 else 0) for i in range(10)])
    ok = gpu.wait_vector(VEC_DMA_DONE)
    rep.check("128-entry ring: a batch wrapping from slot 127 to slot 8", ok and second[0] == 127 and second[-1] == 8
              and all(gpu.record(s)["seq"] == 128 + i for i, s in enumerate(second)) and gpu.r(RING_HEAD) == 9,
              f"HEAD {gpu.r(RING_HEAD)}")


def observations(rep: Report, gpu: Gpu) -> None:
    """What the device does where the spec is silent: INFO lines only (see FINDINGS.md)."""
    vsize = gpu.vram_size

    def run_one(d: bytes) -> str:
        gpu.fresh(16)
        gpu.submit([d])
        ok, _ = gpu.wait_head(1, 5)
        rec = gpu.record(0)
        if ok:
            return f"completed, status {STATUS_NAMES.get(rec['status'])}, bytes_done {rec['bytes_done']}"
        e = gpu.err()
        return (f"halted {STATUS_NAMES.get(e['status'], e['status'])} ERR_ADDR {e['addr']:#x} "
                f"(record status {STATUS_NAMES.get(rec['status'], rec['status'])})")

    rep.info("length 0 VRAM_TO_HOST to a mapped IOVA: " + run_one(desc(OP_VRAM_TO_HOST, 0, HOST_IOVA, 0)))
    rep.info("length 0 VRAM_TO_HOST to an unmapped IOVA: " + run_one(desc(OP_VRAM_TO_HOST, 0, UNMAPPED_IOVA, 0)))
    rep.info("length 0 HOST_TO_VRAM at dst = VRAM size: " + run_one(desc(OP_HOST_TO_VRAM, HOST_IOVA, vsize, 0)))
    rep.info("length 0 FILL_PATTERN at dst = VRAM size + 1: " + run_one(desc(OP_FILL_PATTERN, 1, vsize + 1, 0)))
    rep.info("NOP with length 2^32-1 and src/dst ~0: " + run_one(desc(OP_NOP, ~0 & (2**64 - 1), ~0 & (2**64 - 1),
                                                                   0xFFFFFFFF)))
    # CONTROL bits other than ENABLE/RESET
    gpu.reset()
    gpu.w(CONTROL, 0xFFFFFFFC)
    rep.info(f"CONTROL after writing 0xFFFFFFFC in IDLE reads {gpu.r(CONTROL):#x}, STATUS {gpu.r(STATUS):#x}")
    gpu.reset()
    # a ring that runs off the end of its mapping: slots 0-1 mapped, 2-3 not
    ring = RING_IOVA + RING_BYTES - 2 * DESC_SIZE
    gpu.set_bme(True)
    gpu.configure(4, ring_iova=ring, clear=False)
    gpu.ring_mem[RING_BYTES - 64:RING_BYTES] = desc(OP_NOP, cookie=1) + desc(OP_NOP, cookie=2)
    gpu.compl_mem[:128] = bytes(128)
    gpu.w(RING_TAIL, 3)
    gpu.wait_halted(5)
    e = gpu.err()
    rep.info(f"ring straddling the end of its mapping, 3 descriptors (slots 0-1 mapped): HEAD {gpu.r(RING_HEAD)}, "
             f"COMPLETED {gpu.r(COMPLETED)}, ERR {STATUS_NAMES.get(e['status'], e['status'])} "
             f"index {e['index']} addr {e['addr']:#x} (ring {ring:#x})")
    # BUSY: read STATUS straight after the doorbell of a long transfer
    gpu.fresh(16)
    gpu.submit([desc(OP_HOST_TO_VRAM, HOST_IOVA, 0, 32 << 20, flags=FLAG_INTERRUPT)])
    seen = gpu.r(STATUS)
    gpu.wait_vector(VEC_DMA_DONE, 60)
    rep.info(f"STATUS read right after the doorbell of a 32 MiB transfer: {seen:#x}"
             + (" (BUSY seen)" if seen & STATUS_BUSY else " (BUSY not seen)"))


def final_vectors(rep: Report, gpu: Gpu) -> None:
    rep.check("spare vectors 2 and 3 never fired", not gpu.vectors.pending(2) and not gpu.vectors.pending(3))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bdf", help="the GPU's PCI address (default: the one 0601:1991)")
    parser.add_argument("--no-cxl", action="store_true", help="skip the CXL devdax transfer")
    args = parser.parse_args(argv)
    rep = Report()
    started = time.monotonic()
    bdf = args.bdf or next(iter(find_pci_devices(VENDOR_ID, DEVICE_ID)), None)
    if bdf is None:
        print("FAIL [setup] no PCI device 0601:1991\n0 passed, 1 failed")
        return 1
    rep.section = "setup"
    gpu = Gpu(bdf, rep)
    try:
        gpu.set_bme(True)
        gpu.reset()
        sections = [("pci identity", pci_identity), ("vfio view and config writes", vfio_view),
                    ("bar0 registers", bar0_registers), ("enable validation", enable_validation),
                    ("locked registers", locked_registers), ("descriptor ops", descriptor_ops),
                    ("errors", errors), ("halt", halt_semantics), ("idle doorbell", enable_disable),
                    ("drop: ENABLE 1->0", lambda r, g: dropped_descriptor(r, g, "disable")),
                    ("drop: CONTROL.RESET", lambda r, g: dropped_descriptor(r, g, "reset")),
                    ("drop: BME clear", lambda r, g: dropped_descriptor(r, g, "bme")),
                    ("drop: BAD_TAIL", lambda r, g: dropped_descriptor(r, g, "badtail")),
                    ("bus master enable", bus_master), ("no eventfd", no_eventfd), ("reset", resets),
                    ("wrap-around", wrap_around)]
        if not args.no_cxl:
            sections.append(("cxl devdax", cxl_transfer))
        sections.append(("observations (spec gaps)", observations))
        sections.append(("vectors", final_vectors))
        for name, run in sections:
            t0 = time.monotonic()
            with section(rep, gpu, name):
                run(rep, gpu)
            rep.section = name
            rep.info(f"section took {time.monotonic() - t0:.1f} s")
    finally:
        gpu.close()
    print(f"{rep.passed} passed, {len(rep.failed)} failed ({time.monotonic() - started:.0f} s)")
    return 0 if not rep.failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
