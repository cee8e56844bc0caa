"""Binding to vfio-pci and back, IOMMU groups, device discovery.

FAKE KERNEL: ``FakeSysfs`` builds a sysfs tree in tmp_path and makes writes
to driver_override / unbind / drivers_probe act like the kernel's.  The
discovery tests at the end read the host's real /sys through pyudev.
"""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vfio_cxl.guest.vfio.bind import (Sysfs, bind_vfio_pci, find_pci_devices, find_pci_devices_sysfs,
                                      find_pci_devices_udev, iommu_group, normalize_bdf, require_vfio_pci)
from vfio_cxl.guest.vfio.errors import DeviceBoundElsewhereError, DriverBindError, NoIommuGroupError

GPU = "0000:01:00.0"


class FakeSysfs(Sysfs):
    """A sysfs tree whose attribute writes behave like the kernel's (unit tests only)."""

    def __init__(self, root: Path, drivers=("vfio-pci", "nvme", "e1000e")):
        super().__init__(root)
        self.pci = root / "bus" / "pci"
        (self.pci / "devices").mkdir(parents=True)
        (root / "kernel" / "iommu_groups").mkdir(parents=True)
        for name in drivers:
            self.add_driver(name)
        self.native = {}  # bdf -> the driver that claims it when no override is set
        self.refuse = {}  # attribute name -> errno the "kernel" answers writes with
        self.refusing = set()  # drivers whose probe turns the device down
        self.writes = []

    def add_driver(self, name):
        (self.pci / "drivers" / name).mkdir(parents=True, exist_ok=True)

    def add_device(self, bdf, ids=(0x1B36, 0x0010), driver=None, group=None):
        dev = self.pci / "devices" / bdf
        dev.mkdir()
        (dev / "vendor").write_text(f"{ids[0]:#06x}\n")
        (dev / "device").write_text(f"{ids[1]:#06x}\n")
        (dev / "driver_override").write_text("(null)\n")
        if group is not None:
            group_dir = self.root / "kernel" / "iommu_groups" / str(group)
            (group_dir / "devices").mkdir(parents=True, exist_ok=True)
            (group_dir / "devices" / bdf).symlink_to(dev)
            (dev / "iommu_group").symlink_to(group_dir)
        if driver:
            self.native[bdf] = driver
            self._bind(bdf, driver)

    def _bind(self, bdf, driver):
        (self.pci / "devices" / bdf / "driver").symlink_to(self.pci / "drivers" / driver)

    def write(self, path, text):
        self.writes.append((str(path.relative_to(self.root)), text))
        if path.name in self.refuse:
            raise OSError(self.refuse[path.name], os.strerror(self.refuse[path.name]))
        if path.name == "driver_override":
            path.write_text((text.strip() or "(null)") + "\n")
        elif path.name == "unbind":
            (self.pci / "devices" / text / "driver").unlink()
        elif path.name == "drivers_probe":
            if self.driver(text) is None:
                target = self.driver_override(text) or self.native.get(text)
                if target and (self.pci / "drivers" / target).is_dir() and target not in self.refusing:
                    self._bind(text, target)
        else:
            raise AssertionError(f"unexpected sysfs write to {path}")


@pytest.fixture
def sysfs(tmp_path):
    fake = FakeSysfs(tmp_path / "sys")
    fake.add_device(GPU, driver="nvme", group=5)
    return fake


def test_bind_moves_the_device_and_restore_gives_it_back(sysfs):
    binding = bind_vfio_pci("01:00.0", sysfs=sysfs)
    assert sysfs.driver(GPU) == "vfio-pci"
    assert (binding.bdf, binding.previous_driver) == (GPU, "nvme")
    assert sysfs.writes == [
        (f"bus/pci/devices/{GPU}/driver_override", "vfio-pci"),
        ("bus/pci/drivers/nvme/unbind", GPU),
        ("bus/pci/drivers_probe", GPU),
    ]
    binding.restore()
    assert sysfs.driver(GPU) == "nvme"
    assert sysfs.driver_override(GPU) is None
    writes = len(sysfs.writes)
    binding.restore()  # idempotent
    assert len(sysfs.writes) == writes


