"""GPU memory over CXL in a real guest (docs/gpu-memory.md): every kernel in every memory
mode verifies its result; uvm's fault path counts what the access pattern says; DS after
FLUSH leaves the far window byte-exact; a reset in the middle of a uvm run leaves nothing
hung.  On the Debian kernel (type1) and on the lab kernel (iommufd and type1)."""

import json
import shlex

import pytest

import documented_commands
from vfio_cxl.devices.gpu import regs

SMALL = 256 << 10
UVM_BLOCK = 2 << 20


def plan_all(vram_cache: int) -> list[dict]:
    """Every kernel in every mode; uvm-naive with a cache as large as the working set (cold
    faults only: random gathers through a smaller cache fault on most accesses, ~0.1 s each
    here), uvm with one 2 MiB VA block (its smallest cache; the working set fits in it)."""
    return [{"kernel": k, "mode": m, "latency": "cxl-80ns", "working_set": SMALL,
             "vram_cache": UVM_BLOCK if m == "uvm" else vram_cache, "unit": "4K"}
            for k in regs.KERNELS for m in regs.MODES]


def run_plan(vm, plan, env="", gpu=None):
    gpu_arg = f" --gpu {gpu}" if gpu else ""
    out = vm.run(f"{env}vfio-cxl-m vfio_cxl.guest.cmd.gpumem --plan -{gpu_arg}", stdin=json.dumps(plan),
                 timeout=1800).stdout
    return json.loads(out)


def first_gpu(vm) -> str:
    vm.run("vfio-cxl gpu bind --count 1")
    return json.loads(vm.run("vfio-cxl gpu ls --json").stdout)["gpus"][0]["bdf"]


def check_every_kernel_and_mode(rows):
    assert len(rows) == len(regs.KERNELS) * len(regs.MODES)
    bad = [(r["kernel"], r["mode"], r["check"]) for r in rows if not r["verified"]]
    assert not bad, bad
    for r in rows:
        c = r["counters"]
        if r["mode"] in ("uvm", "uvm-naive"):
            assert c["faults"] > 0 and c["far_lines_read"] == 0 and c["vram_lines"] > 0, r
            assert r["pager"]["spurious"] == 0, r["pager"]
            if r["mode"] == "uvm-naive":    # one fault per stop, nothing prefetched
                assert c["fault_batches"] == c["faults"] and c["prefetched_bytes"] == 0, c
            elif r["kernel"] == "stream":   # the faults of the warps in flight, in one batch
                assert 0 < c["fault_batches"] < c["faults"] and c["prefetched_bytes"] > 0, c
        else:
            assert c["faults"] == 0 and c["far_lines_read"] + c["sr_hits"] > 0, r
        assert (c["sr_issued"] > 0) == ("sr" in r["mode"]) or r["kernel"] == "bfs", r
        if "ds" in r["mode"] and r["kernel"] != "stream":
            assert c["ds_staged"] > 0 and r["ds_flushed_bytes"] > 0, r   # verified after FLUSH
        assert r["modelled_ns"] > 0 and r["modelled_ns"] == c["modelled_ns"]


def test_every_kernel_in_every_mode_verifies(single_lab):
    check_every_kernel_and_mode(run_plan(single_lab["host0"], plan_all(SMALL)))


def test_uvm_at_4x_the_vram_cache_faults_once_per_unit(single_lab):
    vm = single_lab["host0"]
    r = json.loads(vm.run("vfio-cxl gpu run stream --mode uvm-naive --working-set 1M --vram-cache 256K "
                          "--unit 64K --json", timeout=600).stdout)
    c = r["counters"]
    assert r["verified"], r
    # a sequential stream over 16 units through a 4-unit LRU cache: one fault per unit
    assert c["faults"] == c["migrations"] == 16 and c["evictions"] == 12, c
    assert c["bytes_migrated"] == 16 * 65536 and r["pager"]["spurious"] == 0
    s = json.loads(vm.run("vfio-cxl gpu run stencil --mode uvm-naive --working-set 1M --vram-cache 256K "
                          "--unit 64K --json", timeout=600).stdout)
    sc = s["counters"]
    assert s["verified"], s
    assert sc["faults"] == sc["migrations"] == 16       # 8 input + 8 output units
    assert sc["bytes_migrated"] > 16 * 65536            # written units went back on eviction


def test_uvm_batches_prefetches_and_evicts_2mib_blocks(single_lab):
    vm = single_lab["host0"]
    r = json.loads(vm.run("vfio-cxl gpu run stream --mode uvm --working-set 8M --vram-cache 2M "
                          "--unit 64K --json", timeout=600).stdout)
    c = r["counters"]
    assert r["verified"], r
    assert 0 < c["fault_batches"] < c["faults"] and c["faults_coalesced"] > 0, c
    assert c["prefetched_bytes"] > 0 and c["evicted_blocks"] == 3, c     # four blocks through one slot
    assert c["faults"] * 65536 + c["prefetched_bytes"] == c["bytes_migrated"] == 8 << 20, c


