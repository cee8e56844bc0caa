"""The QEMU command line a topology turns into (pure: nothing is started)."""

import json
import re
from pathlib import Path

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import topology
from vfio_cxl.lab.argv import VmResources, qemu_argv
from vfio_cxl.lab.lab import Lab, nic_sockets


def resources(topo, vm_index=1, gpu=True, links=()):
    vm = topo.vms[vm_index - 1]
    run = Path(f"/tmp/lab/{vm.name}")
    return VmResources(index=vm_index, rundir=run, kernel=Path("/img/vmlinuz"), initrd=Path("/img/initrd.img"),
                       rootfs=Path("/img/rootfs.raw"), source=Path("/src"),
                       backend_files={b: Path(f"/tmp/lab/{b}.mem") for b in topo.backends},
                       ssh_port=2222, link_sockets=links,
                       nic_sockets={n: s for n, s in nic_sockets(topo, Path("/tmp/lab")).items()
                                    if topo.nics[n].owner == vm.name},
                       nvme_files={n.drive_id(i): run / f"{n.drive_id(i)}.raw"
                                   for n in vm.nvmes for i in range(1, len(n.namespaces) + 1)},
                       gpu_sockets={g.name: run / f"{g.name}.sock" for g in topo.gpus_of(vm.name)} if gpu else {})


def argv_of(name, vm_index=1, **kwargs):
    topo = topology.load(name)
    return qemu_argv(topo, topo.vms[vm_index - 1], resources(topo, vm_index, **kwargs))


def devices(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]


def test_single_vm_command_line():
    argv = argv_of("single")
    joined = " ".join(argv)
    # intel-iommu must be the first PCI device.
    assert devices(argv)[0].startswith("intel-iommu,") and "caching-mode=on" in devices(argv)[0]
    assert argv[argv.index("-cpu") + 1] == "max,hypervisor=off"
    assert "memory-backend-memfd,id=ram,size=1024M,share=on" in joined
    assert "memory-backend=ram" in argv[argv.index("-machine") + 1]
    assert "memory-backend-file,id=cxl-cxl0,share=on,mem-path=/tmp/lab/cxl0.mem,size=256M" in joined
    assert [d.split(",")[0] for d in devices(argv) if d.startswith("pxb") or d.startswith("cxl-")] == [
        "pxb-cxl", "cxl-rp", "cxl-upstream", "cxl-downstream", "cxl-type3"]
    assert "pxb-cxl,bus_nr=12,bus=pcie.0,id=hb0" in devices(argv)
    assert "cxl-type3,bus=ds0,id=mem0,sn=0x1000,volatile-memdev=cxl-cxl0" in devices(argv)
    assert argv[argv.index("-M") + 1] == \
        "cxl-fmw.0.targets.0=hb0,cxl-fmw.0.size=4096M,cxl-fmw.0.interleave-granularity=8k"
    assert "user,id=ssh,restrict=on,hostfwd=tcp:127.0.0.1:2222-:22" in joined
    assert argv[argv.index("-accel") + 1] == "tcg"
    gpu = [json.loads(d) for d in devices(argv) if d.startswith("{")]
    assert gpu == [{"driver": "vfio-user-pci", "id": "gpu0", "bus": "gpu0-port",
                    "socket": {"type": "unix", "path": "/tmp/lab/host0/gpu0.sock"}}]
    # Every non-CXL PCI device sits on pcie.0 explicitly (QEMU might pick the pxb-cxl bus).
    for dev in devices(argv):
        if dev.startswith(("virtio-", "pcie-root-port")):
            assert "bus=pcie.0" in dev, dev


def test_root_ports_stay_without_gpu_server_and_hotplug_ports_reserve_the_bar():
    argv = argv_of("single", gpu=False)
    ports = [d for d in devices(argv) if d.startswith("pcie-root-port")]
    assert ports == ["pcie-root-port,id=gpu0-port,bus=pcie.0,chassis=1,slot=1",
                     "pcie-root-port,id=hp0,bus=pcie.0,chassis=1,slot=2,pref64-reserve=64M"]
    assert not any(d.startswith("{") for d in devices(argv))


