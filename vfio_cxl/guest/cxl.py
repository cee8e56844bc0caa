"""CXL in the guest: discover the tree; bring regions up with the standard tools.

Discovery walks the ``cxl`` bus with pyudev (the sysfs attributes the kernel's
CXL core exports) and can be cross-checked with ``cxl list`` JSON.  Regions are
made, enabled and torn down only by cxl-cli, daxctl and ndctl, reading their
JSON:

* ``cxl create-region -t ram|pmem -d decoder0.W -w N -g G -m MEM...`` (memdevs
  in interleave position order: cxl-cli does not sort them; the lab passes
  them by serial number, ``cxl-type3,sn=``, in the order the decoders need);
* a ram region's dax device comes up in devdax mode but disabled:
  ``daxctl enable-device`` binds it to device_dax (kmem stays blacklisted in
  the image: a shared region must never become system RAM);
* a pmem region gets a namespace with ``ndctl create-namespace -m fsdax|devdax``
  (labels in the device's LSA; needs cxl_pmem, libnvdimm, nd_pmem, dax_pmem);
* ``cxl destroy-region -f`` undoes a region when a later step fails.

One sysfs read stays: ndctl's region listing does not name the CXL region it
stands for, so an nd region is matched to its CXL region by ``resource``.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import LabError

__all__ = ["CxlError", "Memdev", "DaxDevice", "tool", "memdevs", "switches", "root_decoders", "regions",
           "cxl_list", "dax_geometry", "load_pmem_modules", "create_region", "destroy_region", "bring_up",
           "ensure_ram_devdax"]

SYS_CXL = Path("/sys/bus/cxl/devices")
SYS_ND = Path("/sys/bus/nd/devices")
SYS_DAX = Path("/sys/bus/dax")
SYS_DAX_DEVICES = SYS_DAX / "devices"
DEFAULT_DAX_ALIGN = 2 << 20
PMEM_MODULES = ["cxl_pmem", "libnvdimm", "nd_pmem", "dax_pmem"]


class CxlError(LabError):
    """A CXL or devdax step failed: what, and what to do."""


def _read(path: Path) -> str:
    return path.read_text().strip()


@dataclass(frozen=True)
class Memdev:
    name: str            # mem0
    ram_size: int
    serial: int
    pci_address: str     # the Type3 device's BDF


@dataclass(frozen=True)
class DaxDevice:
    name: str            # dax0.0
    size: int
    align: int
    path: Path           # /dev/dax0.0
    region: str          # region0 (a 1-way region maps its memdev from DPA 0: dax offset == device offset)
    resource: int        # host physical address of the region


def tool(*argv: str, check: bool = True) -> list | dict:
    """Run cxl/daxctl/ndctl; their JSON on stdout (``[]`` when they print nothing)."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise CxlError(f"{argv[0]} is not installed", "the guest image ships ndctl, cxl and daxctl") from None
    if check and out.returncode != 0:
        detail = " / ".join(line for line in out.stderr.splitlines() if line.strip())[-600:]
        raise CxlError(f"'{' '.join(argv)}' failed: {detail or f'exit {out.returncode}'}",
                       "see dmesg for the CXL driver's reason")
    text = out.stdout.strip()
    if not text:
        return []
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise CxlError(f"'{' '.join(argv)}' printed no JSON: {text[:200]!r}") from None


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value] if value else []


def _cxl_devices(prefix: str) -> list["pyudev.Device"]:
    import pyudev   # here: bringing regions up (the lab's boot step) never walks the bus with it
    context = pyudev.Context()
    return sorted((d for d in context.list_devices(subsystem="cxl") if d.sys_name.startswith(prefix)),
                  key=lambda d: d.sys_name)


def _uport(port: "pyudev.Device") -> Path:
    """The device a CXL port stands for (host bridge, switch upstream port, memdev)."""
    return (Path(port.sys_path) / "uport").resolve()


def memdevs() -> list[Memdev]:
    found = []
    for dev in _cxl_devices("mem"):
        sys_path = Path(dev.sys_path)
        ram = sys_path / "ram" / "size"
        found.append(Memdev(
            name=dev.sys_name,
            ram_size=int(_read(ram), 0) if ram.exists() else 0,
            serial=int(_read(sys_path / "serial"), 0),
            pci_address=sys_path.resolve().parent.name,
        ))
    return found


