"""A valid topology that uses most keys, and one edit per validation rule that breaks it.

Kept apart from the tests so the cases read as data: (rule, [(old, new), ...])."""

BASE = '''
description = "the test's base topology"
[backends.m0]
size = "256M"
[backends.m1]
size = "256M"
[backends.p0]
size = "256M"
[gpus.gpu0]
owner = "h"
[gpus.gpu1]
owner = "h"
at = "dp0"
[gpus.spare]
[[vm]]
name = "h"
hotplug_ports = 1
[[vm.host_bridge]]
name = "hb0"
root_ports = ["rp0", "rp1"]
[[vm.host_bridge]]
name = "hb1"
root_ports = ["rp2"]
[[vm.switch]]
name = "sw0"
at = "rp0"
downstream_ports = ["ds0", "ds1"]
[[vm.type3]]
name = "mem0"
at = "ds0"
volatile = "m0"
[[vm.type3]]
name = "mem1"
at = "ds1"
volatile = "m1"
[[vm.type3]]
name = "pm"
at = "rp2"
persistent = "p0"
[[vm.pcie_switch]]
name = "psw0"
downstream_ports = ["dp0", "dp1"]
[[vm.window]]
targets = ["hb0"]
size = "4G"
[[vm.window]]
targets = ["hb1"]
size = "1G"
[[vm.region]]
name = "r0"
memdevs = ["mem0", "mem1"]
[[vm.region]]
name = "pr0"
window = 1
type = "pmem"
memdevs = ["pm"]
use = "fsdax"
[[vm]]
name = "g"
[[link]]
vms = ["h", "g"]
[smc.s0]
hosts = ["h", "g"]
'''

M2 = ('[gpus.gpu0]', '[backends.m2]\nsize = "256M"\n[gpus.gpu0]')
T3_MEM2_ON_RP1 = ('[[vm.pcie_switch]]', '[[vm.type3]]\nname = "mem2"\nat = "rp1"\nvolatile = "m2"\n[[vm.pcie_switch]]')


def nvme(keys: str) -> tuple[str, str]:
    """An edit that adds an NVMe controller to VM h with ``keys``."""
    return ('[[vm.pcie_switch]]', f'[[vm.nvme]]\n{keys}\n[[vm.pcie_switch]]')


def nic(keys: str) -> tuple[str, str]:
    """An edit that adds NIC n0 with ``keys`` (its owner among them)."""
    return ('[smc.s0]', f'[nics.n0]\n{keys}\n[smc.s0]')


G_NIC = ('[smc.s0]', '[nics.gn]\nowner = "g"\nlink = 0\n[smc.s0]')   # g's end of link 0
LINK_G_K = ('[[link]]\nvms = ["h", "g"]', '[[vm]]\nname = "k"\n[[link]]\nvms = ["h", "g"]\n[[link]]\nvms = ["g", "k"]')

