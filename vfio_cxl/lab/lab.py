"""A lab: the VMs of one topology, their GPU servers and shared memory, as one unit.

    with Lab(topology.load("shared")) as lab:
        lab["a"].run("cxl list")

Everything a lab creates lives in one private run directory (sockets, console
logs, CXL backing files, overlays); stopping the lab -- normally, on an
exception or on Ctrl-C -- stops every VM and server and removes that
directory.  Ports and paths are chosen per lab, so labs can run side by side.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from ..errors import LabError
from ..paths import MANAGED_MARKER, guest_bytecode_dir, guest_source, runtime_root
from .argv import VmResources
from .device_process import DeviceServerProcess, smc_server
from .gpu_process import GpuServerProcess
from .host_tsc import host_tsc_khz
from .image import GuestImage, find_image, image_path
from .logs import archive_logs
from .kconfig import kconfig_hz
from .kernel import GuestKernel
from . import usage
from .qemu_runtime import QemuRuntime, find_runtime, planned_runtime
from .ssh import join_all
from .topology import Topology, Vm
from .vm import VirtualMachine


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now: all held bound until every one is
    picked (one bind at a time may get the same port back twice: a Ray node once got one port
    for two of its components and refused to start).  Whoever uses them binds them later, and
    another process may take one in between: the lab's own SSH forwards do not use this (QEMU
    binds port 0 and the lab reads the port back, vm.py); ray's ports in vfio_cxl/matrix do."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def check_port_free(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise LabError(f"port {port} on 127.0.0.1 is already in use",
                           "choose another --ssh-port, or leave it out to pick a free one") from None


def read_at(path: Path, offset: int, length: int) -> bytes:
    """Bytes of a file the VMs share as they are now: pread, not a buffered file object, which
    would serve a stale copy when read again at the same place while the guests keep writing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _backend_path(rundir: Path, name: str) -> Path:
    return rundir / f"{name}.mem"


# The regions' result: the guest's init started ram_regions.sh (a plan of ram regions only) or
# `cxltool regions` on the plan it read from fw_cfg (images/rootfs/sbin/vfio-cxl-init); this waits
# for it and hands over what it printed and its exit status.  A kernel without fw_cfg in sysfs (a
# --kernel of the user's): the init started nothing, and the plan on stdin goes to the same
# program here.
RAM_REGIONS = "busybox sh /opt/vfio-cxl/vfio_cxl/guest/ram_regions.sh"   # the shell the init runs it in
CXLTOOL_REGIONS = "python3 -m vfio_cxl.guest.cmd.cxltool regions"


def regions_result(start: str) -> str:
    """The guest command that collects the regions the init brought up, or runs ``start``."""
    return REGIONS_RESULT.replace("{start}", start)


REGIONS_RESULT = (
    "r=/run/vfio-cxl/regions; "
    "if [ ! -e $r.started ]; then exec {start}; fi; "
    "exec < /dev/null; i=0; "
    "until [ -e $r.rc ]; do i=$((i+1)); [ $i -le 15000 ] || { echo 'the regions the guest init started did not finish in 300 s' >&2; exit 1; }; "
    "sleep 0.02; done; "
    "cat $r.out; cat $r.err >&2; exit $(cat $r.rc)")


def _has_regions(plan: dict) -> bool:
    return bool(plan["regions"] or plan["pmem"])


def ram_regions_plan(plan: dict) -> str | None:
    """A plan of ram regions for devdax only, as the text vfio_cxl/guest/ram_regions.sh reads (one
    region a line: name, window, granularity, serials in position order); None for any other
    plan (pmem, namespaces: cxltool regions with cxl-cli)."""
    if plan["pmem"] or any(r["type"] != "ram" or r["use"] != "devdax" for r in plan["regions"]):
        return None
    return "".join(f"{r['name']} {r['window']} {r['granularity']} {','.join(map(str, r['serials']))}\n"
                   for r in plan["regions"])


