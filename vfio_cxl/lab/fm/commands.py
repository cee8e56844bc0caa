"""The command line of labs that stay up: ``vm up --detach``, ``vm ls|ssh|down``, ``fm status|events|assign|release|restart``.

Every command here is a request to a lab's fabric manager (vfio_cxl.lab.fm)
over its control socket, except ``vm down`` of a lab whose manager died,
which cleans up after it directly.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from ...errors import LabError


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _stamp(unix: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix)) + f".{int(unix * 1000) % 1000:03d}"


def vm_up_detached(args, topo) -> int:
    """``vm up TOPOLOGY --detach``, ``topo`` loaded by ``vm up``: start the lab's manager, print its name."""
    from .launch import launch

    info = launch(topo, accel=args.accel, ssh_port=args.ssh_port, gpu=not args.no_gpu,
                  timeout=args.timeout, echo=lambda text: print(text, file=sys.stderr, flush=True),
                  kernel=args.kernel, modules=args.modules, append=args.append or "")
    print(info["name"])
    return 0


def lab_summary(record) -> dict:
    """One lab as `vm ls` shows it: live from its manager, or from its record if the manager is gone."""
    from .client import FmClient
    from .registry import uptime

    summary = {"name": record.name, "topology": record.topology, "fm_pid": record.fm["pid"],
               "uptime": uptime(record), "rundir": record.rundir, "logdir": record.logdir,
               "vms": {vm: {"ssh_port": info.get("ssh_port"), "state": "unknown"}
                       for vm, info in record.vms.items()},
               "gpus": {}}
    if not record.fm_alive():
        summary["state"] = "fm-dead"
        for vm in summary["vms"].values():
            vm["state"] = "gone"
        return summary
    try:
        with FmClient(record.socket, lab=record.name, timeout=5) as client:
            status = client.status()
    except LabError:
        summary["state"] = "starting" if record.state == "starting" else "unresponsive"
        return summary
    summary["state"] = status["state"]
    summary["vms"] = {name: {"ssh_port": vm["ssh_port"], "state": vm["state"], "qemu_pid": vm["qemu_pid"]}
                      for name, vm in status["vms"].items()}
    summary["gpus"] = {name: {"owner": gpu["owner"], "state": gpu["state"], "server_pid": gpu["server_pid"]}
                       for name, gpu in status["gpus"].items()}
    return summary