CASES = [
    ("malformed TOML", [('[[vm]]\nname = "g"', '[[vm]\nname = "g"')]),
    ("no VM", 'description = "nothing"\n[backends.m0]\nsize = "256M"\n'),
    ("unknown key", [('hotplug_ports = 1', 'hotplug_ports = 1\ncolour = "red"')]),
    ("bad name", [('name = "g"', 'name = "G 2"')]),
    ("reserved name", [('name = "r0"', 'name = "ram"')]),
    ("unique names in a VM", [('name = "mem1"', 'name = "mem0"')]),
    ("unique VM names", [('name = "g"', 'name = "h"')]),
    ("bad size", [('size = "1G"', 'size = "lots"')]),
    ("backend size in 256M units", [('[backends.m1]\nsize = "256M"', '[backends.m1]\nsize = "100M"')]),
    ("memory", [('hotplug_ports = 1', 'hotplug_ports = 1\nmemory = "100M"')]),
    ("cpus", [('hotplug_ports = 1', 'hotplug_ports = 1\ncpus = 0')]),
    ("hotplug ports", [('hotplug_ports = 1', 'hotplug_ports = 9')]),
    ("unknown backend", [('volatile = "m1"', 'volatile = "nope"')]),
    ("unused backend", [M2]),
    ("backend mapped twice in a VM", [('volatile = "m1"', 'volatile = "m0"')]),
    ("Type3 without memory", [('volatile = "m1"', '')]),
    ("LSA without persistent memory", [('volatile = "m1"', 'volatile = "m1"\nlsa = "256K"')]),
    ("switch on a root port", [('at = "rp0"', 'at = "ds1"')]),
    ("Type3 on a CXL port", [('at = "ds1"', 'at = "dp1"')]),
    ("port over-subscribed", [('at = "ds1"', 'at = "ds0"')]),
    ("window ways", [('targets = ["hb0"]', 'targets = ["hb0", "hb1", "hb0", "hb1", "hb0"]')]),
    ("window target exists", [('targets = ["hb0"]', 'targets = ["hb9"]')]),
    ("window targets distinct", [('targets = ["hb0"]', 'targets = ["hb0", "hb0"]')]),
    ("window granularity", [('size = "4G"', 'size = "4G"\ngranularity = "3K"')]),
    ("window size per way", [('targets = ["hb0"]\nsize = "4G"', 'targets = ["hb0", "hb1"]\nsize = "768M"')]),
    ("region ways", [('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0", "mem1", "mem0", "mem1", "mem0"]')]),
    ("region granularity", [('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0", "mem1"]\ngranularity = "32K"')]),
    ("region granularity in a multi-way window",
     [M2, ('root_ports = ["rp2"]', 'root_ports = ["rp2", "rp3"]'),
      ('[[vm.pcie_switch]]', '[[vm.type3]]\nname = "mem2"\nat = "rp3"\nvolatile = "m2"\n[[vm.pcie_switch]]'),
      ('targets = ["hb0"]', 'targets = ["hb0", "hb1"]'), ('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0", "mem2"]\ngranularity = "4K"')]),
    ("region window exists", [('name = "r0"', 'name = "r0"\nwindow = 5')]),
    ("region memdev exists", [('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0", "mem7"]')]),
    ("region memdev listed once", [('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0", "mem0"]')]),
    ("region memdevs reachable under the window", [M2, T3_MEM2_ON_RP1, ('window = 1', 'window = 0')]),
    ("region memdev has the capacity", [('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0", "pm"]')]),
    ("memdev in one region", [('memdevs = ["pm"]', 'memdevs = ["pm"]\n[[vm.region]]\nname = "pr1"\nwindow = 1\ntype = "pmem"\nmemdevs = ["pm"]')]),
    ("region ways a multiple of the window's", [('targets = ["hb0"]', 'targets = ["hb0", "hb1"]'), ('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0"]')]),
    ("same share under each host bridge", [('targets = ["hb0"]', 'targets = ["hb0", "hb1"]'), ('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0", "mem1"]\ntype = "ram"')]),
    ("memdevs spread evenly over root ports", [M2, T3_MEM2_ON_RP1, ('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0", "mem1", "mem2"]')]),
    ("window too small", [('size = "1G"', 'size = "256M"'), ('[backends.p0]\nsize = "256M"', '[backends.p0]\nsize = "512M"')]),
    ("one region per pass-through host bridge",
     [M2, ('persistent = "p0"', 'persistent = "p0"\nvolatile = "m2"'),
      ('use = "fsdax"', 'use = "fsdax"\n[[vm.region]]\nname = "r1"\nwindow = 1\nmemdevs = ["pm"]')]),
    ("memdevs of one size", [('[backends.m1]\nsize = "256M"', '[backends.m1]\nsize = "512M"')]),
    ("at most 16 windows", [('[[vm.region]]\nname = "r0"', '[[vm.window]]\ntargets = ["hb0"]\nsize = "256M"\n' * 15
                                                        + '[[vm.region]]\nname = "r0"')]),
    ("enough PCI bus numbers", [('[[vm.host_bridge]]\nname = "hb1"',
                                 '[[vm.host_bridge]]\nname = "hbx"\nroot_ports = [' + ", ".join(f'"x{n}"' for n in range(240))
                                 + ']\n[[vm.host_bridge]]\nname = "hb1"')]),
    ("fsdax is for pmem", [('memdevs = ["mem0", "mem1"]', 'memdevs = ["mem0", "mem1"]\nuse = "fsdax"')]),
    ("region type", [('type = "pmem"', 'type = "cxl"')]),
    ("one owner per GPU", [('owner = "h"\n[gpus.gpu1]', 'owner = ["h", "g"]\n[gpus.gpu1]')]),
    ("GPU owner exists", [('owner = "h"\n[gpus.gpu1]', 'owner = "zz"\n[gpus.gpu1]')]),
    ("unowned GPU has no placement", [('[gpus.spare]', '[gpus.spare]\nat = "dp1"')]),
    ("GPU on a PCIe switch port", [('at = "dp0"', 'at = "ds0"')]),
    ("GPU VRAM is a BAR", [('at = "dp0"', 'at = "dp0"\nvram = "48M"')]),
    ("link joins two VMs", [('vms = ["h", "g"]', 'vms = ["h", "zz"]')]),
    ("link declared once", [('vms = ["h", "g"]', 'vms = ["h", "g"]\n[[link]]\nvms = ["g", "h"]')]),
    ("SMC keys", [('hosts = ["h", "g"]', 'hosts = ["h", "g"]\nsize = "1M"')]),
    ("SMC name", [('[smc.s0]', '[smc.S0]')]),
    ("SMC has hosts", [('hosts = ["h", "g"]', 'hosts = []')]),
    ("SMC at most 16 hosts", [('hosts = ["h", "g"]', 'hosts = ["h", "g"' + ', "g"' * 15 + ']')]),
    ("SMC host exists", [('hosts = ["h", "g"]', 'hosts = ["h", "zz"]')]),
    ("SMC host named once", [('hosts = ["h", "g"]', 'hosts = ["h", "h"]')]),
    ("SMC host of one controller", [('hosts = ["h", "g"]', 'hosts = ["h"]\n[smc.s1]\nhosts = ["g", "h"]')]),
    ("NIC owner exists", [('[smc.s0]', '[nics.n0]\nowner = "zz"\n[smc.s0]')]),
    ("NIC model", [('[smc.s0]', '[nics.n0]\nowner = "h"\nmodel = "e1000"\n[smc.s0]')]),
    ("NIC name unique in its VM", [('[smc.s0]', '[nics.gpu0]\nowner = "h"\n[smc.s0]')]),
    ("NIC keys", [nic('owner = "h"\nqueues = 4')]),
    ("NIC on a PCIe switch port", [nic('owner = "h"\nat = "ds0"')]),
    ("NIC port over-subscribed", [nic('owner = "h"\nat = "dp0"')]),
    ("NIC on the owner's switch", [nic('owner = "g"\nat = "dp1"')]),
    ("NIC bounce buffer", [nic('owner = "h"\nbounce_buffer = "128M"')]),
    ("NIC link index", [nic('owner = "h"\nlink = -1')]),
    ("NIC link exists", [nic('owner = "h"\nlink = 1')]),
    ("NIC link joins its owner", [LINK_G_K, nic('owner = "h"\nlink = 1')]),
    ("one NIC per VM per link", [G_NIC, nic('owner = "h"\nlink = 0'),
                                 ('[smc.s0]', '[nics.n1]\nowner = "h"\nat = "dp1"\nlink = 0\n[smc.s0]')]),
    ("NIC at both ends of a link", [nic('owner = "h"\nat = "dp1"\nlink = 0')]),
    ("top-level keys", [('[smc.s0]', '[smcx.s0]')]),
    ("NVMe keys", [nvme('name = "nv0"\nsize = "1G"')]),
    ("NVMe has a name", [nvme('queue_pairs = 4')]),
    ("NVMe on a PCIe switch port", [nvme('name = "nv0"\nat = "ds1"')]),
    ("NVMe port over-subscribed", [nvme('name = "nv0"\nat = "dp0"')]),
    ("NVMe name unique in its VM", [nvme('name = "gpu1"')]),
    ("NVMe namespace size", [nvme('name = "nv0"\nnamespaces = ["64M", "100K"]')]),
    ("NVMe has a namespace", [nvme('name = "nv0"\nnamespaces = []')]),
    ("NVMe queue pairs", [nvme('name = "nv0"\nqueue_pairs = 65')]),
    ("NVMe CMB size", [nvme('name = "nv0"\ncmb = "100K"')]),
    ("NVMe bounce buffer", [nvme('name = "nv0"\nbounce_buffer = "3K"')]),
]


def variant(edits) -> str:
    if isinstance(edits, str):
        return edits
    text = BASE
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text
