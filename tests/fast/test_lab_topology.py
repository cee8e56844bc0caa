"""Topologies: the shipped ones load; every validation rule has a bad file and its exact error.

The bad files are the base topology of ``test_lab_topology_cases`` with one edit each."""

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import topology

from test_lab_topology_cases import BASE, CASES, variant

SHIPPED = ["fabric", "hb2", "interleave2", "mhmld", "nic2", "p2p", "pmem", "pool", "selftest", "shared", "single", "smc", "storage"]

EXPECTED = dict([
    ('malformed TOML',
     "t.toml: malformed TOML: Expected ']]' at the end of an array declaration (at line 58, column 5) -- fix the file's syntax"),
    ('no VM',
     't.toml: vm: no [[vm]] defined -- add at least one [[vm]] table with a name'),
    ('unknown key',
     't.toml: vm[0].colour: unknown key -- allowed here: cpus, host_bridge, hotplug_ports, memory, name, nvme, pcie_switch, region, switch, type3, window -- see docs/topologies.md for every key'),
    ('bad name',
     "t.toml: vm[1].name: bad name 'G 2': use 1-16 lower-case letters, digits or '-', starting with a letter -- see docs/topologies.md for every key"),
    ('reserved name',
     "t.toml: vm[0].region[0].name: name 'ram' is reserved by the lab -- choose another name (reserved: console, pcie, ram, root, src, ssh)"),
    ('unique names in a VM',
     "t.toml: vm[0].type3[1].name: name 'mem0' is already used by vm[0].type3[0].name in VM 'h' -- give every host bridge, port, switch, Type3 device and region of a VM its own name"),
    ('unique VM names',
     "t.toml: vm[1].name: VM name 'h' repeats -- give each [[vm]] its own name"),
    ('bad size',
     't.toml: vm[0].window[1].size: bad size \'lots\': write sizes like "256M" or "4G" -- see docs/topologies.md for every key'),
    ('backend size in 256M units',
     't.toml: backends.m1.size: a CXL memory backend\'s size must be a positive multiple of 256M, not 100M: use e.g. "256M", "512M", "1G" -- see docs/topologies.md for every key'),
    ('memory',
     't.toml: vm[0].memory: memory must be a multiple of 2M from 256M to 64G, not 100M -- see docs/topologies.md for every key'),
    ('cpus',
     't.toml: vm[0].cpus: cpus must be a whole number from 1 to 16, not 0 -- see docs/topologies.md for every key'),
    ('hotplug ports',
     't.toml: vm[0].hotplug_ports: hotplug_ports must be a whole number from 0 to 8, not 9 -- see docs/topologies.md for every key'),
    ('unknown backend',
     "t.toml: vm[0].type3[1].volatile: unknown backend 'nope' -- declare it as [backends.nope] with a size; known: m0, m1, p0"),
    ('unused backend',
     "t.toml: backends.m2: backend 'm2' is not used by any Type3 device -- name it in a [[vm.type3]] (volatile = or persistent =), or remove it"),
    ('backend mapped twice in a VM',
     "t.toml: vm[0].type3[1].volatile: backend 'm0' is mapped twice in VM 'h' (also by mem0) -- a VM maps a backend through one Type3 device; share it with other VMs, or declare a second backend"),
    ('Type3 without memory',
     't.toml: vm[0].type3[1]: Type3 \'mem1\' has no memory -- give it volatile = "BACKEND", persistent = "BACKEND" or both'),
    ('LSA without persistent memory',
     't.toml: vm[0].type3[1].lsa: a label storage area is for persistent memory only -- drop lsa, or add persistent = "BACKEND"'),
    ('switch on a root port',
     "t.toml: vm[0].switch[0].at: 'ds1' is not a CXL root port of VM 'h' -- a CXL switch's upstream port sits on a root port: one of rp0, rp1, rp2"),
    ('Type3 on a CXL port',
     "t.toml: vm[0].type3[1].at: 'dp1' is not a CXL root port or switch downstream port of VM 'h' -- use one of: rp0, rp1, rp2, ds0, ds1"),
    ('port over-subscribed',
     "t.toml: vm[0].type3[1].at: port 'ds0' is over-subscribed: Type3 mem0 already sits on it -- a port carries one device: add a root port or a switch downstream port"),
    ('window ways',
     't.toml: vm[0].window[0].targets: 5 host bridges make a 5-way interleave, which CXL does not have: use 1, 2, 3, 4, 6, 8, 12 or 16 host bridges -- see docs/topologies.md for every key'),
    ('window target exists',
     "t.toml: vm[0].window[0].targets[0]: 'hb9' is not a host bridge of VM 'h' -- a window interleaves over host bridges: hb0, hb1"),
    ('window targets distinct',
     "t.toml: vm[0].window[0].targets: targets ['hb0', 'hb0'] repeat a host bridge -- list each host bridge once"),
    ('window granularity',
     't.toml: vm[0].window[0].granularity: interleave granularity 3K is not a CXL granularity: use a power of two from 256 to 16K (256, 512, 1K, 2K, 4K, 8K, 16K) -- see docs/topologies.md for every key'),
    ('window size per way',
     "t.toml: vm[0].window[0].size: a 2-way window's size must be a multiple of 512M (256M per way), not 768M -- use e.g. 8G"),
    ('region ways',
     't.toml: vm[0].region[0].memdevs: 5 memdevs make a 5-way interleave, which CXL does not have: use 1, 2, 3, 4, 6, 8, 12 or 16 memdevs -- see docs/topologies.md for every key'),
    ('region granularity',
     't.toml: vm[0].region[0].granularity: interleave granularity 32K is not a CXL granularity: use a power of two from 256 to 16K (256, 512, 1K, 2K, 4K, 8K, 16K) -- see docs/topologies.md for every key'),
    ('region granularity in a multi-way window',
     't.toml: vm[0].region[0].granularity: a region in a 2-way window must use the window\'s granularity 8K, not 4K -- drop granularity or write granularity = "8K"'),
    ('region window exists',
     "t.toml: vm[0].region[0].window: window 5 does not exist in VM 'h' -- use 0..1"),
    ('region memdev exists',
     "t.toml: vm[0].region[0].memdevs[1]: 'mem7' is not a Type3 device of VM 'h' -- use one of: mem0, mem1, pm"),
    ('region memdev listed once',
     "t.toml: vm[0].region[0].memdevs: memdevs ['mem0', 'mem0'] list a memdev twice -- list each memdev once"),
    ('region memdevs reachable under the window',
     "t.toml: vm[0].region[1].memdevs[0]: Type3 'pm' sits under host bridge 'hb1', which window 0 does not interleave over (hb0) -- a region's memdevs must be reachable under its window's host bridges"),
    ('region memdev has the capacity',
     't.toml: vm[0].region[0].memdevs[1]: Type3 \'pm\' has no volatile memory for a ram region -- give it volatile = "BACKEND", or make the region type = "pmem"'),
    ('memdev in one region',
     "t.toml: vm[0].region[2].memdevs[0]: Type3 'pm''s pmem capacity is already in region 'pr0' -- a region takes a memdev's whole capacity: use another memdev"),
    ("region ways a multiple of the window's",
     't.toml: vm[0].region[0].memdevs: a 1-way region cannot span a 2-way window -- use a multiple of 2 memdevs, the same number under each host bridge'),
    ('same share under each host bridge',
     "t.toml: vm[0].region[0].memdevs: host bridge 'hb0' has 2 of the region's memdevs, not 1 -- a region puts the same number of memdevs under each of its window's host bridges"),
    ('memdevs spread evenly over root ports',
     "t.toml: vm[0].region[0].memdevs: under host bridge 'hb0' the memdevs use 2 root ports unevenly -- spread them evenly over 1, 2, 4, ... root ports"),
    ('window too small',
     't.toml: vm[0].region[1]: the regions in window 1 need 512M, more than its 256M -- make window[1].size larger'),
    ('one region per pass-through host bridge',
     't.toml: vm[0].region[2]: host bridge \'hb1\' has one root port, so its decoder is a pass-through that the guest kernel (6.12) gives to one region only (here \'pr0\'); region \'r1\' would fail with \'no decoder available\' -- give hb1 a second root port (root_ports = ["rp2", "..."])'),
    ('memdevs of one size',
     "t.toml: vm[0].region[0].memdevs: the memdevs' ram capacities differ (256M, 512M) -- interleave memdevs of one size"),
    ('at most 16 windows',
     't.toml: vm[0].window: more than 16 windows (17) -- use at most 16'),
    ('enough PCI bus numbers',
     't.toml: vm[0].host_bridge: the host bridges need more PCI bus numbers than there are (255) -- use fewer host bridges, root ports or switch ports'),
    ('fsdax is for pmem',
     't.toml: vm[0].region[0].use: fsdax is a pmem namespace mode; a ram region gives devdax -- use "devdax" or "none" for a ram region'),
    ('region type',
     "t.toml: vm[0].region[1].type: Input should be 'ram' or 'pmem' -- see docs/topologies.md for every key"),
    ('one owner per GPU',
     "t.toml: gpus.gpu0.owner: one owner per GPU: owner must be one VM name or left out (unowned), not ['h', 'g'] -- see docs/topologies.md for every key"),
    ('GPU owner exists',
     "t.toml: gpus.gpu0.owner: 'zz' is not a VM of this topology -- use one of: h, g, or leave owner out for an unowned GPU"),
    ('unowned GPU has no placement',
     "t.toml: gpus.spare.at: an unowned GPU has no placement yet -- drop 'at' (the fabric manager hot-plugs it into a VM's hot-plug port), or set owner"),
    ('GPU on a PCIe switch port',
     "t.toml: gpus.gpu1.at: 'ds0' is not a PCIe switch downstream port of VM 'h' -- use one of: dp0, dp1, or leave 'at' out for a root port of its own"),
    ('GPU VRAM is a BAR',
     't.toml: gpus.gpu1.vram: VRAM is a PCI BAR: a power of two from 1M to 4G, not 48M -- see docs/topologies.md for every key'),
    ('link joins two VMs',
     't.toml: link[0].vms: a link must join two different VMs of this topology, not [\'h\', \'zz\'] -- write vms = ["h", "..."] with names from: h, g'),
    ('link declared once',
     't.toml: link[1].vms: g and h are already linked -- declare each link once'),
    ('SMC keys',
     't.toml: smc.s0.size: unknown key -- allowed here: hosts -- see docs/topologies.md for every key'),
    ('SMC name',
     "t.toml: smc.S0: bad name 'S0': use 1-16 lower-case letters, digits or '-', starting with a letter -- see docs/topologies.md for every key"),
    ('SMC has hosts',
     't.toml: smc.s0.hosts: a shared-memory controller serves 1 to 16 host VMs, not 0 -- see docs/topologies.md for every key'),
    ('SMC at most 16 hosts',
     't.toml: smc.s0.hosts: a shared-memory controller serves 1 to 16 host VMs, not 17 -- see docs/topologies.md for every key'),
    ('SMC host exists',
     "t.toml: smc.s0.hosts[1]: 'zz' is not a VM of this topology -- use one of: h, g"),
    ('SMC host named once',
     "t.toml: smc.s0.hosts[1]: VM 'h' is named twice in smc.s0.hosts -- name each host VM once"),
    ('SMC host of one controller',
     "t.toml: smc.s1.hosts[1]: VM 'h' is already a host of smc.s0 -- a VM can be a host of one shared-memory controller: remove it from one of them"),
    ('NIC owner exists',
     "t.toml: nics.n0.owner: 'zz' is not a VM of this topology -- use one of: h, g"),
    ('NIC model',
     "t.toml: nics.n0.model: Input should be 'igb' -- see docs/topologies.md for every key"),
    ('NIC name unique in its VM',
     "t.toml: nics.gpu0: name 'gpu0' is already used by gpus.gpu0 in VM 'h' -- give every host bridge, port, switch, Type3 device and region of a VM its own name"),
    ('NIC keys',
     't.toml: nics.n0.queues: unknown key -- allowed here: at, bounce_buffer, link, model, owner -- see docs/topologies.md for every key'),
    ('NIC on a PCIe switch port',
     "t.toml: nics.n0.at: 'ds0' is not a PCIe switch downstream port of VM 'h' -- use one of: dp0, dp1, or leave 'at' out for a root port of its own"),
    ('NIC port over-subscribed',
     "t.toml: nics.n0.at: port 'dp0' is over-subscribed: GPU gpu1 already sits on it -- a port carries one device: add a root port or a switch downstream port"),
    ("NIC on the owner's switch",
     "t.toml: nics.n0.at: 'dp1' is not a PCIe switch downstream port of VM 'g' -- use one of: (none: add a [[vm.pcie_switch]]), or leave 'at' out for a root port of its own"),
    ('NIC bounce buffer',
     't.toml: nics.n0.bounce_buffer: bounce_buffer is a power of two from 4K to 64M, not 128M -- see docs/topologies.md for every key'),
    ('NIC link index',
     't.toml: nics.n0.link: Input should be greater than or equal to 0 -- see docs/topologies.md for every key'),
    ('NIC link exists',
     't.toml: nics.n0.link: link 1 does not exist (the topology has 1 [[link]]) -- use 0 (the [[link]] tables of h, from 0 in file order)'),
    ('NIC link joins its owner',
     't.toml: nics.n0.link: link 1 joins g and k, not the NIC\'s owner h -- use 0 (the [[link]] tables of h, from 0 in file order)'),
    ('one NIC per VM per link',
     "t.toml: nics.n1.link: h already has NIC n0 on link 0 -- a link wires one NIC of each of its two VMs: drop 'link' from one of them"),
    ('NIC at both ends of a link',
     't.toml: link[0]: NIC n0 of h is on this link, but g has no NIC on it -- add [nics.NAME] with owner = "g" and link = 0, or drop \'link\' from nics.n0'),
    ('top-level keys',
     't.toml: smcx: unknown key -- allowed here: backends, description, gpus, link, nics, smc, vm -- see docs/topologies.md for every key'),
    ('NVMe keys',
     't.toml: vm[0].nvme[0].size: unknown key -- allowed here: at, bounce_buffer, cmb, name, namespaces, queue_pairs, shadow_doorbells -- see docs/topologies.md for every key'),
    ('NVMe has a name',
     't.toml: vm[0].nvme[0].name: required key is missing -- see docs/topologies.md for every key'),
    ('NVMe on a PCIe switch port',
     "t.toml: vm[0].nvme[0].at: 'ds1' is not a PCIe switch downstream port of VM 'h' -- use one of: dp0, dp1, or leave 'at' out for a root port of its own"),
    ('NVMe port over-subscribed',
     "t.toml: vm[0].nvme[0].at: port 'dp0' is over-subscribed: GPU gpu1 already sits on it -- a port carries one device: add a root port or a switch downstream port"),
    ('NVMe name unique in its VM',
     "t.toml: vm[0].nvme[0].name: name 'gpu1' is already used by gpus.gpu1 in VM 'h' -- give every host bridge, port, switch, Type3 device and region of a VM its own name"),
    ('NVMe namespace size',
     't.toml: vm[0].nvme[0].namespaces[1]: a namespace is a multiple of 1M from 1M to 64G, not 100K -- see docs/topologies.md for every key'),
    ('NVMe has a namespace',
     't.toml: vm[0].nvme[0].namespaces: an NVMe controller has 1 to 8 namespaces (NSIDs 1..), not 0: write namespaces = ["64M"] -- see docs/topologies.md for every key'),
    ('NVMe queue pairs',
     "t.toml: vm[0].nvme[0].queue_pairs: queue_pairs is a whole number from 1 to 64 (QEMU's nvme max_ioqpairs), not 65 -- see docs/topologies.md for every key"),
    ('NVMe CMB size',
     't.toml: vm[0].nvme[0].cmb: cmb is a multiple of 1M up to 1G (0: no CMB), not 100K -- see docs/topologies.md for every key'),
    ('NVMe bounce buffer',
     't.toml: vm[0].nvme[0].bounce_buffer: bounce_buffer is a power of two from 4K to 64M, not 3K -- see docs/topologies.md for every key'),
])