def region_plan(topo: Topology, vm: Vm) -> dict:
    """What the guest's ``cxltool regions`` creates: each region's memdevs as
    serial numbers (``cxl-type3,sn=``) in interleave position order."""
    regions = []
    for region in vm.regions:
        window = vm.windows[region.window]
        regions.append({"name": region.name, "type": region.type, "window": region.window,
                        "granularity": region.granularity or window.granularity, "use": region.use,
                        "serials": [vm.serial(m) for m in vm.region_order(region)]})
    return {"pmem": any(t.persistent for t in vm.type3), "regions": regions}


def nic_sockets(topo: Topology, rundir: Path) -> dict[str, tuple[Path, bool]]:
    """NIC name -> (socket, listens) for every NIC on a link: one socket per link in the run
    directory, ``linkI-nic.sock``, on which the NIC of the link's first VM listens (as that VM
    does on the link's virtio-net socket) and its peer connects."""
    return {nic.name: (rundir / f"link{nic.link}-nic.sock", nic.owner == topo.links[nic.link].vms[0])
            for nic in topo.nics.values() if nic.link is not None}


def remove_stale_rundirs() -> None:
    """Remove run directories whose lab process is gone (it was SIGKILLed:
    its VMs died with it, but nothing could remove its files)."""
    for rundir in runtime_root().glob("vfio-cxl-*"):
        if (rundir / MANAGED_MARKER).exists():
            continue
        try:
            pid = int((rundir / "lab.pid").read_text())
        except (OSError, ValueError):
            continue
        if not Path(f"/proc/{pid}").exists():
            shutil.rmtree(rundir, ignore_errors=True)


def gpu_server_args(gpu) -> list[str]:
    """The GPU server's options for a topology's ``[gpus.NAME]``: VRAM size, interrupt mode."""
    return ["--vram-mib", str(gpu.vram >> 20), "--irq-mode", gpu.irq]


