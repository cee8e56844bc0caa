"""Boot-to-SSH time per topology and per kernel (GPU servers attached, regions brought
up), median of N boots.

    python -m vfio_cxl.bench boot [--runs 3] [--no-gpu] [--topology NAME | --all]
                                  [--kernel PATH|lab|debian ...] [--json]

Default: the single topology, on Debian's kernel (the image's) and, if it is built, the
lab kernel, alternating so every kernel sees the same machine load.  Each figure is the
slowest VM of the lab from QEMU start to SSH; the time to bring the declared regions up
with cxl-cli, daxctl and ndctl is reported beside it.  Then where the time went:
firmware and kernel loading (host clock until the guest kernel's clock starts), the
kernel until init runs, init until the lab may connect (its network line; the guest init
stamps its console lines with /proc/uptime), then SSH: the SSH server's start, the key
exchange and authentication, with the init's last steps (shares, regions) beside them,
until both are done; and QEMU's CPU seconds for the whole boot (load-independent: on an
idle machine the boot takes about that long).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from ..lab import topology
from ..lab.image import find_image
from ..lab.kernel import cached_lab_kernel, resolve
from ..lab.lab import Lab
from ..lab.qemu_runtime import find_runtime

# single's boot to SSH, and regions up after SSH, by kernel
TARGETS = {"debian": (15.0, None), "lab": (1.5, 1.0)}


def _targets(kernel: str, name: str) -> tuple[float | None, float | None]:
    """(boot to SSH, regions after SSH) targets: set for ``single`` only."""
    return TARGETS.get(kernel, (None, None)) if name == "single" else (None, None)


def _target(kernel: str, name: str) -> str:
    ssh, regions = _targets(kernel, name)
    return "" if ssh is None else f"<= {ssh:g} s" + (f", regions <= {regions:g} s after" if regions else "")


def _stages_line(stages) -> str:
    if stages is None or stages.before_kernel is None:
        return f"QEMU {stages.cpu:.2f} CPU-s" if stages else ""
    return (f"firmware+load {stages.before_kernel:.2f} + kernel {stages.kernel_to_init:.2f} + init "
            f"{stages.init_to_network:.2f} + ssh {stages.ssh:.2f} s; QEMU {stages.cpu:.2f} CPU-s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench boot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-gpu", action="store_true")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--topology", default="single", help="a topology name or .toml path (default single)")
    which.add_argument("--all", action="store_true", help="every shipped topology")
    parser.add_argument("--kernel", action="append", metavar="PATH|lab|debian",
                        help="kernels to time (default: debian, and lab if it is built)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout (progress on stderr)")
    args = parser.parse_args(argv)
    if args.json:   # the tables and progress go to stderr; stdout carries the JSON alone
        out, sys.stdout = sys.stdout, sys.stderr
    names = topology.available() if args.all else [args.topology]
    kernels = args.kernel or ["debian"] + (["lab"] if cached_lab_kernel() else [])
    chosen = {k: None if k == "debian" else resolve(k, provision=False) for k in kernels}
    runtime, image = find_runtime(), find_image()
    print(f"{runtime.version_string}, accel tcg; debian = the image's kernel {image.manifest['kernel']}")
    rows = []
    for name in names:
        topo = topology.load(name)
        boots = {k: [] for k in kernels}
        totals = {k: [] for k in kernels}
        stages = {k: [] for k in kernels}
        for run in range(1, args.runs + 1):
            for k, kernel in chosen.items():   # alternating kernels: the same machine load for each
                t0 = time.monotonic()
                with Lab(topo, runtime=runtime, image=image, gpu=not args.no_gpu, kernel=kernel,
                         log=lambda *_: None) as lab:
                    totals[k].append(time.monotonic() - t0)
                    slowest = max(lab.vms.values(), key=lambda vm: vm.boot_seconds)
                    boots[k].append(slowest.boot_seconds)
                    stages[k].append(slowest.boot_stages)
                print(f"{name} [{k}] boot {run}: {boots[k][-1]:.2f} s to SSH (slowest of "
                      f"{len(topo.vms)} VMs), {totals[k][-1]:.2f} s with regions up; "
                      f"{_stages_line(stages[k][-1])}")
        for k in kernels:
            # regions: from SSH (the slowest VM's) until every VM's regions are up, per boot
            after = [t - b for t, b in zip(totals[k], boots[k])]
            rows.append((name, k, len(topo.vms), boots[k], statistics.median(totals[k]), stages[k],
                         statistics.median(after)))
    print(f"\n{'topology':12} {'kernel':8} {'VMs':>3} {'boot-to-SSH':>12} {'min':>6} {'max':>6} "
          f"{'regions after':>13} {'= up':>6}  target (median of {args.runs})")
    for name, k, count, b, total, _, after in rows:
        print(f"{name:12} {k:8} {count:3d} {statistics.median(b):11.2f}s {min(b):5.2f}s {max(b):5.2f}s "
              f"{after:12.2f}s {total:5.2f}s  {_target(k, name)}")
    print("\nwhere the slowest VM's boot went (median; wall seconds, and QEMU's CPU seconds, which do not "
          "depend on the machine's load)")
    print(f"{'topology':12} {'kernel':8} {'firmware+load':>13} {'kernel':>7} {'init':>6} {'ssh':>6} "
          f"{'= to SSH':>8} {'QEMU CPU-s':>10}")
    for name, k, _, b, _, st, _ in rows:
        def med(get):
            values = [v for v in (get(s) for s in st) if v is not None]
            return f"{statistics.median(values):.2f}" if values else "-"
        print(f"{name:12} {k:8} {med(lambda s: s.before_kernel):>13} {med(lambda s: s.kernel_to_init):>7} "
              f"{med(lambda s: s.init_to_network):>6} {med(lambda s: s.ssh):>6} {statistics.median(b):8.2f} "
              f"{med(lambda s: s.cpu):>10}")
    print("init: from its first line to its network line, when the lab connects; ssh: from there until the SSH "
          "session is open and the init's ready line is out (the shares and regions come up beside the key exchange)")
    if not args.kernel and "lab" not in kernels:
        print("lab kernel not built (vfio-cxl provision --kernel lab): Debian's kernel only")
    if args.json:
        def median(values):
            return statistics.median(values) if values else None
        print(json.dumps({"runs": args.runs, "rows": [
            {"topology": name, "kernel": k, "vms": count, "ssh_s": statistics.median(b), "ssh_min_s": min(b),
             "ssh_max_s": max(b), "regions_after_ssh_s": after, "up_s": total,
             "target_ssh_s": _targets(k, name)[0], "target_regions_after_ssh_s": _targets(k, name)[1],
             "stages": {stage: median([getattr(x, stage) for x in st if x is not None and getattr(x, stage) is not None])
                        for stage in ("before_kernel", "kernel_to_init", "init_to_network", "ssh", "init_to_ready", "cpu")}}
            for name, k, count, b, total, st, after in rows]}, indent=1), file=out)
    return 0
