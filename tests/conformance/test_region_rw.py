"""VFIO_USER_REGION_READ / REGION_WRITE and VFIO_USER_DEVICE_RESET (spec sections
of those names, "Read and Write Operations")."""

from __future__ import annotations

import os

import pytest

from vfio_cxl.bench import gpu_doc as gpu
from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import assert_error_reply, assert_ok_reply


def test_region_read_reply_echoes_the_request_and_carries_count_bytes(peer):
    """REGION_READ Reply: offset "into the region accessed", region "the index of
    the region accessed", count "the size of the data transferred", data "the data
    that was read from the device region".  BAR0 ID reads b"GPU1"."""
    reply = peer.region_read(vu.PCI_BAR0_REGION, gpu.ID, 4)
    assert_ok_reply(reply, vu.REGION_READ)
    assert len(reply.payload) == vu.REGION_RW.size + 4
    assert vu.REGION_RW.unpack_from(reply.payload) == (gpu.ID, vu.PCI_BAR0_REGION, 4)
    assert int.from_bytes(reply.payload[16:], "little") == gpu.ID_VALUE


def test_region_write_reply_echoes_without_data_and_the_write_lands(peer):
    """REGION_WRITE Reply: offset, region, count -- no data (16 bytes)."""
    reply = peer.region_write(vu.PCI_BAR0_REGION, gpu.SCRATCH, (0x1234ABCD).to_bytes(4, "little"))
    assert_ok_reply(reply, vu.REGION_WRITE)
    assert reply.payload == vu.REGION_RW.pack(gpu.SCRATCH, vu.PCI_BAR0_REGION, 4)
    assert peer.read32(gpu.SCRATCH) == 0x1234ABCD


def test_config_space_reads_the_pci_identity(peer):
    """REGION_READ of the config region (VFIO_PCI_CONFIG_REGION_INDEX 7): vendor and
    device ID 0601:1991 (docs/gpu-device.md)."""
    assert peer.read32(0, region=vu.PCI_CONFIG_REGION) == 0x1991_0601


def test_large_region_access_round_trips(peer):
    """Read and Write Operations: up to the peer's max_data_xfer_size per message;
    64 KiB of VRAM (BAR2) written and read back through messages."""
    data = os.urandom(min(64 * 1024, peer.server_caps.get("max_data_xfer_size",
                                                          vu.DEFAULT_MAX_DATA_XFER)))
    assert_ok_reply(peer.region_write(gpu.BAR_VRAM, 0x1000, data), vu.REGION_WRITE)
    reply = peer.region_read(gpu.BAR_VRAM, 0x1000, len(data))
    assert_ok_reply(reply, vu.REGION_READ)
    assert reply.payload[16:] == data


def test_count_above_the_servers_max_data_xfer_size_is_refused(peer):
    """Read and Write Operations: "The count field must not exceed the value of
    max_data_xfer_size of the peer, for both reads and writes."  The server's value
    (1 MiB when it did not say) exceeded by one byte: an error, header only."""
    limit = peer.server_caps.get("max_data_xfer_size", vu.DEFAULT_MAX_DATA_XFER)
    if limit >= 16 << 20:
        pytest.skip(f"server max_data_xfer_size {limit} is not below the 16 MiB BAR2")
    assert_error_reply(peer.region_read(gpu.BAR_VRAM, 0, limit + 1), vu.REGION_READ)


@pytest.mark.parametrize("region, offset, count", [
    (vu.PCI_BAR0_REGION, 4096 - 2, 4), (vu.PCI_BAR0_REGION, 2 ** 64 - 2, 4),
    (vu.PCI_ROM_REGION, 0, 4), (99, 0, 4)], ids=["past-end", "wrap", "absent-rom", "no-region"])
def test_read_outside_a_region_is_refused(peer, region, offset, count):
    """REGION_READ: offset "into the region being accessed", region "the index of the
    region"; an access outside the region (or to a region of size 0, or one that
    does not exist) is an error, header only."""
    assert_error_reply(peer.region_read(region, offset, count), vu.REGION_READ)


def test_write_whose_count_disagrees_with_its_data_is_refused_and_writes_nothing(peer):
    """REGION_WRITE request: count "is the size of the data to be transferred",
    data "is the data to write": a count that disagrees with the data is an
    error and nothing is written."""
    peer.write32(gpu.SCRATCH, 7)
    msg_id = peer.send(vu.REGION_WRITE, vu.REGION_RW.pack(gpu.SCRATCH, 0, 4) + b"\xff\xff")
    assert_error_reply(peer.next_reply(), vu.REGION_WRITE, msg_id)
    assert peer.read32(gpu.SCRATCH) == 7


def test_device_reset_replies_header_only_and_resets_registers(peer):
    """DEVICE_RESET: "This command message is sent from the client to the server to
    reset the device. Neither the request or reply have a payload."  SCRATCH goes
    back to its reset value 0 (docs/gpu-device.md)."""
    peer.write32(gpu.SCRATCH, 0xDEAD)
    reply = peer.request(vu.DEVICE_RESET)
    assert_ok_reply(reply, vu.DEVICE_RESET)
    assert reply.payload == b""
    assert peer.read32(gpu.SCRATCH) == 0
