"""A bounded run of the chaos harness (``scripts/bench chaos``) as a fast test.

The harness starts the server through its CLI and misbehaves at it for a few
seconds with a fixed seed (so a failure replays); its invariants are listed in
vfio_cxl/bench/chaos.py.  Longer runs: ``scripts/bench chaos --seconds 600``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SECONDS = 6
SEED = 9


def test_chaos_run_breaks_no_invariant():
    """The server never dies, always accepts a fresh client, never writes outside a
    live DMA mapping, never completes a descriptor after a reset or halt was
    acknowledged, and follows the vfio-user rules the harness checks."""
    proc = subprocess.run([sys.executable, "-m", "vfio_cxl.bench", "chaos", "--seconds",
                           str(SECONDS), "--seed", str(SEED), "--json"],
                          capture_output=True, text=True, timeout=SECONDS + 12)
    assert proc.stdout, f"no output; stderr:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout)
    assert result["messages_sent"] > 100 and result["sessions"] >= 1, result
    kinds = result["violation_kinds"]
    if result["violations"]:
        pytest.fail(f"{len(result['violations'])} invariant violations; replay: "
                    f"{result['replay']}\n"
                    + "\n".join(f"  {n} x {k}" for k, n in sorted(kinds.items(),
                                                                 key=lambda kv: -kv[1])),
                    pytrace=False)
    assert proc.returncode == 0
