"""Fixtures of the vfio-user conformance suite.

The GPU server runs as a child process started through its CLI
(``vfio-cxl gpu serve --socket PATH --local-dma-faults``: the spec's rule that
DMA names only exported addresses, without the device's fault reports, which
test_fault_report.py checks as the departure they are), one per test module; each test talks
to it over a real UNIX socket with the independent client of
``vfio_cxl.bench.vfio_user_spec``.  After every test the server must still be
alive (a client must never be able to kill the device); if it died, that test
errors with the server's stderr and the next test gets a fresh server.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from vfio_cxl.bench import gpu_doc as gpu
from vfio_cxl.bench import vfio_user_spec as vu

TIMEOUT = 5.0
RING_IOVA = 0x1000_0000
COMPL_IOVA = 0x1010_0000
DATA_IOVA = 0x2000_0000
PCI_COMMAND = 0x04  # config space command register (u16)
PCI_COMMAND_MEMORY = 1 << 1
PCI_COMMAND_MASTER = 1 << 2


class Server:
    """The server process shared by one module's tests."""

    def __init__(self, extra=("--local-dma-faults",)):
        self.dir = tempfile.mkdtemp(prefix="vfio-cxl-conf-")
        self.path = os.path.join(self.dir, "gpu.sock")
        self.proc = vu.ServerProcess(self.path, vram_mib=16, extra=extra)
        self.proc.start()

    def ensure(self) -> None:
        if not self.proc.alive():
            self.proc.stop()
            self.proc.start()

    def connect(self, timeout: float = TIMEOUT) -> vu.Peer:
        return vu.Peer(self.path, timeout=timeout)

    def close(self) -> None:
        self.proc.stop()
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


@pytest.fixture(scope="module")
def server():
    srv = Server()
    yield srv
    srv.close()


@pytest.fixture
def gpu_server(server):
    """The module's server, alive at the start and (checked) at the end of the test."""
    server.ensure()
    yield server
    if not server.proc.alive():
        code = server.proc.exit_status()
        tail = server.proc.stderr_tail()
        pytest.fail(f"the server died during this test (exit status {code}); stderr:\n{tail}")


@pytest.fixture
def raw(gpu_server):
    """A connected client that has sent nothing yet."""
    peer = gpu_server.connect()
    yield peer
    peer.close()


@pytest.fixture
def peer(gpu_server):
    """A client after a successful VERSION handshake (and a device reset)."""
    p = gpu_server.connect()
    reply = p.handshake()
    assert reply.is_reply and not reply.is_error, f"VERSION failed: {reply!r}"
    reset = p.request(vu.DEVICE_RESET)
    assert not reset.is_error, f"DEVICE_RESET failed: {reset!r}"
    yield p
    p.close()


def assert_error_reply(reply: vu.Msg, command: int, msg_id: int | None = None) -> None:
    """An error reply as the spec defines it: "If an error occurs, the reply
    message must only include the reply header"."""
    assert reply.is_reply, f"expected a reply, got {reply!r}"
    assert reply.command == command, f"reply for command {reply.command}, sent {command}"
    if msg_id is not None:
        assert reply.msg_id == msg_id
    assert reply.is_error, f"expected an error reply, got success {reply!r}"
    assert reply.size == vu.HEADER_SIZE and reply.payload == b"", \
        f"error reply carries {len(reply.payload)} payload bytes: {reply!r}"
    assert not reply.fds, "error reply carries file descriptors"


def assert_ok_reply(reply: vu.Msg, command: int) -> None:
    assert reply.is_reply and reply.command == command, f"not a reply to {command}: {reply!r}"
    assert not reply.is_error, f"error reply (errno {reply.error}) to command {command}"
    assert reply.size == vu.HEADER_SIZE + len(reply.payload)


def expect_closed(peer: vu.Peer, timeout: float = 3.0) -> list[vu.Msg]:
    """Read until the server closes the connection; the messages seen before."""
    seen = []
    try:
        while True:
            seen.append(peer.recv(timeout))
    except vu.PeerClosed:
        return seen
    except vu.PeerTimeout:
        raise AssertionError(f"the server kept the connection open for {timeout} s "
                             f"(messages seen: {seen})") from None


