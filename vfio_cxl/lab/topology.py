"""Topologies: any CXL/PCIe fabric as data (``qemu/topologies/*.toml``), checked strictly.

    from vfio_cxl.lab import topology
    topo = topology.load("fabric")            # a shipped name, or a path to a .toml file
    topo.vms[0].type3[0].volatile             # -> "shared" (a backend name)
    topo.gpus["gpu1"].owner                   # -> None (free for hot-plug)

The public API is this module's models (pydantic v2, immutable once loaded):
:class:`Topology` (``backends``, ``gpus``, ``vms``, ``links``, ``smcs``, ``nics``), :class:`Vm`
(``host_bridges``, ``switches``, ``type3``, ``windows``, ``regions``,
``pcie_switches``, ``hotplug_ports``, ``nvmes``: :class:`Nvme`), :class:`Gpu` (``owner`` or None,
``at``, ``vram``, ``irq``), :class:`Nic` (``owner``, ``at``, ``link``: the index of a
:class:`Link`, ``bounce_buffer``) and the derived facts the lab needs:
:meth:`Vm.bus_numbers`, :meth:`Vm.region_order`, :meth:`Vm.hotplug_port_ids`,
:meth:`Topology.gpus_of`, :meth:`Topology.nics_of`, :meth:`Topology.hotplug_reserve`,
:meth:`Topology.smc_of`.

Checking happens in two layers.  pydantic checks shapes, types and each field
alone (unknown keys, names, sizes, interleave ways and granularity);
:func:`check` then checks what spans several tables (references, ports, how a
region's memdevs sit under its window).  Both raise :class:`LabError` naming
the file, the TOML key, the rule broken and what would be valid.  The keys are
documented with examples in ``docs/topologies.md``.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError,
                      field_validator,
                      model_validator)

from ..errors import LabError
from ..paths import data_dir

TOPOLOGY_DIR = data_dir("topologies")   # qemu/topologies; a wheel carries a copy

MIB = 1 << 20
GIB = 1 << 30
CXL_SIZE_UNIT = 256 * MIB                       # HDM decoders work in 256 MiB units
INTERLEAVE_WAYS = (1, 2, 3, 4, 6, 8, 12, 16)
INTERLEAVE_GRANULARITIES = tuple(256 << i for i in range(7))   # 256 B .. 16 KiB
DEFAULT_LSA_SIZE = 256 << 10
FIRST_CXL_BUS = 12                              # pxb-cxl bus numbers start here (pcie.0 below)
CXL_BUS_SLACK = 4                               # spare bus numbers after each host bridge
MAX_HOTPLUG_PORTS = 8
RESERVED_NAMES = {"ram", "ssh", "root", "src", "console", "pcie"}

_SIZE = re.compile(r"^(\d+)\s*([KMGT]?)I?B?$")
_NAME_PATTERN = r"^[a-z][a-z0-9-]{0,15}$"
_NAME = re.compile(_NAME_PATTERN)
_NAME_RULE = "1-16 lower-case letters, digits or '-', starting with a letter"


def parse_size(text: str | int, where: str = "size") -> int:
    """'256M' -> bytes (K, M, G, T are powers of 1024; a bare number is bytes)."""
    if isinstance(text, bool):
        raise LabError(f"{where}: bad size {text!r}", "write sizes like \"256M\" or \"4G\"")
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text).strip().upper())
    if not match:
        raise LabError(f"{where}: bad size {text!r}", "write sizes like \"256M\" or \"4G\"")
    number, unit = match.groups()
    return int(number) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[unit]


def format_size(size: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


def _size(value):
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            return parse_size(value)
        except LabError:
            pass
    raise ValueError(f"bad size {value!r}: write sizes like \"256M\" or \"4G\"")


Size = Annotated[int, BeforeValidator(_size)]
Name = Annotated[str, Field(pattern=_NAME_PATTERN)]


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _ways_rule(ways: int, what: str) -> str:
    return (f"{ways} {what} make a {ways}-way interleave, which CXL does not have: use "
            f"{', '.join(map(str, INTERLEAVE_WAYS[:-1]))} or {INTERLEAVE_WAYS[-1]} {what}")


def _granularity(value: int) -> int:
    if value not in INTERLEAVE_GRANULARITIES:
        raise ValueError(f"interleave granularity {format_size(value)} is not a CXL granularity: use a power "
                         f"of two from 256 to 16K ({', '.join(map(format_size, INTERLEAVE_GRANULARITIES))})")
    return value


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Backend(_Table):
    """A memory backend file in the lab's run directory (``memory-backend-file,share=on``).
    Named by Type3 devices in one VM (private) or in several (shared)."""

    name: Name = ""
    size: Size = 256 * MIB

    @field_validator("size")
    @classmethod
    def _size_unit(cls, v: int) -> int:
        if v <= 0 or v % CXL_SIZE_UNIT:
            raise ValueError(f"a CXL memory backend's size must be a positive multiple of 256M, not "
                             f"{format_size(v)}: use e.g. \"256M\", \"512M\", \"1G\"")
        return v


class HostBridge(_Table):
    """A CXL host bridge (``pxb-cxl``) with its CXL root ports (``cxl-rp``), named."""

    name: Name
    root_ports: list[Name] = Field(min_length=1)


class Switch(_Table):
    """A CXL switch: upstream port on a CXL root port, named downstream ports."""

    name: Name
    at: Name                    # a CXL root port
    downstream_ports: list[Name] = Field(min_length=1)


class Type3(_Table):
    """A CXL Type3 memory device on a CXL root port or switch downstream port."""

    name: Name
    at: Name
    volatile: Name | None = None        # backend name: volatile capacity (ram regions)
    persistent: Name | None = None      # backend name: persistent capacity (pmem regions)
    lsa: Size | None = None             # label storage area size (persistent only; default 256K)

    @property
    def lsa_size(self) -> int:
        return self.lsa or DEFAULT_LSA_SIZE


class Window(_Table):
    """A CXL fixed memory window (CFMWS): host bridges it interleaves over, size, granularity."""

    targets: list[Name] = Field(min_length=1)
    size: Size = 4 * GIB
    granularity: Size = 8 << 10

    @field_validator("granularity")
    @classmethod
    def _granularity(cls, v: int) -> int:
        return _granularity(v)

    @field_validator("targets")
    @classmethod
    def _ways(cls, v: list[str]) -> list[str]:
        if len(v) not in INTERLEAVE_WAYS:
            raise ValueError(_ways_rule(len(v), "host bridges"))
        return v

    @property
    def ways(self) -> int:
        return len(self.targets)


class Region(_Table):
    """A region the lab creates at boot with ``cxl create-region`` (and daxctl/ndctl)."""

    name: Name
    window: int = Field(0, ge=0)
    type: Literal["ram", "pmem"] = "ram"
    memdevs: list[Name] = Field(min_length=1)
    granularity: Size | None = None     # default: the window's
    # ram: "devdax" (an enabled /dev/daxN.M) or "none"; pmem: "fsdax" (/dev/pmemN),
    # "devdax" (a devdax namespace) or "none" (leave the region for the user).
    use: Literal["devdax", "fsdax", "none"] = "devdax"

    @field_validator("granularity")
    @classmethod
    def _granularity(cls, v: int | None) -> int | None:
        return None if v is None else _granularity(v)

    @field_validator("memdevs")
    @classmethod
    def _ways(cls, v: list[str]) -> list[str]:
        if len(v) not in INTERLEAVE_WAYS:
            raise ValueError(_ways_rule(len(v), "memdevs"))
        return v

    @property
    def ways(self) -> int:
        return len(self.memdevs)


class PcieSwitch(_Table):
    """A PCIe switch (``x3130-upstream`` + ``xio3130-downstream``) on its own root port, for GPUs."""

    name: Name
    downstream_ports: list[Name] = Field(min_length=1)


def _one_owner(value):
    if isinstance(value, list):
        raise ValueError(f"one owner per GPU: owner must be one VM name or left out (unowned), not {value!r}")
    return value


class Gpu(_Table):
    """A GPU as a fabric resource: an initial owner (or none: free for hot-plug) and placement."""

    name: Name = ""
    owner: Annotated[Name | None, BeforeValidator(_one_owner)] = None
    at: Name | None = None      # a PCIe switch downstream port in the owner; default: its own root port
    vram: Size = 64 * MIB
    irq: Literal["msix", "msi"] = "msix"
    # What the fabric manager does when the GPU's server dies: "no" (it stays failed until
    # `fm restart`), or "on-failure": a fresh server, back into the VM it was in, at most
    # max_restarts times over the lab's life (then it stays failed and says so).
    restart: Literal["no", "on-failure"] = "no"
    max_restarts: int = Field(default=3, ge=1, le=100)

    @model_validator(mode="after")
    def _restartable(self):
        if self.restart == "on-failure" and self.irq != "msi":
            raise ValueError('restart = "on-failure" takes the dead GPU out of its VM first, and QEMU 11.1 '
                             'aborts when it hot-removes a vfio-user GPU with MSI-X: set irq = "msi"')
        return self

    @field_validator("vram")
    @classmethod
    def _vram(cls, v: int) -> int:
        if not _is_power_of_two(v) or not MIB <= v <= 4 * GIB:
            raise ValueError(f"VRAM is a PCI BAR: a power of two from 1M to 4G, not {format_size(v)}")
        return v

    @property
    def root_port(self) -> str:
        """The id of the root port the lab adds for a GPU that is not behind a switch."""
        return f"{self.name}-port"


def _bounce_buffer(value: int) -> int:
    """QEMU's ``x-max-bounce-buffer-size`` of a DMA-capable device, checked."""
    if not _is_power_of_two(value) or not 4096 <= value <= 64 * MIB:
        raise ValueError(f"bounce_buffer is a power of two from 4K to 64M, not {format_size(value)}")
    return value


