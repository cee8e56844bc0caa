"""Topology -> QEMU command line, for one VM.

Pure: paths and ports come in, a list of arguments goes out, nothing is
started.  ``vfio-cxl vm up --dry-run`` prints what this builds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .topology import VmSpec

SSH_NIC_MAC = "52:54:00:5c:00:{:02x}"   # see vfio_cxl.guest.netconfig
LINK_NIC_MAC = "52:54:00:1c:00:{:02x}"
SOURCE_MOUNT_TAG = "vfio_cxl_src"
GPU_ROOT_PORT = "gpu_port"
SPARE_ROOT_PORT = "spare_port"
SMC_ROOT_PORT = "smc_port"


@dataclass(frozen=True)
class VmResources:
    """Where one VM's files are, and how it is reached."""

    index: int                  # the VM's position in its topology (1-based)
    rundir: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    source: Path                # the checkout, shared read-only
    backend_files: dict[str, Path]
    ssh_port: int
    accel: str = "tcg"
    gpu_socket: Path | None = None
    link_sockets: tuple[tuple[Path, bool], ...] = ()   # (socket, this VM listens)
    smc_socket: Path | None = None   # this VM's socket of its shared-memory controller

    @property
    def console_log(self) -> Path:
        return self.rundir / "console.log"

    @property
    def qmp_socket(self) -> Path:
        return self.rundir / "qmp.sock"


def _mib(size: int) -> str:
    return f"{size >> 20}M"


def _machine(vm: VmSpec, res: VmResources) -> list[str]:
    machine = "q35,cxl=on,memory-backend=ram"
    if res.accel == "kvm":
        machine += ",kernel-irqchip=split"   # intel-iommu's intremap needs it under KVM
    return [
        "-machine", machine, "-accel", res.accel,
        # The kernel refuses to commit a CXL region ("Failed to synchronize CPU
        # cache state") when CPUID says it runs under a hypervisor, because it
        # cannot invalidate caches on a virtual CPU; hiding the bit lets the
        # guest bring CXL memory up as it would on bare metal.
        "-cpu", "max,hypervisor=off",
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


def _cxl(vm: VmSpec, res: VmResources) -> list[str]:
    if not vm.type3:
        return []
    args = []
    for backend in {t.backend.name: t.backend for t in vm.type3}.values():
        args += ["-object", f"memory-backend-file,id=cxl-{backend.name},share=on,"
                 f"mem-path={res.backend_files[backend.name]},size={_mib(backend.size)}"]
    args += [
        "-device", "pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1",
        "-device", "cxl-rp,port=0,bus=cxl.1,id=cxl_rp0,chassis=0,slot=2",
        "-device", "cxl-upstream,bus=cxl_rp0,id=cxl_us0",
    ]
    for i, dev in enumerate(vm.type3):
        args += [
            "-device", f"cxl-downstream,port={i},bus=cxl_us0,id=cxl_ds{i},chassis=0,slot={4 + i}",
            "-device", f"cxl-type3,bus=cxl_ds{i},volatile-memdev=cxl-{dev.backend.name},id=cxl-vmem{i}",
        ]
    args += ["-M", f"cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size={_mib(vm.cxl_window)}"]
    return args


def _gpu(vm: VmSpec, res: VmResources) -> list[str]:
    # The GPU's root port is always there; the vfio-user GPU sits on it when
    # the VM has one.  The spare port stays free for hot-plug experiments.
    args = ["-device", f"pcie-root-port,id={GPU_ROOT_PORT},bus=pcie.0,chassis=1,slot=1",
            "-device", f"pcie-root-port,id={SPARE_ROOT_PORT},bus=pcie.0,chassis=1,slot=2"]
    if vm.gpu and res.gpu_socket:
        device = {"driver": "vfio-user-pci", "id": "gpu0", "bus": GPU_ROOT_PORT,
                  "socket": {"type": "unix", "path": str(res.gpu_socket)}}
        args += ["-device", json.dumps(device, separators=(",", ":"))]
    return args


def _smc(res: VmResources) -> list[str]:
    # The shared-memory controller: one vfio-user-pci per host, on its own root port.
    if not res.smc_socket:
        return []
    device = {"driver": "vfio-user-pci", "id": "smc0", "bus": SMC_ROOT_PORT,
              "socket": {"type": "unix", "path": str(res.smc_socket)}}
    return ["-device", f"pcie-root-port,id={SMC_ROOT_PORT},bus=pcie.0,chassis=1,slot=3",
            "-device", json.dumps(device, separators=(",", ":"))]


def _network(res: VmResources) -> list[str]:
    # restrict=on: the guest reaches nothing outside; only the forwarded SSH port
    # on the host's loopback reaches in.
    args = [
        "-netdev", f"user,id=ssh,restrict=on,hostfwd=tcp:127.0.0.1:{res.ssh_port}-:22",
        "-device", f"virtio-net-pci,netdev=ssh,mac={SSH_NIC_MAC.format(res.index)},bus=pcie.0",
    ]
    for i, (socket, listens) in enumerate(res.link_sockets):
        mode = "server=on" if listens else "server=off,reconnect-ms=100"
        args += [
            "-netdev", f"stream,id=link{i},addr.type=unix,addr.path={socket},{mode}",
            "-device", f"virtio-net-pci,netdev=link{i},mac={LINK_NIC_MAC.format(res.index)},bus=pcie.0",
        ]
    return args


def _storage(res: VmResources) -> list[str]:
    return [
        # snapshot=on: the shared base image stays untouched; this VM's writes go
        # to a temporary copy-on-write overlay that QEMU deletes when it exits.
        "-drive", f"if=none,id=root,file={res.rootfs},format=raw,snapshot=on",
        "-device", "virtio-blk-pci,drive=root,bus=pcie.0",
        "-fsdev", f"local,id=src,path={res.source},security_model=none,readonly=on",
        "-device", f"virtio-9p-pci,fsdev=src,mount_tag={SOURCE_MOUNT_TAG},bus=pcie.0",
    ]


def _boot(vm: VmSpec, res: VmResources) -> list[str]:
    # mitigations=off: a lab VM runs only our code, and under TCG every
    # patched-in mitigation is emulated work.
    cmdline = (f"console=ttyS0 intel_iommu=on mitigations=off panic=-1 quiet loglevel=4 "
               f"vfio_cxl.name={vm.name}")
    return ["-kernel", str(res.kernel), "-initrd", str(res.initrd), "-append", cmdline]


def _control(vm: VmSpec, res: VmResources) -> list[str]:
    return [
        "-name", vm.name,
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-chardev", f"file,id=console,path={res.console_log}",
        "-serial", "chardev:console",
        "-qmp", f"unix:{res.qmp_socket},server=on,wait=off",
    ]


def qemu_argv(vm: VmSpec, res: VmResources) -> list[str]:
    return [*_machine(vm, res), *_iommu(), *_cxl(vm, res), *_gpu(vm, res), *_smc(res),
            *_network(res), *_storage(res), *_boot(vm, res), *_control(vm, res)]
