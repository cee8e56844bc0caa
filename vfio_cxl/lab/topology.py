"""Topologies: lab layouts as data (``qemu/topologies/*.toml``), checked strictly.

A topology names memory backends (files in the lab's run directory, shared by
every Type3 device that names them), the VMs, what each VM carries (the GPU,
its Type3 devices) and the point-to-point links between VMs.  Every VM gets
the same machine skeleton: Q35 + intel-iommu, a free PCIe root port for the
GPU, and a CXL 2.0 host bridge -> root port -> switch -> Type3 devices.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LabError
from ..paths import REPO_ROOT

TOPOLOGY_DIR = REPO_ROOT / "qemu" / "topologies"
_SIZE = re.compile(r"^(\d+)([KMGT]?)$")
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,15}$")


def parse_size(text: str | int, where: str) -> int:
    """'256M' -> bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text).strip().upper())
    if not match:
        raise LabError(f"{where}: bad size {text!r}", "write sizes like 256M or 4G")
    number, unit = match.groups()
    return int(number) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[unit]


@dataclass(frozen=True)
class Backend:
    name: str
    size: int


@dataclass(frozen=True)
class Type3:
    backend: Backend


@dataclass(frozen=True)
class VmSpec:
    name: str
    memory: int
    cpus: int
    gpu: bool
    cxl_window: int
    type3: tuple[Type3, ...]


@dataclass(frozen=True)
class Link:
    vms: tuple[str, str]


@dataclass(frozen=True)
class SmcSpec:
    """A shared-memory controller (``[smc.NAME] hosts = [...]``): host h is hosts[h]."""
    name: str
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Topology:
    name: str
    description: str
    backends: dict[str, Backend]
    vms: tuple[VmSpec, ...]
    links: tuple[Link, ...] = field(default=())
    smcs: tuple[SmcSpec, ...] = field(default=())

    def smc_of(self, vm: str) -> tuple[SmcSpec, int] | None:
        """The controller ``vm`` is a host of, and its host ID there (or None)."""
        for smc in self.smcs:
            if vm in smc.hosts:
                return smc, smc.hosts.index(vm)
        return None

    def vm(self, name: str) -> VmSpec:
        for vm in self.vms:
            if vm.name == name:
                return vm
        raise LabError(f"topology {self.name} has no VM {name!r}",
                       f"use one of: {', '.join(v.name for v in self.vms)}")


def available() -> list[str]:
    return sorted(p.stem for p in TOPOLOGY_DIR.glob("*.toml"))


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise LabError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}",
                       f"allowed here: {', '.join(sorted(allowed))}")


def _vm(raw: dict, index: int, backends: dict[str, Backend], source: str) -> VmSpec:
    where = f"{source}: vm[{index}]"
    if not isinstance(raw, dict):
        raise LabError(f"{where}: must be a table", "write [[vm]] sections")
    _check_keys(raw, {"name", "memory", "cpus", "gpu", "cxl_window", "type3"}, where)
    name = raw.get("name", "")
    if not isinstance(name, str) or not _NAME.match(name):
        raise LabError(f"{where}: bad or missing name {name!r}",
                       "use 1-16 lower-case letters, digits or '-', starting with a letter")
    type3 = []
    for j, dev in enumerate(raw.get("type3", [])):
        _check_keys(dev, {"backend"}, f"{where}.type3[{j}]")
        if dev.get("backend") not in backends:
            raise LabError(f"{where}.type3[{j}]: unknown backend {dev.get('backend')!r}",
                           f"declare it as [backends.NAME]; known: {', '.join(backends) or 'none'}")
        type3.append(Type3(backends[dev["backend"]]))
    cpus = raw.get("cpus", 2)
    if not isinstance(cpus, int) or not 1 <= cpus <= 16:
        raise LabError(f"{where}: cpus must be a whole number from 1 to 16, not {cpus!r}", "fix the topology")
    return VmSpec(
        name=name,
        memory=parse_size(raw.get("memory", "1G"), f"{where}.memory"),
        cpus=cpus,
        gpu=bool(raw.get("gpu", False)),
        cxl_window=parse_size(raw.get("cxl_window", "4G"), f"{where}.cxl_window"),
        type3=tuple(type3),
    )


