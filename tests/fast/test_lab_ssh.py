"""The FM's guest shell (vfio_cxl.lab.ssh.ShellSession) over a FAKE channel: how it reports a
guest that does not answer.  The real channel is paramiko's, in every VM test."""

import socket
from types import SimpleNamespace

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab.ssh import ShellSession


class SilentChannel:
    """A session channel whose guest never answers: recv times out as paramiko's does
    (socket.timeout, no message)."""

    closed = False

    def exec_command(self, command):
        pass

    def sendall(self, data):
        pass

    def settimeout(self, timeout):
        self.timeout = timeout

    def recv(self, size):
        raise socket.timeout()

    def close(self):
        self.closed = True


def test_a_guest_script_that_does_not_answer_is_named_a_timeout():
    channel = SilentChannel()
    transport = SimpleNamespace(is_active=lambda: True, open_session=lambda: channel)
    session = ShellSession(SimpleNamespace(vm_name="b", connection=SimpleNamespace(
        client=SimpleNamespace(get_transport=lambda: transport))))
    with pytest.raises(LabError, match=r"^\[b\] guest script failed: no answer within 60 s -- "):
        session.run("sleep 100", [], 60)   # said "guest script failed: " and nothing more
    assert channel.closed and session.channel is None   # poisoned: never reused