def test_every_rule_has_an_expected_error():
    assert [rule for rule, _ in CASES] == list(EXPECTED)


@pytest.mark.parametrize("rule, edits", CASES, ids=[rule for rule, _ in CASES])
def test_bad_topology_names_file_key_rule_and_fix(rule, edits):
    with pytest.raises(LabError) as err:
        topology.parse(variant(edits), "t", "t.toml")
    assert str(err.value) == EXPECTED[rule]


def test_the_base_topology_is_valid():
    topo = topology.parse(BASE, "t", "t.toml")
    h = topo.vm("h")
    assert [g.name for g in topo.gpus_of("h")] == ["gpu0", "gpu1"] and topo.unowned_gpus()[0].name == "spare"
    assert h.hotplug_port_ids() == ["hp0"]
    assert [(s.name, i) for s, i in (topo.smc_of("h"), topo.smc_of("g"))] == [("s0", 0), ("s0", 1)]


def test_shipped_topologies_load_with_descriptions():
    assert topology.available() == SHIPPED
    for name in SHIPPED:
        topo = topology.load(name)
        assert len(topo.description) > 40, name
        # every topology brings CXL memory up, but the VFIO selftests' (a GPU and a NIC, no CXL),
        # storage's (a GPU and NVMe controllers, no CXL) and nic2's (GPUs and NICs, no CXL)
        assert sum(len(vm.regions) for vm in topo.vms) >= (0 if name in ("selftest", "storage", "nic2") else 1), name


