"""vfio-cxl demo share: two hosts, one CXL memory, driven over SSH with fabric.

Boots ``shared``: VM "a" owns the GPU, VM "b" has none; both Type3 devices
are backed by one memory-backend-file.  Both bring their CXL region up as
devdax; the GPU in "a" DMAs "DMA FROM GPU TO CXL MEMORY" + payload into
shared CXL memory; "b" reads the same bytes -- no copy between hosts -- and
the host's backend file agrees.
"""

from __future__ import annotations

import argparse
import hashlib
import json

from ..guest.demo_dma import expected_payload
from ..lab import topology
from ..lab.lab import Lab


def seed_flow(lab: Lab, size: int, offset: int) -> dict:
    a, b = lab["a"], lab["b"]
    dax_b = json.loads(b.run("python3 -m vfio_cxl.guest.cxltool up").stdout)
    produced = json.loads(a.run(f"python3 -m vfio_cxl.guest.demo_dma --json --size {size} --offset {offset}",
                                timeout=300).stdout)
    consumed = json.loads(b.run(f"python3 -m vfio_cxl.guest.cxltool digest {dax_b['path']} {offset} {size}").stdout)
    with open(lab.backend_file("shared"), "rb") as f:
        f.seek(offset)
        host = hashlib.sha256(f.read(size)).hexdigest()
    expected = hashlib.sha256(expected_payload(size)).hexdigest()
    return {"a": produced, "b": consumed, "expected_sha256": expected,
            "a_match": produced["sha256_read"] == expected, "b_match": consumed["sha256"] == expected,
            "host_match": host == expected}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vfio-cxl demo share", description=__doc__)
    parser.add_argument("--size", type=lambda s: int(s, 0), default=1 << 20)
    parser.add_argument("--offset", type=lambda s: int(s, 0), default=0)
    args = parser.parse_args(argv)
    with Lab(topology.load("shared")) as lab:
        r = seed_flow(lab, args.size, args.offset)
    print(f"[a] GPU DMA'd {r['a']['message']!r} + {args.size - len(r['a']['message'])} bytes into shared CXL "
          f"at {args.offset:#x} (doorbell→MSI-X {r['a']['dma_ms']:.2f} ms); checksum "
          f"{'MATCH' if r['a_match'] else 'MISMATCH'}")
    print(f"[b] read {r['b']['head']!r}… sha256 {r['b']['sha256'][:16]}…: {'MATCH' if r['b_match'] else 'MISMATCH'}"
          " (no copy between hosts)")
    print(f"[host] backend file: {'MATCH' if r['host_match'] else 'MISMATCH'}")
    return 0 if r["a_match"] and r["b_match"] and r["host_match"] else 1
