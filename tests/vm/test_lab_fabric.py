"""GPUs that move between hosts at run time: the `fabric` topology, detached, driven like a user
(`vfio-cxl fm assign|release|restart` as separate processes, `vfio-cxl gpu ...` in the guests over
`vfio-cxl vm ssh`).  Real QEMU hot-plug (QMP device_add / device_del, ACPI), the guests' real
vfio-pci and intel-iommu, real devdax.  Figures are printed (pytest -s or -rA shows them).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import fdcheck

from vfio_cxl.lab.fm import registry
from vfio_cxl.lab.fm.procs import ProcessId, processes_mentioning
from vfio_cxl.paths import REPO_ROOT

from .test_lab_fm import Detached, EventFollower, detached, vfio_cxl  # noqa: F401 (fixture)

# a<->b round trips after the first (the leak check's reference): 2 by default, 10 under --soak;
# $VFIO_CXL_FABRIC_ROUND_TRIPS overrides both
ROUND_TRIPS_ENV = "VFIO_CXL_FABRIC_ROUND_TRIPS"
TAG = "secret of host a"


def gpu_ls(lab: Detached, vm: str) -> list[dict]:
    result = lab.ssh(vm, "vfio-cxl", "gpu", "ls", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["gpus"]


def gpu_dma(lab: Detached, vm: str, bdf: str) -> dict:
    result = lab.ssh(vm, "vfio-cxl", "gpu", "dma", "--gpu", bdf, "--json")
    assert result.returncode == 0, f"gpu dma in {vm}: {result.stdout} {result.stderr}"
    answer = json.loads(result.stdout)
    assert answer["match"] and answer["sha256_read"] == answer["sha256_expected"]
    return answer


def vram_read(lab: Detached, vm: str, bdf: str) -> dict:
    result = lab.ssh(vm, "vfio-cxl", "gpu", "vram-read", "--gpu", bdf, "--length", str(len(TAG)), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def fm(lab: Detached, *args: str) -> dict:
    result = vfio_cxl("fm", *args, "--lab", lab.name, "--json", timeout=300)
    assert result.returncode == 0, f"fm {' '.join(args)}: {result.stderr}"
    return json.loads(result.stdout)


def test_gpu_moves_between_hosts_scrubbed_or_kept(detached, soak):
    """gpu0 starts in a, gpu1 in b (fabric); gpu0 moves to b's hot-plug port and back."""
    lab = detached("fabric", shared=True)   # one fabric boot for the tests of this file
    status = lab.status()
    assert {n: (g["owner"], g["state"]) for n, g in status["gpus"].items()} == {
        "gpu0": ("a", "attached"), "gpu1": ("b", "attached")}
    assert status["free_hotplug_ports"] == {"a": ["hp0"], "b": ["hp0"]}
    (in_a,) = gpu_ls(lab, "a")
    (gpu1_in_b,) = gpu_ls(lab, "b")
    gpu_dma(lab, "a", in_a["bdf"])

    # Scrubbed by default: a writes a tag, the GPU moves, b reads zeros.
    assert lab.ssh("a", "vfio-cxl", "gpu", "vram-write", "--gpu", in_a["bdf"], TAG).returncode == 0
    moved = fm(lab, "assign", "gpu0", "b")
    print(f"\nmove a->b (scrubbed): release {moved['release_s']:.2f} s, scrub {moved['scrub_s']:.2f} s, "
          f"attach {moved['attach_s']:.2f} s, full move {moved['move_s']:.2f} s")
    assert gpu_ls(lab, "a") == []
    in_b = {g["bdf"]: g for g in gpu_ls(lab, "b")}
    assert set(in_b) == {gpu1_in_b["bdf"], moved["bdf"]}
    assert in_b[moved["bdf"]]["driver"] == "vfio-pci" and in_b[moved["bdf"]]["iommu_group"] is not None
    gpu_dma(lab, "b", moved["bdf"])
    status = lab.status()["gpus"]["gpu0"]
    assert (status["owner"], status["state"], status["scrubbed"], status["port"]) == ("b", "attached", True, "hp0")
    # gpu dma wrote its payload at VRAM offset 0; the tag lives at 8 MiB, untouched by it.
    assert vram_read(lab, "b", moved["bdf"])["zero"], "b read a's VRAM after a scrubbed move"

    # Kept: b writes a tag, the GPU moves with --keep-vram, a reads it back.
    assert lab.ssh("b", "vfio-cxl", "gpu", "vram-write", "--gpu", moved["bdf"], TAG).returncode == 0
    moved = fm(lab, "assign", "gpu0", "a", "--keep-vram")
    assert moved["scrubbed"] is False
    assert bytes.fromhex(vram_read(lab, "a", moved["bdf"])["hex"]) == TAG.encode()
    assert lab.status()["gpus"]["gpu0"]["scrubbed"] is False

    # Round trips, gpu dma after each (it finds, opens and uses the GPU); then count what is held.
    # Like with like: the reference is read after the first round trip (a scrubbed move into a,
    # then gpu dma in a), as the reading after the last one is; what a QEMU holds follows the
    # kind of the last move and the guest's last use of the GPU, not only the count of moves.
    before = None
    moves, t0 = [], time.monotonic()
    round_trips = int(os.environ.get(ROUND_TRIPS_ENV) or soak(2, 10))
    for i in range(round_trips):
        for vm in ("b", "a"):
            moved = fm(lab, "assign", "gpu0", vm)
            moves.append(moved["move_s"])
            gpu_dma(lab, vm, moved["bdf"])
        if before is None:
            before = held(lab)
    print(f"{round_trips} round trips a<->b in {time.monotonic() - t0:.0f} s: full move min {min(moves):.2f} s, "
          f"median {sorted(moves)[len(moves) // 2]:.2f} s, max {max(moves):.2f} s")
    after = held(lab, reference=before)
    leaked = {k: (before.counts[k], after.counts[k]) for k in before.counts if before.counts[k] != after.counts[k]}
    leaked_fds = fdcheck.differences(before.fds, after.fds)
    print(f"after {2 * round_trips - 2} more moves, held: {after.counts}, fds: "
          f"{ {k: sum(v.values()) for k, v in after.fds.items()} }; waited {after.waited:.1f} s for late closes")
    assert not leaked and not leaked_fds, f"leaked (before, after): {leaked}; fds by kind (after - before): {leaked_fds}"

    # A guest process that holds the GPU and ignores the kernel's release request: release fails
    # within its timeout naming it; --force kills it and the GPU comes out; it goes back and works.
    holder = subprocess.Popen([sys.executable, "-m", "vfio_cxl", "vm", "ssh", "--lab", lab.name, "a", "--",
                               "python3", "-c", HOLDER, moved["bdf"]], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.PIPE, cwd=REPO_ROOT)
    try:
        line = holder.stdout.readline().split()
        assert line[:1] == ["holding"], holder.stderr.read()
        guest_pid = line[1]
        t0 = time.monotonic()
        result = vfio_cxl("fm", "release", "gpu0", "--timeout", "5", "--lab", lab.name, timeout=120)
        print(f"release with a holder: refused after {time.monotonic() - t0:.1f} s: {result.stderr.strip()}")
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert f"pid {guest_pid} (python3)" in result.stderr and "--force" in result.stderr
        assert lab.status()["gpus"]["gpu0"]["state"] == "attached"
        released = fm(lab, "release", "gpu0", "--force", "--timeout", "5")
        assert released["vm"] == "a" and released["scrubbed"] is True
        assert holder.wait(60) != 0   # killed in the guest: its ssh session ends
        assert lab.status()["gpus"]["gpu0"]["state"] == "free"
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
        holder.stdout.close()
        holder.stderr.close()
    moved = fm(lab, "assign", "gpu0", "a")
    gpu_dma(lab, "a", moved["bdf"])

    # `vm down` leaving nothing is checked by the last test of the lab (the dead VM's).


