"""The SMC as vfio-user servers see it: one ``SmcHostPort`` per host, one shared ``SmcState``.

A ``VfioUserServer`` serves one client on one socket, so an SMC for N hosts
runs N servers; each serves a ``SmcHostPort`` -- that host's PCI function
(its config space, MSI-X table, eventfds) -- and every port forwards its
BAR0 accesses and client events to the one ``SmcState``.  Ports never
change shared state themselves.

The SMC does no DMA: DMA_MAP / DMA_UNMAP from QEMU are kept in the
connection's DMA table (so the protocol's rules hold) and never used.
"""

from __future__ import annotations

import threading

from ..vfio_user import wire
from ..vfio_user.bar import MsixBar, read_bytes, split_write
from ..vfio_user.irq import IrqTable, irq_types
from ..vfio_user.pci_config import Bar, MsixLayout, PciConfig, PciIdentity
from ..vfio_user.server import Region, VfioUserServer
from . import regs
from .state import Input, SmcState


def pci_config() -> PciConfig:
    identity = PciIdentity(regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID, regs.PCI_SUBSYSTEM_VENDOR_ID,
                           regs.PCI_SUBSYSTEM_ID, regs.PCI_REVISION, regs.PCI_CLASS_CODE)
    bars = [Bar(regs.BAR_REGS, regs.REGS_SIZE, 0), Bar(regs.BAR_MSIX, regs.MSIX_BAR_SIZE, 0)]
    msix = MsixLayout(regs.MSIX_VECTORS, regs.BAR_MSIX, regs.MSIX_TABLE_OFFSET, regs.MSIX_PBA_OFFSET)
    return PciConfig(identity, bars, msix)


class SmcHostPort:
    """Host ``host``'s view of the controller: the ``Device`` a VfioUserServer serves."""

    def __init__(self, state: SmcState, host: int):
        self.state = state
        self.host = host
        self.config = pci_config()
        self.msix = MsixBar(regs.MSIX_VECTORS, regs.MSIX_BAR_SIZE)
        self.irqs = IrqTable(irq_types(msix_vectors=regs.MSIX_VECTORS))
        self._local = threading.Lock()   # this port's config space and MSI-X table
        self._conn = None
        rw = wire.REGION_INFO_FLAG_READ | wire.REGION_INFO_FLAG_WRITE
        self.regions = {i: Region(0, 0) for i in range(wire.PCI_NUM_REGIONS)}
        self.regions[regs.BAR_REGS] = Region(regs.REGS_SIZE, rw)
        self.regions[regs.BAR_MSIX] = Region(regs.MSIX_BAR_SIZE, rw)
        self.regions[wire.PCI_CONFIG_REGION] = Region(len(self.config.data), rw)

    # lifetime: the shared state needs no thread
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def close(self) -> None:
        self.irqs.close_all()

    # client events
    def connect(self, conn) -> None:
        self._conn = conn
        self.state.input(Input.CONNECT, self.host)

    def disconnect(self) -> None:
        self.state.input(Input.DISCONNECT, self.host)
        self._conn = None

    def dma_map(self, iova: int, size: int, flags: int, fd: int | None, offset: int):
        return self._conn.table.map(iova, size, flags, fd, offset)

    def dma_unmap(self, iova: int, size: int, everything: bool) -> int:
        table = self._conn.table
        return table.unmap_all() if everything else table.unmap(iova, size)

    def reset(self, *, function_level: bool = False) -> None:
        if function_level:
            with self._local:
                self.config.reset()
                self.msix.reset()
        self.state.input(Input.RESET, self.host)

    # regions
    def region_read(self, index: int, offset: int, count: int):
        if index == regs.BAR_REGS:
            return read_bytes(lambda reg: self.state.input(Input.READ, self.host, reg), offset, count)
        if index == regs.BAR_MSIX:
            with self._local:
                return self.msix.read(offset, count)
        if index == wire.PCI_CONFIG_REGION:
            with self._local:
                return self.config.read(offset, count)
        raise AssertionError(f"region {index} has no data")

    def region_write(self, index: int, offset: int, data) -> None:
        if index == regs.BAR_REGS:
            for reg, value, mask in split_write(offset, bytes(data)):
                self.state.input(Input.WRITE, self.host, reg, value, mask)
        elif index == regs.BAR_MSIX:
            with self._local:
                self.msix.write(offset, data)
        elif index == wire.PCI_CONFIG_REGION:
            with self._local:
                flr = self.config.write(offset, data)
            if flr:
                self.reset(function_level=True)


class SmcController:
    """N host ports over one state, each served on its own socket by its own server thread."""

    def __init__(self, sockets: list[str], *, partial_timeout: float = 2.0):
        self.ports: list[SmcHostPort] = []
        self.state = SmcState(len(sockets), self._raise)
        self.ports = [SmcHostPort(self.state, h) for h in range(len(sockets))]
        self.servers = [VfioUserServer(path, port, partial_timeout=partial_timeout)
                        for path, port in zip(sockets, self.ports)]
        self._threads: list[threading.Thread] = []

    def _raise(self, host: int, vector: int) -> None:
        self.ports[host].irqs.raise_msix(vector)

    def listen(self) -> None:
        """Listen on every socket; on failure nothing stays listening."""
        try:
            for server in self.servers:
                server.listen()
        except BaseException:
            for server in self.servers:
                server.close()
            raise

    def start(self) -> None:
        for h, server in enumerate(self.servers):
            t = threading.Thread(target=server.serve_forever, name=f"smc-host{h}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 5.0) -> None:
        for server in self.servers:
            server.stop()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def close(self) -> None:
        self.stop()
        for server in self.servers:
            server.close()
        for port in self.ports:
            port.close()
