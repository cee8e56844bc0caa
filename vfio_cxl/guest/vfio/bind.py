"""Moving a PCI device to vfio-pci and back, and finding devices and their IOMMU group.

Binding uses ``driver_override`` + ``drivers_probe`` (the kernel's own way:
no new_id side effects on other devices with the same ids) and remembers the
driver it took the device from, so ``Binding.restore()`` can give it back.
Device discovery by PCI id reads sysfs (the kernel's ``vendor`` and ``device`` files, where udev's
``PCI_ID`` comes from): pyudev loads libudev through ctypes, ~0.4 s of a guest command's start
under TCG.  ``find_pci_devices_udev`` asks udev the same question.

The ``vfio-cxl gpu ls`` path imports nothing heavy from here: no dataclasses (whose import
of inspect costs ~0.2 s under TCG), no typing (~0.08 s), no subprocess.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from .errors import (INTEL_IOMMU_HINT, DeviceBoundElsewhereError, DriverBindError,
                     NoIommuGroupError)

VFIO_PCI = "vfio-pci"
_BDF = re.compile(r"^(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")


def normalize_bdf(bdf: str) -> str:
    """'01:00.0' or '0000:01:00.0' -> '0000:01:00.0'."""
    match = _BDF.match(bdf.strip().lower())
    if not match:
        raise ValueError(f"{bdf!r} is not a PCI address like 0000:01:00.0")
    domain, bus, dev, fn = match.groups()
    return f"{domain or '0000'}:{bus}:{dev}.{fn}"


class Sysfs:
    """The few sysfs files this module reads and writes, under ``root``.

    Tests pass a subclass over a fake tree; everything else uses /sys.
    """

    def __init__(self, root: Path | str = "/sys"):
        self.root = Path(root)

    def device_dir(self, bdf: str) -> Path:
        return self.root / "bus" / "pci" / "devices" / bdf

    def driver_dir(self, driver: str) -> Path:
        return self.root / "bus" / "pci" / "drivers" / driver

    def require_device(self, bdf: str) -> None:
        if not self.device_dir(bdf).exists():
            raise DriverBindError(f"there is no PCI device {bdf}", "check the address with lspci -D")

    def driver(self, bdf: str) -> str | None:
        link = self.device_dir(bdf) / "driver"
        return Path(link.readlink()).name if link.is_symlink() else None

    def driver_override(self, bdf: str) -> str | None:
        path = self.device_dir(bdf) / "driver_override"
        value = path.read_text().strip() if path.exists() else ""
        return None if value in ("", "(null)") else value

    def ids(self, bdf: str) -> tuple[int, int]:
        return (int((self.device_dir(bdf) / "vendor").read_text(), 16),
                int((self.device_dir(bdf) / "device").read_text(), 16))

    def iommu_group(self, bdf: str) -> int | None:
        link = self.device_dir(bdf) / "iommu_group"
        return int(Path(link.readlink()).name) if link.is_symlink() else None

    def iommu_groups_exist(self) -> bool:
        groups = self.root / "kernel" / "iommu_groups"
        return groups.is_dir() and any(groups.iterdir())

    def group_members(self, group: int) -> list[tuple[str, str | None]]:
        devices = self.root / "kernel" / "iommu_groups" / str(group) / "devices"
        names = sorted(p.name for p in devices.iterdir()) if devices.is_dir() else []
        return [(name, self.driver(name)) for name in names]

    def pci_devices(self) -> list[str]:
        devices = self.root / "bus" / "pci" / "devices"
        return sorted(p.name for p in devices.iterdir()) if devices.is_dir() else []

    def write(self, path: Path, text: str) -> None:
        """Write a sysfs attribute; the kernel's refusal comes back as OSError."""
        with open(path, "w") as attribute:
            attribute.write(text)


# -- IOMMU groups -----------------------------------------------------------------

def iommu_group(bdf: str, sysfs: Sysfs | None = None) -> int:
    """The IOMMU group number of a PCI device (from /sys/bus/pci/devices/BDF/iommu_group)."""
    sysfs = sysfs or Sysfs()
    bdf = normalize_bdf(bdf)
    sysfs.require_device(bdf)
    group = sysfs.iommu_group(bdf)
    if group is not None:
        return group
    if not sysfs.iommu_groups_exist():
        raise NoIommuGroupError(f"{bdf} has no IOMMU group: the kernel has no IOMMU groups at all "
                                "(the IOMMU is off)", INTEL_IOMMU_HINT)
    raise NoIommuGroupError(f"{bdf} has no IOMMU group (other devices have one)",
                            f"put the device behind the IOMMU; {INTEL_IOMMU_HINT}")


# -- binding ----------------------------------------------------------------------

def modprobe(module: str) -> None:
    try:
        import subprocess   # here: only a missing driver module costs its import
        result = subprocess.run(["modprobe", module], capture_output=True, text=True)
    except FileNotFoundError:
        raise DriverBindError(f"{module} is not loaded and there is no modprobe",
                              "install kmod, or load the module another way") from None
    if result.returncode != 0:
        raise DriverBindError(f"modprobe {module} failed: {result.stderr.strip()}",
                              "install the guest kernel's modules, or use a kernel with CONFIG_VFIO_PCI")