NVME_MAX_QUEUE_PAIRS = 64          # hw/nvme/ctrl.c, QEMU 11.1: max_ioqpairs (default 64)
NVME_MAX_NAMESPACES = 8            # the lab's limit (QEMU takes 256)
NVME_PCI_ID = "1b36:0010"          # QEMU's emulated NVMe controller


def _nvme_namespace(value: int) -> int:
    if value % MIB or not MIB <= value <= 64 * GIB:
        raise ValueError(f"a namespace is a multiple of 1M from 1M to 64G, not {format_size(value)}")
    return value


class Nvme(_Table):
    """An emulated NVMe controller (QEMU ``nvme``, NVMe 1.4) with namespaces backed by sparse
    raw files in the lab's run directory, on a root port of its own or behind a PCIe switch."""

    name: Name
    at: Name | None = None              # a PCIe switch downstream port; default: its own root port
    namespaces: list[Annotated[Size, AfterValidator(_nvme_namespace)]] = Field(default_factory=lambda: [64 * MIB])
    queue_pairs: int = 8                # I/O queue pairs the controller offers (max_ioqpairs)
    cmb: Size = 0                       # controller memory buffer in BAR2 (cmb_size_mb); 0: none
    # x-max-bounce-buffer-size: what QEMU bounces at once when the controller DMAs into another
    # device's BAR (a peer's VRAM); QEMU's default, 4K, moves P2P transfers a page at a time.
    bounce_buffer: Annotated[Size, AfterValidator(_bounce_buffer)] = MIB
    # dbcs: Doorbell Buffer Config (shadow doorbells).  Off by default: once configured the
    # controller takes the SQ tail from the shadow buffer, not from a peer's doorbell write.
    shadow_doorbells: bool = False

    @field_validator("namespaces")
    @classmethod
    def _namespaces(cls, v: list[int]) -> list[int]:
        if not 1 <= len(v) <= NVME_MAX_NAMESPACES:
            raise ValueError(f"an NVMe controller has 1 to {NVME_MAX_NAMESPACES} namespaces (NSIDs 1..), "
                             f"not {len(v)}: write namespaces = [\"64M\"]")
        return v

    @field_validator("queue_pairs")
    @classmethod
    def _queue_pairs(cls, v: int) -> int:
        if not 1 <= v <= NVME_MAX_QUEUE_PAIRS:
            raise ValueError(f"queue_pairs is a whole number from 1 to {NVME_MAX_QUEUE_PAIRS} "
                             f"(QEMU's nvme max_ioqpairs), not {v}")
        return v

    @field_validator("cmb")
    @classmethod
    def _cmb(cls, v: int) -> int:
        if v % MIB or not 0 <= v <= 1 * GIB:
            raise ValueError(f"cmb is a multiple of 1M up to 1G (0: no CMB), not {format_size(v)}")
        return v

    @property
    def root_port(self) -> str:
        """The id of the root port the lab adds for a controller that is not behind a switch."""
        return f"{self.name}-port"

    @property
    def serial(self) -> str:
        """The controller's serial number (Identify Controller SN): how the guest finds it."""
        return f"vfio-cxl-{self.name}"

    def drive_id(self, nsid: int) -> str:
        return f"{self.name}-ns{nsid}"


