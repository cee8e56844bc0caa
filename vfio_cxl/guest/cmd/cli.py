"""In the guest: the ``vfio-cxl`` command (installed in the image as /usr/local/bin/vfio-cxl).

    vfio-cxl gpu ls [--json]                   GPUs: BDF, IOMMU group, bound driver, VFIO backend
    vfio-cxl gpu dma [--size N] [--gpu BDF]    VRAM -> devdax via VFIO, checksum verified (exit 0 on a match)
    vfio-cxl gpu vram-write|vram-read ...      put / read a tag in VRAM (what the next owner sees)
    vfio-cxl gpu bind [--wait S] [--json]      wait for a (hot-plugged) GPU and bind it to vfio-pci
    vfio-cxl gpu holders [--json]              processes that hold a GPU's VFIO group or device open
    vfio-cxl nvme ls|identify|read|write ...   NVMe controllers through the userspace driver (nvme_cli.py)
    vfio-cxl nic ls|stats|send|recv|rdma-recv|rdma-write ...   igb NICs through the userspace driver (nic_cli.py)
    vfio-cxl gpu run KERNEL --mode M --latency L --working-set SIZE [--vram-cache SIZE] [--json]
                                               a kernel over CXL far memory (docs/gpu-memory.md)

Every command works right after a hot-plug: a GPU that has no driver yet is
bound to vfio-pci first (driver_override + drivers_probe).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ...devices.gpu import regs
from ...errors import LabError
from ..vfio.backend import IOMMUFD_PATH, choose_backend
from ..vfio.bind import Sysfs, bind_vfio_pci, find_pci_devices, normalize_bdf
from ..vfio.errors import VfioError
# Each command imports what it drives inside itself: `gpu ls` loads no cffi, no driver, no NVMe.


def _gpus() -> list[str]:
    return find_pci_devices(regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID)


def describe(bdf: str, sysfs: Sysfs | None = None, iommufd_path: str = IOMMUFD_PATH) -> dict:
    sysfs = sysfs or Sysfs()
    group = sysfs.iommu_group(bdf)
    driver = sysfs.driver(bdf)
    backend, paths = None, []
    if driver == "vfio-pci" and group is not None:
        # The backend the stack would take for this device (iommufd when the kernel has
        # it, $VFIO_CXL_VFIO_BACKEND overriding), and the ways in the kernel offers.
        backend = choose_backend(bdf, sysfs=sysfs, iommufd_path=iommufd_path)
        cdevs = sorted((sysfs.device_dir(bdf) / "vfio-dev").glob("vfio*"))
        paths = [f"/dev/vfio/devices/{c.name}" for c in cdevs[:1]] + [f"/dev/vfio/{group}"]
    return {"bdf": bdf, "ids": f"{regs.PCI_VENDOR_ID:04x}:{regs.PCI_DEVICE_ID:04x}", "iommu_group": group,
            "driver": driver, "vfio_backend": backend, "vfio_paths": paths}


def cmd_ls(args) -> int:
    found = [describe(bdf) for bdf in _gpus()]
    if args.json:
        print(json.dumps({"gpus": found}))
        return 0
    if not found:
        print("no GPU in this VM")
    for g in found:
        print(f"{g['bdf']}  [{g['ids']}]  iommu group {g['iommu_group']}  driver {g['driver'] or '-'}  "
              f"vfio backend {g['vfio_backend'] or '-'}"
              + (f" ({', '.join(g['vfio_paths'])})" if g["vfio_paths"] else ""))
    return 0


def _bound(bdf: str | None = None) -> str:
    """The GPU (the only one, or ``bdf``) bound to vfio-pci; binds it if it has no driver yet."""
    found = _gpus()
    if bdf is not None:
        bdf = normalize_bdf(bdf)
        if bdf not in found:
            raise VfioError(f"no GPU at {bdf}", f"GPUs here: {', '.join(found) or 'none'} (vfio-cxl gpu ls)")
    elif not found:
        raise VfioError("no GPU in this VM", "assign one from the host: vfio-cxl fm assign GPU VM")
    elif len(found) > 1:
        raise VfioError(f"{len(found)} GPUs here: {', '.join(found)}", "pick one with --gpu BDF")
    else:
        bdf = found[0]
    bind_vfio_pci(bdf)
    return bdf


def cmd_bind(args) -> int:
    """Wait until the VM has ``--count`` GPUs (a hot-plugged one has appeared), bind every one
    to vfio-pci; print them."""
    deadline = time.monotonic() + args.wait
    while True:
        found = _gpus()
        if len(found) >= args.count or time.monotonic() >= deadline:
            break
        time.sleep(0.05)   # polling sysfs for the hot-plugged device (no udev daemon in the guest)
    if len(found) < args.count:
        raise VfioError(f"{len(found)} GPU(s) after {args.wait:.0f} s, expected {args.count}",
                        "is it plugged in? (vfio-cxl fm status on the host; dmesg here)")
    new = [bdf for bdf in found if Sysfs().driver(bdf) != "vfio-pci"]
    for bdf in ([args.gpu] if args.gpu else found):
        bind_vfio_pci(bdf)
    info = {"gpus": [describe(bdf) for bdf in found], "new": new,
            "bdf": new[-1] if new else found[-1], "driver": "vfio-pci"}
    print(json.dumps(info) if args.json else "\n".join(f"{g['bdf']} bound to {g['driver']}" for g in info["gpus"]))
    return 0


def cmd_dma(args) -> int:
    from . import demo_dma
    bdf = _bound(args.gpu)
    result = demo_dma.run(args.size, 0, bdf=bdf)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{bdf}: {result['bytes']} bytes VRAM -> {result['dax']} via VFIO ({result['vfio_backend']}); checksum "
              f"{'MATCH' if result['match'] else 'MISMATCH'} (sha256 {result['sha256_read'][:16]}…)")
    return 0 if result["match"] else 1


def cmd_vram(args) -> int:
    """A tag at the start of VRAM (after ``gpu dma``'s payload area it does not matter where)."""
    from ..drivers.gpu import GpuDriver
    bdf = _bound(args.gpu)
    with GpuDriver.open(bdf) as gpu:
        if args.op == "vram-write":
            gpu.vram_write(args.offset, args.text.encode())
            data = args.text.encode()
        else:
            data = gpu.vram_read(args.offset, args.length)
    if args.json:
        print(json.dumps({"bdf": bdf, "hex": data.hex(), "zero": not any(data)}))
    else:
        print(data.decode(errors="replace"))
    return 0


def cmd_run(args) -> int:
    """A compute kernel over the CXL far window, in one memory mode (docs/gpu-memory.md)."""
    from ..gpumem import GpuMemory, layout
    bdf = _bound(args.gpu)
    with GpuMemory.open(bdf, layout(args.kernel, args.working_set).size) as mem:
        r = mem.run(args.kernel, args.mode, args.latency, args.working_set, args.vram_cache,
                    args.unit, args.warm, args.seed)
    if args.json:
        print(json.dumps(r))
    else:
        c = r["counters"]
        print(f"{r['kernel']} {r['mode']} {r['latency']}: working set {r['working_set']} bytes, "
              f"{'VRAM cache' if r['unit'] else 'VRAM'} {r['vram']} bytes"
              + (f", unit {r['unit']}" if r["unit"] else "") + (" (warm)" if r["warm"] else ""))
        print(f"  result {r['result']:#x}: {'VERIFIED' if r['verified'] else 'WRONG'} ({r['check']})")
        print(f"  modelled {r['modelled_ns'] / 1e3:.1f} us (model: docs/gpu-memory.md, profile "
              f"{r['latency']}); wall {r['wall_s']:.2f} s (not modelled time)")
        print("  counters: " + ", ".join(f"{k} {v}" for k, v in c.items() if k != "modelled_ns" and v))
    return 0 if r["verified"] else 1


SYSPATH_FIELD = "vfio-device-syspath:"


def _device_of(proc: Path, fd: str) -> str | None:
    """The device a VFIO device fd is for (its fdinfo's vfio-device-syspath), or None."""
    try:
        with open(proc / "fdinfo" / fd, encoding="utf-8", errors="replace") as f:
            for line in f.read(4096).splitlines():
                if line.startswith(SYSPATH_FIELD):
                    return line[len(SYSPATH_FIELD):].strip()
    except OSError:
        pass
    return None


def holders(bdf: str | None = None) -> list[dict]:
    """Processes with a VFIO group or device open (what keeps a GPU from being released), one
    entry per process and node; with ``bdf``, only those holding that device: its IOMMU group's
    node, or a device fd whose fdinfo names it.  The fdinfo finds a cdev (iommufd) holder while
    the device is being removed too: vfio deletes the cdev node before it waits for the holders,
    and their fds then read "/dev/vfio/devices/vfioN (deleted)"."""
    group = syspath = None
    if bdf is not None:
        link = Path(f"/sys/bus/pci/devices/{bdf}/iommu_group")
        if not link.exists():
            raise VfioError(f"no PCI device {bdf} with an IOMMU group here", "see vfio-cxl gpu ls")
        group = f"/dev/vfio/{os.readlink(link).rsplit('/', 1)[-1]}"
        syspath = os.path.realpath(f"/sys/bus/pci/devices/{bdf}")
    found, seen = [], set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if not target.startswith("/dev/vfio/") or target == "/dev/vfio/vfio":
                    continue
                if bdf is not None and target != group and _device_of(proc, fd.name) != syspath:
                    continue
                if (proc.name, target) not in seen:
                    seen.add((proc.name, target))
                    found.append({"pid": int(proc.name), "comm": (proc / "comm").read_text().strip(), "path": target})
        except OSError:
            continue
    return found


def cmd_holders(args) -> int:
    found = holders(args.gpu)
    if args.json:
        print(json.dumps({"holders": found}))
    else:
        for h in found:
            print(f"pid {h['pid']} ({h['comm']}) holds {h['path']}")
    return 0


def parse_size(text: str) -> int:
    """``16M``, ``512K``, ``1G``, ``1MiB``, ``0x100000`` or ``4096`` -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(t[:-1] if scale > 1 else t, 0) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 16M, 512K, 0x100000)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return value


class Parser(argparse.ArgumentParser):
    """argparse sizes its help to the terminal through shutil, whose imports (bz2, lzma, fnmatch)
    cost ~30 ms of every start under TCG, help or not: the same width from os.  Subcommands'
    parsers are of this class too (argparse makes them of the parent's)."""

    def _get_formatter(self):
        try:
            columns = int(os.environ["COLUMNS"])
        except (KeyError, ValueError):
            try:
                columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
            except (AttributeError, ValueError, OSError):
                columns = 80
        return self.formatter_class(prog=self.prog, width=columns - 2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="vfio-cxl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="room", required=True)
    gpu = sub.add_parser("gpu", help="the GPUs of this VM").add_subparsers(dest="command", required=True)
    p = gpu.add_parser("ls", help="GPUs, BDF, IOMMU group, bound driver, VFIO backend")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)
    p = gpu.add_parser("dma", help="VRAM -> devdax via VFIO, checksum verified")
    p.add_argument("--size", type=parse_size, default=1 << 20, help="bytes: 16M, 512K, 0x100000 ...")
    p.add_argument("--gpu", metavar="BDF")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_dma)
    p = gpu.add_parser("bind", help="wait for a GPU and bind it to vfio-pci")
    p.add_argument("--wait", type=float, default=0, metavar="S")
    p.add_argument("--count", type=int, default=1, help="wait until there are this many GPUs")
    p.add_argument("--gpu", metavar="BDF")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bind)
    for op in ("vram-write", "vram-read"):
        p = gpu.add_parser(op, help=f"{op.replace('-', ' ')} at an offset of VRAM")
        p.add_argument("--gpu", metavar="BDF")
        p.add_argument("--offset", type=lambda s: int(s, 0), default=regs.MIB * 8)
        if op == "vram-write":
            p.add_argument("text")
        else:
            p.add_argument("--length", type=int, default=32)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=cmd_vram, op=op)
    p = gpu.add_parser("run", help="a compute kernel over CXL far memory, result verified")
    p.add_argument("kernel", choices=list(regs.KERNELS))
    p.add_argument("--mode", choices=list(regs.MODES), default="cxl")
    p.add_argument("--latency", choices=list(regs.LATENCY_PROFILES), default="cxl-80ns")
    p.add_argument("--working-set", type=parse_size, default=8 << 20, metavar="SIZE")
    p.add_argument("--vram-cache", type=parse_size, metavar="SIZE",
                   help="uvm: VRAM bytes the driver may use as cache (default half the VRAM)")
    p.add_argument("--unit", choices=["4K", "64K", "2M"], default="64K", help="uvm migration unit")
    p.add_argument("--warm", action="store_true", help="run once first; measure the second run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gpu", metavar="BDF")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_run)
    p = gpu.add_parser("holders", help="processes that hold a VFIO group or device open")
    p.add_argument("--gpu", metavar="BDF", help="only those holding this GPU (its group, or its device even while it is being removed)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_holders)
    from . import nic_cli, nvme_cli
    nvme_cli.add_parser(sub, parse_size)
    nic_cli.add_parser(sub, parse_size)
    return parser


_PARSER: argparse.ArgumentParser | None = None


def warm() -> None:
    """What the warm server (vfio_cxl.guest.cmd.warm) does once for every command it forks: build
    the parser (~60 ms of a start under TCG)."""
    global _PARSER
    _PARSER = build_parser()


def main(argv: list[str] | None = None) -> int:
    args = (_PARSER or build_parser()).parse_args(argv)
    try:
        return args.func(args)
    except LabError as err:   # VfioError and CxlError are LabErrors
        print(f"vfio-cxl: error: {err.what}" + (f" -- {err.fix}" if err.fix else ""), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
