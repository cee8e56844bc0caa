"""CXL in the guest: discover the tree, bring a Type3 device's RAM up as devdax.

Discovery walks the ``cxl`` and ``dax`` buses with pyudev (the sysfs
attributes the kernel's CXL core exports) and can be cross-checked with
``cxl list``/``daxctl list`` JSON.  Region creation follows what
``cxl create-region -t ram`` does, step by step through sysfs, so each step's
failure can be named and undone:

1. read ``decoderX.Y/create_ram_region`` on the root decoder, write the name back;
2. region: ``interleave_granularity`` (the root decoder's), ``interleave_ways`` = 1;
3. endpoint decoder: ``mode`` = ram, ``dpa_size`` = the memdev's RAM size;
4. region: ``size``, ``target0``, ``commit`` = 1; bind it to ``cxl_region``;
5. the region's dax device is bound to ``device_dax`` -> ``/dev/daxN.M``.

Idempotent: a region already committed on the memdev is reused.  On failure
everything this call created is torn down again.
"""

from __future__ import annotations

import json
import subprocess
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pyudev

SYS_CXL = Path("/sys/bus/cxl/devices")
SYS_DAX = Path("/sys/bus/dax")
SYS_DAX_DEVICES = SYS_DAX / "devices"
DEFAULT_DAX_ALIGN = 2 << 20


class CxlError(Exception):
    def __init__(self, what: str, fix: str = ""):
        self.what, self.fix = what, fix
        super().__init__(f"{what}{' -- ' + fix if fix else ''}")


def _read(path: Path) -> str:
    return path.read_text().strip()


def _write(path: Path, value: str | int) -> None:
    try:
        path.write_text(str(value))
    except OSError as err:
        raise CxlError(f"writing {value!r} to {path} failed: {err.strerror}",
                       "see dmesg for the CXL driver's reason") from None


@dataclass(frozen=True)
class Memdev:
    name: str            # mem0
    ram_size: int
    serial: int
    pci_address: str     # the Type3 device's BDF
    endpoint: str        # endpointN: the memdev's port in the CXL tree


@dataclass(frozen=True)
class DaxDevice:
    name: str            # dax0.0
    size: int
    align: int
    path: Path           # /dev/dax0.0
    region: str          # region0 (it maps its memdev from DPA 0: dax offset == device offset)
    resource: int        # host physical address of the region


def _cxl_devices(prefix: str) -> list[pyudev.Device]:
    context = pyudev.Context()
    return sorted((d for d in context.list_devices(subsystem="cxl") if d.sys_name.startswith(prefix)),
                  key=lambda d: d.sys_name)


def _uport(port: pyudev.Device) -> Path:
    """The device a CXL port stands for (host bridge, switch upstream port, memdev)."""
    return (Path(port.sys_path) / "uport").resolve()


