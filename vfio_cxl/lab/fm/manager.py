"""The fabric manager: owns one lab's processes, serves its control socket, watches for deaths.

One thread does everything, in one ``selectors`` loop: the control socket and
its clients, a signal wake-up pipe, and one pidfd per process the lab started
(QEMU -- or the bwrap that runs it -- per VM, and each GPU server).  A pidfd
becomes readable the moment its process exits, so a death is reported within
one loop turn, not on a polling interval.

The single thread matters for more than simplicity: every child is started
with PR_SET_PDEATHSIG (and bwrap ``--die-with-parent``), which fires when the
*thread* that forked it exits.  Starting children from a worker thread would
kill them when that thread ends.  The flip side is intended: when the fabric
manager dies, however it dies, its VMs and servers die with it, and
``vfio-cxl vm down`` only has to clean up files (see :mod:`.cleanup`).

All state changes go through :meth:`FabricManager._set_lab_state` and
:meth:`_set_child_state`, called from the start (adoption), :meth:`_vm_exited`
:meth:`_gpu_exited` and :meth:`_smc_exited`; every change that matters to a user records an event.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Callable, Protocol

from ...errors import LabError
from . import protocol
from .procs import ProcessId, find_qemu
from .registry import LabRecord

LAB_STATES = ("starting", "running", "degraded", "stopping", "stopped")
VM_STATES = ("running", "dead", "stopped")
GPU_STATES = ("attached", "failed", "stopped")   # assign/release will add "free" and "moving"
MAX_OUTBUF = 4 << 20   # a follower that reads slower than this is dropped


@dataclass
class Child:
    """A process the lab started: a VM's QEMU (kind "vm"), a GPU server (kind "gpu") or a
    shared-memory controller's server (kind "smc", serving the VMs in ``hosts``)."""

    kind: str
    name: str
    popen: Popen
    owner: str | None = None                 # gpu: the VM it is plugged into
    ssh_port: int | None = None              # vm
    files: dict[str, str] = field(default_factory=dict)   # log name -> live path
    state: str = ""
    returncode: int | None = None
    qemu_pid: int | None = None              # vm: QEMU itself (below bwrap, if any)
    pidfd: int | None = None
    hosts: tuple[str, ...] = ()              # smc: the VMs it serves, host ID = position


class ManagedLab(Protocol):
    """What the fabric manager needs of a lab (the real :class:`~..lab.Lab` or a test's fake)."""

    rundir: Path

    def start(self, log: Callable[[str], None]) -> None: ...
    def children(self) -> list[Child]: ...
    def ssh_info(self, vm: str) -> dict: ...
    def run_state(self, vm: str) -> str: ...
    def stop_processes(self) -> None: ...
    def close(self) -> None: ...


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    if returncode > 128:   # bwrap reports its child's signal as 128 + N
        try:
            return f"exited with {returncode} ({signal.Signals(returncode - 128).name})"
        except ValueError:
            pass
    return f"exited with {returncode}"


class _Client:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = b""
        self.outbuf = b""
        self.follow = False
        self.close_after_flush = False


