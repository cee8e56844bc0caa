"""The GPU as the vfio-user server sees it: regions, and the BAR router.

Region accesses are routed here: BAR0 to the engine (reads under its lock,
writes as ``Input.REG_WRITE``), BAR2 to VRAM, BAR4 to the MSI-X table,
config space to ``PciConfig`` (a change of Bus Master Enable and an FLR
become engine inputs).  Client events (connect, disconnect, DMA_MAP,
DMA_UNMAP, DEVICE_RESET) are engine inputs too.

Message handlers (the connection's reader thread) return at once; all DMA
happens on the engine thread.  That split keeps QEMU alive: a handler that
waited for a DMA round trip would deadlock QEMU's vCPU (it holds the global
lock while waiting for our reply, and its DMA service needs that lock).
"""

from __future__ import annotations

import gc
import logging
import mmap
import os

from ..vfio_user import wire
from ..vfio_user.dma import DmaPort, FaultReports
from ..vfio_user.peer import MemoryShare, PeerSet
from ..vfio_user.irq import IrqTable, irq_types
from ..vfio_user.pci_config import BAR_MEM_64, BAR_PREFETCH, Bar, MsixLayout, PciConfig, PciIdentity
from ..vfio_user.server import Region
from . import regs
from .engine import Engine, Input, State
from ..vfio_user.bar import MsixBar, read_bytes, split_write


log = logging.getLogger(__name__)

IRQ_MODES = ("msix", "msi")


def pci_config(vendor_id: int, device_id: int, vram_size: int, irq_mode: str = "msix") -> PciConfig:
    identity = PciIdentity(vendor_id, device_id, regs.PCI_SUBSYSTEM_VENDOR_ID,
                           regs.PCI_SUBSYSTEM_ID, regs.PCI_REVISION, regs.PCI_CLASS_CODE)
    bars = [Bar(regs.BAR_REGS, regs.REGS_SIZE, 0),
            Bar(regs.BAR_VRAM, vram_size, BAR_MEM_64 | BAR_PREFETCH)]
    if irq_mode == "msi":  # MSI capability instead; no BAR4
        return PciConfig(identity, bars, msi_vectors=regs.MSI_VECTORS)
    bars.append(Bar(regs.BAR_MSIX, regs.MSIX_BAR_SIZE, 0))
    msix = MsixLayout(regs.MSIX_VECTORS, regs.BAR_MSIX, regs.MSIX_TABLE_OFFSET,
                      regs.MSIX_PBA_OFFSET)
    return PciConfig(identity, bars, msix)


