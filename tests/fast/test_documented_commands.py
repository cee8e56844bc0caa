"""Every command README.md and docs/*.md show has a test: the list comes from the docs themselves
(tests/documented_commands.py parses them), and the ones that need no VM run here, as a user
types them (bash, the checkout's venv on PATH), checking the exit status and the lines the
docs show.  The VM ones run in tests/vm/test_documented_commands.py."""

from __future__ import annotations

import re
import signal

import pytest

import documented_commands as docs
from documented_commands import CASES, Case

SHOWN = docs.documented()
FAST = sorted(command for command, case in CASES.items() if case.group == "fast" and not case.skip)


def test_every_documented_command_has_a_test():
    missing = [f"command {s.command!r} shown in {s.where} has no test: add it to CASES in "
               "tests/documented_commands.py (run as is, with its smallest arguments, or skipped with "
               "the reason)" for s in SHOWN if s.command not in CASES]
    assert not missing, "\n".join(missing)


def test_every_case_is_still_documented():
    shown = {s.command for s in SHOWN}
    stale = [command for command in CASES if command not in shown]
    assert not stale, f"in CASES but no longer in README.md or docs/*.md: {stale}"


def test_each_case_says_how_it_runs():
    for command, case in CASES.items():
        assert sum(x is not None for x in (case.same, case.skip)) <= 1, command
        if case.same:
            target = CASES[case.same]
            assert target.skip is None and target.same is None, f"{command}: covered by {case.same!r}, which does not run"
        if case.skip is None and case.same is None:
            # "matrix": the matrix example, run as typed by tests/vm/test_matrix.py; "nic": the NIC's
            # guest commands, run as typed on nic2 by tests/vm/test_nic.py
            assert case.group in ("fast", "demo", "p2p", "boot", "detached", "fabric", "selftest", "bench",
                                  "lab-kernel", "matrix", "nic", "borrowed"), (command, case.group)
            assert (case.group == "borrowed") == (case.borrows is not None), command


def test_the_parser_reads_blocks_spans_and_console_output(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "Run `vfio-cxl vm topologies` or `scripts/bench boot\n--runs 1` (a wrapped span).\n"
        "```sh\n./scripts/demo      # a comment\n# only a comment\n```\n"
        "```console\n$ vfio-cxl vm ls          # --json\nLAB  STATE\nx-1  running\n$ vfio-cxl vm down\n```\n"
        "  ```\n  $ vfio-cxl vm up ./my.toml\n  vfio-cxl: error: my.toml: bad\n  ```\n"
        "```\nvfio-cxl gpu serve --socket PATH\n                   [--vram-mib N]\n"
        "python -m x serve ...   # the same\nhost ── not a command\n```\n"
        "```toml\n# vfio-cxl in toml is not a command\n```\n`cxl list`, `scripts/`\n")
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    found = [(s.command, s.where, s.output) for s in docs.documented()]
    assert found == [
        ("./scripts/demo", "README.md:4", []),
        ("vfio-cxl vm ls", "README.md:8", ["LAB  STATE", "x-1  running"]),
        ("vfio-cxl vm down", "README.md:11", []),
        ("vfio-cxl vm up ./my.toml", "README.md:14", ["vfio-cxl: error: my.toml: bad"]),
        ("vfio-cxl gpu serve --socket PATH [--vram-mib N]", "README.md:18", []),
        ("python -m x serve ...", "README.md:20", []),
        ("vfio-cxl vm topologies", "README.md:1", []),
        ("scripts/bench boot --runs 1", "README.md:1", []),
    ]


def test_a_shown_line_matches_what_varies_and_nothing_else():
    shown = "shared-9  shared    running  0m35s   28049   a:56849 b:47323  gpu0->a"
    assert docs.shown_pattern(shown).fullmatch("shared-12 shared running 12m01s 901 a:40001 b:40002 gpu0->a")
    assert not docs.shown_pattern(shown).fullmatch("shared-12 shared degraded 12m01s 901 a:40001 b:40002 gpu0->a")
    assert not docs.shown_pattern(shown).fullmatch("shared-12 shared running 12m01s 901 a:40001 b:40002 gpu0->b")
    assert docs.shown_pattern("checksum MATCH: sha256 a47f6b24eb55518f…").fullmatch("checksum MATCH: sha256 0e1f…")
    assert docs.unmatched(["LAB  STATE", "x-1  running"], ["noise", "LAB STATE", "x-7 running"]) == []
    assert docs.unmatched(["x-1  running", "LAB  STATE"], ["LAB STATE", "x-7 running"]) == ["LAB  STATE"]


def test_the_checker_fails_a_crash_and_a_wrong_exit(tmp_path):
    case = Case()
    crash = docs.run("python3 -c 'raise SystemExit(format(object(), \"8.0f\"))'", case, tmp_path)
    with pytest.raises(AssertionError, match="exit 1, expected 0"):
        docs.check(crash, case)
    with pytest.raises(AssertionError, match="did not print"):
        docs.check(docs.run("echo other", case, tmp_path), case, ["checksum MATCH: sha256 a47f…"])


def test_ctrl_c_reaches_the_whole_foreground_group(tmp_path):
    # the `until` runs: a server that prints its ready line gets SIGINT on its process group
    case = Case(until=r"^READY ", timeout=30)
    ran = docs.run("echo READY x; trap 'echo got-int; exit 0' INT; while :; do sleep 0.1; done", case, tmp_path)
    assert ran.returncode in (0, -signal.SIGINT) and ran.lines[0] == "READY x"


@pytest.mark.parametrize("command", FAST)
def test_documented_command_runs_as_typed(command, tmp_path):
    case = CASES[command]
    line = case.run or command
    if case.xfail:
        pytest.xfail(case.xfail)
    ran = docs.run(line, case, docs.cwd_for(line, tmp_path))
    shown = [out for s in SHOWN if s.command == command for out in s.output]
    docs.check(ran, case, shown)
    print(f"{ran.seconds:6.1f} s  exit {ran.returncode}  $ {line}")


def test_the_demo_lines_the_test_expects_are_the_readmes():
    # README "The DMA demo" shows demo dma's output in a block of its own (no `$` line): the VM
    # test expects those lines of ./scripts/demo, so each expectation must be a line it shows.
    readme = (docs.ROOT / "README.md").read_text().splitlines()
    for expect in CASES[docs.SCRIPT_DEMO].expect:
        assert any(re.search(expect, line) for line in readme), f"README shows no line like {expect!r}"