def test_restore_after_hot_removal_has_nothing_to_give_back(sysfs):
    import shutil

    binding = bind_vfio_pci(GPU, sysfs=sysfs)
    writes = len(sysfs.writes)
    shutil.rmtree(sysfs.pci / "devices" / GPU)        # the kernel removed the device
    binding.restore()                                 # no error, no write to a directory that is gone
    assert len(sysfs.writes) == writes and not binding.changed


def test_restore_while_the_kernel_removes_the_device_has_nothing_to_give_back(sysfs):
    """The device is still there when restore() looks, and gone by its write (a hot-removal
    finishing once the driver closed it): nothing to give back, not an error."""
    import shutil

    binding = bind_vfio_pci(GPU, sysfs=sysfs)
    real_write = sysfs.write

    def removed_first(path, text):
        shutil.rmtree(sysfs.pci / "devices" / GPU, ignore_errors=True)   # the kernel got there first
        if not path.parent.exists():
            raise FileNotFoundError(2, "No such file or directory")
        real_write(path, text)

    sysfs.write = removed_first
    binding.restore()
    assert not binding.changed


def test_a_restore_write_refused_for_a_device_still_there_is_an_error(sysfs):
    binding = bind_vfio_pci(GPU, sysfs=sysfs)
    sysfs.refuse["driver_override"] = errno.EACCES
    with pytest.raises(DriverBindError, match="restoring driver_override"):
        binding.restore()


def test_device_already_on_vfio_pci_is_left_alone(tmp_path):
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.add_device(GPU, driver="vfio-pci", group=5)
    binding = bind_vfio_pci(GPU, sysfs=sysfs)
    binding.restore()
    assert sysfs.writes == []
    assert sysfs.driver(GPU) == "vfio-pci"


def test_device_without_driver_is_left_without_one_on_restore(tmp_path):
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.add_device(GPU, group=5)
    sysfs.native[GPU] = "e1000e"  # would claim it on a probe
    binding = bind_vfio_pci(GPU, sysfs=sysfs)
    assert sysfs.driver(GPU) == "vfio-pci" and binding.previous_driver is None
    binding.restore()
    assert sysfs.driver(GPU) is None
    assert sysfs.writes[-1] == (f"bus/pci/devices/{GPU}/driver_override", "\n")


def test_vfio_pci_module_is_loaded_when_missing(tmp_path):
    sysfs = FakeSysfs(tmp_path / "sys", drivers=("nvme",))
    sysfs.add_device(GPU, driver="nvme", group=5)
    loaded = []

    def load(module):
        loaded.append(module)
        sysfs.add_driver("vfio-pci")

    bind_vfio_pci(GPU, sysfs=sysfs, load_module=load)
    assert loaded == ["vfio-pci"]
    assert sysfs.driver(GPU) == "vfio-pci"


def test_module_that_does_not_register_is_an_error(tmp_path):
    sysfs = FakeSysfs(tmp_path / "sys", drivers=("nvme",))
    sysfs.add_device(GPU, driver="nvme", group=5)
    with pytest.raises(DriverBindError, match="did not register"):
        bind_vfio_pci(GPU, sysfs=sysfs, load_module=lambda module: None)
    assert sysfs.driver(GPU) == "nvme" and sysfs.writes == []


def test_iommu_off_says_intel_iommu_on_and_touches_nothing(tmp_path):
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.add_device(GPU, driver="nvme")  # no group anywhere
    with pytest.raises(NoIommuGroupError, match="no IOMMU groups at all") as raised:
        bind_vfio_pci(GPU, sysfs=sysfs)
    assert "intel_iommu=on" in raised.value.fix
    assert sysfs.writes == [] and sysfs.driver(GPU) == "nvme"


def test_device_outside_any_group_while_others_have_one(sysfs):
    sysfs.add_device("0000:02:00.0", driver="e1000e")
    with pytest.raises(NoIommuGroupError, match="0000:02:00.0 has no IOMMU group .other devices have one."):
        iommu_group("0000:02:00.0", sysfs)
    assert iommu_group(GPU, sysfs) == 5


def test_failed_probe_is_rolled_back_and_a_failed_rollback_is_noted(sysfs):
    sysfs.refuse["drivers_probe"] = errno.ENODEV
    with pytest.raises(DriverBindError, match="probing 0000:01:00.0 failed.*No such device") as raised:
        bind_vfio_pci(GPU, sysfs=sysfs)
    assert sysfs.driver_override(GPU) is None  # rolled back as far as the kernel let us
    assert any("rolling back also failed: re-probing" in note for note in raised.value.__notes__)