def test_hotplug_reserve_follows_the_largest_vram(tmp_path):
    path = tmp_path / "big.toml"
    path.write_text((topology.TOPOLOGY_DIR / "fabric.toml").read_text().replace(
        "[gpus.gpu1]", "[gpus.gpu1]\nvram = \"256M\""))
    topo = topology.load(str(path))
    argv = qemu_argv(topo, topo.vms[1], resources(topo, 2))
    assert "pcie-root-port,id=hp0,bus=pcie.0,chassis=1,slot=2,pref64-reserve=256M" in devices(argv)


def test_shared_vms_map_one_backend_file():
    a = " ".join(argv_of("shared", 1))
    b = " ".join(argv_of("shared", 2))
    backend = "memory-backend-file,id=cxl-shared,share=on,mem-path=/tmp/lab/shared.mem"
    assert backend in a and backend in b
    assert "vfio-user-pci" in a and "vfio-user-pci" not in b
    assert "52:54:00:5c:00:01" in a and "52:54:00:5c:00:02" in b


def test_link_sockets_make_a_point_to_point_network():
    listen = " ".join(argv_of("shared", links=((Path("/tmp/lab/link0.sock"), True, 0),)))
    connect = " ".join(argv_of("shared", links=((Path("/tmp/lab/link3.sock"), False, 3),)))
    assert "stream,id=link0,addr.type=unix,addr.path=/tmp/lab/link0.sock,server=on" in listen
    assert "server=off" in connect
    assert "52:54:00:1c:00:01" in listen and "52:54:00:1c:03:01" in connect


def test_kvm_needs_split_irqchip():
    topo = topology.load("single")
    res = resources(topo)
    argv = qemu_argv(topo, topo.vms[0], VmResources(**{**res.__dict__, "accel": "kvm"}))
    assert "kernel-irqchip=split" in argv[argv.index("-machine") + 1]


def test_two_host_bridges_one_machine_option_for_every_window():
    argv = argv_of("hb2")
    assert argv.count("-M") == 1   # QEMU: "Parameters 'cxl-fmw.*' used inconsistently" otherwise
    assert argv[argv.index("-M") + 1] == ("cxl-fmw.0.targets.0=hb0,cxl-fmw.0.targets.1=hb1,cxl-fmw.0.size=4096M,"
                                          "cxl-fmw.0.interleave-granularity=8k")
    bridges = [d for d in devices(argv) if d.startswith("pxb-cxl")]
    assert bridges == ["pxb-cxl,bus_nr=12,bus=pcie.0,id=hb0", "pxb-cxl,bus_nr=19,bus=pcie.0,id=hb1"]
    assert "cxl-rp,port=1,bus=hb1,id=rp3,chassis=0,slot=5" in devices(argv)
    # (chassis, slot) pairs are unique across every port of the VM.
    slots = re.findall(r"chassis=(\d+),slot=(\d+)", " ".join(devices(argv)))
    assert len(slots) == len(set(slots))


def test_persistent_type3_gets_its_label_storage_area():
    argv = argv_of("pmem")
    joined = " ".join(argv)
    assert "memory-backend-file,id=lsa-pmem0,share=on,mem-path=/tmp/lab/host0/pmem0.lsa,size=256K" in joined
    assert "cxl-type3,bus=rp0,id=pmem0,sn=0x1000,persistent-memdev=cxl-pm0,lsa=lsa-pmem0" in devices(argv)
    assert ("cxl-type3,bus=rp1,id=both0,sn=0x1001,volatile-memdev=cxl-vm1,persistent-memdev=cxl-pm1,"
            "lsa=lsa-both0") in devices(argv)