def parse(text: str, name: str, source: str = "<topology>") -> Topology:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise LabError(f"{source}: malformed TOML: {err}", "fix the file's syntax") from None
    _check_keys(data, {"description", "backends", "vm", "link", "smc"}, source)
    backends = {}
    for bname, braw in data.get("backends", {}).items():
        where = f"{source}: backends.{bname}"
        if not isinstance(braw, dict):
            raise LabError(f"{where}: must be a table", "write [backends.NAME] with size = \"256M\"")
        _check_keys(braw, {"size"}, where)
        if not _NAME.match(bname):
            raise LabError(f"{where}: bad backend name", "use lower-case letters, digits or '-'")
        backends[bname] = Backend(bname, parse_size(braw.get("size", "256M"), f"{where}.size"))
    raw_vms = data.get("vm", [])
    if not raw_vms:
        raise LabError(f"{source}: no [[vm]] defined", "add at least one [[vm]] section")
    vms = tuple(_vm(raw, i, backends, source) for i, raw in enumerate(raw_vms))
    names = [vm.name for vm in vms]
    if len(set(names)) != len(names):
        raise LabError(f"{source}: VM names repeat: {names}", "give each [[vm]] its own name")
    links = []
    for i, raw in enumerate(data.get("link", [])):
        _check_keys(raw, {"vms"}, f"{source}: link[{i}]")
        pair = raw.get("vms", [])
        if len(pair) != 2 or not set(pair) <= set(names) or pair[0] == pair[1]:
            raise LabError(f"{source}: link[{i}] must join two different VMs of this topology, not {pair!r}",
                           f"write vms = [\"{names[0]}\", \"...\"]")
        links.append(Link((pair[0], pair[1])))
    smcs = _smcs(data.get("smc", {}), names, source)
    return Topology(name, str(data.get("description", "")).strip(), backends, vms, tuple(links), smcs)


SMC_MAX_HOSTS = 16   # docs/smc-device.md (the lab does not import the device's register map)


def _smcs(raw: dict, names: list[str], source: str) -> tuple[SmcSpec, ...]:
    """``[smc.NAME] hosts = ["a", "b"]``: the VMs one shared-memory controller serves.
    (Seam for the pydantic schema: this is the whole of the [smc] table's rules.)"""
    if not isinstance(raw, dict):
        raise LabError(f"{source}: smc must be a table", 'write [smc.NAME] with hosts = ["a", "b"]')
    smcs, taken = [], {}
    for sname, sraw in raw.items():
        where = f"{source}: smc.{sname}"
        if not isinstance(sraw, dict):
            raise LabError(f"{where}: must be a table", 'write hosts = ["a", "b"]')
        _check_keys(sraw, {"hosts"}, where)
        if not _NAME.match(sname):
            raise LabError(f"{where}: bad controller name", "use lower-case letters, digits or '-'")
        hosts = sraw.get("hosts")
        if (not isinstance(hosts, list) or not 1 <= len(hosts) <= SMC_MAX_HOSTS
                or not all(isinstance(h, str) for h in hosts)):
            raise LabError(f"{where}: hosts must be a list of 1 to {SMC_MAX_HOSTS} VM names, not {hosts!r}",
                           f'write hosts = ["{names[0]}", ...]')
        unknown = [h for h in hosts if h not in names]
        if unknown:
            raise LabError(f"{where}: unknown VM(s) {', '.join(unknown)}", f"use VMs of this topology: {', '.join(names)}")
        if len(set(hosts)) != len(hosts):
            raise LabError(f"{where}: a VM is named twice in hosts {hosts}", "name each VM once")
        for h in hosts:
            if h in taken:
                raise LabError(f"{where}: VM {h!r} is already a host of smc.{taken[h]}",
                               "a VM can be a host of one controller")
            taken[h] = sname
        smcs.append(SmcSpec(sname, tuple(hosts)))
    return tuple(smcs)


def load(name_or_path: str) -> Topology:
    """A topology by name (``single``) or by path to a ``.toml`` file."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = TOPOLOGY_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise LabError(f"unknown topology {name_or_path!r}",
                           f"use one of: {', '.join(available())} (or a path to a .toml file)")
    elif not path.is_file():
        raise LabError(f"no topology file {path}", "check the path")
    return parse(path.read_text(), path.stem, str(path))
