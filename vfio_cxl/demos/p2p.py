"""vfio-cxl demo p2p: one GPU's engine writes straight into another GPU's VRAM through the IOMMU.

Boots ``p2p`` (one VM: gpu0 and gpu1 behind one PCIe switch, gpu2 on a root
port of its own).  In the guest the GPUs join one VFIO container, each BAR2
(VRAM) mmap is DMA-mapped for the others, A copies VRAM_A -> IOVA(B's BAR2)
(behind the switch) and A -> C (through the root complex), and back; every
byte is checked through both BAR mmaps.  Then the figures of `scripts/bench p2p`
for one size.

    vfio-cxl demo p2p [--size 16M] [--kernel PATH|lab] [--lab NAME]
"""

from __future__ import annotations

import argparse
import json

from ..lab import topology
from ..lab.borrow import add_lab_option, asked_kernel, booted_or_borrowed
from ..lab.kernel import add_kernel_options, resolve
from ..lab.lab import Lab
from ..lab.memcpy_reference import Memcpy, host_memcpy


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vfio-cxl demo p2p", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=lambda text: topology.parse_size(text, "--size"), default=16 << 20,
                        help="bytes: 16M, 4M, 65536 ... (default 16M)")
    add_kernel_options(parser)
    add_lab_option(parser, "p2p")
    args = parser.parse_args(argv)

    def boot():
        print("booting p2p (two GPUs behind one PCIe switch, a third on its own root port) ...")
        return Lab(topology.load("p2p"), kernel=resolve(args.kernel, args.modules, args.append or ""))

    with booted_or_borrowed(args, "p2p", boot, command="vfio-cxl demo p2p", kernel=asked_kernel(args.kernel)) as lab:
        vm = lab["host0"]
        print(vm.run(f"vfio-cxl-m vfio_cxl.guest.cmd.p2p --size {args.size}", timeout=600).stdout, end="")
        figures = json.loads(vm.run(f"vfio-cxl-m vfio_cxl.guest.cmd.p2p --bench --size {args.size}",
                                    timeout=900).stdout)
        memcpy = host_memcpy(args.size)
    print(report(args.size, figures, memcpy), end="")
    return 0 if all(r["match"] for r in figures.values() if isinstance(r, dict) and "match" in r) else 1


def report(size: int, figures: dict, memcpy: Memcpy) -> str:
    """The demo's table: the guest's ``--bench`` figures beside the host memcpy reference
    (cold: bytes in no cache, what a device's DMA meets; hot: the same buffers every run)."""
    rows = [(f"P2P A->{'B' if r['route']['kind'] == 'switch' else 'C'}, peer fast path", r)
            for k, r in figures.items() if k.startswith("p2p_fast")]
    rows += [("P2P A->B, message path", figures["p2p_message"]), ("bounce A->guest RAM->B", figures["bounce"]),
             ("CPU copy BAR2 -> BAR2", figures["cpu_copy"])]
    lines = [f"\nfigures ({size >> 20} MiB, TCG):"]
    for name, r in rows:
        lines.append(f"  {name:28} {r['mb_per_s']:>8.0f} MB/s  {'ok' if r['match'] else 'MISMATCH'}  "
                     f"({r['path']}; {r['route']['path']})")
    lines.append(f"  {'host memcpy, cold (reference)':28} {memcpy.cold_mb_s:>8.0f} MB/s  "
                 f"(bytes in no cache; median of {memcpy.runs})")
    lines.append(f"  {'host memcpy, hot':28} {memcpy.hot_mb_s:>8.0f} MB/s  (the same two buffers every run)")
    return "\n".join(lines) + "\n"
