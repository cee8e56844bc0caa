"""SSH into lab VMs with fabric, pinning the guest's host key from the image."""

from __future__ import annotations

import base64
import io
import logging
import secrets
import shlex
import socket
import time

import paramiko
from fabric import Config, Connection
from fabric.runners import Remote

from ..errors import LabError
from . import usage

# paramiko logs every refused attempt while the SSH server comes up; connect() reports failure itself.
logging.getLogger("paramiko").setLevel(logging.CRITICAL)


class GuestCommandError(LabError):
    def __init__(self, vm: str, command: str, exited: int, stdout: str, stderr: str):
        self.vm, self.command, self.exited = vm, command, exited
        self.stdout, self.stderr = stdout, stderr
        output = (stderr.strip() or stdout.strip()).splitlines()[-15:]
        super().__init__(f"[{vm}] '{command}' exited {exited}:\n  " + "\n  ".join(output),
                         "see the VM's console log for more")


class WholeInput(io.StringIO):
    """stdin for a guest command, handed over in one piece: invoke reads a non-terminal stream
    one byte per read with a 10 ms sleep between reads (a 1.5 KB script took 16 s to send)."""

    def read(self, size: int | None = -1) -> str:
        return super().read()


class GuestRemote(Remote):
    """fabric's runner for a guest command, except that input for a command whose channel has
    closed is dropped, as a pipe's reader that has exited drops it.  A command that ends without
    reading its stdin can close the channel before invoke's stdin thread has sent the input; that
    thread's "Socket is closed" then failed a command that had succeeded (seen on a loaded host:
    the lab's regions command reads the plan it is given only when the guest's init did not start
    the regions).  The command's own exit status still says how it went."""

    def _write_proc_stdin(self, data):
        try:
            return super()._write_proc_stdin(data)
        except OSError:
            if not self.channel.closed:
                raise

    def close_proc_stdin(self):
        try:
            return super().close_proc_stdin()
        except OSError:
            if not self.channel.closed:
                raise


class UnixConnection(Connection):
    """A fabric connection whose transport is a UNIX socket (``unix_path``), opened afresh at
    each ``open`` -- the first and any reconnect fabric makes by itself; without one, TCP to
    host and port.  The host key is still looked up under ``[host]:port``."""

    unix_path: str | None = None

    def open(self):
        if self.unix_path is None or self.is_connected:
            return super().open()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout)
            sock.connect(self.unix_path)
            self.connect_kwargs["sock"] = sock
            return super().open()
        except BaseException:
            sock.close()
            raise
        finally:
            self.connect_kwargs.pop("sock", None)


class GuestShell:
    """One fabric connection to one VM; every failure names the VM.

    ``unix_socket``: connect through the VM's private SSH socket (``VmResources.ssh_socket``:
    only its owner may connect, and other local users' TCP connections to ``port`` cannot use
    up what dropbear allows this path); ``port`` then only names the host key."""

    def __init__(self, vm_name: str, port: int, key_file: str, host_key: str, unix_socket: str | None = None):
        self.vm_name = vm_name
        self.port = port
        self.connection = UnixConnection(
            host="127.0.0.1", port=port, user="root", connect_timeout=5,
            config=Config(overrides={"runners": {"remote": GuestRemote}}),
            connect_kwargs={"key_filename": key_file, "look_for_keys": False, "allow_agent": False,
                            "banner_timeout": 10, "auth_timeout": 10},
        )
        self.connection.unix_path = unix_socket
        client = self.connection.client
        # The image's host key is known from its build: accept that one only.
        client.get_host_keys().add(f"[127.0.0.1]:{port}", "ssh-ed25519",
                                   paramiko.Ed25519Key(data=base64.b64decode(host_key)))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())

    def connect(self, deadline: float, *, retry_after: float = 0.2, check=None) -> None:
        """Connect, retrying while the SSH server is still coming up, until ``deadline`` (monotonic),
        ``retry_after`` s apart; ``check()``, called after each failed attempt, raises when the
        server will not come.

        Each attempt may take until the deadline (at least 5 s): paramiko bounds the key
        exchange by the connect timeout, and on a loaded host a TCG guest's SSH server can
        need more than a few seconds for it; an attempt given up mid-exchange leaves the
        guest a server process to finish for nothing, and the retries then pile up and
        starve the guest."""
        while True:
            budget = max(5.0, deadline - time.monotonic())
            self.connection.connect_timeout = budget
            self.connection.connect_kwargs.update(banner_timeout=budget, auth_timeout=budget)
            try:
                self.connection.open()
                return
            except (paramiko.SSHException, OSError, EOFError) as err:
                if time.monotonic() >= deadline:
                    where = self.connection.unix_path or f"127.0.0.1:{self.port}"
                    raise LabError(f"[{self.vm_name}] SSH on {where} does not answer: {err}",
                                   "see the VM's console log") from None
                if check is not None:
                    check()
                time.sleep(retry_after)   # retry back-off; not synchronisation

    def run(self, command: str, *, timeout: float = 120, check: bool = True, stdin: str | None = None):
        """Run ``command`` in the guest; returns the fabric Result.  Started and joined as
        ``start`` does: an interrupt (Ctrl-C) while it runs cancels it at once."""
        with self.start(command, timeout=timeout, stdin=stdin) as running:
            return running.join(check=check)

    def start(self, command: str, *, timeout: float = 300, stdin: str | None = None) -> "RunningCommand":
        """Start ``command`` and return at once; ``.join()`` waits for its result, at most
        ``timeout`` s from now.  Use it as a context manager (``with shell.start(...) as
        running:``) so that it is cancelled if the block is left before it was joined."""
        # timeout=None: no invoke timer.  Invoke's is a non-daemon threading.Timer, started per
        # command and cancelled only by a join: a command nobody joined (its caller raised) kept
        # the interpreter alive until the timer ran out (17 min after a failed bench).  The
        # deadline is RunningCommand's own, checked in join.
        usage.record("guest", command)
        try:
            promise = self.connection.run(command, asynchronous=True, hide=True, warn=True, timeout=None,
                                          in_stream=WholeInput(stdin) if stdin is not None else False)
        except Exception as err:   # paramiko errors: the connection is gone
            raise LabError(f"[{self.vm_name}] '{command}' failed: {err}",
                           "see the VM's console log") from None
        return RunningCommand(self, command, promise, timeout)

    def put(self, local: str, remote: str) -> None:
        self.connection.put(local, remote)

    def close(self) -> None:
        self.connection.close()


