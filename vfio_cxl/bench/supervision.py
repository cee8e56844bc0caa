"""A detached lab's fabric manager: start-up, death reports and `vm down`, each beside its reference.

    python -m vfio_cxl.bench supervision [--json]

Boots ``single`` with ``vm up --detach`` (the Python API behind it), then
SIGKILLs the GPU server and then the VM's QEMU, and takes each report's
latency from the event's own timestamp.  References: the VM's boot-to-SSH
inside that start-up (what the FM adds is the rest), and the floor of
"kill -> pidfd readable" for a plain child of this process (median of 20).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time

from ..lab.fm.cleanup import down
from ..lab.fm.client import FmClient
from ..lab.fm.launch import launch
from ..lab.fm.registry import find


def pidfd_floor(runs: int = 20) -> float:
    samples = []
    for _ in range(runs):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        fd = os.pidfd_open(child.pid)
        t0 = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        select.select([fd], [], [], 10)
        samples.append(time.monotonic() - t0)
        os.close(fd)
        child.wait()
    return statistics.median(samples)


def kill_and_wait(client_events, pid: int, kind: str) -> float:
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for event in client_events:
        if event["kind"] == kind:
            return event["monotonic"] - killed
    raise RuntimeError(f"no {kind} event")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench supervision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    boot_lines = []
    t0 = time.monotonic()
    name = launch("single", echo=boot_lines.append)["name"]
    detach_s = time.monotonic() - t0
    record = find(name)
    try:
        with FmClient(record.socket, lab=name) as client, FmClient(record.socket, lab=name) as follower:
            status = client.status()
            events = follower.follow_events(since=len(client.events()), timeout=30)
            gpu_s = kill_and_wait(events, status["gpus"]["gpu0"]["server_pid"], "gpu-server-died")
            qemu_s = kill_and_wait(events, status["vms"]["host0"]["qemu_pid"], "vm-died")
    finally:
        t1 = time.monotonic()
        down(record, log=lambda text: None)
        down_s = time.monotonic() - t1
    boot_s = float(next(line for line in boot_lines if "ready in" in line).split("ready in ")[1].split()[0])
    floor_s = pidfd_floor()
    figures = {"detach_to_ready_s": detach_s, "vm_boot_to_ssh_s": boot_s,
               "gpu_server_death_report_ms": gpu_s * 1e3, "qemu_death_report_ms": qemu_s * 1e3,
               "pidfd_floor_ms": floor_s * 1e3, "down_s": down_s}
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"vm up --detach -> ready:  {detach_s:6.1f} s   (the VM's boot to SSH inside it: {boot_s:.1f} s)")
    print(f"GPU server kill -> event: {gpu_s * 1e3:6.1f} ms  (kill -> pidfd readable, plain child: "
          f"{floor_s * 1e3:.2f} ms; target < 1000 ms)")
    print(f"QEMU kill -> event:       {qemu_s * 1e3:6.1f} ms  (QEMU exits inside bwrap's pid namespace; "
          f"target < 1000 ms)")
    print(f"vm down (dead VM):        {down_s:6.2f} s")
    return 0
