"""vfio-cxl demo share: two hosts, one CXL memory, driven over SSH with fabric.

Boots ``shared``: VM "a" owns the GPU, VM "b" has none; both Type3 devices
are backed by one memory-backend-file.  Both bring their CXL region up as
devdax; the GPU in "a" DMAs "DMA FROM GPU TO CXL MEMORY" + payload into
shared CXL memory; "b" reads the same bytes -- no copy between hosts -- and
the host's backend file agrees.  Then "a" streams records to "b" through a
channel in the shared memory (vfio_cxl.guest.channel), the GPU placing each
payload, "b" learning of them by polling or over the private link.
"""

from __future__ import annotations

import argparse
import hashlib
import json

from ..guest.payload import expected_payload
from ..lab.lab import Lab
from ..lab.record_stream import latencies_ms, stream
from .dma import add_payload_options, payload_lab, run_in_lab


def seed_flow(lab: Lab, size: int, offset: int) -> dict:
    """A's GPU places the payload in the shared memory; b and the host's backend file read it back."""
    b = lab["b"]
    dax_b = json.loads(b.run("vfio-cxl-m vfio_cxl.guest.cmd.cxltool up").stdout)
    produced = run_in_lab(lab, size, offset, vm="a", backend="shared")
    consumed = json.loads(b.run(f"vfio-cxl-m vfio_cxl.guest.cmd.cxltool digest {dax_b['path']} {offset} {size}").stdout)
    expected = hashlib.sha256(expected_payload(size)).hexdigest()
    return {"a": produced, "b": consumed, "expected_sha256": expected,
            "a_match": produced["sha256_read"] == expected, "b_match": consumed["sha256"] == expected,
            "host_match": produced["host_file_match"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vfio-cxl demo share", description=__doc__)
    add_payload_options(parser, "shared")
    parser.add_argument("--records", type=int, default=200, help="records to stream A -> B (0: none)")
    args = parser.parse_args(argv)
    with payload_lab("shared", "a", args, "vfio-cxl demo share") as lab:
        r = seed_flow(lab, args.size, args.offset)
        print(f"[a] GPU DMA'd {r['a']['message']!r} + {args.size - len(r['a']['message'])} bytes into shared "
              f"CXL at {args.offset:#x} (doorbell→MSI-X {r['a']['dma_ms']:.2f} ms); checksum "
              f"{'MATCH' if r['a_match'] else 'MISMATCH'}")
        print(f"[b] read {r['b']['head']!r}… sha256 {r['b']['sha256'][:16]}…: "
              f"{'MATCH' if r['b_match'] else 'MISMATCH'} (no copy between hosts)")
        print(f"[host] backend file: {'MATCH' if r['host_match'] else 'MISMATCH'}")
        ok = r["a_match"] and r["b_match"] and r["host_match"]
        for notify in (False, True) if args.records else ():
            s = stream(lab, args.records, notify=notify, paced=True, max_size=16 << 10)
            b = s["b"]
            lat = sorted(latencies_ms(s))
            mode = "'record N ready' over the link" if notify else "polling shared memory"
            latency = (f"visibility latency median {lat[len(lat) // 2]:.2f} ms, p95 {lat[int(len(lat) * 0.95)]:.2f} ms"
                       if lat else "no visibility latency (no record seen)")
            print(f"[stream, {mode}] {len(b['delivered'])}/{args.records} records A→B, "
                  f"{len(b['bad_bytes'])} corrupt, {latency}")
            for side in s.values():   # a side that failed says why
                if side["error"]:
                    print(f"[stream, {mode}] {side['role']} in {side['vm']} failed: {side['error']}")
            ok = ok and len(b["delivered"]) == args.records and not b["bad_bytes"] and not b["error"] \
                and not s["a"]["error"]
    return 0 if ok else 1
