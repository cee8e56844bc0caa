"""One running VM: its QEMU process, console log, QMP and SSH.

Start launches QEMU (through the runtime's bwrap wrapper); ``wait_ready``
watches the console for the guest init's "ready" line, then opens SSH;
``stop`` asks QEMU to quit over QMP and kills it if it does not.  QEMU dies
with us (PR_SET_PDEATHSIG) so no VM outlives a crashed lab.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from qemu.qmp import QMPError
from qemu.qmp.legacy import QEMUMonitorProtocol

from ..errors import LabError
from .argv import VmResources, qemu_argv
from .image import GuestImage
from .qemu_runtime import QemuRuntime
from .ssh import GuestShell
from .topology import Topology, Vm

# The guest init's console lines the lab waits for (images/rootfs/sbin/vfio-cxl-init): from
# NETWORK_LINE its SSH server is started and reachable (the lab connects, retrying a refused
# attempt at once), READY_LINE says everything is up (the lab runs nothing before it).
NETWORK_LINE = b"vfio-cxl-init: network up"
READY_LINE = b"vfio-cxl-init: ready"
SSH_FAILED_LINE = b"vfio-cxl-init: dropbear failed"
# The guest init stamps its lines with the seconds since the kernel started.
INIT_STAMP = re.compile(rb"vfio-cxl-init: (started|network up|ready) \[([0-9.]+)\]")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# A slirp host forward in HMP's `info usernet` (libslirp's slirp_connection_info): the host
# address and port are the listening socket's own (getsockname), so a rule asked for with
# port 0 shows the port the kernel gave it.
#   TCP[HOST_FORWARD]  10       127.0.0.1 34237       10.0.2.15    22     0     0
HOST_FORWARD = re.compile(r"^\s*TCP\[HOST_FORWARD\]\s+\d+\s+(\S+)\s+(\d+)\s+(\S+)\s+(\d+)\s", re.M)


# Each user network's part of `info usernet` starts with a line naming its netdev: "Hub -1 (ssh):".
USERNET_HUB = re.compile(r"^Hub \S+ \(([^)]*)\):\s*?$", re.M)     # HMP ends its lines with \r\n


def forwarded_port(usernet: str, guest_port: int = 22, netdev: str = "ssh") -> int:
    """The host port of the one TCP forward to ``guest_port`` on user network ``netdev`` in
    ``info usernet``'s output (the lab's own network, ``ctl``, forwards a UNIX socket: libslirp
    prints it as a TCP forward with a made-up address and port, which must not count)."""
    hubs = USERNET_HUB.split(usernet)          # [before, name, text, name, text, ...]
    section = "".join(text for name, text in zip(hubs[1::2], hubs[2::2]) if name == netdev)
    ports = [int(host_port) for _, host_port, _, to in HOST_FORWARD.findall(section) if int(to) == guest_port]
    if len(ports) != 1 or not 0 < ports[0] < 65536:
        raise LabError(f"QEMU's `info usernet` shows {len(ports)} TCP forwards to guest port {guest_port} on "
                       f"netdev {netdev} (ports {ports}), expected one with a port:\n{usernet}",
                       "a lab VM forwards one host port to the guest's SSH port; see the QEMU log")
    return ports[0]


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its descendants (all threads):
    for a TCG guest, the work its boot took, whatever else the machine runs."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS   # utime, stime
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue   # gone in between: what it used is lost with it
    return total


@dataclass(frozen=True)
class BootStages:
    """Where a boot's seconds went (host clock from QEMU start, guest clock from kernel start).
    The stages follow the critical path: firmware and loading, the kernel, the init until
    the lab may connect (its network line), then SSH: the rest of the SSH server's start,
    the key exchange and authentication, and whatever the init still had to do before
    its ready line (the shares, the regions), which runs beside them."""

    to_ssh: float           # QEMU start -> SSH session open and the init ready (host)
    network_seen: float     # QEMU start -> the init's network line in the console log (host)
    kernel_to_init: float | None     # kernel start -> init's first line (guest uptime)
    init_to_network: float | None    # init's first line -> its network line (guest uptime)
    init_to_ready: float | None      # init's first line -> its ready line (guest uptime)
    cpu: float              # CPU seconds of QEMU (all its threads) until SSH was open

    @property
    def before_kernel(self) -> float | None:
        """Firmware, loading and decompressing the kernel (QEMU start -> the kernel's clock starts)."""
        if self.kernel_to_init is None or self.init_to_network is None:
            return None
        return self.network_seen - self.kernel_to_init - self.init_to_network

    @property
    def ssh(self) -> float:
        """The init's network line -> SSH session open and the init ready."""
        return self.to_ssh - self.network_seen


_PR_SET_PDEATHSIG = 1


class BoundedQMP(QEMUMonitorProtocol):
    """The legacy QMP client with a bounded connect.  Its ``connect`` waits for QEMU's greeting
    without end, and QEMU serves one monitor client at a time: a connection left half-open by an
    interrupt (Ctrl-C, a supervisor's SIGINT) kept the next one -- ``stop``'s -- waiting forever,
    and with it the lab and its VMs.  ``cmd`` is bounded by ``settimeout``."""

    def connect_within(self, timeout: float) -> None:
        """Connect, take the greeting and negotiate capabilities, under ``asyncio.wait_for``
        (asyncio.TimeoutError).  On an interrupt the connect task is cancelled and run to its
        end here, so the client's session guard closes the socket before the interrupt goes
        on: left pending in the thread's event loop, it would wake at the next QMP call and
        race its disconnect.

        ``qmp_capabilities`` goes through ``execute``, not the client's own negotiation: that
        takes the first message after the command for its reply, but QEMU starts sending
        events as soon as the command has switched the monitor's mode, before it sends the
        reply, and an event emitted in between failed the connect ("Negotiation failed",
        seen once in a full test run).  ``execute`` matches the reply by its id and queues
        the event."""
        self._qmp.await_greeting = True
        self._qmp.negotiate = False

        async def connect_and_negotiate() -> None:
            await self._qmp.connect(self._address)
            await self._qmp.execute("qmp_capabilities")

        task = self._aloop.create_task(asyncio.wait_for(connect_and_negotiate(), timeout))
        try:
            self._aloop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()
                try:
                    self._aloop.run_until_complete(task)
                except (asyncio.CancelledError, Exception):
                    pass
            raise


# The pid of the process about to fork, set just before each fork (subprocess runs the at-fork
# hooks when it has a preexec_fn): the child inherits it and so knows who its parent was.
_forking_pid = os.getpid()


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


os.register_at_fork(before=_note_forking_pid)


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the lab process dies, however it dies.  A parent
    that died between the fork and this prctl would leave the child to init with nothing to
    kill it (a fast test leaked such a process for an hour): the child checks that its parent
    is still the process that forked it, and ends itself if not."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _forking_pid:
        os._exit(1)


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log; of a guest console, also the lines that say why it stopped
    (a kernel panic's reason, the init's last word) when they scrolled out of the tail."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no output)"
    every = text.splitlines()
    last = every[-lines:]
    why = [line for line in every[:-lines] if "Kernel panic" in line]
    init = [line for line in every[:-lines] if "vfio-cxl-init:" in line][-1:]
    head = [*init, *why[:1]]
    return "\n".join([*head, *(["..."] if head else []), *last]) or "(empty)"


class ConsoleWatch:
    """What a guest's console log holds so far, read a piece at a time (only what is new)."""

    def __init__(self, path: Path):
        self.path = path
        self.text = b""

    def read(self) -> bytes:
        try:
            with open(self.path, "rb") as log:
                log.seek(len(self.text))
                self.text += log.read()
        except FileNotFoundError:
            pass
        return self.text

    def has_line(self, start: bytes) -> bool:
        """Whether a whole line beginning ``start`` is in what was read: the serial port writes
        a line byte by byte, and the stamp at its end may still be coming."""
        at = self.text.find(start)
        return at >= 0 and self.text.find(b"\n", at) >= 0


class VirtualMachine:
    def __init__(self, spec: Vm, resources: VmResources, runtime: QemuRuntime,
                 image: GuestImage, extra_ro: list[Path] = (), *, topology: Topology):
        self.spec = spec
        self.topology = topology
        self.res = resources
        self.runtime = runtime
        self.image = image
        self.extra_ro = list(extra_ro)
        self.process: subprocess.Popen | None = None
        self.qmp: QEMUMonitorProtocol | None = None
        self.shell: GuestShell | None = None
        self.boot_seconds: float | None = None
        self.boot_stages: BootStages | None = None
        self.regions: dict[str, dict] = {}   # topology region name -> what the guest made of it
        self._started_at = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def qemu_log(self) -> Path:
        return self.res.rundir / "qemu.log"

    def argv(self) -> list[str]:
        return qemu_argv(self.topology, self.spec, self.res)

    def command(self) -> list[str]:
        rundir = self.res.rundir.parent   # the lab's run dir: sockets and backends of all VMs
        return self.runtime.command(
            self.argv(), rw=[rundir, *([self.res.bytecode] if self.res.bytecode else [])], ro=[self.image.root, self.res.source, *self.extra_ro],
            chdir=self.res.rundir, env={"TMPDIR": str(self.res.rundir)})

    def start(self) -> None:
        self.res.rundir.mkdir(parents=True, exist_ok=True)
        with open(self.qemu_log, "wb") as log:
            self._started_at = time.monotonic()
            self.process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "TMPDIR": str(self.res.rundir)},
                start_new_session=True,   # Ctrl-C reaches the lab, which then stops QEMU in order
                preexec_fn=die_with_parent,
            )

    def _check_alive(self) -> None:
        if self.process and self.process.poll() is not None:
            log = tail(self.qemu_log)
            fix = "see the QEMU output above"
            if "Could not set up host forwarding rule" in log:
                fix = f"port {self.res.ssh_port} on 127.0.0.1 is taken: choose another --ssh-port or leave it unset"
            raise LabError(f"[{self.name}] QEMU exited with {self.process.returncode}:\n{log}\n"
                           f"console:\n{tail(self.res.console_log)}", fix)

    def _learn_ssh_port(self, deadline: float) -> None:
        """Asked for port 0, QEMU's slirp bound the SSH forward to a port of the kernel's
        choosing: read it back (HMP ``info usernet`` over a QMP connection of its own, closed
        after, so the VM's ``qmp`` sees nothing of it).  No port is picked ahead and handed over
        later, so none can be taken in between."""
        qmp = self._open_qmp(max(0.0, deadline - time.monotonic()))
        try:
            qmp.settimeout(max(1.0, deadline - time.monotonic()))
            usernet = qmp.cmd("human-monitor-command", **{"command-line": "info usernet"})
        except asyncio.TimeoutError:
            self._check_alive()
            raise LabError(f"[{self.name}] QEMU did not answer 'info usernet' on QMP in time",
                           "QEMU is wedged; see the QEMU log") from None
        finally:
            qmp.close()
        self.res = replace(self.res, ssh_port=forwarded_port(str(usernet)))

    def wait_ready(self, timeout: float = 120) -> float:
        """Wait for the guest's SSH session and its init's ready line; returns seconds since start.

        The key exchange starts on the init's network line and overlaps the init's last
        steps (the shares, the regions): boot to SSH is when both are done."""
        deadline = time.monotonic() + timeout
        if self.res.ssh_port == 0:
            self._learn_ssh_port(deadline)
        console = ConsoleWatch(self.res.console_log)

        def wait_for(line: bytes) -> float:
            while True:
                console.read()
                if console.has_line(line) or console.has_line(READY_LINE):
                    return time.monotonic() - self._started_at
                self._check_alive()
                if time.monotonic() >= deadline:
                    # both logs go with the run directory when the lab stops: what they say is kept here
                    raise LabError(f"[{self.name}] not ready after {timeout:.0f} s; console:\n"
                                   f"{tail(self.res.console_log)}\nQEMU's output:\n{tail(self.qemu_log)}",
                                   "the guest never printed its init's ready line: see where its console "
                                   "stops; is the image intact?")
                # Polling the console log (not synchronisation): each look costs a read of what
                # is new; at 50 ms apart the lab saw a line 25 ms late on average.
                time.sleep(0.01)

        def server_failed() -> None:
            self._check_alive()
            console.read()
            if console.has_line(SSH_FAILED_LINE):
                raise LabError(f"[{self.name}] the guest's SSH server did not start; console:\n"
                               f"{tail(self.res.console_log)}", "see dropbear's message above")

        # made before the network line is out: loading the key and setting the client up takes
        # the host tens of milliseconds that would otherwise come after it.  The VM has it (and
        # run() works) only once the guest is ready; a boot that fails closes it.
        shell = GuestShell(self.name, self.res.ssh_port, str(self.image.ssh_key), self.image.host_key,
                           unix_socket=str(self.res.ssh_socket))
        try:
            network_seen = wait_for(NETWORK_LINE)
            # retried every 10 ms: until dropbear listens, the guest refuses at once
            shell.connect(deadline, retry_after=0.01, check=server_failed)
            self.boot_seconds = wait_for(READY_LINE)
        except BaseException:
            shell.close()
            raise
        self.shell = shell
        stamps = {name.decode(): float(up) for name, up in INIT_STAMP.findall(console.text)}

        def since_started(line: str) -> float | None:
            return stamps[line] - stamps["started"] if {"started", line} <= stamps.keys() else None

        self.boot_stages = BootStages(
            self.boot_seconds, network_seen, stamps.get("started"), since_started("network up"),
            since_started("ready"), process_tree_cpu(self.process.pid))
        return self.boot_seconds

    def connect_qmp(self, timeout: float = 10) -> QEMUMonitorProtocol:
        if self.qmp is None:
            self.qmp = self._open_qmp(timeout)
        return self.qmp

    def _open_qmp(self, timeout: float) -> "BoundedQMP":
        """A new QMP connection, negotiated within ``timeout`` s (or LabError): QEMU makes its
        socket, greets, and takes the capabilities.  Closed again on any failure or interrupt."""
        deadline = time.monotonic() + timeout
        while not self.res.qmp_socket.exists():
            self._check_alive()
            if time.monotonic() >= deadline:
                raise LabError(f"[{self.name}] no QMP socket after {timeout:.0f} s", "see the QEMU log")
            time.sleep(0.05)   # polling for QEMU's socket file; not synchronisation
        sock = self._connect_qmp_socket(deadline)
        qmp = BoundedQMP(sock)
        try:
            try:
                qmp.connect_within(max(0.5, deadline - time.monotonic()))
            except BaseException:
                qmp.close()
                sock.close()   # still ours if qemu.qmp failed before taking it
                raise
        except asyncio.TimeoutError:
            self._check_alive()
            raise LabError(f"[{self.name}] QEMU did not greet on QMP within {timeout:.0f} s",
                           "QEMU is wedged or another client holds its monitor; see the QEMU log") from None
        except (QMPError, EOFError, OSError) as err:   # qmp_capabilities refused, or QEMU hung up
            self._check_alive()
            raise LabError(f"[{self.name}] QEMU's QMP monitor did not take qmp_capabilities: {err!r}",
                           "see the QEMU log") from None
        return qmp

    def _connect_qmp_socket(self, deadline: float) -> socket.socket:
        """A UNIX stream socket connected to QEMU's monitor before ``deadline`` (or LabError).
        The connect is made here, apart from QMP's greeting, so that a monitor that is not
        listening and one that does not greet are told apart: a non-blocking UNIX connect is
        answered at once.  Tried again until the deadline when it is refused (QEMU binds its
        socket, and the file appears, before it listens: seen under load at a lab's start) or
        would block (the backlog is full: other clients queue behind the one QEMU serves)."""
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.connect(str(self.res.qmp_socket))
                return sock
            except BaseException as err:
                sock.close()
                if not isinstance(err, OSError):
                    raise
                self._check_alive()
                again = isinstance(err, (ConnectionRefusedError, BlockingIOError))
                if not again or time.monotonic() >= deadline:
                    fix = ("other clients hold QEMU's monitor and queue for it; close them (see the QEMU log)"
                           if isinstance(err, BlockingIOError) else "see the QEMU log")
                    raise LabError(f"[{self.name}] cannot connect to QEMU's QMP socket: {err}", fix) from None
            time.sleep(0.01)   # polling for QEMU's listen or room in its backlog; not synchronisation

    def run(self, command: str, **kwargs):
        if self.shell is None:
            raise LabError(f"[{self.name}] is not ready", "call wait_ready() first")
        return self.shell.run(command, **kwargs)

    def put(self, local: str, remote: str) -> None:
        """Copy a file into the guest (SFTP over the VM's SSH connection)."""
        if self.shell is None:
            raise LabError(f"[{self.name}] is not ready", "call wait_ready() first")
        self.shell.put(local, remote)

    def start_command(self, command: str, **kwargs):
        """Start ``command`` in the guest; its RunningCommand (``GuestShell.start``).  Enter it
        in a ``with`` block (or an ExitStack) so that it is cancelled if the caller fails first."""
        if self.shell is None:
            raise LabError(f"[{self.name}] is not ready", "call wait_ready() first")
        return self.shell.start(command, **kwargs)

    def stop(self, timeout: float = 10) -> None:
        """QMP quit, then SIGKILL to the whole process group if QEMU lingers.  Every step is
        bounded: a QEMU that never answers on QMP is killed all the same."""
        if self.shell:
            self.shell.close()
            self.shell = None
        if self.process and self.process.poll() is None:
            try:
                qmp = self.connect_qmp(timeout=2)
                qmp.settimeout(2)
                qmp.cmd("quit")
            except Exception:
                pass   # QEMU may already be going; the kill below settles it
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self.qmp:
            try:
                self.qmp.close()
            except Exception:
                pass
            self.qmp = None