def test_single_and_shared_keep_their_shape():
    single = topology.load("single")
    (host0,) = single.vms
    assert host0.name == "host0" and [g.name for g in single.gpus_of("host0")] == ["gpu0"]
    assert [t.volatile for t in host0.type3] == ["cxl0"]
    shared = topology.load("shared")
    a, b = shared.vms
    assert single.gpus_of("a") == [] and [g.owner for g in shared.gpus.values()] == ["a"]
    # Both Type3 devices name the same backend: that is the sharing.
    assert a.type3[0].volatile == b.type3[0].volatile == "shared"
    assert shared.backend_users("shared") == [("a", "mem0"), ("b", "mem0")]
    assert shared.links[0].vms == ("a", "b") and shared.smcs == {} and shared.smc_of("a") is None
    pool = topology.load("pool")      # three hosts on one shared-memory controller
    assert list(pool.smcs) == ["smc0"] and pool.smc_of("c") == (pool.smcs["smc0"], 2)
    smc = topology.load("smc")        # two hosts, and a link for the CXL-vs-TCP benchmark
    assert smc.smc_of("b") == (smc.smcs["smc0"], 1) and smc.links[0].vms == ("a", "b")


def test_selftest_has_the_gpu_and_an_igb_on_root_ports_and_ram_for_the_tests():
    topo = topology.load("selftest")
    (host0,) = topo.vms
    assert [g.name for g in topo.gpus_of("host0")] == ["gpu0"] and topo.gpus["gpu0"].at is None
    (igb,) = topo.nics_of("host0")
    assert (igb.model, igb.pci_id, igb.root_port) == ("igb", "8086:10c9", "igb-port")
    assert host0.memory >= 3 << 30   # vfio_pci_driver_test maps a 1 GiB region