def send_signal(channel: paramiko.Channel, name: str) -> None:
    """Ask the SSH server to send signal ``name`` ("TERM") to the process of ``channel``'s
    session (RFC 4254 6.9; dropbear does, to the process it started).  paramiko has no call for
    this request: it is built as paramiko builds its own.  Best effort: errors are ignored."""
    try:
        m = paramiko.Message()
        m.add_byte(paramiko.common.cMSG_CHANNEL_REQUEST)
        m.add_int(channel.remote_chanid)
        m.add_string("signal")
        m.add_boolean(False)
        m.add_string(name)
        channel.transport._send_user_message(m)
    except Exception:
        pass


class RunningCommand:
    """A command started in a guest (``GuestShell.start``).  ``join()`` waits for its result until
    its deadline (start + timeout) and cancels it if that passes or the wait is interrupted;
    ``cancel()`` ends it at once.  It has no thread of its own (invoke's reader threads are
    daemons), so a command nobody joins can never keep the interpreter alive.

    As a context manager it is cancelled when the block is left without having been joined --
    the caller raised, or Ctrl-C::

        with b.start_command("consume ...") as consumer:
            a.run("produce ...")          # raises: the consumer is cancelled, not left running
            result = consumer.join()
    """

    POLL = 0.5   # s: how often a join looks at invoke's reader threads (one that died ends the wait)

    def __init__(self, shell: GuestShell, command: str, promise, timeout: float):
        self.shell, self.command, self.promise = shell, command, promise
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.state = "running"   # -> "joined" or "cancelled"
        self.result = None

    @property
    def channel(self) -> paramiko.Channel:
        return self.promise.runner.channel

    @property
    def done(self) -> bool:
        """Whether the command has ended (its exit status came, or its channel closed); a
        ``join`` then returns at once."""
        return self.channel.exit_status_ready()

    def join(self, check: bool = True):
        """The command's fabric Result.  LabError if it failed to run, did not end by its
        deadline (it is cancelled), or was cancelled before; GuestCommandError if ``check``
        and it exited non-zero."""
        if self.state == "cancelled":
            raise LabError(f"[{self.shell.vm_name}] '{self.command}' was cancelled before it was joined",
                           "its caller failed or was interrupted; see the error raised there")
        if self.state == "running":
            try:
                self._wait()
                result = self.promise.join()
            except LabError:
                raise
            except Exception as err:   # invoke's reader-thread errors, paramiko errors
                self.cancel()
                raise LabError(f"[{self.shell.vm_name}] '{self.command}' failed: {err}",
                               "see the VM's console log") from None
            except BaseException:      # Ctrl-C (KeyboardInterrupt) while waiting: end it now
                self.cancel()
                raise
            self.state, self.result = "joined", result
        result = self.result
        if check and result.exited != 0:
            raise GuestCommandError(self.shell.vm_name, self.command, result.exited, result.stdout, result.stderr)
        return result

    def _wait(self) -> None:
        """Until the command ends (or a reader thread died); at the deadline, cancel and raise."""
        channel, runner = self.channel, self.promise.runner
        while not channel.status_event.wait(min(self.POLL, max(0.0, self.deadline - time.monotonic()))):
            if runner.has_dead_threads:
                return   # promise.join raises what it died of
            if time.monotonic() >= self.deadline:
                partial = self.cancel()   # a Result is false when its exit status is not 0
                said = (partial.stderr.strip() or partial.stdout.strip()) if partial is not None else ""
                raise LabError(f"[{self.shell.vm_name}] '{self.command}' did not finish within {self.timeout:g} s; "
                               "cancelled" + "".join("\n  " + line for line in said.splitlines()[-15:]),
                               "see the VM's console log")

    def cancel(self):
        """End the command now, unless it was joined: SIGTERM to its session's process in the
        guest, then its channel closed (invoke's reader threads end with it).  That process is
        root's shell running the command, which a simple command replaces (bash execs it); what a
        compound command started meets a closed pipe at its next write instead.  Returns what it
        had printed so far (a Result, exit status -1), or None.  Idempotent."""
        if self.state != "running":
            return None
        self.state = "cancelled"
        channel = self.channel
        if not channel.exit_status_ready():
            send_signal(channel, "TERM")
        try:
            channel.close()
            return self.promise.join()   # prompt now: the channel is closed
        except Exception:
            return None

    def __enter__(self) -> "RunningCommand":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()   # nothing once joined


