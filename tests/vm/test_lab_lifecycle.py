"""Stopping a lab -- normally or with Ctrl-C -- leaves no process, socket or file."""

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from vfio_cxl.lab import topology
from vfio_cxl.lab.lab import Lab, remove_stale_rundirs
from vfio_cxl.lab.vm import VirtualMachine
from vfio_cxl.paths import REPO_ROOT, runtime_root

from suite_kernel import suite_kernel, suite_kernel_name


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def start_vm_up() -> tuple[subprocess.Popen, Path]:
    """`vfio-cxl vm up single` in a child process, once it says the lab runs; and its run dir."""
    # SIGINT as at a terminal: a job started in the background of a non-interactive shell (as CI
    # may start the suite) inherits SIGINT ignored, and Python then keeps it ignored.
    kernel = suite_kernel_name()   # the lifecycle is the same on either kernel
    cli = subprocess.Popen([sys.executable, "-m", "vfio_cxl", "vm", "up", "single",
                            *(["--kernel", kernel] if kernel else [])], cwd=REPO_ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=0,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    output = ""
    while "lab running" not in output:
        ready, _, _ = select.select([cli.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            cli.kill()
            raise AssertionError(f"lab not running after 180 s: {output}")
        chunk = os.read(cli.stdout.fileno(), 4096).decode()   # raw: select() sees no Python buffer
        assert chunk, f"vm up exited early: {cli.stderr.read()}"
        output += chunk
    # the lab's run directory is under $VFIO_CXL_RUNDIR (default /tmp): .../vfio-cxl-XXXX/host0/console.log
    console = next((w for w in output.split() if w.startswith(f"{runtime_root()}/vfio-cxl-")), None)
    if console is None:
        cli.kill()   # its lab goes with it; a test that cannot read the output leaves nothing running
        raise AssertionError(f"no console log under {runtime_root()} in vm up's output: {output}")
    return cli, Path(console).parent.parent


def test_stop_leaves_nothing_behind(single_lab, labs):
    # The pool's single lab, handed over after every other test of single: one boot fewer.
    lab = labs.hand_over(single_lab)
    rundir = lab.rundir
    vm = lab["host0"]
    pids = [vm.process.pid, lab.gpu_servers["gpu0"].process.pid]
    assert processes_mentioning(str(rundir))
    assert vm.run("hostname").stdout.strip() == "host0"
    lab.stop()
    assert not rundir.exists()
    assert processes_mentioning(str(rundir)) == []
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} still exists"


def test_ctrl_c_stops_the_lab(labs):
    labs.close()
    cli, rundir = start_vm_up()
    try:
        assert rundir.exists()
        cli.send_signal(signal.SIGINT)
        try:
            status = cli.wait(120)
        except subprocess.TimeoutExpired:
            cli.send_signal(signal.SIGABRT)   # the CLI's faulthandler prints every thread's stack
            cli.wait(60)
            raise AssertionError("vm up did not stop within 120 s of Ctrl-C; its threads:\n"
                                 + cli.stderr.read()[-6000:]) from None
        assert status == 130
        assert "lab stopped" in cli.stderr.read()
        assert not rundir.exists()
        assert processes_mentioning(str(rundir)) == []
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()


def test_a_killed_lab_takes_its_vms_and_gpu_servers_with_it(labs):
    labs.close()
    cli, rundir = start_vm_up()
    assert len(processes_mentioning(str(rundir))) >= 2   # QEMU (in bwrap) and the GPU server
    cli.kill()                                          # no chance to clean up
    cli.wait()
    deadline = time.monotonic() + 10
    while processes_mentioning(str(rundir)) and time.monotonic() < deadline:
        time.sleep(0.1)   # SIGKILL delivery to the children is asynchronous; poll with a deadline
    assert processes_mentioning(str(rundir)) == []
    remove_stale_rundirs()
    assert not rundir.exists()


def test_no_port_is_picked_ahead_for_another_process_to_take(labs, monkeypatch):
    """Another process binds whatever SSH port the lab chose before its QEMU does (the old
    free_port() race: QEMU then failed "Could not set up host forwarding rule").  QEMU binds
    port 0 itself now and the lab reads the port back, so nothing is there to take."""
    labs.close()
    taken: list[socket.socket] = []
    start = VirtualMachine.start

    def start_after_someone_took_the_port(vm):
        if vm.res.ssh_port:
            squatter = socket.socket()
            squatter.bind(("127.0.0.1", vm.res.ssh_port))
            squatter.listen()
            taken.append(squatter)
        start(vm)

    monkeypatch.setattr(VirtualMachine, "start", start_after_someone_took_the_port)
    try:
        with Lab(topology.load("single"), gpu=False, kernel=suite_kernel()) as lab:
            vm = lab["host0"]
            assert vm.res.ssh_port > 0 and vm.run("echo up").stdout == "up\n"
    finally:
        for squatter in taken:
            squatter.close()
    assert taken == []
