"""RDMA-shaped writes between two hosts' VRAM, every path in one run (boots ``nic2``: host0 and
host1, each a GPU and an igb behind one PCIe switch, the igbs wired to each other).

    scripts/bench nic [--quick] [--sizes 4K,1M] [--json] [--backend type1|iommufd] [--kernel distro|lab]
                      [--qemu PATH] [--lab NAME]

Paths, host0's VRAM into host1's (docs/nic.md, "RDMA-shaped writes"):

* zero-copy: host0's igb reads each payload from gpu0's BAR2, host1's igb writes it into
  gpu1's BAR2 at its place (descriptors pre-posted at the right offsets); no CPU touches a
  payload byte.
* bounce (the reference): host0's CPU reads VRAM through BAR2 into frames in guest RAM; host1's
  igb writes whole frames into guest RAM and its CPU copies each payload into VRAM through BAR2.
* tcp: the same writes over the kernel's TCP on the virtio-net link between the same guests
  (the CPU reads and writes BAR2 both ends, the kernel copies in between).

Sizes 4 KiB to 16 MiB (``--quick``: 64 KiB and 1 MiB), one write each per path, into a 16 MiB
region.  Per cell: MB/s (the writer's request to the responder's completion), frames/s, each
side's guest CPU seconds per GB (CLOCK_PROCESS_CPUTIME_ID over the write), the payload bytes
each side's CPU copied, and ``verified`` (the responder read the range back through BAR2 and
found the seeded pattern).  Each figure is printed beside the bounce's at the same size.
Target (issue 35): zero-copy >= the bounce's MB/s with <= 50 % of its receiver CPU per GB.
By default it runs on the lab's own QEMU (Debian's 11.1.3 package, unpatched: "stock"), where
DMA into a BAR is bounced and written out 8 bytes at a time; ``--qemu PATH`` runs it on another
build (VFIO_CXL_QEMU), e.g. one that makes that DMA direct: how QEMU carries DMA into a BAR
decides the zero-copy path's pace.  ``--lab NAME`` (or ``$VFIO_CXL_LAB``) runs in that running
detached ``nic2`` lab instead of booting one (vfio_cxl/lab/borrow.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from ..errors import LabError
from ..lab import topology
from ..lab.borrow import add_lab_option, booted_or_borrowed
from ..lab.lab import Lab
from .options import add_kernel_option, add_qemu_build_option, guest_kernel, kernel_asked, use_qemu_build
from .p2p import parse_size

PATHS = ("zero-copy", "bounce", "tcp")
SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
QUICK_SIZES = (64 << 10, 1 << 20)
REGION = 16 << 20
SEED = 35
READY = "/tmp/nic-bench-ready"


def run_path(lab, path: str, sizes: list[int], backend: str) -> tuple[dict, dict]:
    """``rdma-recv`` on host1 (background, until its ready file is written), ``rdma-write`` of
    every size on host0: (the writer's report, the responder's)."""
    rx, tx = lab["host1"], lab["host0"]
    common = f"--path {path} --length {REGION} --seed {SEED} --backend {backend} --json"
    rx.run(f"rm -f {READY}")
    with rx.start_command(f"vfio-cxl nic rdma-recv {common} --writes {len(sizes)} --ready-file {READY}",
                          timeout=3600) as receiving:
        ready = wait_ready(rx)
        peer = "" if path == "tcp" else f"--to {ready['mac']} --key {ready['key']}"
        sent = json.loads(tx.run(f"vfio-cxl nic rdma-write {common} {peer} --sizes {','.join(map(str, sizes))}",
                                 timeout=3600, check=False).stdout)
        got = json.loads(receiving.join(check=False).stdout)
    return sent, got


def wait_ready(vm, timeout: float = 600) -> dict:
    """The responder's ready file once it exists (written whole: renamed into place), each look
    one command in the guest, bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    while vm.run(f"test -e {READY}", check=False).exited != 0:
        if time.monotonic() > deadline:
            raise LabError(f"the responder wrote no {READY} within {timeout:g} s",
                           "see its output: vfio-cxl nic rdma-recv on host1")
    return json.loads(vm.run(f"cat {READY}").stdout)


def cells_of(path: str, sent: dict, got: dict) -> list[dict]:
    """One cell per write: the writer's figures beside the responder's."""
    cells = []
    for w, r in zip(sent["writes"], got["writes"]):
        gb = w["size"] / 1e9
        ok = w["status"] == "OK" and r["status"] == "OK"
        cells.append({"path": path, "size": w["size"], "mb_s": w.get("mb_s") if ok else None,
                      "frames_s": (w["frames"] / w["seconds"]) if ok and w.get("frames") else None,
                      "receiver_guest_cpu_s_per_gb": r["cpu_seconds"] / gb if ok else None,
                      "sender_guest_cpu_s_per_gb": w["cpu_seconds"] / gb if ok else None,
                      "receiver_payload_bytes_copied": r.get("payload_bytes_copied"),
                      "sender_payload_bytes_copied": w.get("payload_bytes_copied"),
                      "verified": bool(ok and r["verified"]), "error": w.get("error") or r.get("error")})
    return cells