NIC_MODELS = {"igb": "8086:10c9"}   # QEMU's emulated NICs the lab offers, and their PCI IDs


class Nic(_Table):
    """An emulated PCIe NIC (``[nics.NAME] owner = VM, model = "igb"``) in its owner: on a root
    port of its own, or on a downstream port of one of the owner's PCIe switches (``at``,
    beside a GPU).  Behind it, the other end of a ``[[link]]`` (``link``: the link's index; the
    NIC of the link's other VM is wired to it over a UNIX socket), or a user-mode network that
    reaches nothing (restrict=on).  The lab does not configure it: it is a PCI function to bind
    to vfio-pci (the kernel's VFIO selftests and the guest's userspace driver drive its DMA
    engine).  igb is SR-IOV capable, and QEMU refuses it on pcie.0 ("VF addr overflows")."""

    name: Name = ""
    owner: Name
    model: Literal["igb"] = "igb"
    at: Name | None = None              # a PCIe switch downstream port; default: its own root port
    link: int | None = Field(None, ge=0)   # the index of the [[link]] it joins; default: none
    # x-max-bounce-buffer-size: what QEMU maps at once when the NIC DMAs from or into another
    # device's BAR (a GPU's VRAM).  igb skips a TX frame whose map comes back short, so this
    # holds the largest frame (64K: a TSO frame); QEMU's default, 4K, drops anything larger.
    bounce_buffer: Annotated[Size, AfterValidator(_bounce_buffer)] = 64 << 10

    @property
    def root_port(self) -> str:
        """The id of the root port the lab adds for a NIC that is not behind a switch."""
        return f"{self.name}-port"

    @property
    def pci_id(self) -> str:
        return NIC_MODELS[self.model]


SMC_MAX_HOSTS = 16   # docs/smc-device.md (the lab does not import the device's register map)


class Smc(_Table):
    """A shared-memory controller (``[smc.NAME] hosts = [...]``): one device server,
    a vfio-user-pci function in each host VM; host ID h is ``hosts[h]``."""

    name: Name = ""
    hosts: list[Name]

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        if not 1 <= len(v) <= SMC_MAX_HOSTS:
            raise ValueError(f"a shared-memory controller serves 1 to {SMC_MAX_HOSTS} host VMs, not {len(v)}")
        return v


class Link(_Table):
    """A private point-to-point network between two VMs (a virtio-net pair), and the wire two
    emulated NICs may share: ``[nics.NAME] link = I`` names the I-th ``[[link]]`` (from 0)."""

    vms: tuple[Name, Name]


class Vm(_Table):
    name: Name
    memory: Size = 1 * GIB
    cpus: int = 2
    hotplug_ports: int = 0
    host_bridges: list[HostBridge] = Field([], alias="host_bridge")
    switches: list[Switch] = Field([], alias="switch")
    type3: list[Type3] = []
    windows: list[Window] = Field([], alias="window")
    regions: list[Region] = Field([], alias="region")
    pcie_switches: list[PcieSwitch] = Field([], alias="pcie_switch")
    nvmes: list[Nvme] = Field([], alias="nvme")

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: int) -> int:
        if not 1 <= v <= 16:
            raise ValueError(f"cpus must be a whole number from 1 to 16, not {v}")
        return v

    @field_validator("hotplug_ports")
    @classmethod
    def _hotplug(cls, v: int) -> int:
        if not 0 <= v <= MAX_HOTPLUG_PORTS:
            raise ValueError(f"hotplug_ports must be a whole number from 0 to {MAX_HOTPLUG_PORTS}, not {v}")
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: int) -> int:
        if v % (2 * MIB) or not 256 * MIB <= v <= 64 * GIB:
            raise ValueError(f"memory must be a multiple of 2M from 256M to 64G, not {format_size(v)}")
        return v

    # -- derived facts (the argv builder and the guest bring-up use these) --

    def hotplug_port_ids(self) -> list[str]:
        return [f"hp{i}" for i in range(self.hotplug_ports)]

    def host_bridge_of_port(self, port: str) -> HostBridge:
        for hb in self.host_bridges:
            if port in hb.root_ports:
                return hb
        for sw in self.switches:
            if port in sw.downstream_ports:
                return self.host_bridge_of_port(sw.at)
        raise KeyError(port)

    def switch_at(self, root_port: str) -> Switch | None:
        return next((s for s in self.switches if s.at == root_port), None)

    def type3_named(self, name: str) -> Type3:
        return next(t for t in self.type3 if t.name == name)

    def serial(self, type3: str) -> int:
        """The serial number (``cxl-type3,sn=``) that names a Type3 device in the guest."""
        return 0x1000 + [t.name for t in self.type3].index(type3)

    def _place(self, t3: Type3) -> tuple[HostBridge, str, str | None]:
        """(host bridge, root port, downstream port or None) of a Type3 device."""
        for sw in self.switches:
            if t3.at in sw.downstream_ports:
                return self.host_bridge_of_port(sw.at), sw.at, t3.at
        return self.host_bridge_of_port(t3.at), t3.at, None

    def bus_numbers(self) -> dict[str, int]:
        """``bus_nr`` of each host bridge: above every bus of pcie.0's hierarchy,
        each followed by room for its root ports and switches (plus slack)."""
        pcie0 = 2 * self.hotplug_ports + 8   # generous: root ports for GPUs, hot-plug, PCIe switches
        pcie0 += len([n for n in self.nvmes if n.at is None])
        for ps in self.pcie_switches:
            pcie0 += 2 + len(ps.downstream_ports)
        bus = max(FIRST_CXL_BUS, pcie0)
        numbers = {}
        for hb in self.host_bridges:
            numbers[hb.name] = bus
            need = 1 + len(hb.root_ports)
            for rp in hb.root_ports:
                sw = self.switch_at(rp)
                if sw:
                    need += 1 + len(sw.downstream_ports)
            bus += need + CXL_BUS_SLACK
        return numbers

    def region_order(self, region: Region) -> list[str]:
        """The region's memdevs in interleave position order, as cxl-cli needs them.

        Position p sits under the window's target ``p mod W`` (host bridges in
        window order), then under that bridge's root ports in turn, then under a
        switch's downstream ports in turn: each decoder level interleaves on the
        next address bits.  ``cxl create-region`` does not sort memdevs itself."""
        window = self.windows[region.window]
        W = window.ways
        positions = {}
        for hb_index, hb_name in enumerate(window.targets):
            mine = [m for m in region.memdevs if self._place(self.type3_named(m))[0].name == hb_name]
            hb = next(h for h in self.host_bridges if h.name == hb_name)
            rps = [rp for rp in hb.root_ports if any(self._place(self.type3_named(m))[1] == rp for m in mine)]
            for m in mine:
                _, rp, ds = self._place(self.type3_named(m))
                ri = rps.index(rp)
                if ds is None:
                    di = 0
                else:
                    sw = self.switch_at(rp)
                    used = [d for d in sw.downstream_ports
                            if any(self._place(self.type3_named(x))[2] == d for x in mine)]
                    di = used.index(ds)
                positions[m] = hb_index + W * (ri + len(rps) * di)
        return sorted(region.memdevs, key=positions.__getitem__)

    def capacity(self, type3: str, kind: str, backends: dict[str, Backend]) -> int:
        t3 = self.type3_named(type3)
        name = t3.volatile if kind == "ram" else t3.persistent
        return backends[name].size if name else 0

    def region_size(self, region: Region, backends: dict[str, Backend]) -> int:
        return region.ways * min(self.capacity(m, region.type, backends) for m in region.memdevs)


