"""The FM's guest scripts (vfio_cxl/lab/fm/guestscripts.py), run for real by sh on a FAKE guest
tree (fm_fake_lab.FakeGuest: made-up sysfs and /dev/vfio, the host's real /proc), and their
strict parsers.  The VM tests run the same scripts in a real guest (tests/vm/test_fm_hostile.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vfio_cxl.lab.fm.guestscripts import (BIND_SCRIPT, HOLDERS_SCRIPT, KILL_SCRIPT, GuestAnswerError, parse_bind,
                                          parse_holders, parse_kills)

from fm_fake_lab import FakeGuest

HOLDER = Path(__file__).with_name("fm_holder.py")


@pytest.fixture
def guest(tmp_path):
    g = FakeGuest(tmp_path, "a")
    g.plug("gpu0")
    procs = []

    def hold(name: str, dev_id: str = "gpu0") -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(HOLDER), name, str(g.node(dev_id))], stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"holding\n"
        procs.append(proc)
        return proc
    g.hold = hold
    yield g
    g.session.close()
    for proc in procs:
        proc.kill()
        proc.wait()


def run(guest, script, *args, limit=None):
    return guest.session.run(script, list(args), 30, limit=limit)


@pytest.mark.parametrize("name", ['","pid":1,"":"', "a\nholder 1 /dev", "x\\ny", " lead", "\x01\x7f\r", "é"])
def test_holders_are_found_by_inode_and_names_cannot_forge_fields(guest, name):
    held = guest.hold(name)
    status, out = run(guest, HOLDERS_SCRIPT, "0000:02:00.0")
    assert status == 0
    holders = parse_holders("a", out)
    assert [h["pid"] for h in holders] == [held.pid]
    assert holders[0]["path"] == "/dev/vfio/11"
    assert holders[0]["comm"] == name.split("\n")[0].encode()[:15].decode(errors="replace")


def test_kill_script_kills_only_what_holds_the_gpu_now_and_never_pid_1(guest):
    held = guest.hold("holder")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        status, out = run(guest, KILL_SCRIPT, "0000:02:00.0", "1", str(bystander.pid), str(held.pid), "x;y")
        assert status == 0
        killed, skipped = parse_kills("a", out)
        assert killed == [held.pid]
        assert skipped == {"1": "init", str(bystander.pid): "not-holding", "x;y": "not-a-pid"}
        assert held.wait(10) == -signal.SIGKILL and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_bind_script_answers_in_its_format_and_says_what_is_missing(guest):
    status, out = run(guest, BIND_SCRIPT, "1", "1")
    assert status == 0
    answer = parse_bind("a", out)
    assert answer["bdf"] == "0000:02:00.0" and answer["gpus"] == 1 and answer["guest"]["first_scan"] is True
    status, out = run(guest, BIND_SCRIPT, "2", "1")   # one GPU where two are wanted: 1 s, then why
    assert status == 1 and "1 GPU(s) after 1 s, expected 2" in out


def test_bind_script_keeps_its_limit_by_the_guest_clock_however_slow_its_polls(guest, tmp_path, monkeypatch):
    """Under TCG load a 20 ms poll took far longer: the script counted polls, outlasted the FM's
    wait for its answer (limit + 30 s), and the FM could say only that the guest did not answer.
    Its limit is the guest's uptime now, so it answers in time and says what it saw."""
    slow = tmp_path / "slow-bin"
    slow.mkdir()
    (slow / "sleep").write_text(f"#!/bin/sh\nexec {shutil.which('sleep')} 0.25\n")   # each poll: 250 ms
    (slow / "sleep").chmod(0o755)
    monkeypatch.setenv("PATH", f"{slow}:{os.environ['PATH']}")
    guest.session.close()   # the next script runs in a new guest shell, with the slow sleep
    status, out = guest.session.run(BIND_SCRIPT, ["2", "1"], 6)   # 50 polls of 250 ms: 12.5 s
    assert status == 1 and "1 GPU(s) after 1 s, expected 2" in out


def test_a_guest_that_prints_too_much_is_cut_off(guest):
    with pytest.raises(Exception, match="printed more than 4096 bytes"):
        run(guest, "yes", limit=4096)
    status, out = run(guest, "echo fine")   # a new session serves the next script
    assert (status, out) == (0, "fine")


def test_output_cannot_fake_the_end_marker(guest):
    status, out = run(guest, "printf '\\n@@vfio-cxl-exit 1 0\\n'; exit 7")
    assert status == 7


@pytest.mark.parametrize("out, what", [
    ("", "did not name the GPU's VFIO group"),
    ("group /dev/vfio/11\nholder 01 /dev/vfio/11 x", "line 2 not in its format"),
    ("group /dev/vfio/11\nholder 5 /dev/vfio/11", "line 2 not in its format"),
    ("group /dev/vfio/11\nholder 5 /dev/vfio/11 " + "x" * 65, "line 2 not in its format"),
    ("group ../../etc\n", "line 1 not in its format"),
    ("group /dev/vfio/11\nholder 5 /dev/vfio/12 x", "line 2 not in its format"),
    # with its cdev named, a holder of another cdev is no holder of this GPU
    ("group /dev/vfio/11\ncdev /dev/vfio/devices/vfio0\nholder 5 /dev/vfio/devices/vfio1 x", "line 3 not in its format"),
])
def test_holders_parser_refuses_what_is_not_its_format(out, what):
    with pytest.raises(GuestAnswerError, match=what):
        parse_holders("a", out)


def test_a_cdev_holder_is_taken_while_the_gpu_is_being_removed():
    """vfio deletes the cdev (and its sysfs entry) before it waits for the holders: the script
    names no cdev then, and finds the holder by its fd's fdinfo (vfio-device-syspath; the real
    guest's case is tests/vm/test_lab_fabric.py's held GPU on the lab kernel)."""
    holders = parse_holders("a", "group /dev/vfio/11\nholder 92 /dev/vfio/devices/vfio0 python3\n")
    assert holders == [{"pid": 92, "path": "/dev/vfio/devices/vfio0", "comm": "python3"}]
