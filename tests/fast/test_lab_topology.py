"""Topologies: the shipped ones load; bad ones fail with one clear line."""

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import topology


def test_shipped_topologies_load():
    assert topology.available() == ["shared", "single", "smc", "smc3"]
    single = topology.load("single")
    assert [vm.name for vm in single.vms] == ["host0"]
    assert single.vms[0].gpu and len(single.vms[0].type3) == 1
    shared = topology.load("shared")
    a, b = shared.vms
    assert a.gpu and not b.gpu
    # Both Type3 devices name the same backend: that is the sharing.
    assert a.type3[0].backend is b.type3[0].backend
    assert shared.links[0].vms == ("a", "b")


def test_sizes():
    assert topology.parse_size("256M", "x") == 256 << 20
    assert topology.parse_size("4G", "x") == 4 << 30
    with pytest.raises(LabError, match="bad size"):
        topology.parse_size("lots", "x")


@pytest.mark.parametrize("text, message", [
    ("[[vm]\nname='a'", "malformed TOML"),
    ("", "no \\[\\[vm\\]\\] defined"),
    ("[[vm]]\nname='a'\ncolour='red'", "unknown key.*colour"),
    ("[[vm]]\nname='A B'", "bad or missing name"),
    ("[[vm]]\nname='a'\n[[vm.type3]]\nbackend='nope'", "unknown backend 'nope'"),
    ("[[vm]]\nname='a'\n[[vm]]\nname='a'", "names repeat"),
    ("[[vm]]\nname='a'\ncpus=0", "cpus must be"),
    ("[[vm]]\nname='a'\n[[link]]\nvms=['a','zz']", "must join two different VMs"),
    ("[backends.m]\nsize='huge'\n[[vm]]\nname='a'", "bad size"),
])
def test_bad_topologies_name_the_problem(text, message):
    with pytest.raises(LabError, match=message):
        topology.parse(text, "t", "t.toml")


def test_unknown_topology_lists_the_known_ones():
    with pytest.raises(LabError) as err:
        topology.load("nosuch")
    assert "shared, single" in str(err.value)


def test_topology_from_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[backends.m]\nsize='64M'\n[[vm]]\nname='x'\nmemory='512M'\n[[vm.type3]]\nbackend='m'\n")
    topo = topology.load(str(path))
    assert topo.name == "mine" and topo.vms[0].memory == 512 << 20
