"""vfio-user rules the device used to bend (item 6), and a client that truncates a
file it handed over (item 5).  Each test names the rule (QEMU docs/interop/vfio-user.rst
or docs/gpu-device.md) it checks."""

import errno
import fcntl
import os
import socket
import subprocess
import sys

import pytest
from vfio_user_client import DATA_IOVA, Rig, gpu_server  # noqa: F401

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.gpu.regs import DESC_FLAG_INTERRUPT as IRQ, Op, Status, pack_descriptor
from vfio_cxl.devices.vfio_user import wire

F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)


def memfd(size: int, *, sealed: bool = False) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0))
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)
    return fd


def test_exact_remap_is_eexist(gpu_server):
    """DMA_MAP: "a command to map over an existing region must be failed with EEXIST"."""
    c = gpu_server.client()
    fd = memfd(1 << 20)
    try:
        assert c.dma_map(0x100000, 1 << 20, fd=fd).ok
        assert c.dma_map(0x100000, 1 << 20, fd=fd).errno == errno.EEXIST
        assert c.dma_map(0x100000, 1 << 20).errno == errno.EEXIST
    finally:
        os.close(fd)


def test_unmap_all_with_an_address_or_size_is_einval(gpu_server):
    """DMA_UNMAP: VFIO_DMA_UNMAP_FLAG_ALL requires address and size 0."""
    c = gpu_server.client()
    assert c.dma_map(0x100000, 1 << 20).ok
    for addr, size in ((0x100000, 0), (0, 1 << 20), (0x100000, 1 << 20)):
        assert c.dma_unmap(addr, size, wire.DMA_UNMAP_FLAG_ALL).errno == errno.EINVAL
    assert len(gpu_server.server._conn.table) == 1
    assert c.dma_unmap(0, 0, wire.DMA_UNMAP_FLAG_ALL).ok
    assert len(gpu_server.server._conn.table) == 0


@pytest.mark.parametrize("kind", ["pipe", "too-short", "socket"])
def test_an_fd_that_cannot_serve_dma_is_refused_not_downgraded(gpu_server, kind):
    """docs/gpu-device.md: a DMA_MAP fd that can be neither mapped nor read is EINVAL."""
    c = gpu_server.client()
    if kind == "pipe":
        r, w = os.pipe()
        fds = [r, w]
    elif kind == "socket":
        a, b = socket.socketpair()
        fds = [a.detach(), b.detach()]
    else:
        fds = [memfd(4096, sealed=True)]
    try:
        assert c.dma_map(0x100000, 1 << 20, fd=fds[0]).errno == errno.EINVAL
        assert len(gpu_server.server._conn.table) == 0
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("size", [1024, 1000])
def test_the_clients_max_data_xfer_size_is_honoured_as_given(gpu_server, size):
    """VERSION: DMA_READ/WRITE "count must not exceed the peer's max_data_xfer_size"
    -- also below 4096 (the device used to raise it)."""
    rig = Rig(gpu_server, direct=False, max_data_xfer_size=size)
    try:
        rig.submit([pack_descriptor(Op.FILL_PRNG, 3, 0, 10_000),
                    pack_descriptor(Op.VRAM_TO_HOST, 0, DATA_IOVA, 10_000),
                    pack_descriptor(Op.HOST_TO_VRAM, DATA_IOVA, 20_000, 10_000, IRQ)])
        rig.wait_vector(regs.VEC_DMA_DONE)
        assert rig.host(DATA_IOVA, 10_000) == regs.prng_bytes(3, 10_000)
        stats = rig.client.stats
        assert 0 < stats.max_write <= size and 0 < stats.max_read <= size
    finally:
        rig.close()


@pytest.mark.parametrize("value", [0, -5, "big", 1.5])
def test_a_nonsense_max_data_xfer_size_is_einval(gpu_server, value):
    c = gpu_server.client(negotiate=False)
    reply = c.request(wire.VERSION, wire.version_payload(0, 0, {"max_data_xfer_size": value}))
    assert reply.errno == errno.EINVAL


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed-pread", "sealed-mmap"])
def test_truncating_a_handed_over_file_is_a_dma_error_not_a_crash(tmp_path, sealed):
    """Item 5: the client truncates the memfd behind a direct mapping.  Unsealed: the
    device uses pread/pwrite and reports DMA_IO_ERROR (EFAULT); sealed (F_SEAL_SHRINK):
    the truncation itself fails.  The server runs as its own process: a SIGBUS would
    kill it, and the test would see it die."""
    from vfio_cxl.devices.vfio_user.client import GuestMemory, VfioUserClient, wait_eventfd
    sock = tmp_path / "gpu.sock"
    proc = subprocess.Popen([sys.executable, "-m", "vfio_cxl.devices.gpu", "serve", "--socket", str(sock),
                             "--vram-mib", "16"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == f"READY {sock}"
        memory = GuestMemory()
        ring = memory.add(0x1000_0000, 64 * 64, shared=True)
        c = VfioUserClient(str(sock), memory, timeout=5)
        try:
            c.negotiate()
            c.map_area(ring)
            fd = memfd(4 << 20, sealed=sealed)
            assert c.dma_map(DATA_IOVA, 4 << 20, fd=fd).ok
            if sealed:
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 4096)
            else:
                os.ftruncate(fd, 4096)  # 4 KiB left of 4 MiB
            efds = c.attach_msix(regs.MSIX_VECTORS)
            c.set_bus_master()
            for reg, value in ((regs.REG_RING_BASE_LO, 0x1000_0000), (regs.REG_RING_SIZE, 64),
                               (regs.REG_COMPL_BASE_LO, 0x1000_0000 + 32 * 64),
                               (regs.REG_CONTROL, regs.CONTROL_ENABLE)):
                c.reg_write(reg, value)
            ring.view[:64] = (pack_descriptor(Op.VRAM_TO_HOST, 0, DATA_IOVA, 1 << 20, IRQ, 1)
                              + pack_descriptor(Op.HOST_TO_VRAM, DATA_IOVA, 0, 1 << 20, IRQ, 2))
            c.reg_write(regs.REG_RING_TAIL, 1 if not sealed else 2)
            if sealed:
                assert wait_eventfd(efds[regs.VEC_DMA_DONE], 5)
                assert c.reg_read(regs.REG_ERR_STATUS) == 0
            else:
                assert wait_eventfd(efds[regs.VEC_ERROR], 5), "no error vector"
                assert (c.reg_read(regs.REG_ERR_STATUS), c.reg_read(regs.REG_ERR_ERRNO),
                        c.reg_read(regs.REG_ERR_ADDR_LO)) == (Status.DMA_IO_ERROR, errno.EFAULT,
                                                              DATA_IOVA + 4096)
                rec = regs.unpack_completion(ring.view[32 * 64:32 * 65])
                assert (rec["status"], rec["bytes_done"]) == (Status.DMA_IO_ERROR, 4096)
            assert proc.poll() is None, "the server died"
            for e in efds:
                os.close(e)
            os.close(fd)
        finally:
            c.close()
            memory.close()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0, "the server did not exit cleanly"
        proc.stdout.close()