def memdevs() -> list[Memdev]:
    # An endpoint port hangs off its switch port; its uport is the memdev.
    endpoint_of = {_uport(ep).name: ep.sys_name for ep in _cxl_devices("endpoint")}
    found = []
    for dev in _cxl_devices("mem"):
        sys_path = Path(dev.sys_path)
        ram = sys_path / "ram" / "size"
        found.append(Memdev(
            name=dev.sys_name,
            ram_size=int(_read(ram), 0) if ram.exists() else 0,
            serial=int(_read(sys_path / "serial"), 0),
            pci_address=sys_path.resolve().parent.name,
            endpoint=endpoint_of.get(dev.sys_name, ""),
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


def _endpoint_decoder(memdev: Memdev) -> Path:
    decoders = sorted((SYS_CXL / memdev.endpoint).glob(f"decoder{memdev.endpoint[8:]}.*"))
    if not decoders:
        raise CxlError(f"{memdev.name} has no endpoint decoder", "is cxl_mem loaded and the memdev enabled?")
    return SYS_CXL / decoders[0].name


def _region_of(memdev: Memdev) -> str | None:
    """The committed region whose target is this memdev's endpoint decoder, if any."""
    decoder = _endpoint_decoder(memdev).name
    for region in regions():
        path = SYS_CXL / region
        try:
            if _read(path / "target0") == decoder and _read(path / "commit") == "1":
                return region
        except FileNotFoundError:
            continue
    return None


def dax_geometry(name: str) -> tuple[int, int]:
    """(size, align) of dax device ``name`` from sysfs."""
    dev = SYS_DAX_DEVICES / name
    align = dev / "align"
    return int(_read(dev / "size"), 0), int(_read(align), 0) if align.exists() else DEFAULT_DAX_ALIGN


def _dax_of(region: str) -> DaxDevice | None:
    region_path = SYS_CXL / region
    for dax_region in region_path.glob("dax_region*"):
        for dev in sorted(dax_region.glob("dax*.*")):
            size, align = dax_geometry(dev.name)
            return DaxDevice(
                name=dev.name,
                size=size,
                align=align,
                path=Path("/dev") / dev.name,
                region=region,
                resource=int(_read(region_path / "resource"), 0),
            )
    return None


def _dax_driver(name: str) -> str:
    link = SYS_DAX_DEVICES / name / "driver"
    return link.resolve().name if link.exists() else ""


def _bind_device_dax(dax: DaxDevice) -> None:
    """Bind the dax device to device_dax (not kmem), so /dev/daxN.M can be opened.

    A CXL RAM region's dax device prefers kmem; with kmem blacklisted it stays
    unbound (its /dev node exists but opening it fails with ENXIO), and
    device_dax takes it only once its name is added with new_id.
    """
    if _dax_driver(dax.name) == "device_dax":
        return
    subprocess.run(["modprobe", "device_dax"], check=False)
    driver = SYS_DAX / "drivers" / "device_dax"
    if not driver.exists():
        raise CxlError("the device_dax driver is not available", "modprobe device_dax")
    if _dax_driver(dax.name):
        _write(SYS_DAX_DEVICES / dax.name / "driver" / "unbind", dax.name)
    _write(driver / "new_id", dax.name)
    if _dax_driver(dax.name) != "device_dax":
        _write(driver / "bind", dax.name)
    if _dax_driver(dax.name) != "device_dax":
        raise CxlError(f"{dax.name} did not bind to device_dax", "see dmesg")


def ensure_ram_devdax(memdev_name: str | None = None) -> DaxDevice:
    """A devdax device over a RAM region on ``memdev_name`` (default: the only memdev).

    Reuses the region if one is committed already; otherwise creates it and
    removes it again if any later step fails.
    """
    devs = memdevs()
    if not devs:
        raise CxlError("no CXL memdev in this VM", "boot a topology with a Type3 device (vfio-cxl vm up single)")
    if memdev_name is None:
        if len(devs) > 1:
            raise CxlError(f"several memdevs: {', '.join(d.name for d in devs)}", "name one")
        memdev = devs[0]
    else:
        matches = [d for d in devs if d.name == memdev_name]
        if not matches:
            raise CxlError(f"no memdev {memdev_name}", f"known: {', '.join(d.name for d in devs)}")
        memdev = matches[0]
    if memdev.ram_size == 0:
        raise CxlError(f"{memdev.name} has no volatile (RAM) capacity", "use a volatile-memdev Type3 device")

    region = _region_of(memdev)
    with ExitStack() as undo:
        if region is None:
            region = _create_ram_region(memdev, undo)
        dax = _dax_of(region)
        if dax is None:
            raise CxlError(f"{region} has no dax device", "is dax_cxl loaded? (modprobe dax_cxl)")
        _bind_device_dax(dax)
        undo.pop_all()   # success: keep what we made
    return dax


def _create_ram_region(memdev: Memdev, undo: ExitStack) -> str:
    roots = root_decoders()
    if not roots:
        raise CxlError("no CXL root decoder (no CXL fixed memory window)", "is cxl_acpi loaded?")
    root = SYS_CXL / roots[0]
    endpoint = _endpoint_decoder(memdev)
    if int(_read(endpoint / "dpa_size"), 0) != 0:
        raise CxlError(f"{endpoint.name} is already in use (dpa_size {_read(endpoint / 'dpa_size')})",
                       "destroy the region that uses it (destroy_region) first")
    name = _read(root / "create_ram_region")
    _write(root / "create_ram_region", name)
    region = SYS_CXL / name
    undo.callback(_delete_region, root, name)
    _write(region / "interleave_granularity", _read(root / "interleave_granularity"))
    _write(region / "interleave_ways", 1)
    _write(endpoint / "mode", "ram")
    _write(endpoint / "dpa_size", memdev.ram_size)
    undo.callback(_release_dpa, endpoint)
    _write(region / "size", memdev.ram_size)
    _write(region / "target0", endpoint.name)
    _write(region / "commit", 1)
    undo.callback(_write, region / "commit", 0)
    driver = Path("/sys/bus/cxl/drivers/cxl_region")
    if not (region / "driver").exists():
        _write(driver / "bind", name)
    return name


def _release_dpa(endpoint: Path) -> None:
    try:
        _write(endpoint / "dpa_size", 0)
    except CxlError:
        pass


def _delete_region(root: Path, name: str) -> None:
    region = SYS_CXL / name
    try:
        if (region / "driver").exists():
            _write(Path("/sys/bus/cxl/drivers/cxl_region/unbind"), name)
        if (region / "commit").exists() and _read(region / "commit") == "1":
            _write(region / "commit", 0)
        if (region / "target0").exists() and _read(region / "target0"):
            _write(region / "target0", "")
        _write(root / "delete_region", name)
    except (CxlError, FileNotFoundError):
        pass


def destroy_region(region: str) -> None:
    """Tear down a region made by ``ensure_ram_devdax`` (dax unbound, decoders released)."""
    path = SYS_CXL / region
    target = _read(path / "target0") if (path / "target0").exists() else ""
    roots = root_decoders()
    _delete_region(SYS_CXL / roots[0], region)
    if target:
        _release_dpa(SYS_CXL / target)