def switches() -> list[str]:
    """CXL switches: ports whose uport is a PCI function (a switch upstream port),
    not a host bridge."""
    return [d.sys_name for d in _cxl_devices("port") if _uport(d).name.count(":") == 2]


def root_decoders() -> list[str]:
    return [d.sys_name for d in _cxl_devices("decoder0.")]


def regions() -> list[str]:
    return [d.sys_name for d in _cxl_devices("region")]


def cxl_list() -> list:
    """``cxl list`` JSON (memdevs, ports, decoders, regions) for cross-checks."""
    out = subprocess.run(["cxl", "list", "-M", "-P", "-D", "-R", "-E"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout or "[]")


def dax_geometry(name: str) -> tuple[int, int]:
    """(size, align) of dax device ``name`` from sysfs."""
    dev = SYS_DAX_DEVICES / name
    align = dev / "align"
    return int(_read(dev / "size"), 0), int(_read(align), 0) if align.exists() else DEFAULT_DAX_ALIGN


# ---------------------------------------------------------------- regions with cxl-cli

def _root_decoders() -> list[str]:
    """Root decoders (one per CXL fixed memory window, in window order)."""
    names = [d["decoder"] for d in _as_list(tool("cxl", "list", "-D", "-d", "root"))]
    return sorted(names, key=lambda n: int(n.split(".")[1]))


def _regions_json() -> list[dict]:
    return _as_list(tool("cxl", "list", "-R", "-X", "-T"))   # -T: the mappings (memdevs by position)


def _members(region: dict) -> list[str]:
    return [m["memdev"] for m in sorted(region.get("mappings", []), key=lambda m: m["position"])]


def _dax_devices(region: dict) -> list[dict]:
    return region.get("daxregion", {}).get("devices", [])


def _enable_dax(region_name: str) -> DaxDevice:
    """The region's dax device, enabled in devdax mode (device_dax, never kmem)."""
    (region,) = _as_list(tool("cxl", "list", "-R", "-X", "-r", region_name))
    devices = _dax_devices(region)
    if not devices:
        raise CxlError(f"{region_name} has no dax device", "is dax_cxl loaded? (modprobe dax_cxl)")
    dev = devices[0]
    if dev.get("mode") != "devdax":
        tool("daxctl", "reconfigure-device", "--mode=devdax", dev["chardev"])
    elif dev.get("state") == "disabled":
        tool("daxctl", "enable-device", dev["chardev"])
    size, align = dax_geometry(dev["chardev"])
    return DaxDevice(dev["chardev"], size, align, Path("/dev") / dev["chardev"], region_name, region["resource"])


def _nd_region(cxl_region: dict) -> str:
    for nd in sorted(SYS_ND.glob("region*")):
        try:
            if int(_read(nd / "resource"), 0) == cxl_region["resource"]:
                return nd.name
        except (OSError, ValueError):
            continue
    raise CxlError(f"no nvdimm region for {cxl_region['region']}", f"are {', '.join(PMEM_MODULES)} loaded?")


def _namespace(cxl_region: dict, mode: str) -> dict:
    nd = _nd_region(cxl_region)
    for region in _as_list(tool("ndctl", "list", "-R", "-N", "-r", nd)):
        for ns in region.get("namespaces", []):
            if ns.get("mode") == mode:
                return ns
    return tool("ndctl", "create-namespace", "-m", mode, "-r", nd)


def load_pmem_modules() -> None:
    """modprobe the pmem stack; nothing on a kernel without loadable modules (the lab kernel has
    them built in), where a missing driver shows as the region's missing nvdimm or namespace."""
    if not Path("/lib/modules", os.uname().release).is_dir():
        return
    out = subprocess.run(["modprobe", "-a", *PMEM_MODULES], capture_output=True, text=True)
    if out.returncode != 0:
        raise CxlError(f"modprobe {' '.join(PMEM_MODULES)} failed: {out.stderr.strip()}",
                       "the guest kernel needs CONFIG_CXL_PMEM and CONFIG_BLK_DEV_PMEM")


def destroy_region(region: str) -> None:
    """Tear a region down (namespaces and dax devices with it): ``cxl destroy-region -f``."""
    tool("cxl", "destroy-region", "-f", region)


def create_region(kind: str, window: int, memdevs: list[str], granularity: int | None = None, *,
                  existing: list[dict] | None = None) -> dict:
    """``cxl create-region``; memdevs in interleave position order.  Its JSON.  ``existing``: the
    regions as ``cxl list -R`` showed them just before (listed here when not given): a region
    that is not among them after a failure is this call's, and is destroyed."""
    roots = _root_decoders()
    if window >= len(roots):
        raise CxlError(f"no root decoder for window {window} (the guest has {len(roots)})",
                       "is cxl_acpi loaded, and does the topology declare the window?")
    argv = ["cxl", "create-region", "-t", kind, "-d", roots[window], "-w", str(len(memdevs))]
    if granularity:
        argv += ["-g", str(granularity)]
    before = {r["region"] for r in (_regions_json() if existing is None else existing)}
    try:
        return tool(*argv, "-m", *memdevs)
    except CxlError:
        for region in _regions_json():   # cxl-cli cleans up after itself; make sure
            if region["region"] not in before:
                destroy_region(region["region"])
        raise


def bring_up(plan: dict) -> list[dict]:
    """Create the regions a topology declares (idempotent), ram before pmem:
    an endpoint decoder must map a memdev's ram (DPA 0) before its pmem.

    ``plan``: {"pmem": bool, "regions": [{"name", "type", "window", "granularity",
    "serials" (position order), "use"}]}.  Returns what each region became."""
    if plan.get("pmem"):
        load_pmem_modules()
    by_serial = {m["serial"]: m["memdev"] for m in _as_list(tool("cxl", "list", "-M"))}
    results = []
    existing = None   # `cxl list -R`: listed for the first region, and again after one was made
    for spec in sorted(plan["regions"], key=lambda r: r["type"] != "ram"):
        missing = [s for s in spec["serials"] if s not in by_serial]
        if missing:
            raise CxlError(f"region {spec['name']}: no memdev with serial {', '.join(map(hex, missing))}",
                           "is cxl_mem loaded and every Type3 device enabled? (cxl list -M)")
        mems = [by_serial[s] for s in spec["serials"]]
        existing = existing if existing is not None else _regions_json()
        region = next((r for r in existing if _members(r) == mems and r["type"] == spec["type"]), None)
        created = region is None
        if created:
            region = create_region(spec["type"], spec["window"], mems, spec.get("granularity"), existing=existing)
        result = {"name": spec["name"], "region": region["region"], "type": spec["type"], "memdevs": mems,
                  "size": region["size"], "ways": region["interleave_ways"],
                  "granularity": region["interleave_granularity"], "use": spec["use"]}
        try:
            if spec["use"] == "devdax" and spec["type"] == "ram":
                result["dax"] = _enable_dax(region["region"]).name
            elif spec["use"] in ("devdax", "fsdax"):
                ns = _namespace(region, spec["use"])
                result["namespace"] = ns["dev"]
                result["blockdev"] = ns.get("blockdev")
                result["dax"] = next((d["chardev"] for d in _dax_devices(ns)), None)
        except CxlError:
            if created:
                destroy_region(region["region"])
            raise
        if created:
            existing = None
        results.append(result)
    return results


def ensure_ram_devdax(memdev_name: str | None = None) -> DaxDevice:
    """A devdax device over a RAM region (on ``memdev_name``; default: the only one).

    Reuses the region the lab brought up at boot; without one (a topology that
    declares no region), creates a 1-way ram region on the memdev with cxl-cli."""
    ram = [r for r in _regions_json() if r["type"] == "ram"]
    if memdev_name is not None:
        ram = [r for r in ram if memdev_name in _members(r)]
    if len(ram) > 1:
        raise CxlError(f"several RAM regions: {', '.join(r['region'] for r in ram)}", "name a memdev")
    if ram:
        return _enable_dax(ram[0]["region"])
    devs = [m for m in _as_list(tool("cxl", "list", "-M")) if m.get("ram_size")]
    if memdev_name is not None:
        devs = [m for m in devs if m["memdev"] == memdev_name]
    if not devs:
        raise CxlError(f"no CXL memdev with volatile (RAM) capacity{' named ' + memdev_name if memdev_name else ''}",
                       "boot a topology with a volatile Type3 device (vfio-cxl vm up single)")
    if len(devs) > 1:
        raise CxlError(f"several memdevs: {', '.join(d['memdev'] for d in devs)}", "name one")
    region = create_region("ram", 0, [devs[0]["memdev"]])
    try:
        return _enable_dax(region["region"])
    except CxlError:
        destroy_region(region["region"])
        raise