class FabricManager:
    def __init__(self, lab: ManagedLab, record: LabRecord, *, progress=None, log=None):
        self.lab = lab
        self.record = record
        self.progress = progress          # a text stream to `vm up --detach`, or None
        self.log_stream = log or sys.stderr
        self.state = "starting"
        self.vms: dict[str, Child] = {}
        self.gpus: dict[str, Child] = {}
        self.smcs: dict[str, Child] = {}
        self.events: list[dict] = []
        self.clients: dict[int, _Client] = {}
        self.stop_requested = False
        self.sel: selectors.BaseSelector | None = None
        self.listener: socket.socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None

    # -- logging and events --------------------------------------------------------------
    def log(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"{stamp} {text}", file=self.log_stream, flush=True)

    def say(self, text: str) -> None:
        """A progress line for the `vm up --detach` terminal (and the FM log)."""
        self.log(text)
        if self.progress:
            try:
                self.progress.write(f"progress: {text}\n")
                self.progress.flush()
            except (BrokenPipeError, ValueError):
                self.progress = None   # the CLI went away; the lab carries on

    def event(self, kind: str, message: str, **fields) -> dict:
        ev = {"seq": len(self.events) + 1, "time": time.time(), "monotonic": time.monotonic(),
              "kind": kind, "message": message, **fields}
        self.events.append(ev)
        self.log(f"event {kind}: {message}")
        line = protocol.encode(protocol.event(ev))
        for client in list(self.clients.values()):
            if client.follow:
                self._send(client, line)
        return ev

    # -- state transitions (the only places state changes) -------------------------------
    def _set_lab_state(self, state: str) -> None:
        assert state in LAB_STATES, state
        if state != self.state:
            self.state = state
            if state in ("running", "stopping"):
                self.record.state = state
                self.record.save()

    def _set_child_state(self, child: Child, state: str) -> None:
        assert state in (VM_STATES if child.kind == "vm" else GPU_STATES), (child.kind, state)
        child.state = state

    def _vm_exited(self, vm: Child) -> None:
        self._set_child_state(vm, "dead" if self.state != "stopping" else "stopped")
        if vm.state == "dead":
            self.event("vm-died", f"VM {vm.name}: QEMU (pid {vm.qemu_pid or vm.popen.pid}) "
                       f"{describe_exit(vm.returncode)}; the other VMs are untouched",
                       vm=vm.name, pid=vm.popen.pid, qemu_pid=vm.qemu_pid, returncode=vm.returncode)
            self._set_lab_state("degraded")

    def _gpu_exited(self, gpu: Child) -> None:
        self._set_child_state(gpu, "failed" if self.state != "stopping" else "stopped")
        if gpu.state == "failed":
            self.event("gpu-server-died", f"GPU {gpu.name} (in VM {gpu.owner}): server pid {gpu.popen.pid} "
                       f"{describe_exit(gpu.returncode)}", gpu=gpu.name, owner=gpu.owner,
                       pid=gpu.popen.pid, returncode=gpu.returncode)
            self._set_lab_state("degraded")

    def _smc_exited(self, smc: Child) -> None:
        self._set_child_state(smc, "failed" if self.state != "stopping" else "stopped")
        if smc.state == "failed":
            self.event("smc-server-died", f"shared-memory controller {smc.name} (hosts {', '.join(smc.hosts)}): "
                       f"server pid {smc.popen.pid} {describe_exit(smc.returncode)}", smc=smc.name,
                       hosts=list(smc.hosts), pid=smc.popen.pid, returncode=smc.returncode)
            self._set_lab_state("degraded")

    # -- start ---------------------------------------------------------------------------
    def run(self) -> int:
        """Boot the lab, serve until stopped; the process's exit code."""
        def interrupt(signum, frame):
            raise KeyboardInterrupt   # during boot: unwind Lab.start, which stops what it started
        signal.signal(signal.SIGTERM, interrupt)
        signal.signal(signal.SIGINT, interrupt)
        self.event("lab-starting", f"lab {self.record.name} ({self.record.topology}) starting",
                   lab=self.record.name, pid=os.getpid())
        try:
            self.lab.start(self.say)
            self._adopt_children()
            self._open_socket()
        except BaseException as err:   # whatever went wrong, stop what was started
            if isinstance(err, LabError):
                what, fix = err.what, err.fix
            elif isinstance(err, KeyboardInterrupt):
                what, fix = "interrupted while starting", "start it again"
            else:
                self.log(traceback.format_exc())
                what, fix = f"fabric manager could not start: {err!r}", f"see {self.record.logdir}/fm.log"
            self.log(f"start failed: {what}")
            self._report("error", {"what": what, "fix": fix})
            self._shutdown()
            return 1
        self._set_lab_state("running")
        self.event("lab-ready", f"lab {self.record.name} ready: VMs {', '.join(self.vms)}",
                   lab=self.record.name)
        self._report("ready", {"name": self.record.name, "socket": str(self.record.socket)})
        self._detach_stdout()
        try:
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _report(self, kind: str, data: dict) -> None:
        if self.progress:
            try:
                self.progress.write(f"{kind}: {json.dumps(data)}\n")
                self.progress.flush()
            except (BrokenPipeError, ValueError):
                self.progress = None

    def _detach_stdout(self) -> None:
        """The launcher has its answer: stdout goes nowhere from now on (it may exit)."""
        self.progress = None
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)

    def _adopt_children(self) -> None:
        for child in self.lab.children():
            if child.kind == "vm":
                self._set_child_state(child, "running")
                child.qemu_pid = find_qemu(child.popen.pid)
                self.vms[child.name] = child
                self.record.vms[child.name] = {"ssh_port": child.ssh_port}
                self.event("vm-ready", f"VM {child.name} ready (ssh 127.0.0.1:{child.ssh_port}, "
                           f"QEMU pid {child.qemu_pid})", vm=child.name, qemu_pid=child.qemu_pid)
            else:
                self._set_child_state(child, "attached")
                (self.smcs if child.kind == "smc" else self.gpus)[child.name] = child
        for child in [*self.vms.values(), *self.gpus.values(), *self.smcs.values()]:
            ident = ProcessId.of(child.popen.pid)
            if ident:
                self.record.processes[f"{child.kind}:{child.name}"] = ident.to_json()
            if child.qemu_pid and ProcessId.of(child.qemu_pid):
                self.record.processes[f"qemu:{child.name}"] = ProcessId.of(child.qemu_pid).to_json()
        self.record.save()

    def _open_socket(self) -> None:
        self.sel = selectors.DefaultSelector()
        path = self.record.socket
        path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        os.chmod(path, 0o600)
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, ("listen", None))
        # Signals wake the loop through this pair (PEP 475 would otherwise resume select()).
        self._wake = socket.socketpair()
        for s in self._wake:
            s.setblocking(False)
        signal.set_wakeup_fd(self._wake[1].fileno(), warn_on_full_buffer=False)
        self.sel.register(self._wake[0], selectors.EVENT_READ, ("signal", None))

        def request_stop(signum, frame):
            self.stop_requested = True
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        for child in [*self.vms.values(), *self.gpus.values(), *self.smcs.values()]:
            self._watch(child)

    def _watch(self, child: Child) -> None:
        try:
            child.pidfd = os.pidfd_open(child.popen.pid)
        except ProcessLookupError:   # already reaped: handle the exit now
            self._reap(child)
            return
        self.sel.register(child.pidfd, selectors.EVENT_READ, ("exit", child))

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stop_requested:
            for key, mask in self.sel.select():
                what, data = key.data
                if what == "listen":
                    self._accept()
                elif what == "signal":
                    try:
                        self._wake[0].recv(256)
                    except BlockingIOError:
                        pass
                elif what == "exit":
                    self._reap(data)
                elif what == "client":
                    if mask & selectors.EVENT_READ:
                        self._read(data)
                    if mask & selectors.EVENT_WRITE and data.sock.fileno() in self.clients:
                        self._flush(data)

    def _reap(self, child: Child) -> None:
        if child.pidfd is not None:
            self.sel.unregister(child.pidfd)
            os.close(child.pidfd)
            child.pidfd = None
        child.returncode = child.popen.wait()
        if child.kind == "vm":
            self._vm_exited(child)
        elif child.kind == "smc":
            self._smc_exited(child)
        else:
            self._gpu_exited(child)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        client = _Client(sock)
        self.clients[sock.fileno()] = client
        self.sel.register(sock, selectors.EVENT_READ, ("client", client))

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(client)
            return
        client.inbuf += data
        while b"\n" in client.inbuf and not client.close_after_flush:
            line, client.inbuf = client.inbuf.split(b"\n", 1)
            self._send(client, protocol.encode(self._answer(client, line)))
        if len(client.inbuf) > protocol.MAX_LINE:
            client.inbuf = b""
            client.close_after_flush = True
            self._send(client, protocol.encode(protocol.error(
                f"request longer than {protocol.MAX_LINE} bytes without a newline",
                "end each JSON request with a newline")))

    def _send(self, client: _Client, data: bytes) -> None:
        client.outbuf += data
        if len(client.outbuf) > MAX_OUTBUF:
            self.log("dropping a client that does not read its events")
            self._drop(client)
            return
        self._flush(client)

    def _flush(self, client: _Client) -> None:
        try:
            while client.outbuf:
                sent = client.sock.send(client.outbuf)
                client.outbuf = client.outbuf[sent:]
        except BlockingIOError:
            pass
        except OSError:
            self._drop(client)   # a failed write poisons the connection
            return
        if not client.outbuf and client.close_after_flush:
            self._drop(client)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbuf else 0)
        self.sel.modify(client.sock, events, ("client", client))

    def _drop(self, client: _Client) -> None:
        if self.clients.pop(client.sock.fileno(), None) is not None:
            self.sel.unregister(client.sock)
        client.sock.close()

    # -- requests ------------------------------------------------------------------------
    def _answer(self, client: _Client, line: bytes) -> dict:
        try:
            request = protocol.parse_request(line)
            result = getattr(self, f"op_{request['op']}")(client, request)
            return protocol.ok(result)
        except LabError as err:
            return protocol.error(err.what, err.fix)
        except Exception as err:   # a bug in an op must not take the lab down
            self.log(f"internal error: {traceback.format_exc()}")
            return protocol.error(f"fabric manager internal error: {err!r}",
                                  f"see {self.record.logdir}/fm.log and report it")

    def op_hello(self, client, request) -> dict:
        return {"protocol": protocol.VERSION, "lab": self.record.name, "pid": os.getpid(),
                "ops": list(protocol.OPS)}

    def op_status(self, client, request) -> dict:
        return self.status()

    def op_events(self, client, request) -> dict:
        since = request.get("since", 0)
        client.follow = bool(request.get("follow", False))
        return {"events": [ev for ev in self.events if ev["seq"] > since]}

    def op_ssh_info(self, client, request) -> dict:
        vm = self._vm(request["vm"])
        if vm.state != "running":
            raise LabError(f"VM {vm.name} of lab {self.record.name} is {vm.state}: "
                           f"its QEMU {describe_exit(vm.returncode)}",
                           f"see {vm.files.get('qemu_log', self.record.logdir)} (kept in "
                           f"{self.record.logdir} after vm down); vfio-cxl vm down {self.record.name} "
                           f"removes the lab")
        return {"vm": vm.name, "port": vm.ssh_port, **self.lab.ssh_info(vm.name)}

    def op_stop(self, client, request) -> dict:
        self.event("stop-requested", f"stop requested for lab {self.record.name}")
        self.stop_requested = True
        return {"stopping": self.record.name, "pid": os.getpid()}

    def op_restart(self, client, request) -> dict:
        gpu = self._gpu(request["gpu"])
        raise LabError(
            f"restarting GPU {gpu.name} is not supported yet",
            "a restart has to hot-remove the dead device from its VM first, and hot-removing a "
            "vfio-user device with MSI-X aborts QEMU 11.1.3; it comes with the GPU's MSI mode. "
            f"For now: vfio-cxl vm down {self.record.name}, then vm up again")

    def _vm(self, name: str) -> Child:
        if name not in self.vms:
            raise LabError(f"lab {self.record.name} has no VM {name!r}", f"VMs: {', '.join(self.vms)}")
        return self.vms[name]

    def _gpu(self, name: str) -> Child:
        if name not in self.gpus:
            raise LabError(f"lab {self.record.name} has no GPU {name!r}",
                           f"GPUs: {', '.join(self.gpus) or 'none'}")
        return self.gpus[name]

    def status(self) -> dict:
        now = time.time()
        return {
            "name": self.record.name, "topology": self.record.topology, "state": self.state,
            "fm_pid": os.getpid(), "created": self.record.created, "uptime": now - self.record.created,
            "rundir": self.record.rundir, "logdir": self.record.logdir, "socket": str(self.record.socket),
            "vms": {vm.name: {"state": vm.state, "ssh_port": vm.ssh_port, "pid": vm.popen.pid,
                              "run_state": self.lab.run_state(vm.name) if vm.state == "running" else None,
                              "qemu_pid": vm.qemu_pid, "returncode": vm.returncode, **vm.files}
                    for vm in self.vms.values()},
            "gpus": {gpu.name: {"owner": gpu.owner, "state": gpu.state, "server_pid": gpu.popen.pid,
                                "returncode": gpu.returncode, **gpu.files}
                     for gpu in self.gpus.values()},
            "smcs": {smc.name: {"hosts": list(smc.hosts), "state": smc.state, "server_pid": smc.popen.pid,
                                "returncode": smc.returncode, **smc.files}
                     for smc in self.smcs.values()},
        }

    # -- stop ----------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Stop everything, keep the logs, remove the run directory, then the record.

        Not interruptible by SIGTERM/SIGINT (a second `vm down` or Ctrl-C must not leave it
        half done); SIGKILL still ends it, and `vm down` then sweeps up."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        self._set_lab_state("stopping")
        self.event("lab-stopping", f"lab {self.record.name} stopping", lab=self.record.name)
        for client in list(self.clients.values()):
            client.sock.setblocking(True)
            client.sock.settimeout(1)
            try:
                client.sock.sendall(client.outbuf)
            except OSError:
                pass
            self._drop(client)
        if self.listener:
            self.listener.close()
            self.record.socket.unlink(missing_ok=True)
        signal.set_wakeup_fd(-1)
        for child in [*self.vms.values(), *self.gpus.values(), *self.smcs.values()]:
            if child.pidfd is not None:
                os.close(child.pidfd)
                child.pidfd = None
        try:
            self.lab.stop_processes()
        finally:
            self.log(f"lab {self.record.name} stopped; logs in {self.record.logdir}")
            self._set_lab_state("stopped")
            self.lab.close()   # keeps copies of the logs in the log directory, removes the run directory
            self.record.remove()