class GpuDevice:
    def __init__(self, vram_size: int = regs.DEFAULT_VRAM_SIZE,
                 vendor_id: int = regs.PCI_VENDOR_ID, device_id: int = regs.PCI_DEVICE_ID,
                 irq_mode: str = "msix", share_vram: str | None = None,
                 peers: list[str] = (), local_dma_faults: bool = False):
        """``share_vram``: a UNIX socket path on which peer GPU servers get our VRAM
        fd; ``peers``: their share paths (the P2P fast path, docs/gpu-device.md).
        ``local_dma_faults``: a DMA to an IOVA without a DMA_MAP faults inside the device
        only; by default it is also sent to the client, rate limited, so its vIOMMU
        records the fault (docs/gpu-device.md, "Faults")."""
        if irq_mode not in IRQ_MODES:
            raise ValueError(f"interrupt mode {irq_mode!r} is not one of {', '.join(IRQ_MODES)}")
        self.irq_mode = irq_mode
        self.fault_reports = None if local_dma_faults else FaultReports()
        if vram_size & (vram_size - 1) or not regs.MIN_VRAM_SIZE <= vram_size <= regs.MAX_VRAM_SIZE:
            raise ValueError(f"VRAM size {vram_size} must be a power of two in "
                             f"[{regs.MIN_VRAM_SIZE}, {regs.MAX_VRAM_SIZE}]")
        self.vram_size = vram_size
        # VRAM lives in a memfd so QEMU can mmap it: guest CPU access never reaches us.
        self.vram_fd = os.memfd_create("vfio-cxl-gpu-vram", os.MFD_CLOEXEC)
        os.ftruncate(self.vram_fd, vram_size)
        self._vram_mm = mmap.mmap(self.vram_fd, vram_size, flags=mmap.MAP_SHARED)
        self.vram = memoryview(self._vram_mm)

        self.peers = PeerSet(list(peers))
        self.share = MemoryShare(share_vram, self.vram_fd, vram_size) if share_vram else None

        self.config = pci_config(vendor_id, device_id, vram_size, irq_mode)
        msi = irq_mode == "msi"
        self.irqs = IrqTable(irq_types(msix_vectors=0 if msi else regs.MSIX_VECTORS,
                                       msi_vectors=regs.MSI_VECTORS if msi else 0))
        self.msix = MsixBar(regs.MSIX_VECTORS, regs.MSIX_BAR_SIZE)
        self.engine = Engine(self.vram, self.irqs.raise_msi if msi else self.irqs.raise_msix)

        rw = wire.REGION_INFO_FLAG_READ | wire.REGION_INFO_FLAG_WRITE
        self.regions = {i: Region(0, 0) for i in range(wire.PCI_NUM_REGIONS)}
        self.regions[regs.BAR_REGS] = Region(regs.REGS_SIZE, rw)
        self.regions[regs.BAR_VRAM] = Region(
            vram_size, rw | wire.REGION_INFO_FLAG_MMAP | wire.REGION_INFO_FLAG_CAPS, self.vram_fd)
        if not msi:
            self.regions[regs.BAR_MSIX] = Region(regs.MSIX_BAR_SIZE, rw)
        self.regions[wire.PCI_CONFIG_REGION] = Region(len(self.config.data), rw)

    @property
    def state(self) -> State:
        return self.engine.state

    @property
    def resets(self) -> int:
        return self.engine.resets

    # ================================================================ lifetime
    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    def close(self) -> None:
        self.stop()
        if self.share is not None:
            self.share.close()
        self.peers.close()
        self.irqs.close_all()
        self.vram.release()
        try:
            self._vram_mm.close()
        except BufferError:  # a VRAM slice kept alive by a reference cycle (a traceback)
            gc.collect()
            self._vram_mm.close()
        os.close(self.vram_fd)

    # ================================================================ client events
    def connect(self, conn) -> None:
        """A client connected: its DMA table and message path become the bus-master port."""
        self.engine.input(Input.CONNECT, DmaPort(conn.table, conn, self.engine.gate, self.peers,
                                                 self.engine.peer_fast_enabled, self.engine.message_window,
                                                 self.fault_reports))

    def disconnect(self) -> None:
        if self.fault_reports is not None and self.fault_reports.sent:
            log.warning(self.fault_reports.summary())
        self.engine.input(Input.DISCONNECT)

    def dma_map(self, iova: int, size: int, flags: int, fd: int | None, offset: int):
        return self.engine.input(Input.DMA_MAP, iova, size, flags, fd, offset)

    def dma_unmap(self, iova: int, size: int, everything: bool) -> int:
        return self.engine.input(Input.DMA_UNMAP, iova, size, everything)

    def reset(self, *, function_level: bool = False) -> None:
        """DEVICE_RESET / FLR (``function_level``: config space and MSI-X table too)."""
        if function_level:
            with self.engine.lock:
                self.config.reset()
                self.msix.reset()
        self.engine.input(Input.RESET, function_level)

    # ================================================================ regions (BAR router)
    def region_read(self, index: int, offset: int, count: int):
        if index == regs.BAR_REGS:
            with self.engine.lock:
                return read_bytes(self.engine.reg_value, offset, count)
        if index == regs.BAR_VRAM:
            return self.vram[offset:offset + count]
        if index == regs.BAR_MSIX:
            return self.msix.read(offset, count)
        if index == wire.PCI_CONFIG_REGION:
            with self.engine.lock:
                return self.config.read(offset, count)
        raise AssertionError(f"region {index} has no data")

    def region_write(self, index: int, offset: int, data) -> None:
        if index == regs.BAR_REGS:
            for reg, value, mask in split_write(offset, bytes(data)):
                self.engine.input(Input.REG_WRITE, reg, value, mask)
        elif index == regs.BAR_VRAM:
            self.vram[offset:offset + len(data)] = data
        elif index == regs.BAR_MSIX:
            self.msix.write(offset, data)
        elif index == wire.PCI_CONFIG_REGION:
            with self.engine.lock:
                flr = self.config.write(offset, data)
                bus_master = self.config.bus_master
            if flr:
                self.reset(function_level=True)
            else:
                self.engine.input(Input.BUS_MASTER, bus_master)
