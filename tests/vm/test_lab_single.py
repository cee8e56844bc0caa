"""Issue: the single-host lab boots and the guest sees the vIOMMU, the CXL switch,
the Type3 memdev, IOMMU groups and a free PCIe root port.

Written against the pytest plugin's ``lab`` fixture (docs/pytest-plugin.md), as a user's
test of the lab would be: a detached lab, commands over SSH, nothing of QEMU's insides."""

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import PurePosixPath

import pytest

from vfio_cxl.lab.ssh import GuestShell

pytestmark = pytest.mark.lab("single")


def test_guest_sees_intel_iommu_dmar(lab):
    assert "dmar0" in lab.ssh("host0", "ls /sys/class/iommu").split()
    assert "intel_iommu=on" in lab.ssh("host0", "cat /proc/cmdline")


def test_guest_sees_cxl_switch_with_one_memdev(lab):
    listing = json.loads(lab.ssh("host0", "cxl list -M -P"))
    (root,) = listing                          # the host bridge's port
    (switch,) = root[f"ports:{root['port']}"]  # the switch's upstream port
    assert switch["depth"] == 2
    (memdev,) = switch[f"memdevs:{switch['port']}"]
    assert memdev["memdev"] == "mem0" and memdev["ram_size"] == 256 << 20
    # Our pyudev discovery agrees with cxl-cli.
    ours = json.loads(lab.ssh("host0", "vfio-cxl-m vfio_cxl.guest.cmd.cxltool list"))
    assert ours["switches"] == [switch["port"]]
    assert [(m["name"], m["ram_size"]) for m in ours["memdevs"]] == [("mem0", 256 << 20)]


def test_guest_has_iommu_groups(lab):
    groups = lab.ssh("host0", "ls /sys/kernel/iommu_groups").split()
    assert len(groups) >= 5
    # The Type3 device and the GPU each sit in an IOMMU group.
    for bdf in ("0000:0f:00.0", "0000:01:00.0"):
        group = lab.ssh("host0", f"readlink /sys/bus/pci/devices/{bdf}/iommu_group").strip()
        assert PurePosixPath(group).name in groups


def test_a_pcie_root_port_is_free(lab):
    # QEMU root ports (1b36:000c) on bus 0 whose secondary bus holds no device.
    script = (
        "for p in /sys/bus/pci/devices/0000:00:*; do "
        "  [ \"$(cat $p/vendor):$(cat $p/device)\" = 0x1b36:0x000c ] || continue; "
        "  n=$(ls -d $p/0000:??:??.? 2>/dev/null | wc -l); echo \"${p##*/} $n\"; "
        "done")
    ports = dict(line.split() for line in lab.ssh("host0", script).splitlines())
    assert len(ports) >= 2, ports
    assert "0" in ports.values(), f"no free root port: {ports}"


def test_a_failing_guest_command_raises_with_its_stderr_unless_told_not_to(lab):
    from vfio_cxl.lab.ssh import GuestCommandError

    with pytest.raises(GuestCommandError, match="no-such-file") as err:
        lab.ssh("host0", "ls /no-such-file")
    assert err.value.exited != 0 and "no-such-file" in err.value.stderr
    assert lab.ssh("host0", "ls /no-such-file; echo after", check=False) == "after\n"
    assert lab.fm.status()["vms"]["host0"]["ssh_port"] == lab.ports["host0"]


def test_five_idle_tcp_connections_do_not_keep_the_lab_out(lab):
    """docs/fabric-manager.md, "SSH reachability": behind slirp every TCP connection to the
    forwarded port comes from one address, and dropbear lets one address hold 5 connections
    that have not authenticated: any local user's 5 idle connections turn new TCP logins away.
    The lab's own path is a UNIX socket only its user may open, on a user network of its own
    (source 10.0.3.2): `vm ssh` and new lab connections keep working."""
    lab.ssh("host0", "true")
    port = lab.ports["host0"]
    info = lab.fm.ssh_info("host0")
    mode = os.stat(info["socket"]).st_mode
    assert stat.S_ISSOCK(mode) and not mode & 0o022, oct(mode)    # connect needs write: owner only
    assert stat.S_IMODE(os.stat(os.path.dirname(info["socket"])).st_mode) == 0o700   # and its directory
    idle = [socket.create_connection(("127.0.0.1", port), timeout=120) for _ in range(5)]
    try:
        for conn in idle:   # dropbear's banner: each is one of its unauthenticated children now
            assert conn.makefile("rb").readline().startswith(b"SSH-2.0-")
        sixth = socket.create_connection(("127.0.0.1", port), timeout=120)
        with sixth:         # the TCP port is full: dropbear closes a sixth at once, no banner
            assert sixth.makefile("rb").readline() == b""
        vm_ssh = [sys.executable, "-m", "vfio_cxl", "vm", "ssh", "--lab", lab.name, "host0", "--",
                  "echo in; echo $SSH_CONNECTION"]
        answered = subprocess.run(vm_ssh, capture_output=True, text=True, timeout=120)
        assert answered.returncode == 0 and answered.stdout.split()[:2] == ["in", "10.0.3.2"], answered
        fresh = GuestShell("host0", port, info["key"], lab_host_key(info), unix_socket=info["socket"])
        fresh.connect(time.monotonic() + 60)
        try:
            assert fresh.run("echo $SSH_CONNECTION").stdout.split()[0] == "10.0.3.2"
        finally:
            fresh.close()
    finally:
        for conn in idle:
            conn.close()


def lab_host_key(info: dict) -> str:
    with open(info["known_hosts"]) as f:
        return next(line.split()[2] for line in f if line.split()[0] == f"[127.0.0.1]:{info['port']}")
