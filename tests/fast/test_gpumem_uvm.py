"""Mode uvm as NVIDIA's UVM driver does it (UvmBatchPager) and the gemv kernel, against the
GPU's device model (no VM: the guest's GpuDriver over a vfio-user client,
tests/fast/guest_over_vfio_user.py); the density prefetcher on its own."""

import pytest
from guest_over_vfio_user import FakeDax, VfioUserPciDevice
from vfio_user_client import gpu_server  # noqa: F401

from vfio_cxl.devices.gpu import regs
from vfio_cxl.guest import gpumem
from vfio_cxl.guest.drivers.gpu import GpuDriver
from vfio_cxl.guest.gpumem import FaultBatch, GpuMemError, GpuMemory, UvmBatchPager, prefetch_region

MIB = 1 << 20


def open_mem(server, far_size):
    device = VfioUserPciDevice(server)
    dax = FakeDax(device, far_size)
    gpu = GpuDriver(device)
    return GpuMemory(gpu, dax), gpu, dax


@pytest.fixture
def mem(gpu_server):
    m, gpu, dax = open_mem(gpu_server, 8 * MIB)
    yield m
    m.close()
    gpu.close()
    dax.close()


# ---------------------------------------------------------------- the density prefetcher
def test_one_fault_in_an_empty_block_prefetches_nothing():
    assert prefetch_region(32, set(), {5}) == set()


def test_the_largest_subtree_above_51_percent_is_migrated_whole():
    # units 0-6 faulted: [0, 8) holds 7 of 8 (> 51 %), [0, 16) 7 of 16 (not): unit 7 comes along
    assert prefetch_region(32, set(), set(range(7))) == {7}
    # 0-15 resident, 16-22 faulted: the whole block holds 23 of 32 (72 %): the rest comes along
    assert prefetch_region(32, set(range(16)), set(range(16, 23))) == set(range(23, 32))
    # exactly half is not more than 51 %
    assert prefetch_region(32, set(range(8)), set(range(8, 16))) == set()


def test_the_threshold_is_a_parameter_and_bad_blocks_are_refused():
    assert prefetch_region(4, set(), {0, 1}, threshold=49) == {2, 3}
    with pytest.raises(GpuMemError, match="power of two"):
        prefetch_region(24, set(), {0})
    with pytest.raises(GpuMemError, match="not in a VA block of 32"):
        prefetch_region(32, set(), {32})


# ---------------------------------------------------------------- the batch pager end to end
def test_uvm_batches_coalesces_prefetches_and_evicts_blocks(mem):
    r = mem.run("stream", mode="uvm", working_set=8 * MIB, vram_cache=2 * MIB)
    assert r["verified"], r["check"]
    c = r["counters"]
    assert 0 < c["fault_batches"] < c["faults"]
    assert c["faults_coalesced"] > 0 and c["prefetched_bytes"] > 0
    assert c["evicted_blocks"] == 3                         # four 2 MiB blocks through one slot
    # every byte of the 8 MiB came in once, by fault or by prefetch
    assert c["bytes_migrated"] == 8 * MIB
    assert c["faults"] * (64 << 10) + c["prefetched_bytes"] == 8 * MIB


def test_uvm_naive_stops_once_per_fault_and_costs_more(mem):
    naive = mem.run("stream", mode="uvm-naive", working_set=8 * MIB, vram_cache=2 * MIB)
    batched = mem.run("stream", mode="uvm", working_set=8 * MIB, vram_cache=2 * MIB)
    assert naive["verified"] and batched["verified"]
    n = naive["counters"]
    assert n["fault_batches"] == n["faults"] == 128 and n["prefetched_bytes"] == 0
    assert n["faults_coalesced"] == n["evicted_blocks"] == 0
    assert batched["modelled_ns"] < naive["modelled_ns"]


@pytest.mark.parametrize("kernel", ["copy", "stencil", "gemv"])
def test_uvm_writes_back_what_it_evicts(mem, kernel):
    r = mem.run(kernel, mode="uvm", working_set=6 * MIB, vram_cache=4 * MIB)
    assert r["verified"], r["check"]
    assert r["counters"]["evicted_blocks"] > 0


