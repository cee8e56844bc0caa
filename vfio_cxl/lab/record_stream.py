"""The channel's record stream between two lab VMs, run from the host.

VM a produces GPU-placed records into shared CXL memory, VM b consumes them
(``python3 -m vfio_cxl.guest.cmd.stream`` in each, over SSH); ``stream`` runs
both sides at once and returns both sides' reports, or a ``LabError`` saying what
each side said.  ``demo share`` and ``bench share`` drive it.
"""

from __future__ import annotations

import json

from ..errors import LabError
from .lab import Lab

STREAM = "vfio-cxl-m vfio_cxl.guest.cmd.stream"
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