VmSpec = Vm   # the name the lab used before the schema grew


class Topology(_Table):
    name: str = ""
    description: str = ""
    backends: dict[Name, Backend] = {}
    gpus: dict[Name, Gpu] = {}
    vms: list[Vm] = Field(alias="vm", min_length=1)
    links: list[Link] = Field([], alias="link")
    smcs: dict[Name, Smc] = Field({}, alias="smc")
    nics: dict[Name, Nic] = {}
    source: str = Field("", exclude=True)
    # The file it was loaded from (absolute) and its bytes' SHA-256, for handing it to a child
    # process (handoff); unset for a topology parsed from text.
    _file: Path | None = PrivateAttr(None)
    _sha256: str = PrivateAttr("")

    @model_validator(mode="before")
    @classmethod
    def _names_from_keys(cls, data):
        if isinstance(data, dict):
            for key in ("backends", "gpus", "smc", "nics"):
                table = data.get(key)
                if isinstance(table, dict):
                    data[key] = {k: ({**v, "name": k} if isinstance(v, dict) else v) for k, v in table.items()}
        return data

    def vm(self, name: str) -> Vm:
        for vm in self.vms:
            if vm.name == name:
                return vm
        raise LabError(f"topology {self.name} has no VM {name!r}",
                       f"use one of: {', '.join(v.name for v in self.vms)}")

    def gpus_of(self, vm: str) -> list[Gpu]:
        """The GPUs a VM owns at boot, in declaration order."""
        return [g for g in self.gpus.values() if g.owner == vm]

    def nics_of(self, vm: str) -> list[Nic]:
        """The emulated NICs of a VM, in declaration order."""
        return [n for n in self.nics.values() if n.owner == vm]

    def smc_of(self, vm: str) -> tuple[Smc, int] | None:
        """The shared-memory controller ``vm`` is a host of, and its host ID there (or None)."""
        for smc in self.smcs.values():
            if vm in smc.hosts:
                return smc, smc.hosts.index(vm)
        return None

    def unowned_gpus(self) -> list[Gpu]:
        return [g for g in self.gpus.values() if g.owner is None]

    def hotplug_reserve(self) -> int:
        """``pref64-reserve`` of hot-plug ports: the largest VRAM BAR any GPU has (64M at least)."""
        return max([64 * MIB, *(g.vram for g in self.gpus.values())])

    def backend_users(self, backend: str) -> list[tuple[str, str]]:
        """(vm, type3) pairs that map a backend: more than one VM means shared."""
        return [(vm.name, t.name) for vm in self.vms for t in vm.type3 if backend in (t.volatile, t.persistent)]


# ---------------------------------------------------------------- errors

def _key_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path or "(top level)"


def _model_at(loc: tuple):
    """The model class whose table ``loc`` points into (for listing allowed keys)."""
    model, dict_key_next = Topology, False
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int) or dict_key_next:   # a list index, or a [backends.NAME] key
            dict_key_next = False
            continue
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return None
        ann = field.annotation
        dict_key_next = typing.get_origin(ann) is dict
        while typing.get_origin(ann) in (list, dict, typing.Union, Annotated, tuple) or \
                type(ann).__name__ == "UnionType":
            args = [a for a in typing.get_args(ann) if a is not type(None) and a is not str]
            ann = args[-1] if args else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def _allowed_keys(model) -> str:
    return ", ".join(sorted((f.alias or n) for n, f in model.model_fields.items()
                            if n not in ("name", "source") or model not in (Backend, Gpu, Smc, Nic, Topology)))


def _from_pydantic(err: ValidationError, source: str) -> LabError:
    lines = []
    errors = err.errors()
    key_errors = {tuple(e["loc"][:-1]) for e in errors if e["loc"] and e["loc"][-1] == "[key]"}
    for e in errors:
        loc, kind, msg = tuple(e["loc"]), e["type"], e["msg"]
        if loc and loc[-1] == "[key]":   # a bad [TABLE.NAME]: name the table, once
            loc = loc[:-1]
        elif loc and loc[-1] == "name" and loc[:-1] in key_errors:
            continue                     # the same bad name, copied in by _names_from_keys
        if kind == "extra_forbidden":
            model = _model_at(loc[:-1])
            allowed = _allowed_keys(model) if model else "see docs/topologies.md"
            lines.append(f"{_key_path(loc)}: unknown key -- allowed here: {allowed}")
            continue
        if kind == "string_pattern_mismatch":
            msg = f"bad name {e['input']!r}: use {_NAME_RULE}"
        elif kind == "missing":
            msg = "required key is missing"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        lines.append(f"{_key_path(loc)}: {msg}")
    first, *more = lines
    what = f"{source}: {first}"
    if more:
        what += "".join(f"\n{source}: {line}" for line in more)
    return LabError(what, "see docs/topologies.md for every key")


class _Problem(Exception):
    def __init__(self, path: str, what: str, fix: str):
        self.path, self.what, self.fix = path, what, fix


def _fail(path: str, what: str, fix: str):
    raise _Problem(path, what, fix)


# ---------------------------------------------------------------- cross-table rules of one VM
#
# One rule per function, each ``rule(topo, vm, where)`` with ``where`` = "vm[i]"; _check_vm runs
# them in VM_RULES order.  A rule may rely on the rules before it (a region's window exists
# before its memdevs are placed under it).