def test_storage_puts_a_gpu_and_an_nvme_behind_one_switch_and_an_nvme_on_a_root_port():
    topo = topology.load("storage")
    (host0,) = topo.vms
    (psw,) = host0.pcie_switches
    nvme0, nvme1 = host0.nvmes
    assert topo.gpus["gpu0"].at in psw.downstream_ports and nvme0.at in psw.downstream_ports
    assert nvme1.at is None and nvme1.root_port == "nvme1-port" and len(nvme1.namespaces) == 2
    assert not nvme0.shadow_doorbells and nvme0.bounce_buffer == 1 << 20 and nvme1.cmb == 4 << 20
    assert nvme0.cmb == 4 << 20          # the CMB staging path and the GPU-written SQ use it


def test_nic2_puts_a_gpu_and_an_igb_behind_one_switch_in_each_host_and_wires_the_igbs():
    topo = topology.load("nic2")
    assert [vm.name for vm in topo.vms] == ["host0", "host1"] and topo.links[0].vms == ("host0", "host1")
    for vm, gpu, nic in zip(topo.vms, ("gpu0", "gpu1"), ("nic0", "nic1")):
        (psw,) = vm.pcie_switches
        (igb,) = topo.nics_of(vm.name)
        assert topo.gpus_of(vm.name) == [topo.gpus[gpu]] and topo.gpus[gpu].at in psw.downstream_ports
        assert (igb.name, igb.model, igb.link, igb.bounce_buffer) == (nic, "igb", 0, 64 << 10)
        assert igb.at in psw.downstream_ports and igb.at != topo.gpus[gpu].at
        assert not vm.host_bridges and not vm.nvmes