def targets(cells: list[dict]) -> dict:
    """Zero-copy against the bounce at each size both measured (verified): MB/s ratio and
    receiver CPU ratio; the issue's target at the largest such size."""
    def cell(path, size):
        return next((c for c in cells if c["path"] == path and c["size"] == size and c["verified"]), None)
    per_size = {}
    for size in sorted({c["size"] for c in cells}):
        zc, bounce = cell("zero-copy", size), cell("bounce", size)
        if zc and bounce:
            per_size[size] = {"mb_s_vs_bounce": zc["mb_s"] / bounce["mb_s"],
                              "receiver_cpu_vs_bounce": zc["receiver_guest_cpu_s_per_gb"]
                              / bounce["receiver_guest_cpu_s_per_gb"]}
    if not per_size:
        return {"per_size": {}}
    size = max(per_size)
    at = per_size[size]
    return {"per_size": per_size, "target_size": size,
            "target_met": at["mb_s_vs_bounce"] >= 1 and at["receiver_cpu_vs_bounce"] <= 0.5}


def _sizes(text: str) -> list[int]:
    try:
        sizes = [parse_size(s) for s in text.split(",") if s]
    except ValueError:
        sizes = []
    if not sizes or not all(0 < s <= REGION for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes from 1 byte to 16M, comma separated (4K,1M)")
    return sizes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench nic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 KiB and 1 MiB only")
    parser.add_argument("--sizes", type=_sizes, help="these sizes instead (comma separated, up to 16M)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", choices=("type1", "iommufd"), default="type1")
    add_kernel_option(parser)
    add_qemu_build_option(parser)
    add_lab_option(parser, "nic2")
    args = parser.parse_args(argv)
    sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    load = os.getloadavg()[0]
    cells, reports = [], {}
    qemu = f"lab {args.lab}'s" if args.lab else "stock"

    def boot():
        nonlocal qemu
        qemu = use_qemu_build(args)
        return Lab(topology.load("nic2"), kernel=guest_kernel(args), log=lambda *_: None)

    with booted_or_borrowed(args, "nic2", boot, command="scripts/bench nic", kernel=kernel_asked(args)) as lab:
        for path in PATHS:
            sent, got = run_path(lab, path, sizes, args.backend)
            cells += cells_of(path, sent, got)
            reports[path] = {"vfio_backend": got.get("vfio_backend"), "kernel": got.get("kernel")}
    result = {"quick": args.quick, "backend": args.backend, "kernel": args.kernel, "qemu": qemu,
              "load_average_1min": load,
              "sizes": sizes, "cells": cells, "paths": reports, "targets": targets(cells)}
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0 if all(c["verified"] for c in cells) else 1


def _ratio(value, reference) -> str:
    return f"{value / reference:>5.2f}x" if value is not None and reference else f"{'-':>6}"


def _num(value, fmt: str, width: int) -> str:
    return format(value, fmt).rjust(width) if value is not None else "-".rjust(width)


def print_table(result: dict) -> None:
    print(f"nic2, TCG guests, {result['qemu']} QEMU, {result['kernel']} kernel, {result['backend']} backend; "
          f"host load average "
          f"{result['load_average_1min']:.2f} at the start; host0's VRAM -> host1's VRAM, one write per cell")
    print(f"{'size':>7} {'path':10} {'MB/s':>8} {'vs bn':>6} {'frames/s':>9} {'rx CPU s/GB':>11} {'vs bn':>6} "
          f"{'tx CPU s/GB':>11} {'vs bn':>6} {'rx copied':>10} {'tx copied':>10} ok")
    for size in result["sizes"]:
        row = {c["path"]: c for c in result["cells"] if c["size"] == size}
        bounce = row.get("bounce", {})
        for path in PATHS:
            c = row.get(path)
            if c is None:
                continue
            print(f"{size >> 10:>6}K {path:10} {_num(c['mb_s'], '.1f', 8)} {_ratio(c['mb_s'], bounce.get('mb_s'))} "
                  f"{_num(c['frames_s'], '.0f', 9)} {_num(c['receiver_guest_cpu_s_per_gb'], '.1f', 11)} "
                  f"{_ratio(c['receiver_guest_cpu_s_per_gb'], bounce.get('receiver_guest_cpu_s_per_gb'))} "
                  f"{_num(c['sender_guest_cpu_s_per_gb'], '.1f', 11)} "
                  f"{_ratio(c['sender_guest_cpu_s_per_gb'], bounce.get('sender_guest_cpu_s_per_gb'))} "
                  f"{_num(c['receiver_payload_bytes_copied'], 'd', 10)} {_num(c['sender_payload_bytes_copied'], 'd', 10)} "
                  f"{'yes' if c['verified'] else 'NO: ' + str(c['error'])}")
    t = result["targets"]
    if "target_size" in t:
        at = t["per_size"][t["target_size"]]
        print(f"zero-copy at {t['target_size'] >> 10} KiB: {at['mb_s_vs_bounce']:.2f}x the bounce's MB/s (target >= 1), "
              f"{100 * at['receiver_cpu_vs_bounce']:.0f} % of its receiver CPU per GB (target <= 50 %): "
              f"{'met' if t['target_met'] else 'NOT met'}")
    print("vs bn: the figure over the bounce's at the same size; copied: payload bytes each guest's CPU copied "
          "(the kernel's TCP copies not counted)")
