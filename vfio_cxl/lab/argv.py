"""Topology -> QEMU command line, for one VM.

Pure: paths and ports come in, a list of arguments goes out, nothing is
started.  ``vfio-cxl vm up --dry-run`` prints what this builds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .host_tsc import boot_arguments
from ..errors import LabError
from .topology import Nic, Nvme, Topology, Vm, format_size

SSH_NIC_MAC = "52:54:00:5c:00:{:02x}"   # see vfio_cxl.guest.cmd.netconfig
CTL_NIC_MAC = "52:54:00:5d:00:{:02x}"   # the lab's own SSH path (a UNIX socket): see _control_network
LINK_NIC_MAC = "52:54:00:1c:{:02x}:{:02x}"   # link number, VM index
NIC_MAC = "52:54:00:1e:{:02x}:{:02x}"        # VM index, NIC number: topology [nics.NAME]
SOURCE_MOUNT_TAG = "vfio_cxl_src"
BYTECODE_MOUNT_TAG = "vfio_cxl_pyc"      # the guests' bytecode cache (paths.guest_bytecode_dir)
MODULES_MOUNT_TAG = "vfio_cxl_modules"   # --modules DIR: the guest mounts it at /lib/modules/$(uname -r)
GUEST_INIT = "/sbin/vfio-cxl-init"   # PID 1 of a lab VM (images/rootfs/sbin/vfio-cxl-init)
SMC_ROOT_PORT = "smc_port"   # not a topology name ('_' is not allowed there)


@dataclass(frozen=True)
class VmResources:
    """Where one VM's files are, and how it is reached."""

    index: int                  # the VM's position in its topology (1-based)
    rundir: Path
    kernel: Path
    initrd: Path | None         # None: the kernel mounts the root disk itself (see _boot)
    rootfs: Path
    source: Path                # the checkout, shared read-only
    backend_files: dict[str, Path]
    ssh_port: int
    accel: str = "tcg"
    gpu_sockets: dict[str, Path] = field(default_factory=dict)   # owned GPU name -> server socket
    link_sockets: tuple[tuple[Path, bool, int], ...] = ()   # (socket, this VM listens, link number)
    nic_sockets: dict[str, tuple[Path, bool]] = field(default_factory=dict)   # NIC on a link -> (socket, listens)
    append: str = ""                  # extra kernel command line (--append)
    modules: Path | None = None       # a modules tree for a kernel not the image's (--modules)
    smc_socket: Path | None = None    # this VM's socket of its shared-memory controller
    tsc_khz: int | None = None        # the host's TSC frequency: the guest's under TCG (host_tsc.py)
    guest_hz: int | None = None       # CONFIG_HZ of the kernel booted (None: not known)
    lab_boot_params: bool = False     # the kernel takes the boot parameters of the lab kernel's patches
    nvme_files: dict[str, Path] = field(default_factory=dict)   # Nvme.drive_id(nsid) -> raw backing file
    bytecode: Path | None = None      # the guests' bytecode cache, shared writable (None: none)
    regions_plan: Path | None = None  # the region plan (JSON) the guest's init brings up (fw_cfg)

    @property
    def console_log(self) -> Path:
        return self.rundir / "console.log"

    @property
    def qmp_socket(self) -> Path:
        return self.rundir / "qmp.sock"

    @property
    def ssh_socket(self) -> Path:
        """The lab's own way into the guest's SSH server (see ``_control_network``)."""
        return self.rundir / "ssh.sock"

    def lsa_file(self, type3: str) -> Path:
        """The label storage area of a persistent Type3 device (private to this VM)."""
        return self.rundir / f"{type3}.lsa"


def _mib(size: int) -> str:
    return f"{size >> 20}M"


def _machine(vm: Vm, res: VmResources) -> list[str]:
    # No SATA controller, SMBus, SMM or VMware port: a lab VM boots from virtio-blk and
    # uses none of them, and under TCG SeaBIOS probing the AHCI ports and setting up SMM,
    # and the guest kernel probing them again, are emulated work on every boot.
    machine = "q35,cxl=on,memory-backend=ram,sata=off,smbus=off,smm=off,vmport=off"
    if res.accel == "kvm":
        machine += ",kernel-irqchip=split"   # intel-iommu's intremap needs it under KVM
    return [
        "-machine", machine, "-accel", res.accel,
        # The kernel refuses to commit a CXL region ("Failed to synchronize CPU
        # cache state") when CPUID says it runs under a hypervisor, because it
        # cannot invalidate caches on a virtual CPU; hiding the bit lets the
        # guest bring CXL memory up as it would on bare metal.
        "-cpu", "max,hypervisor=off",
        # No TPR-patching option ROM (kvmvapic.bin, an aid for 32-bit Windows):
        # SeaBIOS would run it on every boot for a Linux guest that never uses it.
        "-global", "apic-common.vapic=off",
        "-smp", str(vm.cpus),
        "-m", f"{_mib(vm.memory)},slots=4,maxmem={_mib(vm.memory + (8 << 30))}",
        # Guest RAM is an fd-backed shared backend, so QEMU can hand the GPU
        # server an fd for any RAM range the guest maps for DMA (direct path).
        "-object", f"memory-backend-memfd,id=ram,size={_mib(vm.memory)},share=on",
    ]


