"""vfio-cxl: the command line.

    vfio-cxl provision                       host packages, QEMU runtime, guest image
    vfio-cxl vm up TOPOLOGY [--dry-run]      boot a topology: a name or a .toml path (Ctrl-C stops it)
    vfio-cxl vm up TOPOLOGY --detach         boot it and return; the lab stays up
    vfio-cxl vm ls | ssh VM | down [LAB]     labs that stay up
    vfio-cxl fm status|events|assign|release|restart   a running lab's fabric manager
    vfio-cxl vm topologies                   list topologies
    vfio-cxl vm topology TOPOLOGY [--svg F]  the topology as a tree (text), or drawn (--svg/--png)
    vfio-cxl demo tour|dma|share|p2p         the demos
    vfio-cxl selftest vfio [--kernel lab]    the kernel's VFIO selftests on the GPU and an igb
    vfio-cxl gpu serve --socket PATH         the vfio-user GPU device server
    vfio-cxl smc serve --sockets DIR --hosts N   the shared-memory controller (one socket per host)
    vfio-cxl bench NAME                      benchmarks (python -m vfio_cxl.bench)
    vfio-cxl matrix run FILE [--address A]   a kernel x topology x test matrix of labs on Ray
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import select
import shlex
import signal
import sys

from .lab.borrow import add_lab_option
from .lab.fm import commands as fm_cli
from .errors import LabError


def _provision(args) -> int:
    from .lab.image import find_image
    from .lab.qemu_runtime import find_runtime

    from .lab.kernel import lab_kernel, superseded_lab_kernel

    earlier = superseded_lab_kernel() if args.refresh_lab_kernel and args.kernel != "lab" else None
    if earlier is not None:
        print(f"the lab kernel's recipe changed since {earlier.name} was built: building it again")
    if args.kernel == "lab" or earlier is not None:
        print(f"lab kernel {lab_kernel().image}")   # the cached one for this recipe, else built now

    runtime = find_runtime()
    print(runtime.version_string)
    image = find_image()
    print(f"guest image {image.root} (kernel {image.manifest['kernel']})")
    return 0


def _topologies(args) -> int:
    from .lab import topology

    for name in topology.available():
        topo = topology.load(name)
        print(f"{name:10} {' '.join(topo.description.split())}")
    return 0


def _topology_picture(args) -> int:
    from pathlib import Path

    from .lab import picture, topology

    topo = topology.load(args.topology)
    if args.svg or args.png:
        for path, fmt in ((args.svg, "svg"), (args.png, "png")):
            if path:
                picture.render(topo, Path(path), fmt)
                print(f"{topo.name}: {path}")
        return 0
    print(picture.text(topo), end="")
    return 0


def _vm_up(args) -> int:
    from pathlib import Path

    from .lab import topology
    from .lab.lab import Lab

    detach = args.detach and not args.dry_run
    if detach and args.run:
        raise LabError("--run and --detach do not go together",
                       "use --detach, then vfio-cxl vm ssh VM -- CMD")
    topo = topology.load(args.topology)   # once: the lab here, or the detached lab's manager, gets it
    if detach:
        return fm_cli.vm_up_detached(args, topo)

    from .lab.kernel import resolve

    # Checked before anything starts: a missing file or option fails here.
    kernel = resolve(args.kernel, args.modules, args.append or "", provision=not args.dry_run)
    lab = Lab(topo, accel=args.accel, ssh_port=args.ssh_port, gpu=not args.no_gpu, kernel=kernel)
    if args.dry_run:
        from .lab.qemu_runtime import provisioned_runtime

        runtime = provisioned_runtime()
        version = runtime.version_string if runtime else "QEMU not provisioned yet (run: vfio-cxl provision)"
        for vm in lab.plan(Path("/tmp/vfio-cxl-DRYRUN")):
            print(f"# {vm.name}: {version}")
            print(shlex.join(["qemu-system-x86_64", *vm.argv()]))
        return 0
    with lab:
        for vm in lab.vms.values():
            print(f"{vm.name}: ssh -p {vm.res.ssh_port} -i {lab.image.ssh_key} "
                  f"-o StrictHostKeyChecking=no root@127.0.0.1")
        if args.run:
            failed = []
            for vm in lab.vms.values():
                result = vm.run(args.run, check=False, timeout=args.timeout)
                print(result.stdout, end="")
                print(result.stderr, end="", file=sys.stderr)
                if result.exited != 0:
                    failed.append(f"{vm.name} (exit {result.exited})")
            if failed:
                raise LabError(f"--run {args.run!r} failed in {', '.join(failed)}", "see its output above")
            return 0
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:   # a background job of a script
            print(f"lab running; SIGINT is ignored here (a background job): kill -TERM {os.getpid()} stops it",
                  flush=True)
        else:
            print("lab running; Ctrl-C stops it", flush=True)
        wait_for_a_signal()   # Ctrl-C/SIGTERM raise KeyboardInterrupt; leaving `with` stops the lab


def wait_for_a_signal() -> None:
    """``signal.pause()`` for a process with threads: until a signal's Python handler has run
    (and raised), whichever thread the kernel gave the signal to.  ``pause()`` returns only
    for a signal the main thread itself takes, and a lab's SSH clients have threads: a Ctrl-C
    one of them took left ``vm up`` running.  The signal writes a byte to a pipe
    (``signal.set_wakeup_fd``); once ``select`` returns, the main thread runs the handler."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    try:
        while True:
            select.select([r], [], [])
            os.read(r, 64)   # a signal whose handler did not raise
    finally:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)


