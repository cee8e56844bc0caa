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

from ..guest.cmd.demo_dma import expected_payload
from .dma import check_request
from ..lab import topology
from ..lab.kernel import add_kernel_options, resolve
from ..errors import LabError
from ..lab.lab import Lab


def seed_flow(lab: Lab, size: int, offset: int) -> dict:
    a, b = lab["a"], lab["b"]
    dax_b = json.loads(b.run("python3 -m vfio_cxl.guest.cmd.cxltool up").stdout)
    produced = json.loads(a.run(f"python3 -m vfio_cxl.guest.cmd.demo_dma --json --size {size} --offset {offset}",
                                timeout=300).stdout)
    consumed = json.loads(b.run(f"python3 -m vfio_cxl.guest.cmd.cxltool digest {dax_b['path']} {offset} {size}").stdout)
    host = hashlib.sha256(lab.read_backend("shared", offset, size)).hexdigest()
    expected = hashlib.sha256(expected_payload(size)).hexdigest()
    return {"a": produced, "b": consumed, "expected_sha256": expected,
            "a_match": produced["sha256_read"] == expected, "b_match": consumed["sha256"] == expected,
            "host_match": host == expected}


STREAM = "python3 -m vfio_cxl.guest.cmd.stream"
B_LINK_ADDRESS = "169.254.0.2"   # vfio_cxl.guest.cmd.netconfig: 169.254.<link>.<VM index>, link 0


def stream(lab: Lab, count: int, *, notify: bool = False, corrupt: tuple[int, ...] = (),
           ring_entries: int = 256, stall_until_full: bool = False, max_size: int = 64 << 10,
           paced: bool = False, timeout: float = 30, coherence: str = "coherent") -> dict:
    """Run the consumer in VM b and the producer in VM a at once; both sides' JSON.

    The producer waits for the consumer (clock echo, notification listener)
    itself, so the two may start in either order.  ``coherence``: "coherent"
    (the lab's memory is) or "x86" (real cache-line instructions; the host
    must have built ``vfio_cxl.guest.cacheline`` first)."""
    a, b = lab["a"], lab["b"]
    a.run(f"{STREAM} reset")
    common = f"--count {count} --max-size {max_size} --timeout {timeout} --coherence {coherence}"
    consumer_cmd = f"{STREAM} consume {common}" + (" --notify" if notify else "") + \
        (" --stall-until-full" if stall_until_full else "")
    producer_cmd = f"{STREAM} produce {common} --ring-entries {ring_entries} --peer {B_LINK_ADDRESS}" + \
        (" --notify" if notify else "") + (" --paced" if paced else "") + \
        (" --report-full" if stall_until_full else "") + \
        (" --corrupt " + ",".join(map(str, corrupt)) if corrupt else "")
    # The producer's run raising (no SSH, its deadline, Ctrl-C) cancels the consumer as the block is
    # left; whatever the producer's exit status, the consumer is joined: no side's report is lost.
    with b.start_command(consumer_cmd, timeout=timeout + 600) as consumer:
        producer = a.run(producer_cmd, timeout=timeout + 600, check=False)
        consumer_done = consumer.join(check=False)
    sides = {"a": side_report("a", "producer", producer), "b": side_report("b", "consumer", consumer_done)}
    if not all(side["reported"] for side in sides.values()):   # a side with no report of its own: say what each side said, not only the first
        raise LabError("the stream A→B failed: " + "; ".join(f"{side['role']} in {side['vm']}: "
                                                            f"{side['error'] or 'no error'}" for side in sides.values()),
                       "see each side's error above; under heavy load a side may wait longer than "
                       f"--timeout {timeout:g} s for the other")
    return sides


def what_failed(output: str) -> str:
    """The exception lines of a Python traceback in ``output`` (each chained one: the first is
    often the cause, the last what its clean-up broke), else its last three lines."""
    lines = output.strip().splitlines()
    raised = [line for line in lines if line[:1].strip() and not line.startswith(("Traceback ", "During handling"))
              and ": " in line]
    return " | ".join(raised if raised and len(raised) < len(lines) else lines[-3:]) or "(no output)"


def side_report(vm: str, role: str, result) -> dict:
    """One side's JSON report (``python3 -m vfio_cxl.guest.cmd.stream``: exit 0, or 3 with an
    ``error`` in it), or, if it printed none (a traceback, exit 1), its exit status and stderr
    as ``error``.  Either way the side's ``vm``, ``role``, ``error`` and ``reported`` (whether
    it printed a report) are in it."""
    try:
        report = json.loads(result.stdout)
        if not isinstance(report, dict):
            raise ValueError("not a JSON object")
        reported = True
    except ValueError:
        report, reported = {"error": f"exited {result.exited}: {what_failed(result.stderr or result.stdout)}"}, False
    return {**report, "vm": vm, "role": role, "error": report.get("error"), "reported": reported}


def latencies_ms(result: dict) -> list[float]:
    """GPU completion in a -> record visible in b, per record, on a's clock."""
    offset = result["a"]["clock"]["offset"]
    done = result["a"]["done_at"]
    return [(seen - offset - done[seq]) * 1e3
            for seq, seen in zip(result["b"]["delivered"], result["b"]["seen_at"])]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vfio-cxl demo share", description=__doc__)
    parser.add_argument("--size", type=lambda s: int(s, 0), default=1 << 20)
    parser.add_argument("--offset", type=lambda s: int(s, 0), default=0)
    parser.add_argument("--records", type=int, default=200, help="records to stream A -> B (0: none)")
    add_kernel_options(parser)
    args = parser.parse_args(argv)
    topo = topology.load("shared")
    check_request(topo, "a", args.size, args.offset)
    kernel = resolve(args.kernel, args.modules, args.append or "")
    with Lab(topo, kernel=kernel) as lab:
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