class Binding:
    """A device we moved to vfio-pci; ``restore()`` hands it back to ``previous_driver``."""

    def __init__(self, bdf: str, previous_driver: str | None, previous_override: str | None = None,
                 changed: bool = True, sysfs: Sysfs | None = None):
        self.bdf = bdf
        self.previous_driver = previous_driver
        self.previous_override = previous_override
        self.changed = changed   # False: it already was on vfio-pci, nothing to undo
        self.sysfs = sysfs if sysfs is not None else Sysfs()

    def __repr__(self) -> str:
        return (f"Binding({self.bdf!r}, previous_driver={self.previous_driver!r}, "
                f"previous_override={self.previous_override!r}, changed={self.changed!r})")

    def restore(self) -> None:
        """Unbind from vfio-pci and rebind the previous driver (no-op when already done)."""
        if not self.changed:
            return
        sysfs, bdf = self.sysfs, self.bdf
        if not sysfs.device_dir(bdf).exists():   # hot-removed: nothing is left to restore
            self.changed = False
            return
        try:
            if sysfs.driver(bdf) == VFIO_PCI:
                _write(sysfs, sysfs.driver_dir(VFIO_PCI) / "unbind", bdf, f"unbinding {bdf} from {VFIO_PCI}")
            _write(sysfs, sysfs.device_dir(bdf) / "driver_override", self.previous_override or "\n",
                   f"restoring driver_override of {bdf}")
        except DriverBindError:
            if sysfs.device_dir(bdf).exists():
                raise
            self.changed = False                 # removed while we restored it: nothing is left
            return
        self.changed = False
        if self.previous_driver is None:
            return  # it had no driver: leave it without one
        _write(sysfs, sysfs.root / "bus" / "pci" / "drivers_probe", bdf, f"re-probing {bdf}")
        now = sysfs.driver(bdf)
        if now != self.previous_driver:
            raise DriverBindError(f"{bdf} went back to {now or 'no driver'}, not {self.previous_driver}",
                                  f"bind it by hand: echo {bdf} > /sys/bus/pci/drivers/{self.previous_driver}/bind")


def bind_vfio_pci(bdf: str, *, sysfs: Sysfs | None = None,
                  load_module: Callable[[str], None] = modprobe) -> Binding:
    """Bind ``bdf`` to vfio-pci (loading the module if needed); returns what to restore."""
    sysfs = sysfs or Sysfs()
    bdf = normalize_bdf(bdf)
    sysfs.require_device(bdf)
    previous = sysfs.driver(bdf)
    if previous == VFIO_PCI:
        return Binding(bdf, None, sysfs.driver_override(bdf), changed=False, sysfs=sysfs)
    iommu_group(bdf, sysfs)  # vfio-pci refuses a device without a group: say why first
    if not sysfs.driver_dir(VFIO_PCI).is_dir():
        load_module(VFIO_PCI)
        if not sysfs.driver_dir(VFIO_PCI).is_dir():
            raise DriverBindError(f"modprobe {VFIO_PCI} succeeded but the driver did not register",
                                  "check dmesg")
    binding = Binding(bdf, previous, sysfs.driver_override(bdf), changed=True, sysfs=sysfs)
    try:
        _write(sysfs, sysfs.device_dir(bdf) / "driver_override", VFIO_PCI, f"setting driver_override of {bdf}")
        if previous is not None:
            _write(sysfs, sysfs.driver_dir(previous) / "unbind", bdf, f"unbinding {bdf} from {previous}")
        _write(sysfs, sysfs.root / "bus" / "pci" / "drivers_probe", bdf, f"probing {bdf}")
        now = sysfs.driver(bdf)
        if now != VFIO_PCI:
            raise DriverBindError(f"{bdf} did not bind to {VFIO_PCI} (its driver is now {now or 'none'})",
                                  f"check dmesg; vfio-pci needs an IOMMU group ({INTEL_IOMMU_HINT})")
    except BaseException as error:
        try:
            binding.restore()
        except DriverBindError as rollback:
            error.add_note(f"rolling back also failed: {rollback}")  # the first error stays the one raised
        raise
    return binding


def require_vfio_pci(bdf: str, sysfs: Sysfs | None = None) -> None:
    """Raise DeviceBoundElsewhereError unless ``bdf`` is bound to vfio-pci (or to no driver)."""
    sysfs = sysfs or Sysfs()
    bdf = normalize_bdf(bdf)
    sysfs.require_device(bdf)
    driver = sysfs.driver(bdf)
    if driver is None:
        raise DriverBindError(f"{bdf} is bound to no driver", f"bind it to {VFIO_PCI} first")
    if driver != VFIO_PCI:
        raise DeviceBoundElsewhereError(bdf, driver)


def _write(sysfs: Sysfs, path: Path, text: str, what: str) -> None:
    try:
        sysfs.write(path, text)
    except OSError as error:
        raise DriverBindError(f"{what} failed: {path}: {error.strerror}",
                              "run as root; check dmesg for the driver's reason") from None


# -- discovery --------------------------------------------------------------------

def find_pci_devices(vendor: int, device: int, sysfs: Sysfs | None = None) -> list[str]:
    """BDFs of the PCI devices with these ids, sorted (sysfs: see the module docstring)."""
    return find_pci_devices_sysfs(vendor, device, sysfs)   # Sysfs.pci_devices lists them sorted


def find_pci_devices_udev(vendor: int, device: int) -> list[str]:
    import pyudev  # ImportError (also raised when libudev cannot be loaded) -> caller falls back

    context = pyudev.Context()
    wanted = f"{vendor:04X}:{device:04X}"
    found = context.list_devices(subsystem="pci").match_property("PCI_ID", wanted)
    return sorted(dev.sys_name for dev in found)


def find_pci_devices_sysfs(vendor: int, device: int, sysfs: Sysfs | None = None) -> list[str]:
    sysfs = sysfs or Sysfs()
    return [bdf for bdf in sysfs.pci_devices() if sysfs.ids(bdf) == (vendor, device)]