def test_gpus_behind_a_pcie_switch():
    argv = argv_of("p2p")
    devs = devices(argv)
    assert "pcie-root-port,id=psw0-port,bus=pcie.0,chassis=1,slot=2" in devs
    assert "x3130-upstream,id=psw0,bus=psw0-port" in devs
    assert "xio3130-downstream,id=dp0,bus=psw0,chassis=2,slot=0" in devs
    # gpu2 has no 'at': a root port of its own, so gpu0 -> gpu2 goes through the root complex
    assert "pcie-root-port,id=gpu2-port,bus=pcie.0,chassis=1,slot=1" in devs
    gpus = [json.loads(d) for d in devs if d.startswith("{")]
    assert sorted((g["id"], g["bus"]) for g in gpus) == [("gpu0", "dp0"), ("gpu1", "dp1"), ("gpu2", "gpu2-port")]
    # The switch comes before its GPUs on the command line.
    assert devs.index("xio3130-downstream,id=dp1,bus=psw0,chassis=2,slot=1") < devs.index(
        next(d for d in devs if '"id":"gpu1"' in d))


def test_nvme_behind_the_switch_and_on_a_root_port_with_their_namespaces():
    argv = argv_of("storage")
    devs = devices(argv)
    drives = [argv[i + 1] for i, a in enumerate(argv) if a == "-drive"]
    assert "file=/tmp/lab/host0/nvme0-ns1.raw,if=none,id=nvme0-ns1,format=raw" in drives
    assert "file=/tmp/lab/host0/nvme1-ns2.raw,if=none,id=nvme1-ns2,format=raw" in drives
    # nvme0 beside the GPU behind psw0; shadow doorbells off, QEMU's bounce buffer at 1M
    nvme0 = next(d for d in devs if d.startswith("nvme,id=nvme0,"))
    assert nvme0 == ("nvme,id=nvme0,bus=dp1,serial=vfio-cxl-nvme0,max_ioqpairs=16,dbcs=off,"
                     "x-max-bounce-buffer-size=1048576,cmb_size_mb=4")
    assert devs.index("xio3130-downstream,id=dp1,bus=psw0,chassis=2,slot=1") < devs.index(nvme0)
    # nvme1 on a root port of its own, with its CMB and two namespaces on its bus
    assert "pcie-root-port,id=nvme1-port,bus=pcie.0,chassis=1,slot=2" in devs
    nvme1 = next(d for d in devs if d.startswith("nvme,id=nvme1,"))
    assert "bus=nvme1-port" in nvme1 and nvme1.endswith(",cmb_size_mb=4")
    assert devs.index(nvme1) < devs.index("nvme-ns,drive=nvme1-ns1,bus=nvme1,nsid=1") < \
        devs.index("nvme-ns,drive=nvme1-ns2,bus=nvme1,nsid=2")
    # every namespace's drive is declared before the controller that uses it
    assert argv.index("file=/tmp/lab/host0/nvme1-ns2.raw,if=none,id=nvme1-ns2,format=raw") < argv.index(nvme1)


def test_shadow_doorbells_on_when_asked(tmp_path):
    path = tmp_path / "dbcs.toml"
    path.write_text((topology.TOPOLOGY_DIR / "storage.toml").read_text().replace(
        "queue_pairs = 16", "queue_pairs = 16\nshadow_doorbells = true\nbounce_buffer = \"4K\""))
    topo = topology.load(str(path))
    devs = devices(qemu_argv(topo, topo.vms[0], resources(topo)))
    nvme0 = next(d for d in devs if d.startswith("nvme,id=nvme0,"))
    assert ",dbcs=on," in nvme0 and nvme0.endswith("x-max-bounce-buffer-size=4096,cmb_size_mb=4")


def test_unowned_gpu_is_nowhere_at_boot(tmp_path):
    path = tmp_path / "unowned.toml"
    path.write_text((topology.TOPOLOGY_DIR / "fabric.toml").read_text().replace('owner = "b"', ""))
    topo = topology.load(str(path))
    assert topo.gpus["gpu1"].owner is None
    for vm_index in (1, 2):
        argv = qemu_argv(topo, topo.vms[vm_index - 1], resources(topo, vm_index))
        gpus = [json.loads(d) for d in devices(argv) if d.startswith("{")]
        assert "gpu1" not in [g["id"] for g in gpus]


@pytest.mark.parametrize("name", topology.available())
def test_every_shipped_topology_builds(name):
    topo = topology.load(name)
    for i, vm in enumerate(topo.vms, start=1):
        argv = qemu_argv(topo, vm, resources(topo, i))
        ids = re.findall(r"[,{\"]id[=\":]+([\w.-]+)", " ".join(argv))
        assert len(ids) == len(set(ids)), f"{name}/{vm.name}: repeated QEMU ids {ids}"


