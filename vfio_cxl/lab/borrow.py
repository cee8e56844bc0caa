"""A lab a command borrows instead of booting its own: ``--lab NAME``, or ``$VFIO_CXL_LAB``.

The demos, benches and ``selftest vfio`` that run in one topology boot that topology, run, and
stop it again.  Given ``--lab NAME`` (default: ``$VFIO_CXL_LAB``) they run in that running
detached lab instead (``vfio-cxl vm up TOPOLOGY --detach``) and leave it up: a user iterating on
a driver, and the project's own tests, pay for the boot once.

Before anything runs the lab is checked, and any mismatch is an error naming the lab and what
the command needs, with nothing booted or changed:
- a lab of that name is registered (``vfio-cxl vm ls``) and its fabric manager answers;
- it is of the topology the command needs;
- every VM runs, and every GPU of the topology is attached to the VM the topology puts it in
  (``vfio-cxl fm assign`` moves GPUs: a command written for ``p2p``'s host0 needs them there);
- ``--kernel lab`` (or none) matches the kernel the lab booted.

``borrow()`` gives an object with the in-process lab's interface as these commands use it:
``lab[VM].run(...)`` and ``.start_command(...)``, ``lab.topology``, ``lab.read_backend(...)``.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

from ..errors import LabError

LAB_ENV = "VFIO_CXL_LAB"


def add_lab_option(parser: argparse.ArgumentParser, topology: str) -> None:
    """``--lab NAME``: run in that detached lab of ``topology`` instead of booting one."""
    parser.add_argument("--lab", metavar="NAME", default=os.environ.get(LAB_ENV) or None,
                        help=f"run in this running detached lab of topology {topology} (vfio-cxl vm ls) and "
                             f"leave it up, instead of booting one (default: ${LAB_ENV})")


def guest_shell(fm, lab: str, vm: str):
    """An open SSH connection (vfio_cxl.lab.ssh.GuestShell) to ``vm`` of the detached lab whose
    fabric manager client is ``fm``; the host key is the one the lab wrote for that VM's port."""
    from .ssh import GuestShell

    info = fm.ssh_info(vm)   # fails naming the VM's state if it is not running
    host_key = None
    with open(info["known_hosts"]) as f:
        for line in f:
            host, kind, key = line.split()[:3]
            if host == f"[127.0.0.1]:{info['port']}" and kind == "ssh-ed25519":
                host_key = key
    if host_key is None:
        raise LabError(f"lab {lab}: no host key of VM {vm} in {info['known_hosts']}",
                       f"vfio-cxl vm down {lab}, then boot it again")
    shell = GuestShell(f"{lab}/{vm}", info["port"], info["key"], host_key, info.get("socket"))
    shell.connect(time.monotonic() + 60)
    return shell


class BorrowedVm:
    """One VM of a borrowed lab: ``run`` and ``start_command`` as VirtualMachine has them."""

    def __init__(self, lab: "BorrowedLab", name: str):
        self.lab = lab
        self.name = name

    def run(self, command: str, *, timeout: float = 120, check: bool = True, stdin: str | None = None):
        return self.lab.shell(self.name).run(command, timeout=timeout, check=check, stdin=stdin)

    def start_command(self, command: str, *, timeout: float = 300, stdin: str | None = None):
        return self.lab.shell(self.name).start(command, timeout=timeout, stdin=stdin)

    def put(self, local: str, remote: str) -> None:
        self.lab.shell(self.name).put(local, remote)


class BorrowedLab(AbstractContextManager):
    """A running detached lab, checked by ``borrow()``; leaving its block closes this process's
    connections and leaves the lab up."""

    def __init__(self, name: str, topology, rundir: str, logdir: str, fm):
        self.name = name
        self.topology = topology
        self.rundir = Path(rundir)
        self.logdir = Path(logdir)
        self.fm = fm
        self._shells: dict = {}

    def __getitem__(self, vm: str) -> BorrowedVm:
        if vm not in {v.name for v in self.topology.vms}:
            raise KeyError(f"lab {self.name} has no VM {vm!r}")
        return BorrowedVm(self, vm)

    def shell(self, vm: str):
        if vm not in self._shells:
            self._shells[vm] = guest_shell(self.fm, self.name, vm)
        return self._shells[vm]

    def backend_file(self, name: str) -> Path:
        from .lab import _backend_path

        return _backend_path(self.rundir, name)

    def read_backend(self, name: str, offset: int, length: int) -> bytes:
        """Bytes of a memory backend file as the VMs see them now (as Lab.read_backend)."""
        from .lab import read_at

        return read_at(self.backend_file(name), offset, length)

    def close(self) -> None:
        for shell in self._shells.values():
            shell.close()
        self._shells.clear()
        self.fm.close()

    def __exit__(self, *exc) -> None:
        self.close()