class Lab:
    def __init__(self, topology: Topology, *, runtime: QemuRuntime | None = None,
                 image: GuestImage | None = None, accel: str = "tcg", ssh_port: int | None = None,
                 gpu: bool = True, gpu_args: list[str] = (), kernel: GuestKernel | None = None,
                 log=print, rundir: Path | None = None, logdir: Path | None = None):
        self.topology = topology
        self.runtime = runtime
        self.image = image
        self.accel = accel
        self.ssh_port = ssh_port
        self.gpu = gpu
        self.gpu_args = list(gpu_args)
        self.kernel = kernel   # None: the image's own kernel (see kernel.resolve)
        self.log = log
        self.rundir: Path | None = None
        self.rundir_request = rundir   # an empty directory made by the caller, or None: a fresh one
        self.logdir = logdir           # where stop() keeps copies of the logs, or None
        self.vms: dict[str, VirtualMachine] = {}
        self.gpu_servers: dict[str, GpuServerProcess] = {}
        self.smc_servers: dict[str, DeviceServerProcess] = {}

    def __getitem__(self, name: str) -> VirtualMachine:
        if name not in self.vms:
            raise LabError(f"no running VM {name!r} in this lab", f"VMs: {', '.join(self.vms) or 'none'}")
        return self.vms[name]

    def backend_file(self, name: str) -> Path:
        assert self.rundir is not None
        return _backend_path(self.rundir, name)

    def read_backend(self, name: str, offset: int, length: int) -> bytes:
        """Bytes of a memory backend file as the VMs see them now."""
        return read_at(self.backend_file(name), offset, length)

    def nvme_file(self, vm: str, nvme: str, nsid: int = 1) -> Path:
        """The raw file behind namespace ``nsid`` of NVMe controller ``nvme`` in VM ``vm``."""
        spec = self.topology.vm(vm)
        found = next((n for n in spec.nvmes if n.name == nvme), None)
        if found is None or not 1 <= nsid <= len(found.namespaces):
            raise LabError(f"VM {vm!r} has no NVMe namespace {nvme}/{nsid}",
                           f"use one of: {', '.join(f'{n.name}/{i}' for n in spec.nvmes for i in range(1, len(n.namespaces) + 1)) or '(none)'}")
        return self.vms[vm].res.nvme_files[found.drive_id(nsid)]

    def plan(self, rundir: Path) -> list[VirtualMachine]:
        """The VMs this lab would run, with their resources; starts nothing."""
        # Nothing needs to be provisioned to plan: the cache paths follow from the recipes.
        runtime = self.runtime or planned_runtime()
        image = self.image or GuestImage(image_path())
        link_sockets: dict[str, list[tuple[Path, bool, int]]] = {vm.name: [] for vm in self.topology.vms}
        for i, link in enumerate(self.topology.links):
            sock = rundir / f"link{i}.sock"
            link_sockets[link.vms[0]].append((sock, True, i))
            link_sockets[link.vms[1]].append((sock, False, i))
        nics_on_links = nic_sockets(self.topology, rundir)
        custom = self.kernel is not None and self.kernel.image != Path()
        # read once for all VMs (a --kernel without a .config beside it is unpacked to find it)
        guest_hz = kconfig_hz(self.kernel.config) if custom else image.kernel_hz
        source = guest_source(rundir)
        bytecode = guest_bytecode_dir()
        vms = []
        for index, spec in enumerate(self.topology.vms, start=1):
            # 0: QEMU binds a port of the kernel's choosing, read back once it runs
            # (VirtualMachine.wait_ready); a port picked here could be taken before QEMU binds it.
            port = self.ssh_port + index - 1 if self.ssh_port is not None else 0
            vmdir = rundir / spec.name
            res = VmResources(
                index=index, rundir=vmdir, kernel=self.kernel.image if custom else image.kernel,
                # The image's initramfs loads the image kernel's modules: only its kernel needs it.
                initrd=None if custom else image.initrd, rootfs=image.rootfs,
                source=source, backend_files={b: _backend_path(rundir, b) for b in self.topology.backends},
                ssh_port=port, accel=self.accel,
                gpu_sockets={g.name: vmdir / f"{g.name}.sock" for g in self.topology.gpus_of(spec.name)
                             if self.gpu},
                link_sockets=tuple(link_sockets[spec.name]),
                nic_sockets={n.name: nics_on_links[n.name] for n in self.topology.nics_of(spec.name)
                             if n.name in nics_on_links},
                append=self.kernel.append if self.kernel else "",
                modules=self.kernel.modules if self.kernel else None,
                smc_socket=self._smc_socket(rundir, spec.name),
                nvme_files={n.drive_id(nsid): vmdir / f"{n.drive_id(nsid)}.raw"
                            for n in spec.nvmes for nsid in range(1, len(n.namespaces) + 1)},
                tsc_khz=host_tsc_khz(),
                guest_hz=guest_hz,
                lab_boot_params=custom and self.kernel.takes_lab_boot_params,
                bytecode=bytecode,
                regions_plan=self._regions_file(vmdir, spec),
            )
            extra = [p for p in (res.kernel, res.modules) if custom and p is not None]
            vms.append(VirtualMachine(spec, res, runtime, image, topology=self.topology, extra_ro=extra))
        return vms

    def _regions_file(self, vmdir: Path, spec: Vm) -> Path | None:
        """Where the VM's region plan goes (none: no regions): text for ram regions only."""
        plan = region_plan(self.topology, spec)
        if not _has_regions(plan):
            return None
        return vmdir / ("regions.txt" if ram_regions_plan(plan) is not None else "regions.json")

    def _smc_socket(self, rundir: Path, vm: str) -> Path | None:
        found = self.topology.smc_of(vm)
        if found is None:
            return None
        smc, host = found
        return rundir / f"smc-{smc.name}" / f"host{host}.sock"

    def _start_smcs(self) -> None:
        """One server process per controller, before any QEMU (they connect at start-up)."""
        for smc in self.topology.smcs.values():
            sockdir = self.rundir / f"smc-{smc.name}"
            sockdir.mkdir()
            server = smc_server(smc.name, [sockdir / f"host{h}.sock" for h in range(len(smc.hosts))],
                                self.rundir / f"smc-{smc.name}.log")
            self.smc_servers[smc.name] = server
            server.start()

    def start(self, timeout: float = 180) -> "Lab":
        if self.ssh_port is not None:
            for i in range(len(self.topology.vms)):
                check_port_free(self.ssh_port + i)
        self.runtime = self.runtime or find_runtime(log=self.log)
        self.image = self.image or find_image(log=self.log)
        usage.record("boot", f"{self.topology.name} ({self.kernel.label if self.kernel else 'debian'} kernel)")
        started_at = time.monotonic()
        remove_stale_rundirs()
        if self.rundir_request is not None:
            self.rundir = self.rundir_request
            self.rundir.mkdir(exist_ok=True)
        else:
            self.rundir = Path(tempfile.mkdtemp(prefix="vfio-cxl-", dir=runtime_root()))
        (self.rundir / "lab.pid").write_text(str(os.getpid()))
        try:
            for backend in self.topology.backends.values():
                with open(self.backend_file(backend.name), "wb") as f:
                    f.truncate(backend.size)   # sparse; both VMs map the same file
            self._start_smcs()
            guest_bytecode_dir().mkdir(parents=True, exist_ok=True)
            for vm in self.plan(self.rundir):
                # 0700 whatever the umask: its sockets (QMP, the private SSH socket) are its user's
                vm.res.rundir.mkdir(mode=0o700)
                vm.res.rundir.chmod(0o700)
                for nvme in vm.spec.nvmes:   # NVMe namespaces: sparse raw files, zeroed
                    for nsid, size in enumerate(nvme.namespaces, start=1):
                        with open(vm.res.nvme_files[nvme.drive_id(nsid)], "wb") as f:
                            f.truncate(size)
                if vm.res.regions_plan is not None:   # read by QEMU at start (fw_cfg)
                    plan = region_plan(self.topology, vm.spec)
                    text = ram_regions_plan(plan)
                    vm.res.regions_plan.write_text(json.dumps(plan) if text is None else text)
                for t3 in vm.spec.type3:
                    if t3.persistent:   # the label storage area: private to the device, zeroed
                        with open(vm.res.lsa_file(t3.name), "wb") as f:
                            f.truncate(t3.lsa_size)
                # GPUs of one VM are peers: each shares its VRAM fd on a side socket
                # and may reach the others' (the proven P2P fast path, docs/gpu-device.md)
                shares = {g: vm.res.rundir / f"{g}.vram.sock" for g in vm.res.gpu_sockets}
                for gpu_name, sock in vm.res.gpu_sockets.items():   # one server per GPU
                    p2p = ([f"--share-vram={shares[gpu_name]}"]
                           + [f"--peer={path}" for g, path in shares.items() if g != gpu_name]
                           if len(shares) > 1 else [])
                    server = GpuServerProcess(sock, vm.res.rundir / f"{gpu_name}.log",
                                              [*gpu_server_args(self.topology.gpus[gpu_name]), *p2p,
                                               *self.gpu_args])
                    self.gpu_servers[gpu_name] = server
                    server.start()
                self.vms[vm.name] = vm
                vm.start()
            # Regions (cxl-cli/daxctl/ndctl) in each guest as soon as it answers, while the others
            # still boot; then the private VM-to-VM link (pyroute2) in every linked guest at once.
            # A command started here and not joined (a later VM did not come up, Ctrl-C) is
            # cancelled as the block is left; join_all cancels the others when one fails.
            with contextlib.ExitStack() as started:
                running = {}
                for vm in self.vms.values():
                    seconds = vm.wait_ready(timeout)
                    self.log(f"[{vm.name}] ready in {seconds:.1f} s (ssh 127.0.0.1:{vm.res.ssh_port}, "
                             f"console {vm.res.console_log})")
                    if vm.res.regions_plan is not None:
                        start = RAM_REGIONS if vm.res.regions_plan.suffix == ".txt" else CXLTOOL_REGIONS
                        running[vm.name] = started.enter_context(vm.start_command(
                            regions_result(start), stdin=vm.res.regions_plan.read_text(), timeout=300))
                results = join_all(running)
            for name, out in results.items():
                vm = self.vms[name]
                vm.regions = {r["name"]: r for r in json.loads(out.stdout)}
                self.log(f"[{vm.name}] regions: " + ", ".join(
                    f"{r['name']}={r['region']}" + (f" {r['dax']}" if r.get("dax") else "")
                    + (f" {r['blockdev']}" if r.get("blockdev") else "") for r in vm.regions.values()))
            with contextlib.ExitStack() as started:
                up = "vfio-cxl-m vfio_cxl.guest.cmd.netconfig up"
                join_all({vm.name: started.enter_context(vm.start_command(up, timeout=120))
                          for vm in self.vms.values() if vm.res.link_sockets})
        except BaseException:
            self.stop()
            raise
        usage.record("booted", f"{time.monotonic() - started_at:.3f}")
        return self

    def unhealthy(self) -> str | None:
        """Why this running lab is no longer as it booted, or None: every QEMU and device server
        still running, and each guest answering on its open SSH connection with its regions'
        devdax devices and its GPUs (0601:1991, counted with sh builtins) still there.  A pool
        hands a lab to the next test only when this is None."""
        if not self.vms:
            return "not running"
        for vm in self.vms.values():
            if vm.process is None or vm.process.poll() is not None:
                return f"VM {vm.name}'s QEMU has exited"
        for name, server in [*self.gpu_servers.items(), *self.smc_servers.items()]:
            if server.process is None or server.process.poll() is not None:
                return f"the device server of {name} has exited"
        for vm in self.vms.values():
            daxes = [r["dax"] for r in vm.regions.values() if r.get("dax")]
            gpus = len(self.topology.gpus_of(vm.name)) if self.gpu else 0
            check = (" ".join(f"[ -e /dev/{d} ] || {{ echo 'no /dev/{d}'; exit 1; }};" for d in daxes)
                     + " n=0; for d in /sys/bus/pci/devices/*; do read v < $d/vendor; read i < $d/device;"
                     + " [ $v:$i = 0x0601:0x1991 ] && n=$((n+1)); done;"
                     + f" [ $n = {gpus} ] || {{ echo \"$n GPUs, not {gpus}\"; exit 1; }}")
            try:
                result = vm.run(check, timeout=30, check=False)
            except LabError as err:
                return f"VM {vm.name} does not answer: {err.what}"
            if result.exited != 0:
                return f"VM {vm.name}: {result.stdout.strip() or f'exit {result.exited}'}"
        return None

    def stop(self) -> None:
        started_at = time.monotonic()
        was_up = bool(self.vms)
        for vm in self.vms.values():
            vm.stop()
        for server in [*self.gpu_servers.values(), *self.smc_servers.values()]:
            server.stop()
        self.vms.clear()
        self.gpu_servers.clear()
        self.smc_servers.clear()
        if self.rundir and self.logdir:
            archive_logs(self.rundir, self.logdir)
        if self.rundir:
            shutil.rmtree(self.rundir, ignore_errors=True)
            self.rundir = None
        if was_up:
            usage.record("stopped", f"{time.monotonic() - started_at:.3f}")

    def __enter__(self) -> "Lab":
        return self.start() if not self.vms else self

    def __exit__(self, *exc) -> None:
        self.stop()
