"""docs/guest-library.md, "Your own pager": the page's pager and its use, run as the page shows
them, through GpuMemory's documented hooks, against the GPU's device model (no VM: the guest's
GpuDriver over a vfio-user client, tests/fast/guest_over_vfio_user.py)."""

from pathlib import Path

import pytest
from documented_commands import pager_blocks
from guest_over_vfio_user import FakeDax, VfioUserPciDevice
from vfio_user_client import gpu_server  # noqa: F401

from vfio_cxl.devices.gpu import regs
from vfio_cxl.guest import gpumem
from vfio_cxl.guest.drivers.gpu import GpuDmaError, GpuDriver
from vfio_cxl.guest.gpumem import GpuMemory, UvmPager

DOC = Path(__file__).resolve().parents[2] / "docs" / "guest-library.md"
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


def documented_pager():
    code, _ = pager_blocks()
    space = {}
    exec(compile(code, f"{DOC}:DirectMappedPager", "exec"), space)
    return space["DirectMappedPager"]


class Recording:
    """Wraps a pager class: records the hooks' calls and what they return."""

    def __init__(self, cls):
        self.cls, self.calls, self.pagers = cls, [], []

    def __call__(self, gpu, faults, page_shift, vram_base, vram_cache):
        bar0 = gpu.bar0
        # what the hooks table promises at construction
        assert bar0.read32(regs.REG_UVM_PAGE_SHIFT) == page_shift
        assert bar0.read32(regs.REG_FAULT_GET) == bar0.read32(regs.REG_FAULT_PUT)
        assert len(faults) // regs.FAULT_RECORD.size == bar0.read32(regs.REG_FAULT_ENTRIES)
        self.calls.append(("init", page_shift, vram_base, vram_cache))
        pager = self.cls(gpu, faults, page_shift, vram_base, vram_cache)
        rec = self

        class Spy:
            def service(self):
                n = pager.service()
                rec.calls.append(("service", n))
                return n

            def write_back(self):
                n = pager.write_back()
                rec.calls.append(("write_back", n))
                return n

        self.pagers.append(pager)
        return Spy()


def test_the_documented_use_runs_the_documented_pager(mem, capsys):
    code, use = pager_blocks()
    space = {}
    exec(compile(code + use, f"{DOC}:your-own-pager", "exec"), space)
    result = space["result"]
    assert result["verified"], result["check"]
    faults = result["counters"]["faults"]
    assert faults == 16 and result["counters"]["evictions"] == 12      # 1 MiB in 64 KiB pages, 4 slots
    assert capsys.readouterr().out.strip() == f"True {faults} faults"
    assert result["pager"] == {"served": None, "spurious": None, "trace": []}


@pytest.mark.parametrize("kernel,cache", [("stream", 256 << 10), ("copy", 3 << 16), ("stencil", 3 << 16),
                                          ("scatter", 1 << 20)])
def test_the_documented_pager_goes_through_every_hook(mem, kernel, cache):
    """Three slots for copy/stencil: their input and output pages then never share a slot of the
    direct-mapped cache; scatter's random updates get a slot per page (and run warm).  Written
    pages go back through write_back (and through evictions): the run checks the far window."""
    rec = Recording(documented_pager())
    result = mem.run(kernel, mode="uvm-naive", working_set=1 << 20, vram_cache=cache, warm=kernel == "scatter",
                     pager=rec)
    assert result["verified"], result["check"]
    assert rec.calls[0] == ("init", 16, 0, cache) and len(rec.pagers) == 1
    services = [c[1] for c in rec.calls if c[0] == "service"]
    backs = [c[1] for c in rec.calls if c[0] == "write_back"]
    assert sum(services) == len(services) > 0              # one record per fault vector
    faults = result["counters"]["faults"]                  # the measured launch's
    assert sum(services) >= faults
    assert faults == 0 if kernel == "scatter" else faults > 0   # warm: every page is resident
    assert rec.calls[-1][0] == "write_back"
    assert len(backs) == (2 if kernel == "scatter" else 1)  # scatter: after its warm-up too
    if kernel == "stream":
        assert backs == [0]                                 # nothing written: nothing dirty
    else:
        assert sum(backs) > 0


def test_a_pager_that_cancels_gets_fault_cancelled(mem):
    class Cancelling:
        def __init__(self, gpu, faults, page_shift, vram_base, vram_cache):
            self.bar0, self.faults = gpu.bar0, faults
            self.get = self.bar0.read32(regs.REG_FAULT_GET)

        def service(self):
            _addr, _flags, seq = regs.FAULT_RECORD.unpack_from(self.faults, 16 * self.get)
            self.bar0.write32(regs.REG_UVM_CONTROL, regs.UVM_CANCEL | (seq & 0xFFFFFF) << 8)
            return 0

        def write_back(self):
            return 0

    with pytest.raises(GpuDmaError, match="FAULT_CANCELLED"):
        mem.run("stream", mode="uvm-naive", working_set=1 << 20, vram_cache=256 << 10, pager=Cancelling)
    mem.program()     # the driver reset the GPU: the far window again, then it works
    assert mem.run("stream", mode="uvm-naive", working_set=1 << 20, vram_cache=256 << 10)["verified"]


def test_migration_tags_go_on_from_one_pager_to_the_next(mem):
    """The device ignores a GO that repeats the last accepted tag, and keeps reporting the
    previous migration's DONE: a new pager that started its tags again at 1 after one that
    migrated a single page had its first migration ignored, and computed over stale VRAM."""
    one_page = dict(mode="uvm-naive", working_set=4096, vram_cache=1 << 16)
    first = mem.run("stream", seed=1, **one_page)
    assert first["verified"] and first["counters"]["migrations"] == 1
    second = mem.run("stream", seed=2, **one_page)          # other data, a new UvmPager
    assert second["counters"]["migrations"] == 1
    assert second["verified"], second["check"]
    third = mem.run("stream", seed=3, pager=documented_pager(), **one_page)   # and a pager of one's own
    assert third["verified"], third["check"]


def test_the_library_pager_reports_what_it_did(mem):
    result = mem.run("stream", mode="uvm-naive", working_set=1 << 20, vram_cache=256 << 10, pager=UvmPager)
    assert result["verified"]
    assert result["pager"]["served"] == result["counters"]["faults"] == 16
    assert result["pager"]["trace"] == list(range(16))
    assert gpumem.migrate in (getattr(gpumem, n) for n in gpumem.__all__)
