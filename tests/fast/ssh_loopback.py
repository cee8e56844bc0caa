"""Guest commands in fast tests, no VM.

``LoopbackSsh``: an SSH server on 127.0.0.1 standing in for a guest's dropbear (paramiko's server
side).  Each exec request runs as a local ``bash -c`` (root's shell in the guest), with its
stdin, stdout, stderr and exit status over the channel; a "signal" request signals that process,
as dropbear does; a channel the client closes ends nothing by itself, as with dropbear.

    server = LoopbackSsh(tmp_path)
    shell = server.shell()                  # a vfio_cxl.lab.ssh.GuestShell, connected
    ...
    server.close()                          # kills what is left of the commands

``server.address`` is GuestShell's arguments, for a client in another interpreter.

``FakeRunning``: a stand-in for vfio_cxl.lab.ssh.RunningCommand where the VMs are fakes."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


def _new_key() -> tuple[paramiko.Ed25519Key, str]:
    """A fresh Ed25519 key, as paramiko's and as an OpenSSH private key file's text."""
    text = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()
    return paramiko.Ed25519Key.from_private_key(io.StringIO(text)), text


class Session:
    """One exec request: its command, its local process, the signals the client sent it."""

    def __init__(self, channel: paramiko.Channel, command: str):
        self.channel, self.command = channel, command
        self.signals: list[str] = []           # "signal" requests received
        self.ended = threading.Event()         # the process exited (and its status was sent, if it could be)
        self.process = None
        self.threads = []

    def start(self) -> None:
        """Once the exec request was answered: output and the exit status come after the answer."""
        self.process = subprocess.Popen(["bash", "-c", self.command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
        self.threads = [threading.Thread(target=target, daemon=True)
                        for target in (self._stdin, self._stdout, self._stderr, self._watch)]
        for thread in self.threads:
            thread.start()

    def _stdin(self):
        try:
            while data := self.channel.recv(65536):
                self.process.stdin.write(data)
                self.process.stdin.flush()
        except OSError:
            pass
        finally:
            try:
                self.process.stdin.close()
            except OSError:
                pass

    def _pump(self, source, send):
        try:
            while data := source.read1(65536):
                send(data)
        except OSError:   # the channel is closed: the process's pipe closes
            pass
        finally:
            source.close()

    def _stdout(self):
        self._pump(self.process.stdout, self.channel.sendall)

    def _stderr(self):
        self._pump(self.process.stderr, self.channel.sendall_stderr)

    def _watch(self):
        self.process.wait()
        self.threads[1].join(5)
        self.threads[2].join(5)
        try:
            if self.process.returncode >= 0:   # killed by a signal: no exit status (paramiko reads -1)
                self.channel.send_exit_status(self.process.returncode)
            self.channel.close()
        except (OSError, EOFError):   # the client closed it (or its connection) meanwhile
            pass
        self.ended.set()

    def signal(self, name: str) -> None:
        self.signals.append(name)
        try:
            os.kill(self.process.pid, getattr(signal, f"SIG{name}"))
        except (AttributeError, ProcessLookupError):
            pass

    def kill(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


class _Server(paramiko.ServerInterface):
    def __init__(self, owner: "LoopbackSsh"):
        self.owner = owner

    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        ok = username == "root" and key.get_base64() == self.owner.client_key.get_base64()
        return paramiko.AUTH_SUCCESSFUL if ok else paramiko.AUTH_FAILED

    def check_channel_request(self, kind, chanid):
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel, command):
        self.owner.sessions.append(Session(channel, command.decode()))
        return True


class LoopbackSsh:
    def __init__(self, directory: Path):
        self.host_key, _ = _new_key()
        self.client_key, text = _new_key()
        self.key_file = Path(directory) / "client_key"
        self.key_file.write_text(text)
        self.key_file.chmod(0o600)
        self.sessions: list[Session] = []
        self.transports: list[paramiko.Transport] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> dict:
        """GuestShell's arguments for this server."""
        return {"vm_name": "loopback", "port": self.port, "key_file": str(self.key_file),
                "host_key": self.host_key.get_base64()}

    def shell(self):
        from vfio_cxl.lab.ssh import GuestShell
        shell = GuestShell(**self.address)
        shell.connect(time.monotonic() + 10)
        return shell

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            transport = paramiko.Transport(conn)
            transport.add_server_key(self.host_key)
            # paramiko's server side has no hook for "signal": this transport's channels get one.
            table = dict(paramiko.Transport._channel_handler_table)
            table[paramiko.common.MSG_CHANNEL_REQUEST] = self._channel_request
            transport._channel_handler_table = table
            self.transports.append(transport)
            try:
                transport.start_server(server=_Server(self))
            except (paramiko.SSHException, EOFError, OSError):
                pass

    def _channel_request(self, channel: paramiko.Channel, m: paramiko.Message) -> None:
        at = m.packet.tell()
        if m.get_text() == "signal":
            m.get_boolean()
            name = m.get_text()
            for session in self.sessions:
                if session.channel is channel:
                    session.signal(name)
            return
        m.packet.seek(at)
        paramiko.Channel._handle_request(channel, m)   # an exec request: answered here
        for session in self.sessions:
            if session.channel is channel and session.process is None:
                session.start()

    def session(self, command: str, timeout: float = 10) -> Session:
        """The session of ``command``, once its exec request came."""
        deadline = time.monotonic() + timeout
        while True:
            for session in self.sessions:
                if session.command == command:
                    return session
            assert time.monotonic() < deadline, f"no exec request for {command!r}; got {self.sessions}"
            time.sleep(0.02)   # waiting for the client's request; test scaffolding

    def close(self):
        self.listener.close()
        for session in self.sessions:
            session.kill()
        for transport in self.transports:
            transport.close()



class FakeRunning:
    """What a fake VM's ``start_command`` returns: ``join`` gives ``result``; ``done`` says whether
    it has ended; leaving its ``with`` block unjoined cancels it, as RunningCommand's does."""

    def __init__(self, result=None, done: bool = False):
        self.result, self.done = result, done
        self.joined = self.cancelled = False

    def join(self, check: bool = True):
        assert not self.cancelled, "joined after it was cancelled"
        self.joined = True
        return self.result

    def cancel(self):
        if not self.joined:
            self.cancelled = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()