def test_nic_defaults_keep_todays_nic():
    (igb,) = topology.load("selftest").nics.values()
    assert (igb.at, igb.link, igb.bounce_buffer) == (None, None, 64 << 10)


def test_nvme_defaults():
    topo = topology.parse(BASE.replace("[[vm.pcie_switch]]", '[[vm.nvme]]\nname = "nv0"\n[[vm.pcie_switch]]'), "t")
    (nv0,) = topo.vm("h").nvmes
    assert (nv0.at, nv0.namespaces, nv0.queue_pairs, nv0.cmb, nv0.bounce_buffer, nv0.shadow_doorbells) == \
        (None, [64 << 20], 8, 0, 1 << 20, False)
    assert (nv0.serial, nv0.drive_id(1)) == ("vfio-cxl-nv0", "nv0-ns1")


def test_fabric_has_a_gpu_per_host_and_free_hotplug_ports():
    fabric = topology.load("fabric")
    assert {g.name: g.owner for g in fabric.gpus.values()} == {"gpu0": "a", "gpu1": "b"}
    assert [vm.hotplug_port_ids() for vm in fabric.vms] == [["hp0"], ["hp0"]]
    assert fabric.gpus["gpu1"].irq == "msi" and fabric.gpus["gpu0"].irq == "msi" and fabric.gpus["gpu1"].vram == 64 << 20