def _iommu() -> list[str]:
    # First PCI device: everything after it sits behind the vIOMMU.  caching-mode
    # makes the guest report every mapping, so QEMU can forward it to vfio-user.
    return ["-device", "intel-iommu,intremap=on,caching-mode=on"]


def _cxl(topo: Topology, vm: Vm, res: VmResources) -> list[str]:
    """Backends, host bridges, root ports, switches, Type3 devices and ONE ``-M``
    with every window (QEMU rejects ``cxl-fmw.*`` keys spread over several -M)."""
    if not vm.host_bridges:
        return []
    args = []
    for t3 in vm.type3:
        for backend in (t3.volatile, t3.persistent):
            if backend:
                args += ["-object", f"memory-backend-file,id=cxl-{backend},share=on,"
                         f"mem-path={res.backend_files[backend]},size={_mib(topo.backends[backend].size)}"]
        if t3.persistent:
            args += ["-object", f"memory-backend-file,id=lsa-{t3.name},share=on,"
                     f"mem-path={res.lsa_file(t3.name)},size={format_size(t3.lsa_size)}"]
    slot = 2   # chassis 0: CXL root and downstream ports; chassis 1 and up: PCIe
    buses = vm.bus_numbers()
    for hb in vm.host_bridges:
        args += ["-device", f"pxb-cxl,bus_nr={buses[hb.name]},bus=pcie.0,id={hb.name}"]
        for port, rp in enumerate(hb.root_ports):
            args += ["-device", f"cxl-rp,port={port},bus={hb.name},id={rp},chassis=0,slot={slot}"]
            slot += 1
            sw = vm.switch_at(rp)
            if sw:
                args += ["-device", f"cxl-upstream,bus={rp},id={sw.name}"]
                for dport, ds in enumerate(sw.downstream_ports):
                    args += ["-device", f"cxl-downstream,port={dport},bus={sw.name},id={ds},chassis=0,slot={slot}"]
                    slot += 1
    for t3 in vm.type3:
        dev = f"cxl-type3,bus={t3.at},id={t3.name},sn={vm.serial(t3.name):#x}"
        if t3.volatile:
            dev += f",volatile-memdev=cxl-{t3.volatile}"
        if t3.persistent:
            dev += f",persistent-memdev=cxl-{t3.persistent},lsa=lsa-{t3.name}"
        args += ["-device", dev]
    fmw = []
    for w, window in enumerate(vm.windows):
        fmw += [f"cxl-fmw.{w}.targets.{t}={target}" for t, target in enumerate(window.targets)]
        fmw += [f"cxl-fmw.{w}.size={_mib(window.size)}",
                f"cxl-fmw.{w}.interleave-granularity={format_size(window.granularity).lower()}"]
    if fmw:
        args += ["-M", ",".join(fmw)]
    return args


def _vfio_user_device(name: str, bus: str, socket: Path) -> str:
    device = {"driver": "vfio-user-pci", "id": name, "bus": bus,
              "socket": {"type": "unix", "path": str(socket)}}
    return json.dumps(device, separators=(",", ":"))


def _nvme(nvme: Nvme, bus: str, res: VmResources) -> list[str]:
    """One NVMe controller and its namespaces (``nvme-ns`` on the controller's bus, NSIDs from 1).

    The controller's DMA goes through the vIOMMU like any PCI device's; the bounce-buffer size
    bounds what QEMU moves per round trip when that DMA lands in another device's BAR."""
    ctrl = (f"nvme,id={nvme.name},bus={bus},serial={nvme.serial},max_ioqpairs={nvme.queue_pairs},"
            f"dbcs={'on' if nvme.shadow_doorbells else 'off'},x-max-bounce-buffer-size={nvme.bounce_buffer}")
    if nvme.cmb:
        ctrl += f",cmb_size_mb={nvme.cmb >> 20}"
    args = []
    for nsid in range(1, len(nvme.namespaces) + 1):
        drive = nvme.drive_id(nsid)
        args += ["-drive", f"file={res.nvme_files[drive]},if=none,id={drive},format=raw"]
    args += ["-device", ctrl]
    for nsid in range(1, len(nvme.namespaces) + 1):
        args += ["-device", f"nvme-ns,drive={nvme.drive_id(nsid)},bus={nvme.name},nsid={nsid}"]
    return args


