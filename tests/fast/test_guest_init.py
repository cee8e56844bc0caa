"""The guest's PID 1 (images/rootfs/sbin/vfio-cxl-init) is a shell script: a command that ends
that shell panics the guest kernel ("Attempted to kill init").  Its functions run here, as
written, under the host's POSIX shell (dash: the same rules as the image's busybox ash for
special builtins and redirections)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

INIT = Path(__file__).resolve().parents[2] / "images/rootfs/sbin/vfio-cxl-init"
SH = shutil.which("dash") or shutil.which("sh")


def function(name: str) -> str:
    text = INIT.read_text()
    found = re.search(rf"^{name}\(\) {{\n.*?^}}\n", text, re.M | re.S)
    assert found, f"{name}() not in {INIT}"
    return found.group(0)


def run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([SH, "-c", script], capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(SH is None, reason="no POSIX shell")
def test_an_unwritable_bytecode_share_is_reported_and_init_goes_on(tmp_path):
    """A share the guest cannot write: the probe says so and the shell lives on (with `:` as the
    probe, the failed redirection ended the shell -- PID 1 -- and CI saw a guest panic)."""
    (tmp_path / "file").write_text("")
    ran = run(function("writable") + f'writable "{tmp_path}/file" || echo not-writable; echo alive')
    assert ran.stdout.split() == ["not-writable", "alive"], ran


@pytest.mark.skipif(SH is None, reason="no POSIX shell")
def test_the_probe_leaves_nothing_and_no_two_boots_share_its_name(tmp_path):
    """Every guest's init is PID 1 and all labs share the cache directory: a probe named after
    $$ was one file for every guest, created by one while another removed it."""
    share = tmp_path / "pyc"
    share.mkdir()
    body = function("writable")
    assert "$$" not in body
    # many probes at once in one directory, as many guests booting together: all see it writable
    ran = run(body + f'for i in $(seq 40); do (writable "{share}" && echo ok) & done; wait')
    assert ran.stdout.split() == ["ok"] * 40, ran
    assert list(share.iterdir()) == []