def test_nic_sits_on_a_root_port_of_its_own_with_a_network_that_reaches_nothing():
    argv = argv_of("selftest")
    devs = devices(argv)
    port = next(d for d in devs if d.startswith("pcie-root-port,id=igb-port"))
    assert "bus=pcie.0" in port
    assert "igb,netdev=nic-igb,id=igb,bus=igb-port,mac=52:54:00:1e:01:00,x-max-bounce-buffer-size=65536" in devs
    assert "user,id=nic-igb,restrict=on" in argv   # no hostfwd: nothing reaches in or out
    # the NIC's port comes after the GPU's, so adding a NIC moves no other device
    assert devs.index(port) > devs.index("pcie-root-port,id=gpu0-port,bus=pcie.0,chassis=1,slot=1")


def test_nic2_puts_each_igb_beside_its_gpu_behind_one_switch():
    for vm_index, gpu, mac in ((1, "gpu0", "01"), (2, "gpu1", "02")):
        devs = devices(argv_of("nic2", vm_index))
        nic = f"nic{vm_index - 1}"
        igb = f"igb,netdev=nic-{nic},id={nic},bus=dp1,mac=52:54:00:1e:{mac}:00,x-max-bounce-buffer-size=65536"
        assert igb in devs
        assert devs.index("xio3130-downstream,id=dp1,bus=psw0,chassis=2,slot=1") < devs.index(igb)
        assert [json.loads(d)["bus"] for d in devs if d.startswith("{")] == ["dp0"]   # the GPU beside it
        # behind the switch: the only root port is the switch's (no igb-port, no nicN-port)
        assert [d for d in devs if d.startswith("pcie-root-port")] == [
            "pcie-root-port,id=psw0-port,bus=pcie.0,chassis=1,slot=1"]


def test_nic2_wires_the_two_igbs_through_one_socket_of_their_own(tmp_path):
    """Lab.plan gives the link's NICs one socket, beside the link's virtio-net socket: host0
    (the link's first VM) listens, host1 connects; the virtio-net pair stays."""
    topo = topology.load("nic2")
    netdevs = {}
    for vm in Lab(topo).plan(tmp_path):
        argv = qemu_argv(topo, vm.spec, vm.res)
        netdevs[vm.spec.name] = [argv[i + 1] for i, a in enumerate(argv) if a == "-netdev"]
    socket = tmp_path / "link0-nic.sock"
    assert f"stream,id=nic-nic0,addr.type=unix,addr.path={socket},server=on" in netdevs["host0"]
    assert f"stream,id=nic-nic1,addr.type=unix,addr.path={socket},server=off,reconnect-ms=100" in netdevs["host1"]
    for name, vm_netdevs in netdevs.items():
        assert any(d.startswith(f"stream,id=link0,addr.type=unix,addr.path={tmp_path / 'link0.sock'},")
                   for d in vm_netdevs), name
        assert not any(d.startswith("user,id=nic-") for d in vm_netdevs), name


def test_a_nic_bounce_buffer_and_a_nic_on_a_link_without_its_socket(tmp_path):
    path = tmp_path / "big.toml"
    path.write_text((topology.TOPOLOGY_DIR / "nic2.toml").read_text().replace(
        "link = 0                       # wired", 'bounce_buffer = "1M"\nlink = 0   # wired'))
    topo = topology.load(str(path))
    assert [n.bounce_buffer for n in topo.nics.values()] == [1 << 20, 64 << 10]
    res = resources(topo)
    assert any(d.endswith("x-max-bounce-buffer-size=1048576") for d in devices(qemu_argv(topo, topo.vms[0], res)))
    with pytest.raises(LabError, match="NIC nic0 is on link 0 but has no socket for it"):
        qemu_argv(topo, topo.vms[0], VmResources(**{**res.__dict__, "nic_sockets": {}}))