def _names_are_unique(topo: Topology, vm: Vm, where: str) -> None:
    """Every component name becomes a QEMU id: one namespace per VM, and no reserved name."""
    seen: dict[str, str] = {}
    for name, path in _named_components(topo, vm, where):
        if name in RESERVED_NAMES:
            _fail(path, f"name {name!r} is reserved by the lab", f"choose another name (reserved: "
                  f"{', '.join(sorted(RESERVED_NAMES))})")
        if name in seen:
            _fail(path, f"name {name!r} is already used by {seen[name]} in VM {vm.name!r}",
                  "give every host bridge, port, switch, Type3 device and region of a VM its own name")
        seen[name] = path


def _named_components(topo: Topology, vm: Vm, where: str) -> typing.Iterator[tuple[str, str]]:
    """(name, TOML path) of everything in ``vm`` that QEMU or the lab names."""
    for h, hb in enumerate(vm.host_bridges):
        yield hb.name, f"{where}.host_bridge[{h}].name"
        for r, rp in enumerate(hb.root_ports):
            yield rp, f"{where}.host_bridge[{h}].root_ports[{r}]"
    for table, switches in (("switch", vm.switches), ("pcie_switch", vm.pcie_switches)):
        for s, sw in enumerate(switches):
            yield sw.name, f"{where}.{table}[{s}].name"
            for d, ds in enumerate(sw.downstream_ports):
                yield ds, f"{where}.{table}[{s}].downstream_ports[{d}]"
    for t, t3 in enumerate(vm.type3):
        yield t3.name, f"{where}.type3[{t}].name"
    for r, region in enumerate(vm.regions):
        yield region.name, f"{where}.region[{r}].name"
    for hp in vm.hotplug_port_ids():
        yield hp, f"{where}.hotplug_ports"
    for gpu in topo.gpus_of(vm.name):
        yield gpu.name, f"gpus.{gpu.name}"
        if gpu.at is None:
            yield gpu.root_port, f"gpus.{gpu.name}"
    for nic in topo.nics_of(vm.name):
        yield nic.name, f"nics.{nic.name}"
        if nic.at is None:
            yield nic.root_port, f"nics.{nic.name}"
    for n, nvme in enumerate(vm.nvmes):
        yield nvme.name, f"{where}.nvme[{n}].name"
        if nvme.at is None:
            yield nvme.root_port, f"{where}.nvme[{n}].name"


def _root_ports(vm: Vm) -> list[str]:
    return [rp for hb in vm.host_bridges for rp in hb.root_ports]


def _cxl_downstream_ports(vm: Vm) -> list[str]:
    return [ds for sw in vm.switches for ds in sw.downstream_ports]


def _pcie_downstream_ports(vm: Vm) -> list[str]:
    return [ds for ps in vm.pcie_switches for ds in ps.downstream_ports]


def _switches_sit_on_root_ports(topo: Topology, vm: Vm, where: str) -> None:
    root_ports = _root_ports(vm)
    for s, sw in enumerate(vm.switches):
        if sw.at not in root_ports:
            _fail(f"{where}.switch[{s}].at", f"{sw.at!r} is not a CXL root port of VM {vm.name!r}",
                  "a CXL switch's upstream port sits on a root port: one of "
                  f"{', '.join(root_ports) or '(none: add a [[vm.host_bridge]])'}")


def _type3_sit_on_cxl_ports(topo: Topology, vm: Vm, where: str) -> None:
    ports = _root_ports(vm) + _cxl_downstream_ports(vm)
    for t, t3 in enumerate(vm.type3):
        if t3.at not in ports:
            _fail(f"{where}.type3[{t}].at",
                  f"{t3.at!r} is not a CXL root port or switch downstream port of VM {vm.name!r}",
                  f"use one of: {', '.join(ports) or '(none: add a [[vm.host_bridge]])'}")


def _placed_pcie_devices(topo: Topology, vm: Vm, where: str) -> list[tuple[str, str, str]]:
    """(port, TOML path of 'at', "GPU name" / "NVMe name" / "NIC name") of the GPUs, NVMe
    controllers and NICs placed with 'at' (the others get a root port of their own)."""
    placed = [(gpu.at, f"gpus.{gpu.name}.at", f"GPU {gpu.name}") for gpu in topo.gpus_of(vm.name)]
    placed += [(nvme.at, f"{where}.nvme[{n}].at", f"NVMe {nvme.name}") for n, nvme in enumerate(vm.nvmes)]
    placed += [(nic.at, f"nics.{nic.name}.at", f"NIC {nic.name}") for nic in topo.nics_of(vm.name)]
    return [p for p in placed if p[0] is not None]


def _pcie_devices_sit_on_pcie_switch_ports(topo: Topology, vm: Vm, where: str) -> None:
    ports = _pcie_downstream_ports(vm)
    for port, path, _ in _placed_pcie_devices(topo, vm, where):
        if port not in ports:
            _fail(path, f"{port!r} is not a PCIe switch downstream port of VM {vm.name!r}",
                  f"use one of: {', '.join(ports) or '(none: add a [[vm.pcie_switch]])'}, "
                  "or leave 'at' out for a root port of its own")


def _ports_carry_one_device(topo: Topology, vm: Vm, where: str) -> None:
    placed = [(sw.at, f"{where}.switch[{s}].at", f"switch {sw.name}") for s, sw in enumerate(vm.switches)]
    placed += [(t3.at, f"{where}.type3[{t}].at", f"Type3 {t3.name}") for t, t3 in enumerate(vm.type3)]
    placed += _placed_pcie_devices(topo, vm, where)
    used: dict[str, str] = {}
    for port, path, what in placed:
        if port in used:
            _fail(path, f"port {port!r} is over-subscribed: {used[port]} already sits on it",
                  "a port carries one device: add a root port or a switch downstream port")
        used[port] = what


def _type3_have_memory(topo: Topology, vm: Vm, where: str) -> None:
    for t, t3 in enumerate(vm.type3):
        if t3.volatile is None and t3.persistent is None:
            _fail(f"{where}.type3[{t}]", f"Type3 {t3.name!r} has no memory",
                  "give it volatile = \"BACKEND\", persistent = \"BACKEND\" or both")
        if t3.lsa is not None and t3.persistent is None:
            _fail(f"{where}.type3[{t}].lsa", "a label storage area is for persistent memory only",
                  "drop lsa, or add persistent = \"BACKEND\"")


