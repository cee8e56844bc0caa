"""Test harness: a vfio-user client that plays QEMU against the GPU server.

The protocol work (version negotiation, info queries, region access,
SET_IRQS with eventfds over SCM_RIGHTS, DMA_MAP with a memfd, answering the
server's DMA_READ / DMA_WRITE from local buffers, DMA_UNMAP, reset) is in
``vfio_cxl.devices.vfio_user.client`` so the benchmark can use it too; this module adds
what tests need on top: an in-process server, a ready-made ring ("rig"),
leak checks and fixtures.  Wire layouts are pinned independently by
test_gpu_wire.py, so client and server cannot agree on a wrong format.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import pytest

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.vfio_user.client import (  # noqa: F401  (re-exported for the tests)
    Area, GuestMemory, Reply, VfioUserClient, eventfd_count, wait_eventfd,
)
from vfio_cxl.devices.gpu.device import GpuDevice
from vfio_cxl.devices.vfio_user.server import VfioUserServer

TEST_VRAM = 16 * regs.MIB
RING_IOVA = 0x1000_0000
DATA_IOVA = 0x2000_0000
TIMEOUT = 5.0


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


@contextmanager
def no_leaks():
    """Fail if the block leaves threads running or file descriptors open."""
    threads_before = set(threading.enumerate())
    fds_before = open_fds()
    yield
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        if not extra:
            break
        time.sleep(0.01)
    assert not extra, f"threads left running: {[t.name for t in extra]}"
    leaked = open_fds() - fds_before
    # an fd that closed between listdir and the check shows up as a dangling number
    leaked = {fd for fd in leaked if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not leaked, "fds left open: " + ", ".join(
        f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}" for fd in sorted(leaked))


class ServerThread:
    """A VfioUserServer serving the GPU from a background thread of this process."""

    def __init__(self, directory, *, vram_size: int = TEST_VRAM, partial_timeout: float = 0.3,
                 dma_timeout: float = 2.0, vendor_id: int = regs.PCI_VENDOR_ID,
                 device_id: int = regs.PCI_DEVICE_ID, irq_mode: str = "msix",
                 local_dma_faults: bool = False):
        self.path = os.path.join(os.fspath(directory), "gpu.sock")
        self.device = GpuDevice(vram_size, vendor_id, device_id, irq_mode=irq_mode,
                                local_dma_faults=local_dma_faults)
        self.server = VfioUserServer(self.path, self.device, partial_timeout=partial_timeout,
                                dma_timeout=dma_timeout)
        self.server.listen()
        self.thread = threading.Thread(target=self.server.serve_forever, name="gpu-server")
        self.thread.start()
        self.clients: list[VfioUserClient] = []

    def client(self, memory: GuestMemory | None = None, *, negotiate: bool = True,
               **caps) -> VfioUserClient:
        c = VfioUserClient(self.path, memory, timeout=TIMEOUT)
        self.clients.append(c)
        if negotiate:
            c.negotiate(**caps)
        return c

    def wait_idle(self, timeout: float = TIMEOUT) -> None:
        """Until the server has dropped its current client (it serves one at a time)."""
        deadline = time.monotonic() + timeout
        while self.server._conn is not None:
            assert time.monotonic() < deadline, "server still holds the previous client"
            time.sleep(0.005)

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        self.server.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "server thread did not stop"
        self.server.close()
        self.device.close()


class Rig:
    """A negotiated client with guest memory, four MSI-X eventfds and an enabled ring.

    ``direct=True`` puts ring, completions and data in memfds passed with
    DMA_MAP (the server copies itself); ``direct=False`` maps the same IOVAs
    without fds, so every byte goes through DMA_READ / DMA_WRITE messages.
    """

    def __init__(self, srv: ServerThread, *, direct: bool, entries: int = 128,
                 data_size: int = 8 * regs.MIB, **caps):
        self.memory = GuestMemory()
        self.entries = entries
        ring_bytes = entries * regs.DESC_SIZE
        # whole 4 KiB pages: the server refuses DMA_MAPs that are not page-aligned
        self.ring = self.memory.add(RING_IOVA, -(-ring_bytes * 2 // 4096) * 4096, shared=direct)
        self.compl_iova = RING_IOVA + ring_bytes
        self.data = self.memory.add(DATA_IOVA, data_size, shared=direct)
        self.client = srv.client(self.memory, **caps)
        self.client.map_area(self.ring, direct=direct)
        self.client.map_area(self.data, direct=direct)
        self.efds = self.client.attach_msix(regs.MSIX_VECTORS)
        self.tail = 0
        self.program()

    def program(self) -> None:
        c = self.client
        c.reg_write(regs.REG_CONTROL, regs.CONTROL_RESET)  # whatever an earlier client left
        c.set_bus_master()
        c.reg_write(regs.REG_RING_BASE_LO, RING_IOVA & 0xFFFFFFFF)
        c.reg_write(regs.REG_RING_BASE_HI, RING_IOVA >> 32)
        c.reg_write(regs.REG_RING_SIZE, self.entries)
        c.reg_write(regs.REG_COMPL_BASE_LO, self.compl_iova & 0xFFFFFFFF)
        c.reg_write(regs.REG_COMPL_BASE_HI, self.compl_iova >> 32)
        c.reg_write(regs.REG_CONTROL, regs.CONTROL_ENABLE)
        self.tail = 0

    def put(self, index: int, desc: bytes) -> None:
        off = (index % self.entries) * regs.DESC_SIZE
        self.ring.view[off:off + regs.DESC_SIZE] = desc

    def submit(self, descs: list[bytes], *, posted: bool = False) -> list[int]:
        """Queue descriptors and ring the doorbell once; returns their indices."""
        indices = []
        for d in descs:
            self.put(self.tail, d)
            indices.append(self.tail)
            self.tail = (self.tail + 1) % self.entries
        self.client.reg_write(regs.REG_RING_TAIL, self.tail, posted=posted)
        return indices

    def wait_vector(self, vector: int, timeout: float = TIMEOUT) -> int:
        count = wait_eventfd(self.efds[vector], timeout)
        assert count, (f"MSI-X vector {vector} did not fire within {timeout}s; "
                       f"STATUS={self.client.reg_read(regs.REG_STATUS):#x} "
                       f"HEAD={self.client.reg_read(regs.REG_RING_HEAD)} "
                       f"ERR={self.client.reg_read(regs.REG_ERR_STATUS)}")
        return count

    def wait_head(self, head: int, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.client.reg_read(regs.REG_RING_HEAD) != head:
            assert time.monotonic() < deadline, f"ring head never reached {head}"
            time.sleep(0.002)

    def completion(self, index: int) -> dict:
        off = self.compl_iova - RING_IOVA + index * regs.COMPL_SIZE
        return regs.unpack_completion(self.ring.view[off:off + regs.COMPL_SIZE])

    def host(self, iova: int, length: int) -> bytes:
        return bytes(self.memory.view(iova, length))

    def close(self) -> None:
        for fd in self.efds:
            os.close(fd)
        self.efds = []
        self.client.close()
        self.memory.close()


@pytest.fixture
def gpu_server(tmp_path):
    """An in-process server (16 MiB VRAM, short timeouts); checks for leaks after."""
    with no_leaks():
        srv = ServerThread(tmp_path)
        try:
            yield srv
        finally:
            srv.stop()
        assert srv.server.internal_errors == 0, "the server logged internal errors"