def join_all(running: dict) -> dict:
    """Wait for every command started in the guests (name -> RunningCommand), in turn; their
    results.  The first that fails -- or a Ctrl-C -- cancels the others at once and is raised."""
    try:
        return {name: command.join() for name, command in running.items()}
    finally:
        for command in running.values():
            command.cancel()   # nothing for those joined


class ShellSession:
    """One long-lived ``sh`` on a VM's open SSH connection: each script goes to its stdin and
    runs in a subshell; its output ends with a marker line carrying the exit status.  This saves
    what the SSH server does per command (a session process, a login shell): 1-2 s under TCG
    load, against one fork here.  A session that times out or breaks is closed and never reused; the next
    ``run`` opens a new one."""

    MARK = "@@vfio-cxl-exit"
    OUTPUT_MAX = 1 << 20   # bytes a script may print (the guest is not trusted)

    def __init__(self, shell: GuestShell):
        self.shell = shell
        self.channel = None
        self.count = 0

    def _open(self):
        transport = self.shell.connection.client.get_transport()
        if transport is None or not transport.is_active():
            raise LabError(f"[{self.shell.vm_name}] the SSH connection is closed", "see the VM's console log")
        channel = transport.open_session()
        channel.exec_command("exec sh")
        return channel

    def run(self, script: str, args: list[str], timeout: float, limit: int | None = None) -> tuple[int, str]:
        """(exit status, stdout and stderr merged) of ``script`` run as ``sh -c script sh args``.

        At most ``limit`` bytes of output (default OUTPUT_MAX) are read: a script that prints
        more fails (and the session is closed), so a guest cannot make the host buffer or scan
        without bound.  The end marker carries a random nonce: output cannot fake the exit status."""
        limit = self.OUTPUT_MAX if limit is None else limit
        if self.channel is None:
            self.channel = self._open()
        self.count += 1
        mark = f"{self.MARK} {self.count} {secrets.token_hex(8)} "
        quoted = " ".join(shlex.quote(a) for a in args)
        line = (f"( set -- {quoted}\n{script}\n) </dev/null 2>&1; printf '\\n%s%s\\n' {shlex.quote(mark)} $?\n")
        deadline = time.monotonic() + timeout
        received, marker = bytearray(), mark.encode()
        end, scanned = -1, 0
        try:
            self.channel.sendall(line.encode())
            while True:
                if end < 0:   # look for the marker line ("\n" MARK STATUS "\n") in what is new
                    end = received.find(marker, max(scanned - len(marker), 0))
                    scanned = len(received)
                if end >= 0 and received.find(b"\n", end) == len(received) - 1:
                    break
                if len(received) > limit + len(marker) + 16:
                    raise OverflowError(f"the script printed more than {limit} bytes")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer within {timeout:.0f} s")
                self.channel.settimeout(left)
                try:
                    chunk = self.channel.recv(65536)
                except socket.timeout:   # raised without a message
                    raise TimeoutError(f"no answer within {timeout:.0f} s") from None
                if not chunk:
                    raise EOFError("the guest shell ended")
                received += chunk
        except Exception as err:
            self.close()   # poisoned: never reused
            raise LabError(f"[{self.shell.vm_name}] guest script failed: {str(err) or type(err).__name__}",
                           "see the VM's console log") from None
        try:
            status = int(received[end + len(marker):].split()[0])
        except (ValueError, IndexError):
            self.close()
            raise LabError(f"[{self.shell.vm_name}] guest script ended without an exit status",
                           "see the VM's console log") from None
        return status, received[:end].decode(errors="replace").rstrip("\n")

    def close(self) -> None:
        if self.channel is not None:
            try:
                self.channel.close()
            except Exception:
                pass
            self.channel = None
