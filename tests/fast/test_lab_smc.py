"""The lab's side of the shared-memory controller: the [smc.NAME] table, the QEMU
devices it adds, and the SMC server process (started for real, reached over its sockets)."""

import json
from pathlib import Path

import pytest

from vfio_cxl.devices.vfio_user.client import VfioUserClient
from vfio_cxl.errors import LabError
from vfio_cxl.lab import topology
from vfio_cxl.lab.argv import VmResources, qemu_argv
from vfio_cxl.lab.device_process import smc_server

VMS = "[[vm]]\nname='a'\n[[vm]]\nname='b'\n[[vm]]\nname='c'\n"


def test_smc_topology_loads():
    # The [smc.NAME] table's rules are tested with the rest of the schema (test_lab_topology.py).
    topo = topology.load("smc")
    assert list(topo.smcs) == ["smc0"] and topo.smcs["smc0"].hosts == ["a", "b"]
    assert topo.smc_of("a") == (topo.smcs["smc0"], 0)
    assert topo.smc_of("b") == (topo.smcs["smc0"], 1)
    assert topology.load("shared").smcs == {} and topology.load("shared").smc_of("a") is None


def test_a_host_gets_one_vfio_user_device_on_its_own_root_port():
    topo = topology.load("smc")
    vm = topo.vms[1]
    res = VmResources(index=2, rundir=Path("/tmp/lab/b"), kernel=Path("/k"), initrd=Path("/i"),
                      rootfs=Path("/r"), source=Path("/src"), backend_files={"shared": Path("/tmp/lab/s.mem")},
                      ssh_port=2222, smc_socket=Path("/tmp/lab/smc-smc0/host1.sock"))
    argv = qemu_argv(topo, vm, res)
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]
    ports = [d for d in devices if d.startswith("pcie-root-port,id=smc_port,bus=pcie.0,chassis=1,slot=")]
    assert len(ports) == 1
    # a slot no other root port of pcie.0 uses
    slots = [d.split("slot=")[1].split(",")[0] for d in devices if d.startswith("pcie-root-port,") and "bus=pcie.0" in d]
    assert len(slots) == len(set(slots))
    user = [json.loads(d) for d in devices if d.startswith("{")]
    assert user == [{"driver": "vfio-user-pci", "id": "smc0", "bus": "smc_port",
                     "socket": {"type": "unix", "path": "/tmp/lab/smc-smc0/host1.sock"}}]
    res_without = VmResources(**{**res.__dict__, "smc_socket": None})
    assert "smc_port" not in " ".join(qemu_argv(topo, vm, res_without))


def test_smc_server_process_ready_serves_and_stops(tmp_path):
    sockets = [tmp_path / "host0.sock", tmp_path / "host1.sock"]
    server = smc_server("smc0", sockets, tmp_path / "smc.log")
    server.start()
    try:
        with VfioUserClient(str(sockets[1])) as client:
            client.negotiate()
            assert client.reg_read(0x008) == 1   # HOST_ID of the second socket
    finally:
        server.stop()
    assert server.process is None and not any(s.exists() for s in sockets)


def test_smc_server_that_cannot_listen_is_a_lab_error(tmp_path):
    server = smc_server("smc0", [tmp_path / "missing-dir" / "host0.sock"], tmp_path / "smc.log")
    with pytest.raises(LabError, match="exited before it was ready"):
        server.start()
    assert server.process is None
