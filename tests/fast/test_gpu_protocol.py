"""Session set-up and the device's identity: version, info, regions, IRQs, BAR0."""

import errno
import mmap
import os

import pytest
from vfio_user_client import ServerThread, TEST_VRAM, gpu_server, no_leaks  # noqa: F401

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.vfio_user import wire


def test_version_negotiation_reports_server_limits(gpu_server):
    c = gpu_server.client(negotiate=False)
    caps = c.negotiate(max_data_xfer_size=1 << 20)
    assert caps == {"max_msg_fds": 8, "max_data_xfer_size": 1 << 20}


def test_requests_before_version_are_refused(gpu_server):
    c = gpu_server.client(negotiate=False)
    reply = c.request(wire.DEVICE_GET_INFO, wire.DEVICE_INFO.pack(16, 0, 0, 0))
    assert reply.errno == errno.EINVAL
    c.negotiate()
    assert c.device_info()[2] == 9


def test_second_version_and_wrong_major_are_refused(gpu_server):
    """A major the server cannot support: error reply, then the connection closes
    (vfio-user "Connection Initiation"); a second VERSION is refused."""
    c = gpu_server.client(negotiate=False)
    reply = c.request(wire.VERSION, wire.version_payload(1, 0, {}))
    assert reply.errno == errno.ENOTSUP
    assert c.closed.wait(5), "the server kept the connection after an unsupported major"
    gpu_server.wait_idle()
    c = gpu_server.client()
    assert c.request(wire.VERSION, wire.version_payload(0, 0, {})).errno == errno.EINVAL


def test_device_info_is_a_resettable_pci_device(gpu_server):
    argsz, flags, regions, irqs = gpu_server.client().device_info()
    assert argsz == 16
    assert flags == wire.DEVICE_FLAGS_RESET | wire.DEVICE_FLAGS_PCI
    assert (regions, irqs) == (9, 5)


@pytest.mark.parametrize("index,size,flags", [
    (0, regs.REGS_SIZE, 3), (1, 0, 0), (3, 0, 0), (4, regs.MSIX_BAR_SIZE, 3),
    (5, 0, 0), (6, 0, 0), (7, 4096, 3), (8, 0, 0),
])
def test_trapped_and_absent_regions(gpu_server, index, size, flags):
    info, raw, fds = gpu_server.client().region_info(index)
    assert fds == []
    assert (info["index"], info["size"], info["flags"], info["argsz"]) == (index, size, flags, 32)


def test_vram_region_is_mmappable_through_its_fd_with_a_sparse_cap(gpu_server):
    c = gpu_server.client()
    info, raw, fds = c.region_info(regs.BAR_VRAM)
    try:
        flags = (wire.REGION_INFO_FLAG_READ | wire.REGION_INFO_FLAG_WRITE
                 | wire.REGION_INFO_FLAG_MMAP | wire.REGION_INFO_FLAG_CAPS)
        assert info["flags"] == flags and info["size"] == TEST_VRAM
        assert info["argsz"] == len(raw) == 64 and info["cap_offset"] == 32
        cap_id, version, nxt = wire.CAP_HEADER.unpack_from(raw, 32)
        assert (cap_id, version, nxt) == (wire.REGION_INFO_CAP_SPARSE_MMAP, 1, 0)
        assert wire.SPARSE_MMAP.unpack_from(raw, 40) == (1, 0)
        assert wire.SPARSE_AREA.unpack_from(raw, 48) == (0, TEST_VRAM)
        assert len(fds) == 1
        # what QEMU does: mmap the fd at info.offset + area.offset; the guest CPU's
        # stores land in the server's VRAM without a message
        mm = mmap.mmap(fds[0], TEST_VRAM, offset=info["offset"])
        mm[4096:4100] = b"GPU!"
        assert bytes(gpu_server.device.vram[4096:4100]) == b"GPU!"
        assert c.read(regs.BAR_VRAM, 4096, 4) == b"GPU!"  # and via REGION_READ
        c.write(regs.BAR_VRAM, 8192, b"back")
        assert mm[8192:8196] == b"back"
        mm.close()
    finally:
        for fd in fds:
            os.close(fd)


def test_region_info_with_small_argsz_is_cut_but_reports_full_size(gpu_server):
    # QEMU first asks with argsz 32, then again with the argsz the reply named
    info, raw, fds = gpu_server.client().region_info(regs.BAR_VRAM, argsz=32)
    for fd in fds:
        os.close(fd)
    assert len(raw) == 32 and info["argsz"] == 64


