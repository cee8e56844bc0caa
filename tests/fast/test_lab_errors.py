"""Bad input to the lab fails early, with one clear line, and starts nothing.

Where these tests fake something (the QEMU device list, the effective uid) it
is to test our own checks, not the kernel or QEMU."""

import os
import socket
import subprocess
from dataclasses import replace

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import apt, topology
from vfio_cxl.lab.lab import Lab, remove_stale_rundirs
from vfio_cxl.lab.qemu_runtime import QemuRuntime


def test_taken_port_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("VFIO_CXL_RUNDIR", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LabError, match=f"port {port} on 127.0.0.1 is already in use"):
            Lab(topology.load("single"), ssh_port=port).start()
    assert list(tmp_path.iterdir()) == []


def test_qemu_missing_features_is_named(monkeypatch):
    runtime = QemuRuntime(tree=None, version=(11, 1, 3))
    monkeypatch.setattr(runtime, "devices", lambda: 'name "cxl-type3"\nname "intel-iommu"\n')
    with pytest.raises(LabError, match="lacks devices: vfio-user-pci"):
        runtime.check_features()


def test_old_qemu_is_named():
    with pytest.raises(LabError, match="too old"):
        QemuRuntime(tree=None, version=(7, 2, 0)).check_features()


def test_host_packages_without_root(monkeypatch):
    monkeypatch.setattr(apt.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(apt, "missing_host_packages", lambda names: ["mmdebstrap"])
    with pytest.raises(LabError) as err:
        apt.ensure_host_packages(["mmdebstrap"])
    assert "run as root" in str(err.value) and "sudo apt-get install mmdebstrap" in str(err.value)


def test_a_dead_labs_directory_is_removed_by_the_next_lab(tmp_path, monkeypatch):
    monkeypatch.setenv("VFIO_CXL_RUNDIR", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / "vfio-cxl-stale"
    stale.mkdir()
    (stale / "lab.pid").write_text(str(dead.pid))
    alive = tmp_path / "vfio-cxl-alive"
    alive.mkdir()
    (alive / "lab.pid").write_text(str(os.getpid()))
    remove_stale_rundirs()
    assert not stale.exists() and alive.exists()


# `info usernet` as QEMU 11.1.3 with libslirp 4.8 printed it for a VM started with
# hostfwd=tcp:127.0.0.1:0-:22 (the kernel gave the forward port 34237).
USERNET = """Hub -1 (ssh):
  Protocol[State]    FD  Source Address  Port   Dest. Address  Port RecvQ SendQ
  TCP[HOST_FORWARD]  10       127.0.0.1 34237       10.0.2.15    22     0     0
"""
# ... and with the lab's own network beside it (hostfwd=unix:.../ssh.sock-:22): libslirp prints
# the UNIX forward as a TCP one, its "address" and "port" bytes of the socket's sockaddr_un.
USERNET_BOTH = """Hub -1 (ssh):
  Protocol[State]    FD  Source Address  Port   Dest. Address  Port RecvQ SendQ
  TCP[HOST_FORWARD]  13       127.0.0.1 38363       10.0.2.15    22     0     0
Hub -1 (ctl):
  Protocol[State]    FD  Source Address  Port   Dest. Address  Port RecvQ SendQ
  TCP[HOST_FORWARD]  14  109.112.47.118 12148       10.0.3.15    22     0     0
"""


def test_the_ssh_forward_port_is_read_from_info_usernet():
    from vfio_cxl.lab.vm import forwarded_port
    assert forwarded_port(USERNET) == 34237
    busy = USERNET + "  TCP[ESTABLISHED]  23       127.0.0.1 51422       10.0.2.15    22     0     0\n"
    assert forwarded_port(busy) == 34237   # a connection to port 22 is not a forward
    assert forwarded_port(USERNET_BOTH) == 38363   # the lab's UNIX forward on ctl is not the port
    assert forwarded_port(USERNET_BOTH.replace("\n", "\r\n")) == 38363       # as HMP sends it
    assert forwarded_port(USERNET_BOTH.replace("(ssh)", "(other)").replace("(ctl)", "(ssh)")) == 12148
    for broken in ("Hub -1 (ssh):\n", USERNET.replace(" 22 ", " 23 "), USERNET + USERNET.splitlines()[-1] + "\n",
                   USERNET.replace("(ssh)", "(ctl)")):
        with pytest.raises(LabError, match="TCP forwards to guest port 22"):
            forwarded_port(broken)


def test_a_lab_asks_qemu_for_port_0_unless_given_one(tmp_path):
    from vfio_cxl.lab.argv import qemu_argv
    topo = topology.load("single")
    for asked, rule in ((None, "hostfwd=tcp:127.0.0.1:0-:22"), (40100, "hostfwd=tcp:127.0.0.1:40100-:22")):
        vm = Lab(topo, ssh_port=asked).plan(tmp_path)[0]
        assert vm.res.ssh_port == (asked or 0)
        assert any(rule in arg for arg in qemu_argv(topo, vm.spec, vm.res))


def test_a_guest_that_never_gets_ready_is_named_with_both_logs(vm):
    """The run directory (console and QEMU logs) goes when the lab stops: the error keeps their tails."""
    vm.res = replace(vm.res, ssh_port=40100)          # no QMP port lookup for this stand-in
    vm.res.console_log.write_text("Failed to access perfctr msr (MSR c0010007 is 0)\n")
    vm.qemu_log.write_text("qemu-system-x86_64: vfio-user: something went wrong\n")
    vm.process = subprocess.Popen(["sleep", "600"])   # a QEMU that stays up
    with pytest.raises(LabError) as err:
        vm.wait_ready(timeout=0.3)
    text = str(err.value)
    assert "[host0] not ready after 0 s" in text and "perfctr msr" in text
    assert "QEMU's output:\nqemu-system-x86_64: vfio-user: something went wrong" in text
    assert "never printed its init's ready line" in err.value.fix


def test_a_guest_that_panicked_says_why_though_its_trace_scrolled_past(tmp_path):
    """The lab's error shows the console's tail; a panic's reason and the init's last line come
    before the trace's tail that would otherwise hide them (CI saw only the trace once)."""
    from vfio_cxl.lab.vm import tail
    console = tmp_path / "console.log"
    console.write_text("\n".join([
        "vfio-cxl-init: started [0.9]", "vfio-cxl-init: modules loaded [1.2]",
        "Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100",
        *(f"[    6.15] trace line {i}" for i in range(30)), "Kernel Offset: 0x2f400000"]))
    shown = tail(console).splitlines()
    assert shown[:3] == ["vfio-cxl-init: modules loaded [1.2]",
                         "Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100", "..."]
    assert shown[-1] == "Kernel Offset: 0x2f400000" and len(shown) == 18
    console.write_text("one\ntwo\n")
    assert tail(console) == "one\ntwo"   # nothing scrolled out: the tail alone



def test_a_child_whose_parent_died_before_it_asked_for_pdeathsig_ends_itself():
    """die_with_parent (every process the lab starts): PR_SET_PDEATHSIG set after the parent died
    would never fire.  Here the parent is SIGKILLed while its child waits in its preexec_fn,
    before die_with_parent: the child must end there, not exec and live on under init."""
    import sys
    go_r, go_w = os.pipe()
    middle = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys
from vfio_cxl.lab.vm import die_with_parent
def preexec():
    os.write(1, b"child %d\\n" % os.getpid())
    os.read({go_r}, 1)            # until the test has killed this child's parent
    die_with_parent()
subprocess.Popen([sys.executable, "-c", "print('exec-ed'); import time; time.sleep(60)"], preexec_fn=preexec,
                 pass_fds=[{go_r}])
"""], stdout=subprocess.PIPE, text=True, pass_fds=[go_r])
    os.close(go_r)
    try:
        line = middle.stdout.readline()
        assert line.startswith("child "), line
        child = int(line.split()[1])
        middle.kill()
        middle.wait(30)
        os.write(go_w, b"x")
        # the orphan ends itself: waited for through its pidfd (it is init's child, not ours)
        try:
            fd = os.pidfd_open(child)
        except ProcessLookupError:
            fd = None                 # ended and reaped already
        if fd is not None:
            try:
                import select
                assert select.select([fd], [], [], 30)[0], "the orphaned child is still running"
            finally:
                os.close(fd)
        assert "exec-ed" not in middle.stdout.read()
    finally:
        os.close(go_w)
        middle.stdout.close()