def test_the_readme_commands(single_lab):
    vm = single_lab["host0"]
    out = vm.run("vfio-cxl gpu run stencil --mode cxl+sr+ds --latency cxl-80ns --working-set 1M",
                 timeout=600).stdout
    assert "VERIFIED" in out and "modelled" in out and "sr_hits" in out, out
    out = vm.run("vfio-cxl gpu run stream --mode uvm-naive --working-set 1M --vram-cache 256K --unit 64K",
                 timeout=600).stdout
    assert "VERIFIED" in out and "faults 16" in out, out


def test_bad_input_is_refused_with_a_clear_error(single_lab):
    vm = single_lab["host0"]
    r = vm.run("vfio-cxl gpu run stream --working-set 1G", check=False)
    assert r.exited == 1 and "needs" in r.stderr and "far memory" in r.stderr, r.stderr
    r = vm.run("vfio-cxl gpu run stream --mode uvm --vram-cache 8K --unit 64K", check=False)
    assert r.exited == 1 and "smaller than one migration unit" in r.stderr, r.stderr
    r = vm.run("vfio-cxl gpu run sort", check=False)
    assert r.exited == 2 and "invalid choice: 'sort'" in r.stderr
    assert json.loads(vm.run("vfio-cxl gpu holders --json").stdout)["holders"] == []


RESET_MID_RUN = r'''
import json, subprocess, sys, time
from vfio_cxl.guest import gpumem
from vfio_cxl.guest.gpumem import GpuMemory, UvmPager
bdf = sys.argv[1]
state = {"reset_at": None}
real = UvmPager.service
def service(self):
    n = real(self)
    if self.served >= 8 and state["reset_at"] is None:
        # a function level reset through config space, behind the back of the driver
        subprocess.run(["setpci", "-s", bdf, "CAP_EXP+8.w=8000:8000"], check=True)
        state["reset_at"] = time.monotonic()
    return n
UvmPager.service = service
error = None
try:
    with GpuMemory.open(bdf, 8 << 20) as mem:
        mem.run("stream", "uvm-naive", "cxl-80ns", 8 << 20, 256 << 10, "4K")
except gpumem.GpuError as err:
    error = str(err)
done = time.monotonic()
print(json.dumps({"error": error, "after_reset_s": done - state["reset_at"] if state["reset_at"] else None}))
'''


def test_reset_in_the_middle_of_a_uvm_run_leaves_nothing_hung(single_lab):
    vm = single_lab["host0"]
    bdf = first_gpu(vm)
    out = json.loads(vm.run(f"python3 -c {shlex.quote(RESET_MID_RUN)} {bdf}", timeout=600).stdout)
    assert out["error"] is not None and out["after_reset_s"] is not None, out
    assert "reset" in out["error"], out
    assert out["after_reset_s"] < 10, out
    assert json.loads(vm.run("vfio-cxl gpu holders --json").stdout)["holders"] == []
    # no program of ours is left but the warm vfio-cxl server (its parent is init: a command it
    # forked has the server as its parent, and none runs now)
    left = [line.split(None, 1) for line in vm.run("ps -eo ppid,args | grep '[v]fio_cxl.guest' || true")
            .stdout.splitlines()]
    assert all(ppid == "1" and args == "python3 -m vfio_cxl.guest.cmd.warm /run/vfio-cxl/warm.sock"
               for ppid, args in left), left
    # the GPU works again, nothing left pending in it
    r = json.loads(vm.run("vfio-cxl gpu run stream --mode uvm-naive --working-set 256K --vram-cache 64K "
                          "--unit 4K --json", timeout=600).stdout)
    assert r["verified"] and r["counters"]["faults"] == 64


@pytest.mark.parametrize("backend", ["iommufd", "type1"])
def test_every_kernel_in_every_mode_on_the_lab_kernel(lab_kernel_lab, backend):
    vm = lab_kernel_lab["host0"]
    gpu = first_gpu(vm)
    rows = run_plan(vm, plan_all(SMALL), f"VFIO_CXL_VFIO_BACKEND={backend} ", gpu)
    assert {r["vfio_backend"] for r in rows} == {backend}
    check_every_kernel_and_mode(rows)


def test_the_documented_pager_runs_in_the_guest(single_lab):
    """docs/guest-library.md, "Your own pager": its pager class and its use, the two blocks as the
    page shows them, run in the guest through GpuMemory's documented hooks on the real GPU (its
    fast twin, tests/fast/test_gpumem_pager.py, runs them against the device model alone)."""
    pager, use = documented_commands.pager_blocks()
    vm = single_lab["host0"]
    first_gpu(vm)
    out = vm.run("python3 -", stdin=pager + "\n" + use, timeout=600).stdout
    verified, faults, word = out.split()
    assert (verified, word) == ("True", "faults") and int(faults) > 0, out