def _selftest(args) -> int:
    import contextlib
    import json
    import time

    from .lab import selftests, topology
    from .lab.borrow import asked_kernel, borrow
    from .lab.fm.registry import reserve_name
    from .lab.kernel import resolve
    from .lab.lab import Lab

    started = time.monotonic()
    out = sys.stderr if args.json else sys.stdout

    def log(message: str) -> None:
        print(message, file=out, flush=True)

    # Everything that can be wrong with the input fails here, before anything boots.
    if args.backend not in selftests.BACKENDS:
        raise LabError(f"--backend {args.backend}: unknown backend",
                       f"use one of: {', '.join(selftests.BACKENDS)}")
    # a file with VFIO in its config, or 'lab'; a borrowed lab (--lab) is checked to run the one named
    kernel = None if args.lab else resolve(args.kernel, log=log)
    topo = topology.load("selftest")
    with contextlib.ExitStack() as held:
        if args.lab:   # a lab that cannot serve fails here, before the selftests build
            lab = held.enter_context(borrow(args.lab, topo.name, command="vfio-cxl selftest vfio",
                                            kernel=asked_kernel(args.kernel)))
            logdir = lab.logdir
        build = selftests.build_selftests(log=log)
        plan = selftests.Plan.make(build, args.backend, args.k)
        log(f"VFIO selftests of {build.version} ({'cached' if build.cached else f'built in {build.seconds:.0f} s'}): "
            f"{plan.count()} cases, modes {', '.join(plan.modes)}; "
            + (f"lab {args.lab}" if args.lab else f"kernel {kernel.label if kernel else 'debian'}"))
        if not args.lab:
            name, logdir = reserve_name(topo.name)
            lab = held.enter_context(Lab(topo, kernel=kernel, logdir=logdir, log=log))   # boots it
        results, guest = selftests.run(lab, "host0", build, plan, logdir / "selftests", log)
    report = selftests.summary(results)
    seconds = time.monotonic() - started
    if args.json:
        print(json.dumps({**report, "kernel": guest["kernel"], "seconds": round(seconds, 1),
                          "logs": str(logdir)}, indent=1))
    else:
        print(selftests.table(results))
        print(f"guest kernel {guest['kernel']}; {seconds:.0f} s in all "
              f"(build {'cached' if build.cached else f'{build.seconds:.0f} s'}); TAP logs in {logdir}/selftests")
    return 0 if report["failed"] == 0 else 1


def _demo(args) -> int:
    from .demos import run_demo

    return run_demo(args.name, args.rest)


def _forward(module: str):
    def run(args) -> int:
        import importlib

        return importlib.import_module(module).main(args.rest) or 0
    return run


def add_qemu_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--qemu", metavar="PATH",
                        help="your own qemu-system-x86_64 build, checked as the lab's is (version >= 10.1; "
                             "cxl-type3, vfio-user-pci, intel-iommu); VFIO_CXL_QEMU=PATH does the same for "
                             "any command that boots (tests, benchmarks)")