def test_vfio_pci_refusing_the_device_is_rolled_back(sysfs):
    sysfs.refusing.add("vfio-pci")
    with pytest.raises(DriverBindError, match="did not bind to vfio-pci .its driver is now none.") as raised:
        bind_vfio_pci(GPU, sysfs=sysfs)
    assert "intel_iommu=on" in raised.value.fix
    assert sysfs.driver(GPU) == "nvme"
    assert sysfs.driver_override(GPU) is None


def test_unbind_refused_is_reported_with_its_path_and_rolled_back(sysfs):
    sysfs.refuse["unbind"] = errno.EBUSY
    with pytest.raises(DriverBindError, match="unbinding 0000:01:00.0 from nvme failed") as raised:
        bind_vfio_pci(GPU, sysfs=sysfs)
    assert "drivers/nvme/unbind" in str(raised.value)
    assert sysfs.driver(GPU) == "nvme"
    assert sysfs.driver_override(GPU) is None


def test_require_vfio_pci_names_the_other_driver(sysfs):
    with pytest.raises(DeviceBoundElsewhereError, match="bound to nvme, not vfio-pci") as raised:
        require_vfio_pci(GPU, sysfs)
    assert "bind=True" in raised.value.fix


def test_missing_device_is_named(sysfs):
    with pytest.raises(DriverBindError, match="there is no PCI device 0000:09:00.0"):
        bind_vfio_pci("0000:09:00.0", sysfs=sysfs)


def test_group_members_list_devices_and_drivers(sysfs):
    sysfs.add_device("0000:01:00.1", driver="e1000e", group=5)
    assert sysfs.group_members(5) == [(GPU, "nvme"), ("0000:01:00.1", "e1000e")]


@pytest.mark.parametrize("text, bdf", [("01:00.0", GPU), ("0000:01:00.0", GPU), (" 0001:AB:1f.7 ", "0001:ab:1f.7")])
def test_normalize_bdf(text, bdf):
    assert normalize_bdf(text) == bdf


@pytest.mark.parametrize("text", ["1:00.0", "0000:01:00.8", "01:00", "gpu"])
def test_normalize_bdf_refuses_nonsense(text):
    with pytest.raises(ValueError, match="not a PCI address"):
        normalize_bdf(text)


def test_sysfs_discovery_by_ids(sysfs):
    sysfs.add_device("0000:02:00.0", ids=(0x8086, 0x10D3), driver="e1000e")
    assert find_pci_devices_sysfs(0x1B36, 0x0010, sysfs) == [GPU]
    assert find_pci_devices_sysfs(0x8086, 0x10D3, sysfs) == ["0000:02:00.0"]
    assert find_pci_devices_sysfs(0xFFFF, 0xFFFF, sysfs) == []


# -- discovery on the host's real PCI devices (no fake) ------------------------------

def host_id_pairs():
    real = Sysfs()
    return sorted({real.ids(bdf) for bdf in real.pci_devices()})


@pytest.mark.skipif(not host_id_pairs(), reason="this host shows no PCI devices in /sys")
def test_pyudev_finds_the_same_devices_as_sysfs():
    for vendor, device in host_id_pairs():
        found = find_pci_devices_udev(vendor, device)
        assert found, f"pyudev found no {vendor:04x}:{device:04x}"
        assert found == find_pci_devices_sysfs(vendor, device)


@pytest.mark.skipif(not host_id_pairs(), reason="this host shows no PCI devices in /sys")
def test_discovery_reads_sysfs_and_loads_no_pyudev():
    """find_pci_devices answers as udev does, without loading pyudev (libudev through ctypes:
    ~0.4 s of a guest command's start under TCG)."""
    vendor, device = host_id_pairs()[0]
    probe = ("import sys; from vfio_cxl.guest.vfio.bind import find_pci_devices; "
             f"print(find_pci_devices({vendor}, {device})); print(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('pyudev', 'dataclasses', 'inspect', 'typing', 'subprocess')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    found, loaded = out.splitlines()
    assert found == str(find_pci_devices_udev(vendor, device))
    assert loaded == "[]"
