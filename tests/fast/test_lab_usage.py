"""What a run costs, counted across processes (vfio_cxl.lab.usage): the lines, the summary,
and nothing written where no log was asked for or after it is gone."""

import subprocess
import sys

from vfio_cxl.lab import usage


def test_boots_commands_python_starts_and_reboots_are_counted(tmp_path, monkeypatch):
    log = tmp_path / "usage.jsonl"
    log.touch()
    monkeypatch.setenv(usage.ENV, str(log))
    usage.record("boot", "single (debian kernel)")
    usage.record("guest", "vfio-cxl gpu ls")
    usage.record("guest", "sh -c 'true'")
    usage.record("guest", "VFIO_CXL_PYC=$(mktemp -d) python3 -c pass")
    usage.record("guest", "vfio-cxl-m vfio_cxl.guest.cmd.p2p --size 1M")
    usage.record("reboot", "single: VM host0: no /dev/dax0.0")
    usage.record("booted", "3.250")
    usage.record("booted", "4.500")
    usage.record("stopped", "0.125")
    # a child process counts into the same file
    subprocess.run([sys.executable, "-c", "from vfio_cxl.lab import usage; usage.record('boot', 'shared (lab kernel)')"],
                   check=True)
    counted = usage.summary(str(log))
    assert counted["boots"] == {"single (debian kernel)": 1, "shared (lab kernel)": 1}
    assert counted["guest_commands"] == 4 and counted["guest_python"] == 3
    assert counted["reboots"] == ["single: VM host0: no /dev/dax0.0"]
    assert counted["boot_s"] == 7.75 and counted["stop_s"] == 0.125
    # each boot is laid to the test that asked for it (pytest's PYTEST_CURRENT_TEST, inherited)
    assert counted["boots_by_file"] == {"test_lab_usage.py": 2}


def test_nothing_is_written_without_a_log_or_after_it_is_gone(tmp_path, monkeypatch):
    monkeypatch.delenv(usage.ENV, raising=False)
    usage.record("boot", "single")          # no log asked for: nothing, no error
    gone = tmp_path / "gone.jsonl"
    monkeypatch.setenv(usage.ENV, str(gone))
    usage.record("boot", "single")          # the session's log was removed: no stray file
    assert not gone.exists()
    assert usage.summary(str(gone))["guest_commands"] == 0