def _type3_backends_are_declared_and_mapped_once(topo: Topology, vm: Vm, where: str) -> None:
    in_vm: dict[str, str] = {}
    for t, t3 in enumerate(vm.type3):
        for kind in ("volatile", "persistent"):
            backend = getattr(t3, kind)
            if backend is None:
                continue
            path = f"{where}.type3[{t}].{kind}"
            if backend not in topo.backends:
                _fail(path, f"unknown backend {backend!r}",
                      f"declare it as [backends.{backend}] with a size; "
                      f"known: {', '.join(topo.backends) or 'none'}")
            if backend in in_vm:
                _fail(path, f"backend {backend!r} is mapped twice in VM {vm.name!r} (also by {in_vm[backend]})",
                      "a VM maps a backend through one Type3 device; share it with other VMs, "
                      "or declare a second backend")
            in_vm[backend] = t3.name


def _windows_target_host_bridges(topo: Topology, vm: Vm, where: str) -> None:
    hb_names = [hb.name for hb in vm.host_bridges]
    for w, window in enumerate(vm.windows):
        for t, target in enumerate(window.targets):
            if target not in hb_names:
                _fail(f"{where}.window[{w}].targets[{t}]", f"{target!r} is not a host bridge of VM {vm.name!r}",
                      f"a window interleaves over host bridges: {', '.join(hb_names) or '(none)'}")
        if len(set(window.targets)) != len(window.targets):
            _fail(f"{where}.window[{w}].targets", f"targets {window.targets} repeat a host bridge",
                  "list each host bridge once")


def _window_sizes_are_whole_units_per_way(topo: Topology, vm: Vm, where: str) -> None:
    for w, window in enumerate(vm.windows):
        unit = CXL_SIZE_UNIT * window.ways
        if window.size % unit:
            _fail(f"{where}.window[{w}].size", f"a {window.ways}-way window's size must be a multiple of "
                  f"{format_size(unit)} (256M per way), not {format_size(window.size)}",
                  f"use e.g. {format_size(unit * 16)}")


def _at_most_16_windows(topo: Topology, vm: Vm, where: str) -> None:
    if len(vm.windows) > 16:
        _fail(f"{where}.window", f"more than 16 windows ({len(vm.windows)})", "use at most 16")


def _bus_numbers_suffice(topo: Topology, vm: Vm, where: str) -> None:
    numbers = vm.bus_numbers()
    if numbers and max(numbers.values()) > 250:
        _fail(f"{where}.host_bridge", "the host bridges need more PCI bus numbers than there are (255)",
              "use fewer host bridges, root ports or switch ports")


def _regions_use_existing_windows(topo: Topology, vm: Vm, where: str) -> None:
    for r, region in enumerate(vm.regions):
        if region.window >= len(vm.windows):
            _fail(f"{where}.region[{r}].window", f"window {region.window} does not exist in VM {vm.name!r}",
                  f"use 0..{len(vm.windows) - 1}" if vm.windows else "declare a [[vm.window]] first")


def _region_memdevs_are_type3_listed_once(topo: Topology, vm: Vm, where: str) -> None:
    t3_names = [t.name for t in vm.type3]
    for r, region in enumerate(vm.regions):
        path = f"{where}.region[{r}]"
        if len(set(region.memdevs)) != len(region.memdevs):
            _fail(f"{path}.memdevs", f"memdevs {region.memdevs} list a memdev twice", "list each memdev once")
        for m, name in enumerate(region.memdevs):
            if name not in t3_names:
                _fail(f"{path}.memdevs[{m}]", f"{name!r} is not a Type3 device of VM {vm.name!r}",
                      f"use one of: {', '.join(t3_names) or '(none)'}")


def _region_memdevs_have_the_capacity(topo: Topology, vm: Vm, where: str) -> None:
    """A ram region needs volatile memory of each memdev, a pmem region persistent, and takes
    all of it: a memdev's capacity of one kind is in one region."""
    in_region: dict[tuple[str, str], str] = {}
    for r, region in enumerate(vm.regions):
        for m, name in enumerate(region.memdevs):
            path = f"{where}.region[{r}].memdevs[{m}]"
            t3 = vm.type3_named(name)
            if (region.type == "ram" and t3.volatile is None) or (region.type == "pmem" and t3.persistent is None):
                kind = "volatile" if region.type == "ram" else "persistent"
                _fail(path, f"Type3 {name!r} has no {kind} memory for a {region.type} region",
                      f"give it {kind} = \"BACKEND\", or make the region type = "
                      f"\"{'pmem' if region.type == 'ram' else 'ram'}\"")
            if (name, region.type) in in_region:
                _fail(path, f"Type3 {name!r}'s {region.type} capacity is already in region "
                      f"{in_region[name, region.type]!r}", "a region takes a memdev's whole capacity: use another memdev")
            in_region[name, region.type] = region.name


def _region_memdevs_sit_under_the_window(topo: Topology, vm: Vm, where: str) -> None:
    for r, region in enumerate(vm.regions):
        window = vm.windows[region.window]
        for m, name in enumerate(region.memdevs):
            hb = vm._place(vm.type3_named(name))[0].name
            if hb not in window.targets:
                _fail(f"{where}.region[{r}].memdevs[{m}]", f"Type3 {name!r} sits under host bridge {hb!r}, which "
                      f"window {region.window} does not interleave over ({', '.join(window.targets)})",
                      "a region's memdevs must be reachable under its window's host bridges")


def _region_interleave_is_even(topo: Topology, vm: Vm, where: str) -> None:
    """The region's ways divide evenly: the same number of memdevs under each of the window's
    host bridges, spread evenly over 1, 2, 4, ... root ports under each."""
    for r, region in enumerate(vm.regions):
        path = f"{where}.region[{r}].memdevs"
        window = vm.windows[region.window]
        if region.ways % window.ways:
            _fail(path, f"a {region.ways}-way region cannot span a {window.ways}-way window",
                  f"use a multiple of {window.ways} memdevs, the same number under each host bridge")
        per_hb = region.ways // window.ways
        for hb_name in window.targets:
            mine = [m for m in region.memdevs if vm._place(vm.type3_named(m))[0].name == hb_name]
            if len(mine) != per_hb:
                _fail(path, f"host bridge {hb_name!r} has {len(mine)} of the region's memdevs, not {per_hb}",
                      "a region puts the same number of memdevs under each of its window's host bridges")
            _root_ports_share_evenly(vm, path, hb_name, mine)