def fresh_client_works(server: Server) -> None:
    """The spec's disconnect rule implies the next client is served: handshake + a read."""
    with server.connect() as p:
        reply = p.handshake()
        assert_ok_reply(reply, vu.VERSION)
        assert p.read32(gpu.ID) == gpu.ID_VALUE


class Rig:
    """A descriptor ring of the GPU (docs/gpu-device.md) set up over one client."""

    def __init__(self, peer: vu.Peer, entries: int = 16, direct: bool = True,
                 bus_master: bool = True):
        self.peer = peer
        # PCI command register: memory space + bus master enable (a driver sets both)
        command = PCI_COMMAND_MEMORY | (PCI_COMMAND_MASTER if bus_master else 0)
        assert_ok_reply(peer.region_write(vu.PCI_CONFIG_REGION, PCI_COMMAND,
                                          command.to_bytes(2, "little")), vu.REGION_WRITE)
        self.entries = entries
        size = max(vu.PAGE, entries * gpu.DESC_SIZE)
        self.ring = vu.Window(RING_IOVA, size, direct=direct, name="ring")
        self.compl = vu.Window(COMPL_IOVA, size, direct=direct, name="compl")
        for w in (self.ring, self.compl):
            assert_ok_reply(peer.dma_map(w), vu.DMA_MAP)
        self.efds = [vu.new_eventfd() for _ in range(gpu.MSIX_VECTORS)]
        assert_ok_reply(peer.set_irqs(vu.PCI_MSIX_IRQ, 0, gpu.MSIX_VECTORS,
                                      vu.IRQ_SET_DATA_EVENTFD | vu.IRQ_SET_ACTION_TRIGGER,
                                      fds=self.efds), vu.DEVICE_SET_IRQS)
        self.irq_counts = [0] * gpu.MSIX_VECTORS
        peer.write32(gpu.RING_BASE_LO, RING_IOVA & 0xFFFFFFFF)
        peer.write32(gpu.RING_BASE_HI, RING_IOVA >> 32)
        peer.write32(gpu.RING_SIZE, entries)
        peer.write32(gpu.COMPL_BASE_LO, COMPL_IOVA & 0xFFFFFFFF)
        peer.write32(gpu.COMPL_BASE_HI, COMPL_IOVA >> 32)
        peer.write32(gpu.CONTROL, gpu.CONTROL_ENABLE)
        assert peer.read32(gpu.STATUS) & gpu.STATUS_ENABLED, "ring did not enable"
        self.tail = 0

    def submit(self, *descs: bytes) -> int:
        """Write descriptors at TAIL and ring the doorbell (a posted write, as QEMU does)."""
        for d in descs:
            self.ring.write(RING_IOVA + self.tail * gpu.DESC_SIZE, d)
            self.tail = (self.tail + 1) % self.entries
        self.peer.write32(gpu.RING_TAIL, self.tail, posted=True)
        return self.tail

    def _take_irqs(self) -> None:
        for v, fd in enumerate(self.efds):
            self.irq_counts[v] += vu.eventfd_take(fd)

    def wait_irq(self, vector: int, timeout: float = 10.0) -> None:
        """Serve DMA requests until MSI-X ``vector`` fires."""
        def fired():
            self._take_irqs()
            return self.irq_counts[vector] > 0
        self.peer.pump(fired, timeout, poll_fds=self.efds)
        self.irq_counts[vector] -= 1

    def wait_idle(self, timeout: float = 10.0) -> int:
        """Serve DMA until HEAD == TAIL or the ring halted; returns STATUS."""
        state = {}

        def settled():
            status = self.peer.read32(gpu.STATUS)
            state["status"] = status
            return (status & gpu.STATUS_HALTED
                    or self.peer.read32(gpu.RING_HEAD) == self.tail and not status & gpu.STATUS_BUSY)
        self.peer.pump(settled, timeout)
        return state["status"]

    def completion(self, index: int) -> tuple:
        return gpu.COMPL.unpack(self.compl.read(COMPL_IOVA + index * gpu.COMPL_SIZE,
                                                gpu.COMPL_SIZE))

    def close(self) -> None:
        for fd in self.efds:
            os.close(fd)
        self.efds = []
