"""PCI config space as QEMU and the guest kernel see and poke it."""

import struct

from vfio_user_client import TEST_VRAM, gpu_server  # noqa: F401

from vfio_cxl.devices.gpu import regs


def u16(raw, off):
    return struct.unpack_from("<H", raw, off)[0]


def u32(raw, off):
    return struct.unpack_from("<I", raw, off)[0]


def test_identity_class_and_header(gpu_server):
    cfg = gpu_server.client().config_read(0, 4096)  # QEMU reads it whole at realize
    assert len(cfg) == 4096
    assert (u16(cfg, 0), u16(cfg, 2)) == (0x0601, 0x1991)
    assert cfg[8] == regs.PCI_REVISION
    assert int.from_bytes(cfg[9:12], "little") == 0x030200  # 3D controller
    assert cfg[0x0E] == 0  # type-0 header, single function
    assert u16(cfg, 6) & 0x10  # capability list present
    assert (u16(cfg, 0x2C), u16(cfg, 0x2E)) == (regs.PCI_SUBSYSTEM_VENDOR_ID, regs.PCI_SUBSYSTEM_ID)
    assert cfg[0x3D] == 0  # no INTx pin: MSI-X only
    assert u32(cfg, 0x100) == 0  # no extended capabilities


def test_capability_list_is_pcie_endpoint_then_msix(gpu_server):
    cfg = gpu_server.client().config_read(0, 256)
    caps, pos = {}, cfg[0x34]
    while pos:
        assert pos >= 0x40 and pos % 4 == 0 and pos not in caps
        caps[cfg[pos]] = pos
        pos = cfg[pos + 1]
    assert list(caps) == [0x10, 0x11]
    exp = caps[0x10]
    assert u16(cfg, exp + 2) & 0xF == 2 and (u16(cfg, exp + 2) >> 4) & 0xF == 0  # v2 endpoint
    assert u32(cfg, exp + 4) & (1 << 28)  # function-level reset supported
    msix = caps[0x11]
    assert u16(cfg, msix + 2) & 0x7FF == regs.MSIX_VECTORS - 1
    assert u32(cfg, msix + 4) == regs.MSIX_TABLE_OFFSET | regs.BAR_MSIX
    assert u32(cfg, msix + 8) == regs.MSIX_PBA_OFFSET | regs.BAR_MSIX


def test_bar_type_bits(gpu_server):
    cfg = gpu_server.client().config_read(0x10, 24)
    assert u32(cfg, 0) == 0  # BAR0: 32-bit memory
    assert u32(cfg, 8) == 0xC  # BAR2: 64-bit prefetchable memory
    assert u32(cfg, 16) == 0  # BAR4: 32-bit memory
    assert u32(cfg, 4) == u32(cfg, 20) == 0  # BAR1, BAR5 unimplemented


def test_bar_sizing_with_all_ones(gpu_server):
    c = gpu_server.client()
    for bar in range(6):
        c.config_write(0x10 + 4 * bar, b"\xff\xff\xff\xff")
    got = [u32(c.config_read(0x10 + 4 * bar, 4), 0) for bar in range(6)]
    vram_mask = ~(TEST_VRAM - 1) & 0xFFFFFFFF
    assert got == [0xFFFFF000, 0, vram_mask | 0xC, 0xFFFFFFFF, 0xFFFFF000, 0]
    c.config_write(0x18, struct.pack("<II", 0xE000_0000, 0x1))  # program an address
    assert c.config_read(0x18, 8) == struct.pack("<II", 0xE000_000C, 0x1)


def test_rom_bar_is_absent(gpu_server):
    c = gpu_server.client()
    c.config_write(0x30, struct.pack("<I", 0xFFFFF800))
    assert c.config_read(0x30, 4) == bytes(4)


def test_command_register_keeps_only_implemented_bits(gpu_server):
    c = gpu_server.client()
    c.config_write(4, b"\x06\x00")  # memory + bus master
    assert u16(c.config_read(4, 2), 0) == 0x0006
    c.config_write(4, b"\xff\xff")
    assert u16(c.config_read(4, 2), 0) == 0x0546
    c.config_write(0, b"\xff\xff\xff\xff")  # IDs are read-only
    assert c.config_read(0, 4) == bytes.fromhex("01069119")


def test_msix_enable_and_function_mask_are_writable(gpu_server):
    c = gpu_server.client()
    cfg = c.config_read(0, 256)
    msix = cfg[0x34]
    while cfg[msix] != 0x11:
        msix = cfg[msix + 1]
    c.config_write(msix + 2, struct.pack("<H", 0xFFFF))
    assert u16(c.config_read(msix + 2, 2), 0) == 0xC000 | (regs.MSIX_VECTORS - 1)
    assert gpu_server.device.config.msix_enabled


def test_flr_resets_config_and_registers(gpu_server):
    c = gpu_server.client()
    c.config_write(4, b"\x06\x00")
    c.reg_write(regs.REG_SCRATCH, 0x55)
    devctl = 0x40 + 8
    c.config_write(devctl, struct.pack("<H", 0x8000 | 0x2810))  # initiate FLR
    assert u16(c.config_read(4, 2), 0) == 0
    assert u16(c.config_read(devctl, 2), 0) == 0x2810  # FLR bit reads 0
    assert c.reg_read(regs.REG_SCRATCH) == 0


def test_msi_mode_has_an_msi_capability_and_no_bar4(tmp_path):
    """--irq-mode msi: MSI capability at 0x80 (64-bit, 4 vectors capable), VFIO IRQ
    index 1 with 4 vectors, MSI-X index 0 vectors, BAR4 absent; a vector beyond those
    the client registered is folded onto the last one registered."""
    import os

    from vfio_user_client import ServerThread, no_leaks, wait_eventfd

    from vfio_cxl.devices.vfio_user import wire

    with no_leaks():
        srv = ServerThread(tmp_path, irq_mode="msi")
        try:
            c = srv.client()
            cfg = c.config_read(0, 0x100)
            assert cfg[0x34] == 0x40 and cfg[0x41] == 0x80  # PCIe -> MSI
            assert cfg[0x80] == 0x05 and cfg[0x81] == 0
            flags = int.from_bytes(cfg[0x82:0x84], "little")
            assert flags & 0x80 and (flags >> 1) & 7 == 2  # 64-bit, Multiple Message Capable 4
            assert c.irq_info(wire.PCI_MSI_IRQ)[3] == regs.MSI_VECTORS
            assert c.irq_info(wire.PCI_MSIX_IRQ)[3] == 0
            info, _, fds = c.region_info(regs.BAR_MSIX)
            assert info["size"] == 0 and not fds
            efds = [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)]  # one vector granted
            assert c.set_irqs(wire.PCI_MSI_IRQ, 0, 1,
                              wire.IRQ_SET_DATA_EVENTFD | wire.IRQ_SET_ACTION_TRIGGER, efds).ok
            c.set_bus_master()
            c.reg_write(regs.REG_RING_SIZE, 16)
            c.reg_write(regs.REG_CONTROL, regs.CONTROL_ENABLE)
            c.reg_write(regs.REG_RING_TAIL, 16)  # BAD_TAIL: error vector 1, folded onto 0
            assert wait_eventfd(efds[0], 5) == 1
            os.close(efds[0])
            c.close()
        finally:
            srv.stop()