# Opens the GPU (GpuDriver registers the kernel's release-request eventfd) and then never looks at
# it: the kernel asks, nobody answers, the device stays held.
HOLDER = r"""
import os, sys, time
from vfio_cxl.guest.drivers.gpu import GpuDriver
gpu = GpuDriver.open(sys.argv[1])
print("holding", os.getpid(), flush=True)
time.sleep(600)
"""


@dataclass
class Held:
    counts: dict[str, int]
    fds: fdcheck.Holdings       # by kind (tests/fdcheck.py), per process
    waited: float               # for what QEMU releases late (slirp's sockets of ended SSH sessions)


def held(lab: Detached, reference: Held | None = None) -> Held:
    """What the lab holds, to compare before and after moves: the fds of the FM, of each QEMU and
    of each GPU server, by kind, once no QEMU holds a late-released socket (and, given a reference,
    once they equal it, up to a deadline: a real leak still fails); processes naming the run dir;
    run-dir files and sockets; each QEMU's mappings of GPU VRAM; guest processes holding a GPU."""
    status = lab.status()
    counts = {}
    for name in status["vms"]:
        # Open VFIO group, device (cdev) and iommufd files in the guest (one ls, not a guest Python
        # start: minutes at load 18).  First: each SSH session leaves QEMU a socket that slirp
        # closes seconds later.
        result = lab.ssh(name, "ls -l /proc/[0-9]*/fd 2>/dev/null | grep -c -e ' /dev/vfio/[0-9]' "
                               "-e ' /dev/vfio/devices/' -e ' /dev/iommu$' || true")
        assert result.returncode == 0, result.stderr
        counts[f"guest_{name}_vfio_fds"] = int(result.stdout.strip() or 0)
    pids = {"fm": lab.record.fm["pid"]}
    pids.update({f"qemu_{name}": vm["qemu_pid"] for name, vm in status["vms"].items()})
    pids.update({f"{name}_server": gpu["server_pid"] for name, gpu in status["gpus"].items()})
    fds, waited = fdcheck.settle(pids, reference.fds if reference else None, timeout=30)
    rundir = Path(lab.record.rundir)
    files = sorted(rundir.rglob("*"))
    counts.update({"processes": len(processes_mentioning(lab.record.rundir)),
                   "rundir_files": len(files), "sockets": sum(1 for f in files if f.is_socket())})
    for name, vm in status["vms"].items():
        maps = Path(f"/proc/{vm['qemu_pid']}/maps").read_text()
        counts[f"qemu_{name}_vram_maps"] = maps.count("vfio-cxl-gpu-vram")
    return Held(counts, fds, waited)


