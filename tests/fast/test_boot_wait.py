"""How the lab waits for a booting guest (vfio_cxl.lab.vm.VirtualMachine.wait_ready): it connects
on the init's network line, so the SSH key exchange overlaps the init's last steps, and it is
done on the init's ready line.  The SSH shell is a stand-in here, recording when it was asked to
connect: these tests check the lab's own order of events; every VM test opens the real session
(and its retry, against a port nobody listens on, is tested below with paramiko itself)."""

import socket
import subprocess
import time
from dataclasses import replace

import pytest
from ssh_loopback import LoopbackSsh

from vfio_cxl.errors import LabError
from vfio_cxl.lab import vm as vm_module
from vfio_cxl.lab.ssh import GuestShell
from vfio_cxl.lab.vm import ConsoleWatch

STARTED = "vfio-cxl-init: started [0.90]\n"
NETWORK = "vfio-cxl-init: network up [0.97]\n"
READY = "vfio-cxl-init: ready [1.10]\n"


class RecordingShell:
    """Stands in for GuestShell: ``on_connect(check)`` runs when the lab connects."""
    on_connect = None
    connects: list = []
    closed: list = []

    def __init__(self, *args, **kwargs):
        pass

    def close(self):
        RecordingShell.closed.append(self)

    def connect(self, deadline, *, retry_after=0.2, check=None):
        RecordingShell.connects.append(retry_after)
        RecordingShell.on_connect(check)


@pytest.fixture
def booting(vm, monkeypatch):
    """``vm`` with a QEMU stand-in that stays up, and a RecordingShell for its SSH."""
    vm.res = replace(vm.res, ssh_port=40100)   # no QMP port lookup for this stand-in
    vm.process = subprocess.Popen(["sleep", "600"])
    vm._started_at = time.monotonic()
    RecordingShell.connects, RecordingShell.closed = [], []
    monkeypatch.setattr(vm_module, "GuestShell", RecordingShell)
    return vm


def test_the_lab_connects_on_the_network_line_and_is_done_on_the_ready_line(booting):
    console = booting.res.console_log
    console.write_text(STARTED + NETWORK)
    seen = []

    def on_connect(check):   # the init goes on while the key exchange runs: its ready line comes
        seen.append(console.read_text())
        with open(console, "a") as log:
            log.write("vfio-cxl-init: shares up [1.05]\n" + READY)

    RecordingShell.on_connect = on_connect
    booting.wait_ready(timeout=10)
    assert seen == [STARTED + NETWORK], "connected before the network line, or after the ready line"
    assert RecordingShell.connects == [0.01], "a refused attempt is retried at once, not 0.2 s later"
    assert isinstance(booting.shell, RecordingShell) and RecordingShell.closed == []
    stages = booting.boot_stages
    assert (stages.kernel_to_init, round(stages.init_to_network, 2), round(stages.init_to_ready, 2)) == (0.9, 0.07, 0.2)
    assert stages.to_ssh >= stages.network_seen and stages.ssh >= 0


def test_a_guest_whose_ssh_server_died_is_named_at_once(booting):
    """dropbear exits at start (a bad host key, say): the init says so, and the lab stops
    retrying then, not after its whole boot timeout, with dropbear's words in the error."""
    booting.res.console_log.write_text(STARTED + NETWORK)

    def on_connect(check):
        check()   # a refused attempt: nothing said yet, so the lab retries
        with open(booting.res.console_log, "a") as log:
            log.write("vfio-cxl-init: dropbear failed: Failed loading /etc/dropbear/dropbear_ed25519_host_key [1.12]\n")
        check()

    RecordingShell.on_connect = on_connect
    started = time.monotonic()
    with pytest.raises(LabError) as err:
        booting.wait_ready(timeout=60)
    assert time.monotonic() - started < 30
    assert "[host0] the guest's SSH server did not start" in str(err.value)
    assert "Failed loading /etc/dropbear/dropbear_ed25519_host_key" in str(err.value)
    # not ready: the VM has no shell to run commands on, and the one it made is closed
    assert booting.shell is None and len(RecordingShell.closed) == 1


def test_a_line_counts_only_once_the_serial_port_wrote_all_of_it(tmp_path):
    """The serial port writes byte by byte: a ready line whose stamp is still coming is not read
    (its stamp, half there, would have said 1.1 for 1.15)."""
    log = tmp_path / "console.log"
    log.write_text(STARTED + "vfio-cxl-init: ready [1.1")
    watch = ConsoleWatch(log)
    watch.read()
    assert not watch.has_line(b"vfio-cxl-init: ready")
    with open(log, "a") as out:
        out.write("5]\n")
    assert not watch.has_line(b"vfio-cxl-init: ready")   # what was read, until the next look
    watch.read()
    assert watch.has_line(b"vfio-cxl-init: ready")
    assert watch.text.endswith(b"ready [1.15]\n")
    missing = ConsoleWatch(tmp_path / "none.log")
    assert missing.read() == b"" and missing.has_line(b"vfio-cxl-init") is False   # no log yet


def test_connect_retries_a_refused_attempt_until_its_check_says_stop(tmp_path):
    """GuestShell.connect with paramiko against a port nobody listens on: each refused attempt
    is followed by ``check()``, whose error ends the retrying."""
    with socket.socket() as s:   # a port that was free a moment ago: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = LoopbackSsh(tmp_path)   # its keys only: nobody connects to it
    server.close()
    shell = GuestShell("host0", port, str(server.key_file), server.host_key.get_base64())
    calls = []

    def check():
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise LabError("stop", "the check's own error")

    with pytest.raises(LabError, match="stop"):
        shell.connect(time.monotonic() + 30, retry_after=0.01, check=check)
    assert len(calls) == 3