def test_region_info_bad_index_and_short_argsz(gpu_server):
    c = gpu_server.client()
    assert c.request(wire.DEVICE_GET_REGION_INFO,
                     wire.REGION_INFO.pack(32, 0, 9, 0, 0, 0)).errno == errno.EINVAL
    assert c.request(wire.DEVICE_GET_REGION_INFO,
                     wire.REGION_INFO.pack(16, 0, 0, 0, 0, 0)).errno == errno.EINVAL
    assert c.request(wire.DEVICE_GET_REGION_INFO, b"\0" * 8).errno == errno.EINVAL


def test_irq_info(gpu_server):
    c = gpu_server.client()
    info = {i: c.irq_info(i) for i in range(5)}
    assert info[wire.PCI_MSIX_IRQ] == (16, wire.IRQ_INFO_EVENTFD | wire.IRQ_INFO_NORESIZE,
                                       2, regs.MSIX_VECTORS)
    assert info[wire.PCI_ERR_IRQ][3] == 1  # quiets QEMU's "error recovery" warning
    assert info[wire.PCI_INTX_IRQ][3] == 0 and info[wire.PCI_MSI_IRQ][3] == 0
    assert c.request(wire.DEVICE_GET_IRQ_INFO, wire.IRQ_INFO.pack(16, 0, 5, 0)).errno == errno.EINVAL


def test_bar0_identity_registers(gpu_server):
    c = gpu_server.client()
    assert c.reg_read(regs.REG_ID) == regs.ID_MAGIC
    assert c.reg_read(regs.REG_VERSION) == regs.DEVICE_VERSION
    size = c.reg_read(regs.REG_VRAM_SIZE_LO) | c.reg_read(regs.REG_VRAM_SIZE_HI) << 32
    assert size == TEST_VRAM
    assert c.reg_read(regs.REG_CAPS) == regs.CAPS_OPS
    assert c.reg_read(regs.REG_RING_MAX) == regs.RING_SIZE_MAX


def test_bar0_reads_every_register_at_its_reset_value(gpu_server):
    c = gpu_server.client()
    for offset, value in regs.reset_values(TEST_VRAM).items():
        assert c.reg_read(offset) == value, hex(offset)
    assert c.reg_read(0xFFC) == 0  # unassigned reads 0


def test_bar0_writes_partial_and_wide(gpu_server):
    c = gpu_server.client()
    c.reg_write(regs.REG_SCRATCH, 0xA5A5F00D)
    assert c.reg_read(regs.REG_SCRATCH) == 0xA5A5F00D
    c.write(0, regs.REG_SCRATCH + 1, b"\x11")  # one byte: the others keep their value
    assert c.reg_read(regs.REG_SCRATCH) == 0xA5A511 << 8 | 0x0D
    c.write(0, regs.REG_RING_BASE_LO, (0x1234_5678_9ABC_DE00).to_bytes(8, "little"))
    assert c.read(0, regs.REG_RING_BASE_LO, 8) == (0x1234_5678_9ABC_DE00).to_bytes(8, "little")
    c.reg_write(regs.REG_ID, 0)  # read-only: ignored
    assert c.reg_read(regs.REG_ID) == regs.ID_MAGIC
    c.reg_write(regs.REG_SCRATCH, 7, posted=True)  # posted (no-reply) write lands too
    assert c.reg_read(regs.REG_SCRATCH) == 7


def test_msix_bar_table_is_storage_and_pba_reads_zero(gpu_server):
    c = gpu_server.client()
    assert c.read(regs.BAR_MSIX, 12, 4) == b"\1\0\0\0"  # vector control: masked at reset
    c.write(regs.BAR_MSIX, 0, b"\x00\x10\xe0\xfe\0\0\0\0\x41\0\0\0\0\0\0\0")
    assert c.read(regs.BAR_MSIX, 0, 16)[8] == 0x41
    assert c.read(regs.BAR_MSIX, regs.MSIX_PBA_OFFSET, 8) == bytes(8)


def test_custom_pci_ids_and_vram_size(tmp_path):
    with no_leaks():
        srv = ServerThread(tmp_path, vendor_id=0x1AF4, device_id=0x10F0, vram_size=2 * regs.MIB)
        try:
            c = srv.client()
            assert c.config_read(0, 4) == bytes.fromhex("f41af010")
            assert c.reg_read(regs.REG_VRAM_SIZE_LO) == 2 * regs.MIB
        finally:
            srv.stop()


def test_vram_size_must_be_a_power_of_two():
    from vfio_cxl.devices.gpu.device import GpuDevice
    with pytest.raises(ValueError):
        GpuDevice(3 * regs.MIB)