def _root_ports_share_evenly(vm: Vm, path: str, hb_name: str, memdevs: list[str]) -> None:
    """``memdevs`` (a region's, under host bridge ``hb_name``) spread evenly over its root ports."""
    rps = {vm._place(vm.type3_named(m))[1] for m in memdevs}
    if len(rps) not in INTERLEAVE_WAYS or len(memdevs) % len(rps):
        _fail(path, f"under host bridge {hb_name!r} the memdevs use {len(rps)} root ports unevenly",
              "spread them evenly over 1, 2, 4, ... root ports")
    for rp in rps:
        under = [m for m in memdevs if vm._place(vm.type3_named(m))[1] == rp]
        if len(under) != len(memdevs) // len(rps):
            _fail(path, f"root port {rp!r} has {len(under)} of the region's memdevs, "
                  f"not {len(memdevs) // len(rps)}", "spread the memdevs evenly over the root ports")
        if len(under) not in INTERLEAVE_WAYS:
            _fail(path, _ways_rule(len(under), f"memdevs under root port {rp!r}"),
                  "spread the memdevs over more root ports")


def _region_granularity_matches_a_multi_way_window(topo: Topology, vm: Vm, where: str) -> None:
    for r, region in enumerate(vm.regions):
        window = vm.windows[region.window]
        granularity = region.granularity or window.granularity
        if window.ways > 1 and granularity != window.granularity:
            _fail(f"{where}.region[{r}].granularity", f"a region in a {window.ways}-way window must use the "
                  f"window's granularity {format_size(window.granularity)}, not {format_size(granularity)}",
                  f"drop granularity or write granularity = \"{format_size(window.granularity)}\"")


def _region_memdevs_are_one_size(topo: Topology, vm: Vm, where: str) -> None:
    for r, region in enumerate(vm.regions):
        sizes = {vm.capacity(m, region.type, topo.backends) for m in region.memdevs}
        if len(sizes) > 1:
            _fail(f"{where}.region[{r}].memdevs", f"the memdevs' {region.type} capacities differ "
                  f"({', '.join(map(format_size, sorted(sizes)))})", "interleave memdevs of one size")


def _windows_hold_their_regions(topo: Topology, vm: Vm, where: str) -> None:
    window_use = [0] * len(vm.windows)
    for r, region in enumerate(vm.regions):
        window = vm.windows[region.window]
        window_use[region.window] += vm.region_size(region, topo.backends)
        if window_use[region.window] > window.size:
            _fail(f"{where}.region[{r}]", f"the regions in window {region.window} need "
                  f"{format_size(window_use[region.window])}, more than its {format_size(window.size)}",
                  f"make window[{region.window}].size larger")


def _pass_through_bridges_serve_one_region(topo: Topology, vm: Vm, where: str) -> None:
    """A host bridge with one root port has a pass-through decoder: the guest kernel (6.12)
    gives it to one region only."""
    per_bridge: dict[str, list[str]] = {hb.name: [] for hb in vm.host_bridges}
    for r, region in enumerate(vm.regions):
        for hb_name in vm.windows[region.window].targets:
            hb = next(h for h in vm.host_bridges if h.name == hb_name)
            per_bridge[hb_name].append(region.name)
            if len(hb.root_ports) == 1 and len(per_bridge[hb_name]) > 1:
                _fail(f"{where}.region[{r}]", f"host bridge {hb_name!r} has one root port, so its decoder is a "
                      f"pass-through that the guest kernel (6.12) gives to one region only (here "
                      f"{per_bridge[hb_name][0]!r}); region {region.name!r} would fail with 'no decoder available'",
                      f"give {hb_name} a second root port (root_ports = [\"{hb.root_ports[0]}\", \"...\"])")


def _fsdax_is_for_pmem_regions(topo: Topology, vm: Vm, where: str) -> None:
    for r, region in enumerate(vm.regions):
        if region.type == "ram" and region.use == "fsdax":
            _fail(f"{where}.region[{r}].use", "fsdax is a pmem namespace mode; a ram region gives devdax",
                  "use \"devdax\" or \"none\" for a ram region")


VM_RULES = (
    _names_are_unique,
    _switches_sit_on_root_ports,
    _type3_sit_on_cxl_ports,
    _pcie_devices_sit_on_pcie_switch_ports,
    _ports_carry_one_device,
    _type3_have_memory,
    _type3_backends_are_declared_and_mapped_once,
    _windows_target_host_bridges,
    _window_sizes_are_whole_units_per_way,
    _at_most_16_windows,
    _bus_numbers_suffice,
    _regions_use_existing_windows,
    _region_memdevs_are_type3_listed_once,
    _region_memdevs_have_the_capacity,
    _region_memdevs_sit_under_the_window,
    _region_interleave_is_even,
    _region_granularity_matches_a_multi_way_window,
    _region_memdevs_are_one_size,
    _windows_hold_their_regions,
    _pass_through_bridges_serve_one_region,
    _fsdax_is_for_pmem_regions,
)


def _check_vm(topo: Topology, i: int, vm: Vm) -> None:
    """The rules within VM ``i``, in VM_RULES order; the first broken one raises."""
    for rule in VM_RULES:
        rule(topo, vm, f"vm[{i}]")


def check(topo: Topology) -> None:
    """The rules that span several tables; raises _Problem(path, what, fix)."""
    names = [vm.name for vm in topo.vms]
    for i, name in enumerate(names):
        if name in names[:i]:
            _fail(f"vm[{i}].name", f"VM name {name!r} repeats", "give each [[vm]] its own name")
    for gname, gpu in topo.gpus.items():
        if gpu.owner is not None and gpu.owner not in names:
            _fail(f"gpus.{gname}.owner", f"{gpu.owner!r} is not a VM of this topology",
                  f"use one of: {', '.join(names)}, or leave owner out for an unowned GPU")
        if gpu.owner is None and gpu.at is not None:
            _fail(f"gpus.{gname}.at", "an unowned GPU has no placement yet",
                  "drop 'at' (the fabric manager hot-plugs it into a VM's hot-plug port), or set owner")
    for nname, nic in topo.nics.items():
        if nic.owner not in names:
            _fail(f"nics.{nname}.owner", f"{nic.owner!r} is not a VM of this topology",
                  f"use one of: {', '.join(names)}")
    for i, vm in enumerate(topo.vms):
        _check_vm(topo, i, vm)
    for bname in topo.backends:
        if not topo.backend_users(bname):
            _fail(f"backends.{bname}", f"backend {bname!r} is not used by any Type3 device",
                  "name it in a [[vm.type3]] (volatile = or persistent =), or remove it")
    pairs = set()
    for i, link in enumerate(topo.links):
        a, b = link.vms
        if a == b or a not in names or b not in names:
            _fail(f"link[{i}].vms", f"a link must join two different VMs of this topology, not {list(link.vms)}",
                  f"write vms = [\"{names[0]}\", \"...\"] with names from: {', '.join(names)}")
        if frozenset(link.vms) in pairs:
            _fail(f"link[{i}].vms", f"{a} and {b} are already linked", "declare each link once")
        pairs.add(frozenset(link.vms))
    _nics_join_links_of_their_owners(topo)
    _links_have_a_nic_at_both_ends_or_none(topo)
    taken: dict[str, str] = {}
    for sname, smc in topo.smcs.items():
        for h, host in enumerate(smc.hosts):
            path = f"smc.{sname}.hosts[{h}]"
            if host not in names:
                _fail(path, f"{host!r} is not a VM of this topology", f"use one of: {', '.join(names)}")
            if host in smc.hosts[:h]:
                _fail(path, f"VM {host!r} is named twice in smc.{sname}.hosts", "name each host VM once")
            if host in taken:
                _fail(path, f"VM {host!r} is already a host of smc.{taken[host]}",
                      "a VM can be a host of one shared-memory controller: remove it from one of them")
            taken[host] = sname


