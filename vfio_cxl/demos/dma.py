"""vfio-cxl demo dma: the GPU DMAs into CXL memory through VFIO, checked from the host too.

Boots ``single``; in the guest the GPU writes "DMA FROM GPU TO CXL MEMORY" +
payload from VRAM straight into /dev/dax (route B), the driver waits for the
MSI-X eventfd and verifies the bytes; then the host reads the same bytes from
the CXL memory backend file.
"""

from __future__ import annotations

import argparse
import hashlib
import json

from ..errors import LabError
from ..guest.payload import MESSAGE, expected_payload
from ..lab import topology
from ..lab.borrow import add_lab_option, asked_kernel, booted_or_borrowed
from ..lab.kernel import add_kernel_options, resolve
from ..lab.lab import Lab
from ..lab.topology import Topology, format_size

PAGE = 4096


def check_request(topo: Topology, vm_name: str, size: int, offset: int) -> None:
    """What can be checked before booting: the payload fits the GPU's VRAM and the
    devdax region the topology declares, at a page-aligned offset."""
    vm = topo.vm(vm_name)
    dax_size = next(vm.region_size(r, topo.backends) for r in vm.regions if r.type == "ram")
    vram = topo.gpus_of(vm_name)[0].vram
    if offset < 0 or offset % PAGE:
        raise LabError(f"--offset {offset} is not a multiple of 4096",
                       "the GPU DMAs into devdax at page granularity: use 0, 4096, 8192, ...")
    if size <= len(MESSAGE):
        raise LabError(f"--size {size} is too small: the payload starts with the {len(MESSAGE)}-byte "
                       f"message {MESSAGE.decode()!r}", f"use --size {len(MESSAGE) + 1} or more (default 1 MiB)")
    if size > vram:
        raise LabError(f"--size {size} is larger than the GPU's VRAM ({format_size(vram)})",
                       f"use --size {vram} or less")
    if offset + size > dax_size:
        raise LabError(f"--size {size} at --offset {offset} runs past the end of the "
                       f"{format_size(dax_size)} devdax region", f"keep offset + size <= {dax_size}")


def run_in_lab(lab: Lab, size: int, offset: int, vfio_backend: str | None = None, *,
               vm: str = "host0", backend: str = "cxl0") -> dict:
    """``vfio_backend``: type1, iommufd or auto (None: the guest's default, auto).  ``vm``: the
    VM with the GPU (single's host0); ``backend``: the memory backend of its RAM region."""
    machine = lab[vm]
    env = f"VFIO_CXL_VFIO_BACKEND={vfio_backend} " if vfio_backend else ""
    result = json.loads(machine.run(f"{env}vfio-cxl-m vfio_cxl.guest.cmd.demo_dma --json --size {size} --offset {offset}",
                               timeout=300).stdout)
    # The RAM region maps the memdev from DPA 0: devdax offset == backend file offset.
    host_bytes = lab.read_backend(backend, offset, size)
    result["host_file_match"] = hashlib.sha256(host_bytes).hexdigest() == hashlib.sha256(
        expected_payload(size)).hexdigest()
    return result


def add_payload_options(parser: argparse.ArgumentParser, topology_name: str) -> None:
    """--size and --offset of the payload, the guest kernel's options and --lab (demo dma, demo share)."""
    parser.add_argument("--size", type=lambda s: int(s, 0), default=1 << 20, help="bytes (default 1 MiB)")
    parser.add_argument("--offset", type=lambda s: int(s, 0), default=0, help="offset in devdax (4 KiB-aligned)")
    add_kernel_options(parser)
    add_lab_option(parser, topology_name)


def payload_lab(topology_name: str, vm: str, args: argparse.Namespace, command: str):
    """The lab a payload demo runs in (a Lab to boot, or the lab ``--lab`` borrows), once the
    payload of ``args`` is known to fit the GPU and the devdax region of ``vm``: checked before
    anything boots."""
    topo = topology.load(topology_name)
    check_request(topo, vm, args.size, args.offset)
    return booted_or_borrowed(args, topology_name,
                              lambda: Lab(topo, kernel=resolve(args.kernel, args.modules, args.append or "")),
                              command=command, kernel=asked_kernel(args.kernel))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vfio-cxl demo dma", description=__doc__)
    add_payload_options(parser, "single")
    parser.add_argument("--vfio-backend", choices=["auto", "type1", "iommufd"],
                        help="the guest's VFIO backend (default auto: iommufd if the kernel has it)")
    args = parser.parse_args(argv)
    with payload_lab("single", "host0", args, "vfio-cxl demo dma") as lab:
        r = run_in_lab(lab, args.size, args.offset, args.vfio_backend)
    print(f"GPU → CXL: {r['message']!r} + {r['size'] - len(r['message'])} bytes, "
          f"{r['bytes']} bytes into {r['dax']} ({r['region']}) at offset {r['offset']:#x}")
    print(f"guest checksum: {'MATCH' if r['match'] else 'MISMATCH'} (sha256 {r['sha256_read'][:16]}…); "
          f"host backend file: {'MATCH' if r['host_file_match'] else 'MISMATCH'}")
    print(f"timings: DMA map {r['map_ms']:.1f} ms, doorbell→MSI-X {r['dma_ms']:.2f} ms "
          f"({r['mb_per_s']:.0f} MB/s), device {r['device_us']:.0f} µs; VFIO backend {r['vfio_backend']}")
    return 0 if r["match"] and r["host_file_match"] else 1