def test_the_host_tsc_frequency_spares_the_guest_its_calibration():
    topo = topology.load("single")
    res = resources(topo)

    def cmdline(**changes):
        argv = qemu_argv(topo, topo.vms[0], VmResources(**{**res.__dict__, **changes}))
        return argv[argv.index("-append") + 1]

    assert "tsc_early_khz" not in cmdline()
    # lpj is loops per jiffy, at the kernel's own HZ; the user's --append comes last, so it wins
    assert cmdline(tsc_khz=2_300_000, guest_hz=250, append="lpj=1").endswith(
        "tsc_early_khz=2300000 lpj=9200000 lpj=1")
    assert cmdline(tsc_khz=2_300_000, guest_hz=1000).endswith("tsc_early_khz=2300000 lpj=2300000")
    # a kernel whose HZ is not known calibrates its delay loop itself
    assert cmdline(tsc_khz=2_300_000).endswith("tsc_early_khz=2300000")


def test_the_lab_kernel_is_given_its_tcg_boot_parameters_and_no_other_kernel_is():
    """QEMU's TCG APIC counts nanoseconds: 1 GHz, so 10**9 / HZ bus clocks per jiffy; and the
    freed init memory is not poisoned.  Only for a kernel that takes them (the lab kernel's
    patches), only under TCG; the period only where HZ is known."""
    topo = topology.load("single")
    res = resources(topo)

    def words(**changes):
        argv = qemu_argv(topo, topo.vms[0], VmResources(**{**res.__dict__, **changes}))
        return argv[argv.index("-append") + 1].split()

    lab = words(lab_boot_params=True, guest_hz=250)
    assert "lapic_timer_period=4000000" in lab and "initmem_poison=off" in lab
    # QEMU commits CXL decoders at once, under any accelerator: no 20 ms settle per port
    assert "cxl_core.decoder_settle_ms=0" in lab
    assert "cxl_core.decoder_settle_ms=0" in words(lab_boot_params=True, guest_hz=250, accel="kvm")
    assert "cxl_core.decoder_settle_ms=0" not in words(lab_boot_params=False, guest_hz=250)
    assert "lapic_timer_period=1000000" in words(lab_boot_params=True, guest_hz=1000)
    unknown_hz = words(lab_boot_params=True, guest_hz=None)
    assert "initmem_poison=off" in unknown_hz and not any(w.startswith("lapic_timer_period") for w in unknown_hz)
    for other in (words(lab_boot_params=False, guest_hz=250),                 # Debian's, a user's kernel
                  words(lab_boot_params=True, guest_hz=250, accel="kvm")):   # not TCG
        assert not any(w.startswith(("lapic_timer_period", "initmem_poison")) for w in other), other
    # every kernel: no 10 ms wait after each secondary CPU's INIT (TCG's CPU looks pre-K8)
    assert "cpu_init_udelay=0" in words()
    # --append comes last, so a user can poison after all
    assert words(lab_boot_params=True, guest_hz=250, append="initmem_poison=on")[-1] == "initmem_poison=on"


def test_only_the_lab_kernel_is_said_to_take_the_lab_boot_parameters():
    from vfio_cxl.lab.kernel import GuestKernel
    assert GuestKernel(Path("vmlinux"), label="lab").takes_lab_boot_params
    assert not GuestKernel(Path("bzImage"), label="custom").takes_lab_boot_params
    assert not GuestKernel(Path(), label="debian").takes_lab_boot_params


def test_the_kernel_hz_is_read_from_its_config():
    from vfio_cxl.lab.kconfig import kconfig_hz, parse_config
    assert kconfig_hz(parse_config("CONFIG_HZ_250=y\nCONFIG_HZ=250\n")) == 250
    assert kconfig_hz(parse_config("# CONFIG_HZ is not set\n")) is None
    assert kconfig_hz({}) is None