WAITER = r"""
import os, sys, time
from vfio_cxl.guest.drivers.gpu import GpuDriver, GpuError
gpu = GpuDriver.open(sys.argv[1])
print("waiting", flush=True)
try:
    gpu.wait([], timeout=60)    # nothing submitted: waits on the GPU's interrupts
except GpuError as err:
    print(f"guest-error {time.time():.3f} {type(err).__name__}: {err.what}", flush=True)
    os._exit(3)
"""


def test_killed_gpu_server_is_reported_and_the_guest_errs_promptly(detached):
    lab = detached("fabric", shared=True)
    (gpu,) = gpu_ls(lab, "a")
    gpu_dma(lab, "a", gpu["bdf"])
    events = EventFollower(lab.name)
    waiter = subprocess.Popen([sys.executable, "-m", "vfio_cxl", "vm", "ssh", "--lab", lab.name, "a", "--",
                               "python3", "-c", WAITER, gpu["bdf"]], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.PIPE, cwd=REPO_ROOT)
    try:
        assert waiter.stdout.readline().strip() == "waiting", waiter.stderr.read()
        server = lab.status()["gpus"]["gpu0"]["server_pid"]
        t_kill = time.time()
        os.kill(server, signal.SIGKILL)
        died = events.until("gpu-server-died")
        removal = events.until("gpu-surprise-removal")
        ready, _, _ = select.select([waiter.stdout], [], [], 30)
        line = waiter.stdout.readline() if ready else ""
        print(f"\nGPU server killed: reported after {died['time'] - t_kill:.3f} s, device_del sent after "
              f"{removal['time'] - t_kill:.3f} s; guest: {line.strip() or 'no error within 30 s'}")
        assert died["time"] - t_kill < 1.0
        assert line.startswith("guest-error"), line
        assert float(line.split()[1]) - t_kill < 10.0
        assert lab.status()["gpus"]["gpu0"]["state"] == "failed"
    finally:
        waiter.kill()
        waiter.wait()
        events.close()
    restarted = fm(lab, "restart", "gpu0")
    gpu_dma(lab, "a", restarted["bdf"])
    assert lab.status()["gpus"]["gpu0"]["state"] == "attached"


def test_dead_vm_frees_its_gpu_for_the_other(detached):
    lab = detached("fabric", shared=True)   # last of the file: it kills VM a and ends the lab
    events = EventFollower(lab.name)
    try:
        qemu_pid = lab.status()["vms"]["a"]["qemu_pid"]
        t_kill = time.time()
        os.kill(qemu_pid, signal.SIGKILL)
        died = events.until("vm-died")
        freed = events.until("gpu-freed")
        print(f"\nVM a killed: reported after {died['time'] - t_kill:.3f} s, gpu0 free after "
              f"{freed['time'] - t_kill:.3f} s")
        assert died["time"] - t_kill < 1.0
        status = lab.status()
        assert status["vms"]["a"]["state"] == "dead"
        gpu = status["gpus"]["gpu0"]
        assert (gpu["owner"], gpu["state"], gpu["scrubbed"]) == (None, "free", True)
        assert ProcessId.of(gpu["server_pid"]) is not None
        moved = fm(lab, "assign", "gpu0", "b")
        gpu_dma(lab, "b", moved["bdf"])
        assert lab.status()["gpus"]["gpu0"]["owner"] == "b"
    finally:
        events.close()
    result = lab.down()
    assert result.returncode == 0, result.stderr
    assert not any(r.name == lab.name for r in registry.records())
    assert lab.leftovers() == {"processes": 0, "sockets": 0, "rundir_files": 0, "records": 0}


def test_msix_gpu_release_is_refused_with_the_reason(detached):
    # Last of the file: the single lab it leaves up is test_lab_fm's second-process test's.
    lab = detached("single", shared=True)
    result = vfio_cxl("fm", "release", "gpu0", "--lab", lab.name)
    assert result.returncode == 1
    assert "MSI-X" in result.stderr and 'irq = "msi"' in result.stderr and "Traceback" not in result.stderr
    assert lab.status()["gpus"]["gpu0"]["state"] == "attached"
    (gpu,) = gpu_ls(lab, "host0")
    gpu_dma(lab, "host0", gpu["bdf"])
