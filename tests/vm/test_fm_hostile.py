"""A hostile guest against the fabric manager: the `fabric` topology, detached, real guests.

A guest process named to forge the holders list's fields holds a GPU; a guest root replaces a
tool the FM's bind check runs (``sleep``) with one that floods its output.  The FM kills the real holder and never pid 1,
neither wedges the GPU nor dies, and says what the guest did.  The two share one fabric lab
among themselves only (``detached("fabric", shared=MOVED)``): they leave gpu0 on a hot-plug port,
and a lab handed on that way failed test_lab_fabric's check of the boot layout; the next test
that needs another lab brings it down.  And on
the p2p topology: a peer GPU server unmaps the VRAM of a GPU whose server ended.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from vfio_cxl.paths import REPO_ROOT

from .conftest import guest_json
from .test_lab_fm import Detached, EventFollower, detached, vfio_cxl  # noqa: F401 (fixture)

GPU_ID = "0601 1991"          # vendor device, as vfio-pci's new_id and remove_id take it
CRAFTED = '","pid":1,"":"'   # 14 characters: the old holders script's JSON made it pid 1

# Opens the GPU, then takes the name argv[2] (prctl PR_SET_NAME) and never lets go.
HOLDER = r"""
import ctypes, os, sys, time
from vfio_cxl.guest.drivers.gpu import GpuDriver
gpu = GpuDriver.open(sys.argv[1])
ctypes.CDLL(None).prctl(15, sys.argv[2].encode(), 0, 0, 0)
print("holding", os.getpid(), open("/proc/self/comm").read().strip(), flush=True)
time.sleep(600)
"""


def fm(lab: Detached, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    result = vfio_cxl("fm", *args, "--lab", lab.name, timeout=300)
    assert (result.returncode == 0) == ok, f"fm {' '.join(args)}: {result.stdout} {result.stderr}"
    assert "Traceback" not in result.stderr
    return result


def bound_gpus(lab: Detached, vm: str) -> list[str]:
    result = lab.ssh(vm, "ls /sys/bus/pci/drivers/vfio-pci/")
    assert result.returncode == 0, result.stderr
    return [b for b in result.stdout.split() if re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", b)]


def replace_tool(lab: Detached, vm: str, tool: str) -> None:
    """The guest root puts a tool that floods its stdout over `tool` (a bind mount)."""
    result = lab.ssh(vm, f"printf '#!/bin/sh\\nexec yes flood\\n' > /tmp/flood && chmod +x /tmp/flood && "
                         f"mount --bind /tmp/flood $(command -v {tool})")
    assert result.returncode == 0, result.stderr


def restore_tool(lab: Detached, vm: str, tool: str) -> None:
    result = lab.ssh(vm, f"umount $(command -v {tool})")
    assert result.returncode == 0, result.stderr


# the share of the fabric lab these tests leave with gpu0 off its boot port (healthy otherwise)
MOVED = "gpu0 moved"


def test_forced_release_kills_the_real_holder_never_pid_1(detached):
    lab = detached("fabric", shared=MOVED)
    [bdf] = bound_gpus(lab, "a")   # gpu0
    holder = subprocess.Popen([sys.executable, "-m", "vfio_cxl", "vm", "ssh", "--lab", lab.name, "a", "--",
                               "python3", "-c", HOLDER, bdf, CRAFTED], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.PIPE, cwd=REPO_ROOT)
    events = EventFollower(lab.name)
    try:
        line = holder.stdout.readline().split(" ", 2)
        assert line[:1] == ["holding"], holder.stderr.read()
        guest_pid, comm = int(line[1]), line[2].strip()
        assert comm == CRAFTED
        refused = fm(lab, "release", "gpu0", "--timeout", "5", ok=False)
        print(f"release with a crafted holder: {refused.stderr.strip()}")
        assert f"pid {guest_pid} ({json.dumps(CRAFTED)})" in refused.stderr and "pid 1 " not in refused.stderr
        fm(lab, "release", "gpu0", "--force", "--timeout", "5")
        force = events.until("gpu-force")
        assert force["pids"] == [guest_pid], force
        assert holder.wait(120) != 0   # killed in the guest: its ssh session ends
        assert lab.ssh("a", "cat /proc/1/comm").returncode == 0   # the guest (and its init) lives
        status = lab.status()
        assert status["gpus"]["gpu0"]["state"] == "free" and status["vms"]["a"]["state"] == "running"
    finally:
        events.close()
        if holder.poll() is None:
            holder.kill()
        holder.wait()
    fm(lab, "assign", "gpu0", "a")
    assert lab.status()["gpus"]["gpu0"]["state"] == "attached"


def test_a_guest_that_floods_the_bind_check(detached):
    """VM b's root puts `yes` over `sleep` (the bind check's poll): the FM cuts it off at 64 KiB,
    says so, the GPU is `failed` in b (not wedged `moving`), and `fm restart` brings it back once
    the guest behaves.  (The holders and kill scripts run sh builtins only: nothing to replace.)
    b's root also takes the GPU's ID from vfio-pci, so the new GPU is still unbound at the bind
    check's first scan and it must poll: with the ID there, the kernel may bind the GPU before
    the check starts, which then never sleeps (CI saw the assign succeed that way)."""
    lab = detached("fabric", shared=MOVED)
    events = EventFollower(lab.name)
    try:
        result = lab.ssh("b", f"echo {GPU_ID} > /sys/bus/pci/drivers/vfio-pci/remove_id")
        assert result.returncode == 0, result.stderr
        replace_tool(lab, "b", "sleep")
        try:
            result = fm(lab, "assign", "gpu0", "b", ok=False)
            print(f"assign into a flooding guest: {result.stderr.strip()}")
            assert "printed more than 65536 bytes" in result.stderr
            failed = events.until("gpu-attach-failed")
            assert failed["vm"] == "b" and "printed more than 65536 bytes" in failed["message"]
            assert lab.status()["gpus"]["gpu0"]["state"] == "failed"
        finally:
            restore_tool(lab, "b", "sleep")
            result = lab.ssh("b", f"echo {GPU_ID} > /sys/bus/pci/drivers/vfio-pci/new_id")
            assert result.returncode == 0, result.stderr
        fm(lab, "restart", "gpu0")   # takes it back and attaches it again, in b
        gpu0 = lab.status()["gpus"]["gpu0"]
        assert (gpu0["state"], gpu0["owner"]) == ("attached", "b")
        fm(lab, "assign", "gpu0", "a")
        status = lab.status()
        assert status["gpus"]["gpu0"]["state"] == "attached"
        assert all(vm["state"] == "running" for vm in status["vms"].values())
    finally:
        events.close()


def vram_memfds(pid: int) -> set[str]:
    """Inodes of the GPU VRAM memfds a process maps (its own and its peers')."""
    return {line.split()[4] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "vfio-cxl-gpu-vram" in line}


def own_vram(pid: int) -> str:
    """The inode of a GPU server's own VRAM memfd: the one it holds open (a peer's fd is closed
    once mapped)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:vfio-cxl-gpu-vram"):
                return str(os.stat(fd).st_ino)
        except OSError:
            continue
    raise AssertionError(f"pid {pid} holds no VRAM memfd")


def test_a_peer_unmaps_the_vram_of_a_gpu_whose_server_ended(p2p_lab, labs):
    """p2p: three peer GPUs in host0.  After a P2P copy each server maps its peers' VRAM; when
    gpu1's server ends (what a scrub, a move or a death does to it), gpu0's server unmaps gpu1's
    VRAM: nothing of that owner stays in a peer (issue 23, item 8).  Ends the lab."""
    lab = labs.hand_over(p2p_lab)
    try:
        result = guest_json(lab["host0"], "vfio-cxl-m vfio_cxl.guest.cmd.p2p --size 4096 --json")
        assert all(copy["path"] == "peer fast path" for copy in result["copies"]), result["copies"]
        a, b = lab.gpu_servers["gpu0"].process.pid, lab.gpu_servers["gpu1"].process.pid
        theirs = {own_vram(b)}   # gpu1's VRAM, which gpu0 maps as a peer's
        mine = vram_memfds(a)
        assert len(mine) >= 2 and theirs <= mine, (mine, theirs)
        lab.gpu_servers["gpu1"].stop()
        deadline = time.monotonic() + 10
        while vram_memfds(a) & theirs and time.monotonic() < deadline:
            time.sleep(0.05)   # polling gpu0's maps for the unmap; not synchronisation
        left = vram_memfds(a)
        print(f"gpu0's server maps {len(mine)} VRAM memfds, {len(left)} after gpu1's server ended")
        assert not left & theirs, f"gpu0 still maps gpu1's VRAM: {left & theirs}"
        assert len(left) == len(mine) - 1
    finally:
        lab.stop()