def test_the_host_tsc_is_measured_within_a_percent_of_what_the_kernel_says():
    import platform

    from vfio_cxl.lab.host_tsc import host_tsc_khz
    khz = host_tsc_khz()
    if platform.machine() != "x86_64":
        assert khz is None
        return
    # /proc/cpuinfo's "cpu MHz" is the TSC frequency when the kernel knows it exactly
    # (tsc_known_freq: virtual machines); elsewhere it is the current core clock
    cpuinfo = Path("/proc/cpuinfo").read_text()
    if khz is None or " tsc_known_freq" not in cpuinfo:
        pytest.skip("no reference for the TSC frequency on this host")
    mhz = float(re.search(r"cpu MHz\s*:\s*([0-9.]+)", cpuinfo).group(1))
    assert abs(khz / 1000 - mhz) / mhz < 0.002, (khz, mhz)   # the guest keeps it if within 1 %


def test_the_labs_own_ssh_path_is_a_unix_socket_on_a_subnet_of_its_own_and_the_last_device():
    """docs/fabric-manager.md, "SSH reachability": the lab connects through a UNIX socket in the
    VM's run directory, on a second user network, so its connections reach dropbear from
    10.0.3.2 and other users' TCP connections to the forwarded port cannot use up its 5."""
    argv = argv_of("single")
    assert argv[-4:] == ["-netdev", "user,id=ctl,restrict=on,net=10.0.3.0/24,hostfwd=unix:/tmp/lab/host0/ssh.sock-:22",
                         "-device", "virtio-net-pci,netdev=ctl,mac=52:54:00:5d:00:01,bus=pcie.0,romfile="]
    assert "user,id=ssh,restrict=on,hostfwd=tcp:127.0.0.1:2222-:22" in argv     # the TCP port stays
    # appended last (above): every other device keeps the PCI address it had without it
    topo = topology.load("single")
    res = resources(topo)
    odd = VmResources(**{**res.__dict__, "rundir": Path("/tmp/a,b/host0")})
    assert "hostfwd=unix:/tmp/a,,b/host0/ssh.sock-:22" in qemu_argv(topo, topo.vms[0], odd)[-3]


def test_the_bytecode_cache_is_the_last_device_and_writable():
    """The guests' bytecode cache: a writable 9p share after every other device (so no device's
    PCI address moves), none without one."""
    topo = topology.load("single")
    res = resources(topo)
    without = qemu_argv(topo, topo.vms[0], res)
    assert not any("vfio_cxl_pyc" in d for d in devices(without))
    argv = qemu_argv(topo, topo.vms[0], VmResources(**{**res.__dict__, "bytecode": Path("/c/pyc,x")}))
    assert devices(argv)[:-1] == devices(without)
    assert devices(argv)[-1] == "virtio-9p-pci,fsdev=pyc,mount_tag=vfio_cxl_pyc,bus=pcie.0"
    shares = [argv[i + 1] for i, a in enumerate(argv) if a == "-fsdev"]
    assert shares[-1] == "local,id=pyc,path=/c/pyc,,x,security_model=none"   # no readonly
    assert "readonly=on" in shares[0]   # the source stays read-only


def test_a_vm_with_regions_gets_its_plan_as_a_fw_cfg_file(tmp_path):
    """The guest's init reads the region plan from fw_cfg and brings the regions up while SSH
    starts: a plan of ram regions only as text (opt/vfio-cxl/ram-regions, for ram_regions.sh),
    one with pmem as JSON (opt/vfio-cxl/regions, for cxltool); a VM without regions gets no file."""
    from vfio_cxl.lab.lab import region_plan
    topo = topology.load("single")
    (vm,) = Lab(topo).plan(tmp_path)
    assert vm.res.regions_plan == tmp_path / "host0" / "regions.txt"
    argv = vm.argv()
    assert argv[-2:] == ["-fw_cfg", f"name=opt/vfio-cxl/ram-regions,file={tmp_path}/host0/regions.txt"]
    assert region_plan(topo, vm.spec)["regions"], "single has a region to plan"
    (vm,) = Lab(topology.load("pmem")).plan(tmp_path / "p")
    assert vm.argv()[-2:] == ["-fw_cfg", f"name=opt/vfio-cxl/regions,file={tmp_path}/p/host0/regions.json"]
    storage = topology.load("storage")   # no CXL: no plan, no fw_cfg
    (vm,) = Lab(storage).plan(tmp_path / "s")
    assert vm.res.regions_plan is None and "-fw_cfg" not in vm.argv()
