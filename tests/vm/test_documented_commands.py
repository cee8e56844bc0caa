"""Every command README.md and docs/*.md show that needs a booted lab, run as a user types it:
`bash -c COMMAND` with the checkout's venv first on PATH, `scripts/...` from the repo root,
checking the exit status and the lines the docs show under it.  Which commands, and how each is
run (as is, with its smallest arguments, or why not), comes from tests/documented_commands.py,
which reads the docs (tests/fast/test_documented_commands.py fails on a documented command
without an entry there).

The docs' two console sessions (a detached `shared` lab in docs/fabric-manager.md; moving GPUs
on `fabric` in the README) are replayed step by step in the order the docs show them, each on
one boot.  Each command's exit
status and time are printed (pytest -s or -rA shows them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

import documented_commands as docs
from documented_commands import CASES, Case
from vfio_cxl.errors import LabError
from vfio_cxl.lab.borrow import LAB_ENV
from vfio_cxl.lab.fm import registry
from vfio_cxl.lab.kernel import lab_kernel

SHOWN = docs.documented()
TIMES: list[tuple[str, int | None, float]] = []


@pytest.fixture(scope="module", autouse=True)
def times_report():
    """After the module: each command run, its exit status and time (pytest -s or -rA shows it)."""
    yield
    total = sum(seconds for _, _, seconds in TIMES)
    for line, code, seconds in TIMES:
        print(f"{seconds:7.1f} s  exit {code}  $ {line}")
    print(f"{len(TIMES)} documented commands in {total:.0f} s")


@pytest.fixture
def quiet_host(labs, kept_detached):
    """One lab at a time on two cores: the pool's lab and any detached lab another test kept are
    stopped first (the commands here boot their own, as a user's would).  Whatever a command of
    this test left running is brought down after it."""
    labs.close()
    for name, lab in list(kept_detached.items()):
        if any(r.name == lab.name for r in registry.records()):
            lab.down()
        del kept_detached[name]
    before = {r.name for r in registry.records()}
    yield
    for record in registry.records():
        if record.name not in before:
            docs.run(f"vfio-cxl vm down {record.name}", Case(timeout=300), docs.ROOT)


def session(first: str) -> list[docs.Shown]:
    """The commands of the console block (README.md or docs/*.md) that starts with ``first``, in order."""
    start = next(s for s in SHOWN if s.command == first and s.block)
    return [s for s in SHOWN if s.block == start.block]


def run_checked(command: str, tmp_path, *, line: str | None = None, shown=(), stdin: str | None = None,
                env: dict | None = None) -> docs.Ran:
    case = CASES[command]
    line = line or case.run or command
    ran = docs.run(line, case, docs.cwd_for(line, tmp_path), stdin=stdin, env=env)
    TIMES.append((line, ran.returncode, ran.seconds))
    print(f"{ran.seconds:7.1f} s  exit {ran.returncode}  $ {line}", flush=True)
    docs.check(ran, case, list(shown))
    return ran


def fm_status_json(tmp_path) -> dict:
    ran = docs.run("vfio-cxl fm status --json", Case(), tmp_path)
    assert ran.returncode == 0, ran.describe()
    return json.loads(ran.stdout)


def test_the_demo_script_runs_the_three_demos(quiet_host, tmp_path):
    """`./scripts/demo`: provision (cached), then `vfio-cxl demo tour`, `demo dma`, `demo share`
    exactly as the README lists them; the DMA demo's lines as the README shows them."""
    ran = run_checked(docs.SCRIPT_DEMO, tmp_path)
    for header in ("== demo tour", "== demo dma", "== demo share"):
        assert any(line.startswith(header) for line in ran.lines), ran.describe()


@pytest.mark.parametrize("command", ["scripts/boot-vm", "scripts/boot-shared"])
def test_boot_scripts_run_until_ctrl_c(quiet_host, tmp_path, command):
    """Boot, print the SSH commands and "lab running; Ctrl-C stops it"; Ctrl-C stops the lab."""
    ran = run_checked(command, tmp_path)
    assert any(re.match(r"^\w+: ssh -p \d+ ", line) for line in ran.lines), ran.describe()


def test_detached_shared_session_as_documented(quiet_host, tmp_path):
    """docs/fabric-manager.md "A detached lab, as a user types it": `vm up shared --detach`,
    `vm ls`, `fm status`, `vm ssh a -- ...demo_dma`, a shell in b, then -- as the page's comment
    says -- kill -9 of the GPU server and of b's QEMU, `fm events --follow`, `vm ls` (degraded),
    `vm down`."""
    for step in session("vfio-cxl vm up shared --detach"):
        stdin = None
        if step.command == "vfio-cxl vm ssh b":
            stdin = "echo shell-in-b $(cat /proc/sys/kernel/hostname)\nexit\n"
        if step.command == "vfio-cxl fm events --follow":
            status = fm_status_json(tmp_path)
            os.kill(status["gpus"]["gpu0"]["server_pid"], signal.SIGKILL)
            os.kill(status["vms"]["b"]["qemu_pid"], signal.SIGKILL)
        ran = run_checked(step.command, tmp_path, shown=step.output, stdin=stdin)
        if stdin:
            assert "shell-in-b" in ran.stdout, ran.describe()


def test_fabric_session_as_the_readme_shows_it(quiet_host, tmp_path):
    """README "Fabric manager: labs that stay up, and GPUs that move": `vm up fabric --detach`,
    `gpu ls` and `gpu dma` in a, `fm assign gpu0 b`, `gpu ls` in b, back with --keep-vram,
    `fm release`, `fm status`, `fm restart`, `vm down`; plus `vfio-cxl gpu holders --gpu BDF` in a (docs/fabric-manager.md)."""
    for step in session("vfio-cxl vm up fabric --detach"):
        ran = run_checked(step.command, tmp_path, shown=step.output)
        if step.command == "vfio-cxl vm ssh a -- vfio-cxl gpu ls":
            bdf = ran.stdout.split()[0]
            holders = CASES["vfio-cxl gpu holders --gpu BDF"]
            run_checked("vfio-cxl gpu holders --gpu BDF", tmp_path, line=holders.run.format(bdf=bdf))
        if step.command == "vfio-cxl vm ssh b -- vfio-cxl gpu ls":
            assert len(ran.stdout.splitlines()) == 2, ran.describe()   # gpu1 and the new gpu0
        if step.command == "vfio-cxl fm release gpu0":
            assert fm_status_json(tmp_path)["gpus"]["gpu0"]["state"] == "free"


# Each borrows the session's detached lab of its topology through the plugin's ``lab`` fixture:
# the session orders them with the plugin's other tests of that topology (tests/vm/conftest.py),
# so that lab boots once for all of them.
BORROWED = [pytest.param(command, marks=pytest.mark.lab(case.borrows[0], kernel=case.borrows[1]))
            for command, case in sorted(CASES.items()) if case.group == "borrowed" and not case.skip]


@pytest.mark.parametrize("command", BORROWED)
def test_in_the_sessions_lab(lab, tmp_path, command):
    """A demo, bench or selftest typed as the docs show it, with $VFIO_CXL_LAB naming the session's
    running detached lab of its topology: the command runs there and leaves it up, as healthy as
    it found it."""
    line = (CASES[command].run or command).replace("{lab}", lab.name)
    run_checked(command, tmp_path, line=line, env={LAB_ENV: lab.name})
    assert lab.healthy(), f"{command} left lab {lab.name} unfit for the next test: {lab.status()}"


BENCHES = sorted(command for command, case in CASES.items() if case.group == "bench" and not case.skip)


@pytest.mark.parametrize("command", BENCHES)
def test_bench_with_its_smallest_arguments(quiet_host, tmp_path, command):
    run_checked(command, tmp_path)


LAB_KERNEL_RUNS = sorted(command for command, case in CASES.items() if case.group == "lab-kernel")


@pytest.mark.parametrize("command", LAB_KERNEL_RUNS)
def test_lab_kernel_commands(quiet_host, tmp_path, command):
    """Run when the lab kernel is cached (the suite does not build it unasked: README)."""
    try:
        lab_kernel(provision=False)
    except LabError:
        pytest.skip(CASES[command].skip)
    run_checked(command, tmp_path, line=CASES[command].run or command)
