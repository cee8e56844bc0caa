"""The QEMU command line a topology turns into (pure: nothing is started)."""

import json
from pathlib import Path

from vfio_cxl.lab import topology
from vfio_cxl.lab.argv import VmResources, qemu_argv


def resources(vm_index=1, gpu=True, links=()):
    run = Path("/tmp/lab/vm")
    return VmResources(index=vm_index, rundir=run, kernel=Path("/img/vmlinuz"), initrd=Path("/img/initrd.img"),
                       rootfs=Path("/img/rootfs.raw"), source=Path("/src"),
                       backend_files={"cxl0": Path("/tmp/lab/cxl0.mem"), "shared": Path("/tmp/lab/shared.mem")},
                       ssh_port=2222, gpu_socket=run / "gpu.sock" if gpu else None, link_sockets=links)


def devices(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]


def test_single_vm_command_line():
    vm = topology.load("single").vms[0]
    argv = qemu_argv(vm, resources())
    joined = " ".join(argv)
    # intel-iommu must be the first PCI device.
    assert devices(argv)[0].startswith("intel-iommu,") and "caching-mode=on" in devices(argv)[0]
    assert argv[argv.index("-cpu") + 1] == "max,hypervisor=off"
    assert "memory-backend-memfd,id=ram,size=1024M,share=on" in joined
    assert "memory-backend=ram" in argv[argv.index("-machine") + 1]
    assert "memory-backend-file,id=cxl-cxl0,share=on,mem-path=/tmp/lab/cxl0.mem,size=256M" in joined
    for dev in ("pxb-cxl,", "cxl-rp,", "cxl-upstream,", "cxl-downstream,", "cxl-type3,"):
        assert any(d.startswith(dev) for d in devices(argv)), dev
    assert "cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4096M" in joined
    assert "user,id=ssh,restrict=on,hostfwd=tcp:127.0.0.1:2222-:22" in joined
    assert argv[argv.index("-accel") + 1] == "tcg"
    gpu = [json.loads(d) for d in devices(argv) if d.startswith("{")]
    assert gpu == [{"driver": "vfio-user-pci", "id": "gpu0", "bus": "gpu_port",
                    "socket": {"type": "unix", "path": "/tmp/lab/vm/gpu.sock"}}]
    # Every non-CXL PCI device sits on pcie.0 explicitly (QEMU might pick the pxb-cxl bus).
    for dev in devices(argv):
        if dev.startswith(("virtio-", "pcie-root-port")):
            assert "bus=pcie.0" in dev, dev


def test_free_root_ports_without_gpu():
    vm = topology.load("single").vms[0]
    argv = qemu_argv(vm, resources(gpu=False))
    ports = [d for d in devices(argv) if d.startswith("pcie-root-port")]
    assert len(ports) == 2
    assert not any(d.startswith("{") for d in devices(argv))


def test_shared_vms_map_one_backend_file():
    topo = topology.load("shared")
    a = " ".join(qemu_argv(topo.vms[0], resources(1)))
    b = " ".join(qemu_argv(topo.vms[1], resources(2, gpu=False)))
    backend = "memory-backend-file,id=cxl-shared,share=on,mem-path=/tmp/lab/shared.mem"
    assert backend in a and backend in b
    assert "vfio-user-pci" in a and "vfio-user-pci" not in b
    assert "52:54:00:5c:00:01" in a and "52:54:00:5c:00:02" in b


def test_link_sockets_make_a_point_to_point_network():
    vm = topology.load("shared").vms[0]
    listen = " ".join(qemu_argv(vm, resources(links=((Path("/tmp/lab/link0.sock"), True),))))
    connect = " ".join(qemu_argv(vm, resources(links=((Path("/tmp/lab/link0.sock"), False),))))
    assert "stream,id=link0,addr.type=unix,addr.path=/tmp/lab/link0.sock,server=on" in listen
    assert "server=off" in connect
    assert "52:54:00:1c:00:01" in listen


def test_kvm_needs_split_irqchip():
    vm = topology.load("single").vms[0]
    res = resources()
    argv = qemu_argv(vm, VmResources(**{**res.__dict__, "accel": "kvm"}))
    assert "kernel-irqchip=split" in argv[argv.index("-machine") + 1]