def build_parser() -> argparse.ArgumentParser:
    from .lab.kernel_options import add_kernel_options

    parser = argparse.ArgumentParser(prog="vfio-cxl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    prov = sub.add_parser("provision", help="install host packages, the QEMU runtime and the guest image")
    prov.add_argument("--kernel", choices=["lab"], help="also build the lab kernel (IOMMUFD, VFIO cdev, CXL)")
    prov.add_argument("--refresh-lab-kernel", action="store_true",
                      help="build the lab kernel again if the cache holds one of an earlier recipe only "
                           "(./scripts/test does: the lab-kernel tests would skip without it)")
    prov.set_defaults(func=_provision)

    vm = sub.add_parser("vm", help="boot topologies").add_subparsers(dest="vm_command", required=True)
    up = vm.add_parser("up", help="boot a topology and keep it running until Ctrl-C")
    up.add_argument("topology", help="a name (see 'vfio-cxl vm topologies') or a .toml path")
    up.add_argument("--dry-run", action="store_true", help="print the QEMU command lines and exit")
    up.add_argument("--ssh-port", type=int, help="host port for the first VM's SSH (next VMs: +1, ...)")
    up.add_argument("--accel", choices=["tcg", "kvm"], default="tcg",
                    help="accelerator (default tcg; kvm only where it works)")
    up.add_argument("--no-gpu", action="store_true", help="do not attach the vfio-user GPU")
    up.add_argument("--run", metavar="CMD", help="run CMD in every VM over SSH, print it, then stop")
    up.add_argument("--detach", action="store_true",
                    help="return once every VM answers SSH and print the lab's name; the lab stays up")
    up.add_argument("--timeout", type=float, default=300, help="seconds to wait for the VMs (--detach), or for CMD (--run)")
    add_qemu_option(up)
    add_kernel_options(up)
    up.set_defaults(func=_vm_up)
    fm_cli.add_vm_commands(vm)
    vm.add_parser("topologies", help="list topologies").set_defaults(func=_topologies)
    pic = vm.add_parser("topology", help="show a topology as a tree, or draw it with graphviz")
    pic.add_argument("topology", help="a name (see 'vfio-cxl vm topologies') or a .toml path")
    pic.add_argument("--svg", metavar="FILE", help="draw it as SVG into FILE")
    pic.add_argument("--png", metavar="FILE", help="draw it as PNG into FILE")
    pic.set_defaults(func=_topology_picture)

    fm_cli.add_fm_parser(sub)

    st = sub.add_parser("selftest", help="the kernel's own selftests, run in the lab")
    st.add_argument("suite", choices=["vfio"], help="vfio: tools/testing/selftests/vfio on the GPU and an igb")
    st.add_argument("--kernel", metavar="lab|PATH",
                    help="boot this kernel (default: the image's Debian kernel; 'lab': the lab kernel, IOMMUFD)")
    st.add_argument("--backend", default="all", metavar="type1|iommufd|all",
                    help="IOMMU modes: type1 (vfio_type1_iommu, vfio_type1v2_iommu), iommufd "
                         "(iommufd_compat_type1, iommufd_compat_type1v2, iommufd) or all (default)")
    st.add_argument("-k", action="append", metavar="FILTER",
                    help="only cases whose TEST.CASE contains FILTER (or matches it as a glob); repeatable")
    st.add_argument("--json", action="store_true", help="print the results as JSON")
    add_lab_option(st, "selftest")
    st.set_defaults(func=_selftest)

    from .matrix.command import add_parser as add_matrix_parser
    add_matrix_parser(sub)

    demo = sub.add_parser("demo", help="run a demo (tour, dma, share, p2p)")
    add_qemu_option(demo)
    demo.add_argument("name")
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_demo)

    for name, module, text in (("gpu", "vfio_cxl.devices.gpu.serve", "the vfio-user GPU device server"),
                               ("smc", "vfio_cxl.devices.smc.serve", "the shared-memory controller server"),
                               ("bench", "vfio_cxl.bench.__main__", "benchmarks")):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_forward(module))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "qemu", None):   # every lab this process (or a detached FM) boots uses it
        from .lab.qemu_runtime import QEMU_ENV
        os.environ[QEMU_ENV] = os.path.abspath(os.path.expanduser(args.qemu))
    # A lab process that hangs can be asked where: SIGABRT prints every thread's stack.
    faulthandler.enable(all_threads=True)
    # SIGTERM unwinds like Ctrl-C, so labs stop their VMs on either.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return args.func(args)
    except LabError as err:
        print(f"vfio-cxl: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vfio-cxl: interrupted; lab stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
