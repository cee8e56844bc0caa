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


def test_pid_1_never_redirects_a_special_builtin():
    """`:`, `.`, `eval`, `exec`, `set`, ... with a redirection that fails end a non-interactive
    shell: in PID 1 a kernel panic.  Every redirection of the init goes to a regular builtin."""
    special = re.compile(r"(^\s*|[;&|!]\s*|\b(if|elif|then|else|do|while|until)\s+)"
                         r"(:|\.|eval|set|export|readonly|shift|times|trap|unset)\s[^#\n]*[<>]")
    bad = [line for line in INIT.read_text().splitlines() if special.search(line.split("#", 1)[0])]
    assert bad == []


@pytest.mark.skipif(SH is None, reason="no POSIX shell")
@pytest.mark.parametrize("state, rc, out, err", [
    ("started", 0, "[{\"name\": \"r0\"}]\n", ""),      # the init's run: its output and status
    ("started", 3, "", "cxltool: no memdev with serial 7\n"),
    ("none", 0, "PLAN\n", ""),                           # nothing started (no fw_cfg): runs it here
])
def test_the_lab_collects_the_regions_the_init_brought_up(tmp_path, state, rc, out, err):
    """vfio_cxl.lab.lab.regions_result, as the lab runs it in the guest (its paths moved into
    tmp_path, the fallback's ram_regions.sh or cxltool stood in for by cat: it gets the plan on stdin)."""
    from vfio_cxl.lab.lab import regions_result
    r = tmp_path / "regions"
    script = regions_result("cat").replace("/run/vfio-cxl/regions", str(r))
    if state == "started":
        Path(f"{r}.started").touch()
        Path(f"{r}.out").write_text(out)
        Path(f"{r}.err").write_text(err)
        Path(f"{r}.rc").write_text(f"{rc}\n")
    ran = subprocess.run([SH, "-c", script], input="PLAN\n", capture_output=True, text=True, timeout=30)
    assert (ran.returncode, ran.stdout, ran.stderr) == (rc, out, err)


def test_until_proc_is_mounted_every_program_is_named_by_its_path():
    """busybox runs an applet by exec'ing /proc/self/exe; before /proc is mounted its shell falls
    back to the PATH, where `mount` is util-linux's, dynamically linked: the first exec of the
    boot then loaded a dozen libraries cold (0.12 s under TCG, found stamping the init's lines)."""
    text = INIT.read_text().replace("\\\n", " ")     # continued lines as one
    mount_proc = re.search(r"^(.*)mount -t proc proc /proc$", text, re.M)
    commands = [line.split("#", 1)[0].strip() for line in text[:mount_proc.start()].splitlines()]
    commands = [c for c in commands if c and not re.match(r"^\w+=", c) and not c.startswith(("export ", "say() "))]
    assert mount_proc.group(1) == "/bin/busybox ", "the /proc mount itself names busybox by its path"
    assert commands and all(c.split()[0].startswith("/") for c in commands), commands


def test_the_lab_may_connect_once_the_ssh_server_and_its_nics_are_up_and_waits_for_ready():
    """The order the lab relies on (vfio_cxl.lab.vm.wait_ready): dropbear starts first, the
    network line comes once the SSH NICs are up, the shares and regions after it (beside the
    key exchange), and "ready" last."""
    text = INIT.read_text()
    at = {what: text.index(line) for what, line in (
        ("dropbear", "/usr/sbin/dropbear"), ("nics", "ifconfig \"${dev##*/}\" 10.0.3.15"),
        ("network", 'say "network up"'), ("source share", "vfio_cxl_src /opt/vfio-cxl"),
        ("regions", 'say "regions started"'), ("ready", 'say "ready"'))}
    assert list(at) == sorted(at, key=at.get), at
