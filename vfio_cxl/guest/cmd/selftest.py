"""Guest side of ``vfio-cxl selftest vfio``: get the VM ready for the kernel's VFIO selftests.

    echo '{"devices": [{"name": "gpu0", "id": "0601:1991"}]}' | python3 -m vfio_cxl.guest.cmd.selftest prepare

binds each device to vfio-pci (the selftests open it through VFIO, by BDF), and
prepares what the tests use when it is there, saying what it got:

* shared anonymous memory backed by transparent huge pages
  (``shmem_enabled=always``): vfio_pci_driver_test DMA-maps a 1 GiB
  ``MAP_SHARED|MAP_ANONYMOUS`` region; in 2 MiB pages the vIOMMU maps it in
  512 pieces, which QEMU forwards to a vfio-user device as 512 DMA_MAPs
  instead of 262144 (above the 65535 mappings a vfio-user server takes);
* one 2 MiB and one 1 GiB HugeTLB page for vfio_dma_mapping_test's hugetlb
  variants (they skip when the pages are not there);
* vfio-pci's ``enable_sriov`` (vfio_pci_sriov_uapi_test creates a VF of a PF
  bound to vfio-pci).

Prints one JSON object: the kernel release, whether IOMMUFD is there, and per
device its BDF, IOMMU group and SR-IOV VF count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from ...errors import LabError
from ..vfio import bind_vfio_pci, find_pci_devices, iommu_group
from ..vfio.errors import VfioError

THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
HUGEPAGES = {"2M": Path("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"),
             "1G": Path("/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages")}
ENABLE_SRIOV = Path("/sys/module/vfio_pci/parameters/enable_sriov")


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def prepare(devices: list[dict]) -> dict:
    found: dict[str, dict] = {}
    by_id: dict[str, list[str]] = {}
    for dev in devices:
        vendor, device = (int(x, 16) for x in dev["id"].split(":"))
        bdfs = by_id.setdefault(dev["id"], sorted(find_pci_devices(vendor, device)))
        if not bdfs:
            raise LabError(f"no PCI device {dev['id']} ({dev['name']}) in this VM",
                           "check the topology: lspci -nn lists what the guest sees")
        bdf = bdfs.pop(0)   # devices of one id in declaration order = BDF order
        bind_vfio_pci(bdf)
        totalvfs = _read(Path(f"/sys/bus/pci/devices/{bdf}/sriov_totalvfs"), "0")
        found[dev["name"]] = {"bdf": bdf, "id": dev["id"], "group": iommu_group(bdf),
                              "sriov_totalvfs": int(totalvfs or 0)}
    if any(d["sriov_totalvfs"] for d in found.values()):
        _write(ENABLE_SRIOV, "Y")
    thp = _write(THP_SHMEM, "always") and "[always]" in _read(THP_SHMEM)
    # A 1 GiB page needs 1 GiB of contiguous free memory: free the page cache and compact first.
    _write(Path("/proc/sys/vm/drop_caches"), "3")
    _write(Path("/proc/sys/vm/compact_memory"), "1")
    pages = {}
    for size, path in HUGEPAGES.items():
        if path.exists():
            _write(path, "1")
            pages[size] = int(_read(path, "0") or 0)
        else:
            pages[size] = 0
    return {"kernel": platform.release(), "iommufd": os.path.exists("/dev/iommu"),
            "vfio_cdev": os.path.isdir("/dev/vfio/devices"), "devices": found,
            "shmem_thp": thp, "hugepages": pages,
            "enable_sriov": _read(ENABLE_SRIOV) in ("Y", "1")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vfio_cxl.guest.cmd.selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="bind the devices (JSON on stdin) to vfio-pci; print what the VM has")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            print(json.dumps(prepare(json.load(sys.stdin)["devices"])))
    except (LabError, VfioError) as err:
        print(f"vfio_cxl.guest.cmd.selftest: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