def borrow(name: str, topology: str, *, command: str, kernel: str | None = None) -> BorrowedLab:
    """The running detached lab ``name``, checked to be what ``command`` needs: of ``topology``,
    every VM running, every GPU attached where the topology puts it, and booted on ``kernel``
    ("lab", "debian"; None: either; "custom", a --kernel PATH, is refused: a lab does not say
    which path it booted).  Raises LabError naming the mismatch; changes nothing."""
    from . import topology as topologies
    from .fm import registry
    from .fm.client import FmClient

    if kernel == "custom":   # a lab reports "custom" for any kernel of the user's: no path to match
        raise LabError(f"--kernel PATH boots that kernel, and --lab {name} borrows a running lab whose "
                       "kernel cannot be matched to a path", "leave out --kernel, or leave out --lab "
                       f"(and ${LAB_ENV})")
    try:
        record = registry.find(name)
    except LabError as err:
        raise LabError(f"--lab {name} (or ${LAB_ENV}): {err.what}", err.fix) from None
    if record.topology != topology:
        raise LabError(f"lab {name} is of topology {record.topology!r}; {command} needs {topology!r}",
                       f"vfio-cxl vm up {topology} --detach, then --lab with its name")
    fm = FmClient.for_lab(name, timeout=60).connect()
    try:
        status = fm.status()
        topo = topologies.load(topology)
        why = _unfit(status, topo, kernel)
        if why:
            what, fix = why
            raise LabError(f"lab {name}: {what}; {command} needs {_needs(topo)}", fix.format(lab=name))
    except BaseException:
        fm.close()
        raise
    return BorrowedLab(name, topo, status["rundir"], status["logdir"], fm)


def _needs(topo) -> str:
    placed = ", ".join(f"{g} on {gpu.owner}" for g, gpu in topo.gpus.items() if gpu.owner)
    return f"every VM of {topo.name} running" + (f" and {placed}" if placed else "")


def _unfit(status: dict, topo, kernel: str | None) -> tuple[str, str] | None:
    """(what is wrong, how to fix it) for a lab's FM status against ``topo`` and ``kernel``."""
    for vm in topo.vms:
        state = status["vms"].get(vm.name, {}).get("state", "missing")
        if state != "running":
            return f"VM {vm.name} is {state}", "vfio-cxl vm down {lab}, then boot it again"
    for name, gpu in topo.gpus.items():
        if not gpu.owner:
            continue
        now = status["gpus"].get(name, {})
        if now.get("state") != "attached" or now.get("owner") != gpu.owner:
            where = f"attached to {now['owner']}" if now.get("state") == "attached" else now.get("state", "missing")
            return f"GPU {name} is {where}", f"vfio-cxl fm assign {name} {gpu.owner} --lab {{lab}}"
    booted = status.get("kernel") or "debian"
    if kernel is not None and booted != kernel:
        return (f"it runs the {booted} kernel, not the {kernel} kernel",
                f"vfio-cxl vm up {topo.name} --detach" + (" --kernel lab" if kernel == "lab" else "")
                + ", then --lab with its name")
    return None


def asked_kernel(kernel: str | None) -> str | None:
    """The kernel a ``--kernel`` value names, as a lab reports it: None (not asked), "lab", or
    "custom" (a path)."""
    return None if kernel is None else "lab" if kernel == "lab" else "custom"


def booted_or_borrowed(args: argparse.Namespace, topology: str, boot: Callable[[], AbstractContextManager], *,
                       command: str, kernel: str | None = None) -> AbstractContextManager:
    """The lab a command runs in: ``args.lab`` borrowed (checked as ``borrow`` does), else what
    ``boot()`` returns (an in-process Lab, started by its ``with`` block).  ``kernel``: the
    kernel the command asked for by name ("lab", "debian"), checked against a borrowed lab."""
    if not getattr(args, "lab", None):
        return boot()
    for option, what in (("modules", "a kernel's modules"), ("append", "a kernel command line"),
                         ("qemu", "a QEMU build")):
        if getattr(args, option, None):
            raise LabError(f"--{option} boots a lab with {what}, and --lab {args.lab} borrows a running lab",
                           f"leave out --{option}, or leave out --lab (and ${LAB_ENV})")
    return borrow(args.lab, topology, command=command, kernel=kernel)