def _nic_netdev(nic: Nic, res: VmResources) -> str:
    """What is behind a NIC: its link's wire (a ``stream`` netdev over the link's NIC socket, the
    link's first VM listening, as for the virtio pair), or a user-mode network that reaches
    nothing."""
    if nic.link is None:
        return f"user,id=nic-{nic.name},restrict=on"
    if nic.name not in res.nic_sockets:
        raise LabError(f"NIC {nic.name} is on link {nic.link} but has no socket for it",
                       "plan the VM with Lab.plan, which gives each NIC on a link its socket")
    socket, listens = res.nic_sockets[nic.name]
    mode = "server=on" if listens else "server=off,reconnect-ms=100"
    return f"stream,id=nic-{nic.name},addr.type=unix,addr.path={socket},{mode}"


def _nic(nic: Nic, number: int, bus: str, res: VmResources) -> list[str]:
    """One emulated NIC on ``bus`` with its netdev; ``number`` is its place among the VM's NICs
    (its MAC).  The bounce buffer bounds what QEMU maps at once when the NIC's DMA reaches
    another device's BAR."""
    return ["-netdev", _nic_netdev(nic, res),
            "-device", f"{nic.model},netdev=nic-{nic.name},id={nic.name},bus={bus},"
                       f"mac={NIC_MAC.format(res.index, number)},x-max-bounce-buffer-size={nic.bounce_buffer}"]


def _pcie(topo: Topology, vm: Vm, res: VmResources) -> list[str]:
    """GPUs, NVMe controllers and NICs (on root ports of their own or behind PCIe switches) and
    hot-plug root ports.

    Every owned GPU gets its port even when no server is attached (``--no-gpu``);
    hot-plug ports reserve a 64-bit prefetchable window as large as the largest
    VRAM BAR, or a hot-added GPU's BAR2 finds no space."""
    args = []
    slot = 1
    sockets = res.gpu_sockets
    nics = list(enumerate(topo.nics_of(vm.name)))
    for gpu in topo.gpus_of(vm.name):
        if gpu.at is None:
            args += ["-device", f"pcie-root-port,id={gpu.root_port},bus=pcie.0,chassis=1,slot={slot}"]
            slot += 1
            if gpu.name in sockets:
                args += ["-device", _vfio_user_device(gpu.name, gpu.root_port, sockets[gpu.name])]
    for chassis, ps in enumerate(vm.pcie_switches, start=2):
        args += ["-device", f"pcie-root-port,id={ps.name}-port,bus=pcie.0,chassis=1,slot={slot}",
                 "-device", f"x3130-upstream,id={ps.name},bus={ps.name}-port"]
        slot += 1
        for dslot, ds in enumerate(ps.downstream_ports):
            args += ["-device", f"xio3130-downstream,id={ds},bus={ps.name},chassis={chassis},slot={dslot}"]
        for gpu in topo.gpus_of(vm.name):
            if gpu.at in ps.downstream_ports and gpu.name in sockets:
                args += ["-device", _vfio_user_device(gpu.name, gpu.at, sockets[gpu.name])]
        for nvme in vm.nvmes:
            if nvme.at in ps.downstream_ports:
                args += _nvme(nvme, nvme.at, res)
        for n, nic in nics:
            if nic.at in ps.downstream_ports:
                args += _nic(nic, n, nic.at, res)
    for nvme in vm.nvmes:
        if nvme.at is None:
            args += ["-device", f"pcie-root-port,id={nvme.root_port},bus=pcie.0,chassis=1,slot={slot}"]
            slot += 1
            args += _nvme(nvme, nvme.root_port, res)
    reserve = format_size(topo.hotplug_reserve())
    for hp in vm.hotplug_port_ids():
        args += ["-device", f"pcie-root-port,id={hp},bus=pcie.0,chassis=1,slot={slot},pref64-reserve={reserve}"]
        slot += 1
    if res.smc_socket:
        # The shared-memory controller: one vfio-user-pci per host VM, on a root port of its own.
        args += ["-device", f"pcie-root-port,id={SMC_ROOT_PORT},bus=pcie.0,chassis=1,slot={slot}",
                 "-device", _vfio_user_device("smc0", SMC_ROOT_PORT, res.smc_socket)]
        slot += 1
    for n, nic in nics:
        # The other NICs on root ports of their own (igb's SR-IOV VFs do not fit on pcie.0),
        # last, so adding one moves no other device.
        if nic.at is None:
            args += ["-device", f"pcie-root-port,id={nic.root_port},bus=pcie.0,chassis=1,slot={slot}",
                     *_nic(nic, n, nic.root_port, res)]
            slot += 1
    return args