def test_region_order_follows_the_decoders():
    hb2 = topology.load("hb2").vms[0]
    # Window over hb0, hb1: position p under target p mod 2, then root port p div 2.
    assert hb2.region_order(hb2.regions[0]) == ["mem0", "mem2", "mem1", "mem3"]
    i2 = topology.load("interleave2").vms[0]
    assert i2.region_order(i2.regions[0]) == ["mem0", "mem1"]


def test_region_sizes():
    topo = topology.load("hb2")
    vm = topo.vms[0]
    assert vm.region_size(vm.regions[0], topo.backends) == 1 << 30


def test_bus_numbers_leave_room_for_each_host_bridge():
    assert topology.load("single").vms[0].bus_numbers() == {"hb0": 12}   # Type3 at 0000:0f:00.0
    assert topology.load("hb2").vms[0].bus_numbers() == {"hb0": 12, "hb1": 19}


def test_sizes():
    assert topology.parse_size("256M", "x") == 256 << 20
    assert topology.parse_size("4G", "x") == 4 << 30
    assert topology.format_size(8 << 10) == "8K"
    with pytest.raises(LabError, match="bad size"):
        topology.parse_size("lots", "x")


def test_unknown_topology_lists_the_known_ones():
    with pytest.raises(LabError) as err:
        topology.load("nosuch")
    assert str(err.value) == ("unknown topology 'nosuch' -- use one of: " + ", ".join(SHIPPED)
                              + " (or a path to a .toml file)")


def test_topology_from_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text((topology.TOPOLOGY_DIR / "single.toml").read_text().replace('memory = "1G"', 'memory = "512M"'))
    topo = topology.load(str(path))
    assert topo.name == "mine" and topo.vms[0].memory == 512 << 20


def test_errors_in_a_file_name_the_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text((topology.TOPOLOGY_DIR / "single.toml").read_text().replace('at = "ds0"', 'at = "ds9"'))
    with pytest.raises(LabError) as err:
        topology.load(str(path))
    assert str(err.value).startswith(f"{path}: vm[0].type3[0].at: 'ds9' is not a CXL root port")


@pytest.mark.parametrize("table, old, allowed", [
    ("backends.m0", '[backends.m0]\nsize = "256M"', "size"),
    ("gpus.gpu1", 'owner = "h"\n[gpus.gpu1]', "at, irq, max_restarts, owner, restart, vram"),
    ("vm[0].type3[0]", 'volatile = "m0"', "at, lsa, name, persistent, volatile"),
    ("vm[0].region[0]", 'memdevs = ["mem0", "mem1"]', "granularity, memdevs, name, type, use, window"),
])
def test_unknown_keys_list_what_is_allowed_there(table, old, allowed):
    text = BASE.replace(old, old + '\ncolour = "red"', 1)
    with pytest.raises(LabError) as err:
        topology.parse(text, "t", "t.toml")
    assert str(err.value) == f"t.toml: {table}.colour: unknown key -- allowed here: {allowed} -- " \
                             "see docs/topologies.md for every key"