def vm_ls(args) -> int:
    from . import registry

    labs = [lab_summary(r) for r in registry.records()]
    if args.json:
        print(json.dumps(labs, indent=1))
        return 0
    if not labs:
        print("no labs running (start one with: vfio-cxl vm up TOPOLOGY --detach)")
        return 0
    rows = [("LAB", "TOPOLOGY", "STATE", "UPTIME", "FM PID", "VMS (ssh port)", "GPUS (owner)")]
    for lab in labs:
        vms = " ".join(f"{n}:{v['ssh_port']}" + ("" if v["state"] in ("running", "unknown") else f"({v['state']})")
                       for n, v in lab["vms"].items())
        gpus = " ".join(f"{n}->{g['owner'] or '-'}" + ("" if g["state"] == "attached" else f"({g['state']})")
                        for n, g in lab["gpus"].items())
        rows.append((lab["name"], lab["topology"], lab["state"], _duration(lab["uptime"]),
                     str(lab["fm_pid"]), vms or "-", gpus or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for lab in labs:
        if lab["state"] == "fm-dead":
            print(f"\nlab {lab['name']}: its fabric manager is gone and its VMs with it; "
                  f"logs in {lab['logdir']}; clean up with: vfio-cxl vm down {lab['name']}")
    return 0


def vm_ssh(args) -> int:
    from .client import FmClient

    with FmClient.for_lab(args.lab) as client:
        info = client.ssh_info(args.vm)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    argv = ["ssh", "-p", str(info["port"]), "-i", info["key"], "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={info['known_hosts']}", "-o", "StrictHostKeyChecking=yes",
            "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10"]
    if info.get("socket"):
        # the VM's private SSH socket (docs/fabric-manager.md, "SSH reachability"); ssh(1) runs
        # the proxy through sh after %-expansion, so both are quoted
        proxy = shlex.join([sys.executable, "-m", "vfio_cxl.lab.unix_proxy", info["socket"]])
        argv += ["-o", "ProxyCommand=" + proxy.replace("%", "%%")]
    if not command and sys.stdin.isatty():
        argv.append("-t")   # a login shell at a terminal; commands run without one, as with ssh
    argv.append(f"{info['user']}@127.0.0.1")
    if command:
        # One argument is a shell command line (`vm ssh a -- 'ls | wc -l'`); several are an
        # argv whose words reach the guest unchanged (`vm ssh a -- sh -c 'exit 3'`).
        argv += ["--", command[0] if len(command) == 1 else shlex.join(command)]
    from .. import usage
    usage.record("guest", argv[-1] if command else "(interactive shell)")
    sys.stdout.flush()
    try:
        os.execvp("ssh", argv)   # its exit status is the command's (255: ssh itself failed)
    except FileNotFoundError:
        raise LabError("no ssh client on this host", "install openssh-client") from None


def vm_down(args) -> int:
    from . import registry
    from .cleanup import down

    def log(text):
        print(text, file=sys.stderr)

    if args.all:
        targets = registry.records()
        if not targets:
            print("no labs to stop")
            return 0
    else:
        targets = [registry.find(args.lab)]
    for record in targets:
        down(record, log=log)
        print(f"lab {record.name} stopped; logs kept in {record.logdir}")
    return 0


def fm_status(args) -> int:
    from .client import FmClient

    with FmClient.for_lab(args.lab) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(f"lab {status['name']} ({status['topology']}): {status['state']}, up {_duration(status['uptime'])}, "
          f"fabric manager pid {status['fm_pid']}")
    for name, vm in status["vms"].items():
        extra = "" if vm["returncode"] is None else f", exit {vm['returncode']}"
        qmp = f"  (QMP: {vm['run_state']})" if vm["run_state"] else ""
        print(f"  vm  {name:8} {vm['state']:9} ssh 127.0.0.1:{vm['ssh_port']}  QEMU pid {vm['qemu_pid']}{extra}{qmp}")
    for name, gpu in status["gpus"].items():
        extra = "" if gpu["returncode"] is None else f", exit {gpu['returncode']}"
        print(f"  gpu {name:8} {gpu['state']:9} owner {gpu['owner'] or '-'}  server pid {gpu['server_pid']}  "
              f"VRAM {gpu.get('vram_mib')} MiB {'scrubbed' if gpu.get('scrubbed') else 'holds data'}  "
              f"irq {gpu.get('irq')}{extra}")
    for name, ports in status.get("free_hotplug_ports", {}).items():
        print(f"  vm  {name:8} free hot-plug ports: {', '.join(ports) or 'none'}")
    print(f"  logs: {status['logdir']} (live: {status['rundir']})")
    return 0


def _print_event(ev: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(ev), flush=True)
    else:
        print(f"{_stamp(ev['time'])}  {ev['kind']:16} {ev['message']}", flush=True)


def fm_events(args) -> int:
    from .client import FmClient

    with FmClient.for_lab(args.lab) as client:
        if args.follow:
            events = client.follow_events()
            _say_dropped(client.dropped)
            for ev in events:
                _print_event(ev, args.json)
        else:
            page = client.events_page()
            _say_dropped(page["dropped"])
            while True:
                for ev in page["events"]:
                    _print_event(ev, args.json)
                if not page["more"] or not page["events"]:
                    break
                page = client.events_page(since=page["events"][-1]["seq"])
    return 0


def _say_dropped(count: int) -> None:
    from .events import EVENT_HISTORY

    if count:
        print(f"({count} older events are no longer kept: the fabric manager keeps the newest "
              f"{EVENT_HISTORY}; its fm.log has them all)", file=sys.stderr, flush=True)


def _fabric_call(args, op: str, **fields) -> int:
    from .client import FmClient

    with FmClient.for_lab(args.lab) as client:   # waits for a slow op as long as the FM may take
        result = getattr(client, op)(**fields)
    if args.json:
        print(json.dumps(result))
        return 0
    timing = ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in result.items() if k.endswith("_s"))
    where = f" -> {result['vm']} ({result.get('bdf', '')})" if result.get("vm") and op != "release" else ""
    print(f"{op} {result.get('gpu')}{where}: ok" + (f"; {timing}" if timing else "")
          + ("" if result.get("scrubbed", True) else "; VRAM kept"))
    return 0


def fm_restart(args) -> int:
    return _fabric_call(args, "restart", gpu=args.gpu)


def fm_assign(args) -> int:
    return _fabric_call(args, "assign", gpu=args.gpu, vm=args.vm, keep_vram=args.keep_vram)


def fm_release(args) -> int:
    fields = {"timeout": args.timeout} if args.timeout is not None else {}
    return _fabric_call(args, "release", gpu=args.gpu, force=args.force, keep_vram=args.keep_vram, **fields)


def fm_redfish(args) -> int:
    from .client import FmClient

    with FmClient.for_lab(args.lab) as client:
        result = client.redfish(port=args.port, stop=args.stop)
    if args.json:
        print(json.dumps(result))
    elif args.stop:
        print(f"Redfish service of lab {client.lab} (pid {result['pid']}) stopped")
    else:
        print(result["url"])
    return 0


def add_vm_commands(vm: argparse._SubParsersAction) -> None:
    ls = vm.add_parser("ls", help="list labs started with --detach")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=vm_ls)
    ssh = vm.add_parser("ssh", help="a shell in a VM of a running lab, or run a command there")
    ssh.add_argument("--lab", help="the lab (default: the only one running)")
    ssh.add_argument("vm")
    ssh.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...: run CMD; its exit status is ours")
    ssh.set_defaults(func=vm_ssh)
    down = vm.add_parser("down", help="stop a lab and remove what it made (logs are kept)")
    down.add_argument("lab", nargs="?", help="the lab (default: the only one)")
    down.add_argument("--all", action="store_true", help="every lab in `vfio-cxl vm ls`")
    down.set_defaults(func=vm_down)


