"""GpuMemory's UVM pager against the GPU's device model (no VM: the guest's GpuDriver over a
vfio-user client, tests/fast/guest_over_vfio_user.py)."""

import pytest
from guest_over_vfio_user import FakeDax, VfioUserPciDevice
from vfio_user_client import gpu_server  # noqa: F401

from vfio_cxl.guest.drivers.gpu import GpuDriver
from vfio_cxl.guest.gpumem import GpuMemory

FAR_SIZE = 2 << 20


@pytest.fixture
def mem(gpu_server, monkeypatch):
    """A GpuMemory over the device model; GpuMemory.open() hands out this one."""
    device = VfioUserPciDevice(gpu_server)
    dax = FakeDax(device, FAR_SIZE)
    gpu = GpuDriver(device)
    m = GpuMemory(gpu, dax)
    monkeypatch.setattr(GpuMemory, "open", classmethod(lambda cls, *a, **k: m))
    yield m
    m.close()
    gpu.close()
    dax.close()


def test_migration_tags_go_on_from_one_pager_to_the_next(mem):
    """The device ignores a GO that repeats the last accepted tag, and keeps reporting the
    previous migration's DONE: a new pager that started its tags again at 1 after one that
    migrated a single page had its first migration ignored, and computed over stale VRAM."""
    one_page = dict(mode="uvm", working_set=4096, vram_cache=1 << 16)
    first = mem.run("stream", seed=1, **one_page)
    assert first["verified"] and first["counters"]["migrations"] == 1
    second = mem.run("stream", seed=2, **one_page)          # other data, a new UvmPager
    assert second["counters"]["migrations"] == 1
    assert second["verified"], second["check"]