@pytest.mark.parametrize("kernel,cache", [("copy", 2 * MIB), ("scatter", 4 * MIB)])
def test_a_cache_too_small_for_the_blocks_in_flight_is_reported_not_spun_on(mem, kernel, cache):
    """copy reads a and writes b in step: with one 2 MiB block in VRAM each stop evicts the
    other; scatter's random updates over a 4 MiB table with the index stream need three.
    The pager cancels the op and says so (NVIDIA's driver would pin pages: not modelled)."""
    with pytest.raises(GpuMemError, match=rf"\({cache >> 21} VA blocks of 2 MiB\) thrashes"):
        mem.run(kernel, mode="uvm", working_set=8 * MIB, vram_cache=cache)


def test_a_full_fault_buffer_overflows_and_no_fault_is_lost(gpu_server, monkeypatch):
    monkeypatch.setattr(gpumem, "FAULT_ENTRIES", 4)       # 3 free records per stop
    m, gpu, dax = open_mem(gpu_server, 4 * MIB)
    pagers = []

    def keep(*args):
        pagers.append(UvmBatchPager(*args))
        return pagers[-1]

    try:
        r = m.run("stream", mode="uvm", working_set=4 * MIB, vram_cache=2 * MIB, pager=keep)
    finally:
        m.close()
        gpu.close()
        dax.close()
    assert r["verified"], r["check"]
    assert pagers[0].overflows > 0
    assert r["counters"]["faults"] <= 3 * r["counters"]["fault_batches"]


def test_the_pager_refuses_a_block_straddling_the_window_and_a_small_cache(gpu_server):
    m, gpu, dax = open_mem(gpu_server, 3 * MIB)
    try:
        with pytest.raises(GpuMemError, match="ends inside a 2 MiB VA block"):
            m.run("stream", mode="uvm", working_set=1 * MIB, vram_cache=2 * MIB)
    finally:
        m.close()
        gpu.close()
        dax.close()


def test_a_cache_below_one_va_block_is_refused(mem):
    with pytest.raises(GpuMemError, match="at least 2M, or use mode uvm-naive"):
        mem.run("stream", mode="uvm", working_set=1 * MIB, vram_cache=1 * MIB)


def test_replays_name_the_batch_just_read_and_prefetch_stays_in_the_window(mem):
    mem.bar0.write32(regs.REG_FAR_SIZE_LO, 8 * MIB)
    pager = UvmBatchPager(mem.gpu, mem.fault_buffer, 16, 0, 2 * MIB)
    with pytest.raises(GpuMemError, match="replay for fault batch 7, which this pager did not read"):
        pager.replay(FaultBatch(7, [gpumem.FaultRecord(0, False, 1)]))
    pager.batches_read = 1
    done = FaultBatch(1, [gpumem.FaultRecord(0, False, 1)])
    pager.replay(done)
    with pytest.raises(GpuMemError, match="replayed already"):
        pager.replay(done)
    with pytest.raises(GpuMemError, match="unit 128 is beyond the far window"):
        pager.service_block(4, {0})                        # block 4 starts at 8 MiB


# ---------------------------------------------------------------- gemv
@pytest.mark.parametrize("mode", ["cxl", "cxl+sr+ds", "uvm", "uvm-naive"])
def test_gemv_is_verified_in_every_mode(mem, mode):
    r = mem.run("gemv", mode=mode, working_set=4 * MIB, vram_cache=4 * MIB)
    assert r["verified"], r["check"]
    assert r["n"] == 720 and "4 tokens" in r["check"]


def test_a_wrong_gemv_result_is_caught(mem):
    lay = gpumem.layout("gemv", 1 * MIB)
    verifier = mem.prepare(lay)
    result = mem.launch(lay)
    assert verifier.check(result)[0]
    mem.dax.write(lay.b, b"\x01")                          # one byte of y wrong
    assert not verifier.check(result)[0]
    mem.dax.write(lay.b, b"\x00")
    assert not verifier.check(result ^ 1)[0]