def _network(res: VmResources) -> list[str]:
    # restrict=on: the guest reaches nothing outside; only the forwarded SSH port
    # on the host's loopback reaches in.  romfile= (none): the NICs carry no iPXE
    # option ROM, which SeaBIOS would load and run on every boot; the lab boots
    # with -kernel, never from the network.
    args = [
        "-netdev", f"user,id=ssh,restrict=on,hostfwd=tcp:127.0.0.1:{res.ssh_port}-:22",
        "-device", f"virtio-net-pci,netdev=ssh,mac={SSH_NIC_MAC.format(res.index)},bus=pcie.0,romfile=",
    ]
    for socket, listens, link in res.link_sockets:
        mode = "server=on" if listens else "server=off,reconnect-ms=100"
        args += [
            "-netdev", f"stream,id=link{link},addr.type=unix,addr.path={socket},{mode}",
            "-device", f"virtio-net-pci,netdev=link{link},mac={LINK_NIC_MAC.format(link, res.index)},"
                       "bus=pcie.0,romfile=",
        ]
    return args


def _control_network(res: VmResources) -> list[str]:
    """The lab's own SSH path: a second user-network NIC whose only way in is a UNIX socket in
    the VM's run directory (mode 0700: only the lab's user reaches it), forwarded to
    the guest's port 22.  Its own subnet (the guest takes 10.0.3.15, images/rootfs/sbin/
    vfio-cxl-init) makes these connections come from 10.0.3.2, not the 10.0.2.2 every TCP
    connection to the forwarded port comes from: dropbear's limit of 5 unauthenticated
    connections per source address then cannot be used up by other local users against the
    lab.  Last on the command line, so no other device's PCI address moves."""
    path = str(res.ssh_socket).replace(",", ",,")
    return [
        "-netdev", f"user,id=ctl,restrict=on,net=10.0.3.0/24,hostfwd=unix:{path}-:22",
        "-device", f"virtio-net-pci,netdev=ctl,mac={CTL_NIC_MAC.format(res.index)},bus=pcie.0,romfile=",
    ]


def _bytecode(res: VmResources) -> list[str]:
    """The guests' bytecode cache (paths.guest_bytecode_dir), shared writable: the guest's
    init mounts it and points ``VFIO_CXL_PYC`` at it.  After the control NIC, last:
    an endpoint on pcie.0 after every other moves no device's PCI address."""
    if res.bytecode is None:
        return []
    path = str(res.bytecode).replace(",", ",,")
    return [
        "-fsdev", f"local,id=pyc,path={path},security_model=none",
        "-device", f"virtio-9p-pci,fsdev=pyc,mount_tag={BYTECODE_MOUNT_TAG},bus=pcie.0",
    ]


def _storage(res: VmResources) -> list[str]:
    return [
        # snapshot=on: the shared base image stays untouched; this VM's writes go
        # to a temporary copy-on-write overlay that QEMU deletes when it exits.
        "-drive", f"if=none,id=root,file={res.rootfs},format=raw,snapshot=on",
        "-device", "virtio-blk-pci,drive=root,bus=pcie.0",
        "-fsdev", f"local,id=src,path={res.source},security_model=none,readonly=on",
        "-device", f"virtio-9p-pci,fsdev=src,mount_tag={SOURCE_MOUNT_TAG},bus=pcie.0",
    ] + ([
        "-fsdev", f"local,id=modules,path={res.modules},security_model=none,readonly=on",
        "-device", f"virtio-9p-pci,fsdev=modules,mount_tag={MODULES_MOUNT_TAG},bus=pcie.0",
    ] if res.modules else [])


# QEMU's TCG local APIC (hw/intc/apic.c) counts its timer in nanoseconds of the virtual
# clock, shifted by the divide configuration: its bus runs at 1 GHz.
TCG_APIC_BUS_HZ = 1_000_000_000


# What the lab kernel's patches take in any QEMU VM: QEMU's CXL ports and Type3 devices commit
# an HDM decoder in the register write, so a port's enumeration need not sleep 20 ms before it
# trusts "not committed" (at boot none is; the endpoint's sleep held up mounting the root).
LAB_KERNEL_QEMU_ARGUMENTS = "cxl_core.decoder_settle_ms=0"


