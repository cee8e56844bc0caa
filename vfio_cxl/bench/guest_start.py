"""How long a guest command takes to start: in the guest (its own clock) and through
``vfio-cxl vm ssh`` (the host's clock, a new host process each time, as a user types it).

    python -m vfio_cxl.bench guest-start [--runs 5] [--lab NAME] [--kernel debian|lab] [--json]

Boots ``single`` detached (or borrows the running lab ``--lab NAME``) and runs each command
``--runs`` times after one warm-up, in the guest over one open SSH connection (its clock does not
see the transport), then through ``vfio-cxl vm ssh``; prints the median of each with its reference: ``true`` and
``python3 -c pass`` are the floor every other row stands on.  The last rows run the same
``vfio-cxl gpu ls`` with an empty bytecode cache (``VFIO_CXL_PYC`` pointed at a fresh
directory): what every guest command cost before the lab shared the guests' bytecode.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time

from ..errors import LabError
from ..lab.borrow import add_lab_option, borrow

# (label, guest command, in-guest reference, through-`vm ssh` reference)
COMMANDS = [
    ("true", "true", None, None),
    ("python3 -c pass", "python3 -c pass", None, None),
    ("import vfio_cxl.guest", "python3 -c 'import vfio_cxl.guest'", None, None),
    ("vfio-cxl gpu ls", "vfio-cxl gpu ls", 0.3, 0.6),
    ("cxltool regions (already up)", "python3 -m vfio_cxl.guest.cmd.cxltool regions < /run/vfio-cxl-plan.json",
     None, None),
    ("the same, by vfio-cxl-m (warm)", "vfio-cxl-m vfio_cxl.guest.cmd.cxltool regions < /run/vfio-cxl-plan.json",
     None, None),
    ("FM's vfio-pci check (sh)", "sh -c '[ -d /sys/bus/pci/drivers/vfio-pci ]'", None, None),
]
# The guest's clock around the command (sh: date, as the command, is a fork+exec both ends).
TIMED = "s=$(date +%s.%N); {command} >/dev/null 2>&1; rc=$?; e=$(date +%s.%N); echo \"$rc $s $e\""


def _ssh(lab: str, vm: str, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vfio_cxl", "vm", "ssh", "--lab", lab, vm, "--", command],
                          capture_output=True, text=True, timeout=timeout)


def in_guest(lab, vm: str, command: str) -> float:
    """Seconds the command took by the guest's clock (checked: it exited 0), run over the
    borrowed lab's open SSH connection: the guest's clock does not see the transport, and the
    host needs no new process per run."""
    out = lab[vm].run(TIMED.format(command=command), timeout=120, check=False)
    try:
        rc, start, end = out.stdout.split()[-3:]
    except ValueError:
        raise LabError(f"timing {command!r} in {vm} printed {out.stdout!r} {out.stderr[-300:]!r}",
                       "see the lab's console log") from None
    if rc != "0":
        raise LabError(f"{command!r} failed in {vm} (exit {rc})", f"run it: vfio-cxl vm ssh {vm} -- {command}")
    return float(end) - float(start)


def through_ssh(lab: str, vm: str, command: str) -> float:
    t0 = time.monotonic()
    out = _ssh(lab, vm, command)
    seconds = time.monotonic() - t0
    if out.returncode != 0:
        raise LabError(f"vfio-cxl vm ssh {vm} -- {command} exited {out.returncode}: {out.stderr[-300:]}",
                       "see the lab's console log")
    return seconds


def measure(lab, vm: str, runs: int, log=print) -> list[dict]:
    """Each command's in-guest and through-``vm ssh`` times in ``lab`` (a BorrowedLab)."""
    # the regions plan the lab brought up at boot, kept where the no-op row reads it
    from ..lab import topology
    from ..lab.lab import region_plan
    topo = topology.load("single")
    plan = json.dumps(region_plan(topo, topo.vm(vm)))
    lab[vm].run(f"echo {shlex.quote(plan)} > /run/vfio-cxl-plan.json")
    rows = []
    cases = [*COMMANDS,
             # the same command started the plain way (no warm server), then also with no bytecode
             ("vfio-cxl gpu ls, not warm", "VFIO_CXL_WARM=0 vfio-cxl gpu ls", None, None),
             ("vfio-cxl gpu ls, empty cache", "VFIO_CXL_WARM=0 VFIO_CXL_PYC=$(mktemp -d) vfio-cxl gpu ls", None, None)]
    for label, command, ref_guest, ref_ssh in cases:
        in_guest(lab, vm, command)   # warm-up: the shared bytecode cache holds what it imports
        guest = [in_guest(lab, vm, command) for _ in range(runs)]
        ssh = [through_ssh(lab.name, vm, command) for _ in range(runs)]
        row = {"command": label, "guest_s": statistics.median(guest), "guest_min_s": min(guest),
               "guest_max_s": max(guest), "ssh_s": statistics.median(ssh), "ref_guest_s": ref_guest,
               "ref_ssh_s": ref_ssh, "runs": runs}
        rows.append(row)
        log(f"  {label}: in guest {row['guest_s']:.3f} s, through vm ssh {row['ssh_s']:.3f} s")
    return rows


def _ref(value: float | None) -> str:
    return f"<= {value:.1f} s" if value is not None else "-"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench guest-start", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    add_lab_option(parser, "single")
    parser.add_argument("--kernel", choices=("debian", "lab"), default=None,
                        help="the kernel of the lab it boots (default: lab when built, else debian)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    booted = None
    try:
        if args.lab:
            name = args.lab
        else:
            from ..lab.fm.launch import launch
            from ..lab.kernel import cached_lab_kernel
            kernel = args.kernel or ("lab" if cached_lab_kernel() else "debian")
            booted = name = launch("single", kernel=None if kernel == "debian" else "lab",
                                   echo=lambda text: log(f"  {text}"))["name"]
        with borrow(name, "single", command="scripts/bench guest-start", kernel=args.kernel) as lab:
            rows = measure(lab, "host0", args.runs, log)
    except LabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if booted:
            subprocess.run([sys.executable, "-m", "vfio_cxl", "vm", "down", booted], capture_output=True,
                           timeout=300)
    if args.json:
        print(json.dumps({"lab": name, "rows": rows}, indent=1))
        return 0
    print(f"\n{'command':32} {'in guest':>9} {'reference':>10} {'vm ssh':>8} {'reference':>10}"
          f"   (median of {args.runs})")
    for r in rows:
        print(f"{r['command']:32} {r['guest_s']:8.3f}s {_ref(r['ref_guest_s']):>10} {r['ssh_s']:7.3f}s "
              f"{_ref(r['ref_ssh_s']):>10}")
    return 0
