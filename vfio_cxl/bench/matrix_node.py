"""What a second node of a matrix cluster costs, beside what the first (the head) costs.

    python -m vfio_cxl.bench matrix-node [--json]

Starts the matrix's local Ray head (:class:`vfio_cxl.matrix.engine.LocalHead`, one ``tcg_vm``
slot) and then a second node on this machine (``ray start --address HEAD --node-ip-address
127.0.0.2``, one slot, in a session of its own), and measures for each: ``ray start`` until
"Ray runtime started", the resident memory of its Ray processes once idle (VmRSS summed over
its session), and the first and the second task placed on it (the first pays for starting a
Ray worker process there; it runs :func:`vfio_cxl.matrix.job.node_facts`, the probe every
matrix run sends each node).  Then the artefacts a node must hold (QEMU tree, guest image, lab
kernel: bytes on disk in this node's cache), which it builds from the same recipes
(``vfio-cxl provision``) rather than receiving them.  No lab boots.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..lab.lab import free_ports
from ..matrix import engine
from ..paths import runtime_root

SECOND_NODE_IP = "127.0.0.2"       # its own IP: the driver attaches to the head's (docs/matrix.md)


def session_rss_mib(sid: int) -> float:
    total = 0
    for pid in engine.session_processes(sid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total / 1024


def settle_rss(sid: int, seconds: float = 20.0) -> float:
    """The session's RSS once it stops growing (agents start after "Ray runtime started")."""
    last, deadline = -1.0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = session_rss_mib(sid)
        if abs(now - last) < 1.0:
            return now
        last = now
        time.sleep(2.0)
    return last


def start_second_node(address: str, log_file: Path) -> tuple[subprocess.Popen, float]:
    ray_bin = Path(sys.executable).with_name("ray")
    flags = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")
    ports = [x for flag, port in zip(flags, free_ports(len(flags))) for x in (flag, str(port))]
    started = time.monotonic()
    with open(log_file, "w") as out:
        proc = subprocess.Popen([str(ray_bin), "start", "--block", "--address", address, "--node-ip-address",
                                 SECOND_NODE_IP, "--num-cpus", "2", "--resources", '{"tcg_vm": 1}', *ports],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    while "Ray runtime started" not in log_file.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() - started > engine.HEAD_START_TIMEOUT:
            stop_session(proc)
            raise RuntimeError(f"the second node did not start: {log_file.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, time.monotonic() - started


def stop_session(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        for pid in engine.session_processes(proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while engine.session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not engine.session_processes(proc.pid):
            break
    proc.wait()


def task_seconds(ray_engine, node: str) -> tuple[float, float]:
    times = []
    for _ in range(2):
        t0 = time.monotonic()
        ray_engine.probe(node, ["debian"])
        times.append(time.monotonic() - t0)
    return times[0], times[1]


def artefact_bytes() -> dict[str, int]:
    from ..lab.image import image_path
    from ..lab.kernel import cached_lab_kernel
    from ..lab.qemu_runtime import tree_path

    def du(path: Path | None) -> int:
        if path is None or not path.exists():
            return 0
        out = subprocess.run(["du", "-sB1", str(path.resolve())], capture_output=True, text=True, check=True).stdout
        return int(out.split()[0])
    return {"qemu": du(tree_path()), "image": du(image_path()), "lab_kernel": du(cached_lab_kernel())}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench matrix-node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    log = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    ray_engine = engine.RayEngine(slots=1, log=log)
    head_start = time.monotonic() - t0          # ray start of the head and the driver's ray.init
    second = None
    try:
        (head,) = ray_engine.nodes()
        head_rss = settle_rss(ray_engine.head.proc.pid)
        head_first, head_again = task_seconds(ray_engine, head)
        second, second_start = start_second_node(ray_engine.head.address,
                                                 runtime_root() / f"ray-second-{os.getpid()}.log")
        deadline = time.monotonic() + 60
        while len(ray_engine.nodes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        (node,) = [n for n in ray_engine.nodes() if n != head]
        second_rss = settle_rss(second.pid)
        second_first, second_again = task_seconds(ray_engine, node)
    finally:
        if second is not None:
            stop_session(second)
            Path(runtime_root() / f"ray-second-{os.getpid()}.log").unlink(missing_ok=True)
        ray_engine.close()
    sizes = artefact_bytes()
    figures = {"head_start_s": round(head_start, 1), "second_node_start_s": round(second_start, 1),
               "head_rss_mib": round(head_rss), "second_node_rss_mib": round(second_rss),
               "head_first_task_s": round(head_first, 2), "second_node_first_task_s": round(second_first, 2),
               "head_next_task_s": round(head_again, 3), "second_node_next_task_s": round(second_again, 3),
               "artefacts_mib": {k: round(v / 2**20) for k, v in sizes.items()}}
    if args.json:
        print(json.dumps(figures))
        return 0
    rows = [("ray start (head: with the driver's ray.init)", f"{head_start:.1f} s", f"{second_start:.1f} s"),
            ("Ray processes' memory once idle (VmRSS)", f"{head_rss:.0f} MiB", f"{second_rss:.0f} MiB"),
            ("first task there (starts a Ray worker)", f"{head_first:.2f} s", f"{second_first:.2f} s"),
            ("next task there", f"{head_again * 1e3:.0f} ms", f"{second_again * 1e3:.0f} ms")]
    print(f"{'':46} {'head (reference)':>17} {'second node':>12}")
    for what, ref, got in rows:
        print(f"{what:46} {ref:>17} {got:>12}")
    print("artefacts each node builds from the same recipes (vfio-cxl provision), on disk: " +
          ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sizes.items()))
    return 0
