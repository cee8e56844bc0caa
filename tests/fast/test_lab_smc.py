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
    topo = topology.load("smc")
    assert topo.smcs == (topology.SmcSpec("smc0", ("a", "b")),)
    assert topo.smc_of("a") == (topo.smcs[0], 0)
    assert topo.smc_of("b") == (topo.smcs[0], 1)
    assert topology.load("shared").smcs == () and topology.load("shared").smc_of("a") is None


@pytest.mark.parametrize("text, message", [
    ("[smc.s]\nhosts=['a','zz']", "unknown VM.*zz"),
    ("[smc.s]\nhosts=[]", "hosts must be a list of 1 to 16"),
    ("[smc.s]\nhosts='a'", "hosts must be a list"),
    ("[smc.s]\nhosts=['a','a']", "named twice"),
    ("[smc.s]\nhosts=['a']\n[smc.t]\nhosts=['b','a']", "already a host of smc.s"),
    ("[smc.s]\nhosts=['a']\ncolour=1", "unknown key.*colour"),
    ("[smc.BAD]\nhosts=['a']", "bad controller name"),
    ("smc=3", "smc must be a table"),
])
def test_bad_smc_tables_name_the_problem(text, message):
    with pytest.raises(LabError, match=message):
        topology.parse(VMS + text if text.startswith("[") else text + "\n" + VMS, "t")


def test_a_host_gets_one_vfio_user_device_on_its_own_root_port():
    vm = topology.load("smc").vms[1]
    res = VmResources(index=2, rundir=Path("/tmp/lab/b"), kernel=Path("/k"), initrd=Path("/i"),
                      rootfs=Path("/r"), source=Path("/src"), backend_files={"shared": Path("/tmp/lab/s.mem")},
                      ssh_port=2222, smc_socket=Path("/tmp/lab/smc-smc0/host1.sock"))
    argv = qemu_argv(vm, res)
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]
    assert "pcie-root-port,id=smc_port,bus=pcie.0,chassis=1,slot=3" in devices
    user = [json.loads(d) for d in devices if d.startswith("{")]
    assert user == [{"driver": "vfio-user-pci", "id": "smc0", "bus": "smc_port",
                     "socket": {"type": "unix", "path": "/tmp/lab/smc-smc0/host1.sock"}}]
    res_without = VmResources(**{**res.__dict__, "smc_socket": None})
    assert "smc_port" not in " ".join(qemu_argv(vm, res_without))


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