def lab_kernel_tcg_arguments(hz: int | None) -> str:
    """What the lab kernel's patches (qemu/kernel/patches) take, for a boot under TCG:
    its local APIC timer's period in bus clocks per jiffy (10**9 / HZ; where HZ is not known
    the kernel calibrates it: HZ/10 jiffies against the PIT or HPET, 0.1 s), and no poisoning
    of the init memory it frees (each store into a page of translated code takes TCG's slow
    path: 45 ms)."""
    period = f"lapic_timer_period={TCG_APIC_BUS_HZ // hz} " if hz else ""
    return period + "initmem_poison=off"


def _boot(vm: Vm, res: VmResources) -> list[str]:
    # mitigations=off: a lab VM runs only our code, and under TCG every
    # patched-in mitigation is emulated work.  no_timer_check: on a loaded
    # host a TCG guest can miss the IO-APIC timer check's deadline and panic
    # at boot ("IO-APIC + timer doesn't work!"; seen with three VMs booting).
    # swiotlb=2048: a 4 MiB bounce-buffer pool, not the default 64 MiB, which took
    # ~0.06 s of every boot to set up under TCG; nothing in a lab VM bounces much
    # (device DMA goes through intel-iommu, virtio bypasses the DMA API).
    # cpu_init_udelay=0: TCG's CPU says it is an AMD family 6, which the kernel takes for
    # a part older than K8 and so waits 10 ms after each secondary CPU's INIT; QEMU's
    # APIC needs no wait, as the kernel assumes for every Intel or K8-and-later CPU.
    cmdline = (f"console=ttyS0 intel_iommu=on mitigations=off no_timer_check swiotlb=2048 panic=-1 quiet "
               f"loglevel=4 cpu_init_udelay=0 vfio_cxl.name={vm.name}")
    if res.initrd is None:
        # A kernel with the root disk's drivers built in (every kernel but the
        # image's own passes that check) mounts the root itself: no initramfs
        # to decompress, no busybox, no modules of another kernel to refuse.
        cmdline += f" root=/dev/vda rootfstype=ext4 rootwait rw init={GUEST_INIT}"
    if res.modules:
        cmdline += " vfio_cxl.modules=1"
    if res.tsc_khz:   # no TSC and delay-loop calibration against emulated timers
        cmdline += " " + boot_arguments(res.tsc_khz, res.guest_hz)
    if res.lab_boot_params:
        cmdline += " " + LAB_KERNEL_QEMU_ARGUMENTS
    if res.lab_boot_params and res.accel == "tcg":
        cmdline += " " + lab_kernel_tcg_arguments(res.guest_hz)
    if res.append:
        cmdline += " " + res.append
    initrd = ["-initrd", str(res.initrd)] if res.initrd is not None else []
    return ["-kernel", str(res.kernel), *initrd, "-append", cmdline]


def _control(vm: Vm, res: VmResources) -> list[str]:
    return [
        "-name", vm.name,
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-chardev", f"file,id=console,path={res.console_log}",
        "-serial", "chardev:console",
        "-qmp", f"unix:{res.qmp_socket},server=on,wait=off",
    ]


# the guest reads /sys/firmware/qemu_fw_cfg/by_name/<this>/raw
REGIONS_FW_CFG = "opt/vfio-cxl/regions"            # a JSON plan, for cxltool regions (cxl-cli)
RAM_REGIONS_FW_CFG = "opt/vfio-cxl/ram-regions"    # ram regions only: the text plan of ram_regions.sh


def _regions_plan(res: VmResources) -> list[str]:
    """The region plan as a fw_cfg file: the guest's init starts bringing the regions up while
    its SSH server starts, rather than the lab asking once SSH answers.  Its name says which
    plan it is (the lab writes regions.txt for a plan of ram regions only, else regions.json)."""
    if res.regions_plan is None:
        return []
    name = RAM_REGIONS_FW_CFG if res.regions_plan.suffix == ".txt" else REGIONS_FW_CFG
    path = str(res.regions_plan).replace(",", ",,")
    return ["-fw_cfg", f"name={name},file={path}"]


def qemu_argv(topo: Topology, vm: Vm, res: VmResources) -> list[str]:
    return [*_machine(vm, res), *_iommu(), *_cxl(topo, vm, res), *_pcie(topo, vm, res),
            *_network(res), *_storage(res), *_boot(vm, res), *_control(vm, res), *_control_network(res),
            *_bytecode(res), *_regions_plan(res)]
