"""The guest half of `scripts/bench gpumem` reads its plan from stdin (``--plan -``: the guest's
SSH server refuses long command lines); a plan that is not JSON, or too long, is refused before
any GPU is touched, naming what was wrong."""

import subprocess
import sys

from vfio_cxl.guest.cmd.gpumem import PLAN_MAX


def plan(stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vfio_cxl.guest.cmd.gpumem", "--plan", "-"], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_a_plan_that_is_not_json_is_refused():
    out = plan("[{'kernel': 'stream'}]")
    assert out.returncode == 2 and "the plan is not JSON" in out.stderr, out.stderr


def test_a_plan_over_the_bound_is_refused():
    out = plan("[" + " " * PLAN_MAX + "]")
    assert out.returncode == 2 and f"the plan is over {PLAN_MAX} bytes" in out.stderr, out.stderr