def add_fm_parser(sub: argparse._SubParsersAction) -> None:
    fm = sub.add_parser("fm", help="a running lab's fabric manager").add_subparsers(dest="fm_command",
                                                                                    required=True)
    status = fm.add_parser("status", help="VMs and GPUs: state, owner, pids")
    status.add_argument("--lab")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=fm_status)
    events = fm.add_parser("events", help="what the fabric manager did and saw, with timestamps")
    events.add_argument("--lab")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events until the lab stops")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    events.set_defaults(func=fm_events)
    restart = fm.add_parser("restart", help="a fresh GPU server (VRAM scrubbed), re-attached to its VM")
    restart.add_argument("--lab")
    restart.add_argument("--json", action="store_true")
    restart.add_argument("gpu")
    restart.set_defaults(func=fm_restart)
    assign = fm.add_parser("assign", help="hot-plug a GPU into a VM (released from its owner first)")
    assign.add_argument("--lab")
    assign.add_argument("--json", action="store_true")
    assign.add_argument("--keep-vram", action="store_true", help="hand VRAM over intact (default: scrubbed)")
    assign.add_argument("gpu")
    assign.add_argument("vm")
    assign.set_defaults(func=fm_assign)
    release = fm.add_parser("release", help="hot-remove a GPU from its VM (device_del, DEVICE_DELETED)")
    release.add_argument("--lab")
    release.add_argument("--json", action="store_true")
    release.add_argument("--force", action="store_true",
                         help="if the guest does not let go within the timeout: kill the guest processes "
                              "that hold the GPU, then wait again")
    release.add_argument("--timeout", type=float, metavar="S",
                         help="seconds the guest gets to let go (default 15, at most 600); the command waits as long as the fabric manager may take")
    release.add_argument("--keep-vram", action="store_true", help="keep VRAM for the next owner")
    release.add_argument("gpu")
    release.set_defaults(func=fm_release)
    redfish = fm.add_parser("redfish", help="serve the lab's fabric as a Redfish service on 127.0.0.1 "
                                            "(prints its URL; docs/redfish.md)")
    redfish.add_argument("--lab")
    redfish.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")
    redfish.add_argument("--stop", action="store_true", help="end the lab's Redfish service")
    redfish.add_argument("--json", action="store_true")
    redfish.set_defaults(func=fm_redfish)