# ---------------------------------------------------------------- NICs on links

def _nics_join_links_of_their_owners(topo: Topology) -> None:
    """A NIC's ``link`` is a ``[[link]]`` of the topology that joins the NIC's owner, and the
    owner has no other NIC on it."""
    on_link: dict[tuple[int, str], str] = {}
    for nname, nic in topo.nics.items():
        if nic.link is None:
            continue
        path = f"nics.{nname}.link"
        own = [i for i, link in enumerate(topo.links) if nic.owner in link.vms]
        use = (f"use {' or '.join(map(str, own))} (the [[link]] tables of {nic.owner}, from 0 in file order)"
               if own else f"declare a [[link]] with vms = [\"{nic.owner}\", \"...\"] first")
        if nic.link >= len(topo.links):
            _fail(path, f"link {nic.link} does not exist (the topology has {len(topo.links)} [[link]])", use)
        a, b = topo.links[nic.link].vms
        if nic.owner not in (a, b):
            _fail(path, f"link {nic.link} joins {a} and {b}, not the NIC's owner {nic.owner}", use)
        if (nic.link, nic.owner) in on_link:
            _fail(path, f"{nic.owner} already has NIC {on_link[nic.link, nic.owner]} on link {nic.link}",
                  "a link wires one NIC of each of its two VMs: drop 'link' from one of them")
        on_link[nic.link, nic.owner] = nname


def _links_have_a_nic_at_both_ends_or_none(topo: Topology) -> None:
    """A NIC on a link needs a peer: the link's other VM has a NIC on it too."""
    nic_of = {(nic.link, nic.owner): nic.name for nic in topo.nics.values() if nic.link is not None}
    for i, link in enumerate(topo.links):
        ends = [vm for vm in link.vms if (i, vm) in nic_of]
        if len(ends) == 1:
            (has,) = ends
            (lacks,) = [vm for vm in link.vms if vm != has]
            _fail(f"link[{i}]", f"NIC {nic_of[i, has]} of {has} is on this link, but {lacks} has no NIC on it",
                  f"add [nics.NAME] with owner = \"{lacks}\" and link = {i}, or drop 'link' from "
                  f"nics.{nic_of[i, has]}")


# ---------------------------------------------------------------- loading

def available() -> list[str]:
    return sorted(p.stem for p in TOPOLOGY_DIR.glob("*.toml"))


def parse(text: str, name: str, source: str = "<topology>") -> Topology:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise LabError(f"{source}: malformed TOML: {err}", "fix the file's syntax") from None
    if not data.get("vm"):
        raise LabError(f"{source}: vm: no [[vm]] defined", "add at least one [[vm]] table with a name")
    for key in ("name", "source"):
        if key in data:
            raise LabError(f"{source}: {key}: unknown key", "a topology's name is its file name")
    try:
        topo = Topology.model_validate({**data, "name": name, "source": source})
    except ValidationError as err:
        raise _from_pydantic(err, source) from None
    try:
        check(topo)
    except _Problem as p:
        raise LabError(f"{source}: {p.path}: {p.what}", p.fix) from None
    return topo


def resolve(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix != ".toml" and "/" not in name_or_path:
        path = TOPOLOGY_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise LabError(f"unknown topology {name_or_path!r}",
                           f"use one of: {', '.join(available())} (or a path to a .toml file)")
    elif not path.is_file():
        raise LabError(f"no topology file {path}", "check the path")
    return path


def load(name_or_path: str) -> Topology:
    """A topology by name (``single``) or by path to a ``.toml`` file, validated."""
    path = resolve(name_or_path)
    return _load_file(path, path.read_bytes())


def _load_file(path: Path, data: bytes) -> Topology:
    try:
        text = data.decode()
    except UnicodeDecodeError as err:
        raise LabError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})",
                       "a topology is a TOML file, in UTF-8") from None
    topo = parse(text, path.stem, str(path) if path.parent != TOPOLOGY_DIR else path.name)
    topo._file, topo._sha256 = path.resolve(), hashlib.sha256(data).hexdigest()
    return topo


# -- handing a loaded topology to a child process ------------------------------------------------
# A process loads its topology once and passes the object on.  Across a process boundary
# (the detached fabric manager, the Redfish service) it passes the file's path and SHA-256;
# the child loads that file and refuses it if it is not the one the parent loaded.

def handoff(topo: Topology) -> list[str]:
    """The options that hand ``topo`` to a child: ``--topology PATH --topology-sha256 HEX``
    (the child parses them with :func:`add_handoff_options` and loads with :func:`load_handed`)."""
    if topo._file is None:
        raise LabError(f"topology {topo.name} was not loaded from a file", "load it with topology.load")
    return ["--topology", str(topo._file), "--topology-sha256", topo._sha256]


def add_handoff_options(parser) -> None:
    """``--topology PATH --topology-sha256 HEX`` on an argparse parser (see :func:`handoff`)."""
    parser.add_argument("--topology", required=True, type=Path, help="the topology file the parent loaded")
    parser.add_argument("--topology-sha256", required=True, help="its SHA-256 (hex), checked before use")


def load_handed(path: Path, sha256: str) -> Topology:
    """The topology file a parent process loaded, refused if it is not the same any more."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise LabError(f"topology file {path}: {err.strerror}", "the file the lab was started from must stay "
                       "in place while the lab runs") from None
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise LabError(f"topology file {path} changed after it was loaded (SHA-256 {found[:12]}..., "
                       f"expected {sha256[:12]}...)", "put the file back as it was, or stop the lab "
                       "(vfio-cxl vm down) and start it again from the file as it is now")
    return _load_file(path, data)
