"""The fabric manager: owns one lab's processes, serves its control socket, watches for deaths.

It is made of parts, each with one concern, composed here:

- :mod:`.state`: the lab's state machine (the one owner of every transition) and its children;
- :mod:`.events`: the event log (bounded history, pages);
- :mod:`.server`: the control protocol server (client sockets, framing, bounds, followers);
- :mod:`.dispatch`: request dispatch (one method per op);
- :mod:`.gpuops`: GPU operations (assign, release, restart, scrub);
- :mod:`.supervise`: process supervision (pidfds, the registry's process ids);
- :mod:`.worker`: the op worker thread.

Threads and the lock
--------------------
Two threads, one lock (``OpWorker.lock``, "the lock"), which guards all of the lab's state:
the children and their states, the event log, the registry record, the Redfish service.

- **The loop** (the main thread, :meth:`FabricManager._loop`) waits in one ``selectors``
  selector on the control socket and its clients, a signal wake-up socket, the op worker's
  wake-up socket, and one pidfd per child (a death is seen within one loop turn).  It takes
  the lock for each batch of ready keys and answers every request but the slow ones, reaps
  children, and is the only thread that touches a client socket: it sends what the worker
  posted to its outbox.  The main thread also boots the lab (QEMU, the servers the topology
  places) before the loop starts, and stops it after.
- **The op worker** (thread ``fm-ops``, :mod:`.worker`, alive as long as the FM) runs, one
  at a time, the slow ops (:data:`.dispatch.SLOW_OPS`: assign, release, restart) and what a
  death entails (freeing a dead VM's GPUs, surprise removal, automatic restart).  It holds
  the lock while it runs a job and **drops it only around one blocking call** (QMP, the
  guest's scripts over SSH, a server start: ``OpWorker.unlocked``), so that meanwhile the
  loop reports deaths and answers status.

Why dropping the lock is safe: only the worker moves a GPU (its owner, device id, port and
server: :mod:`.gpuops`); the loop, meanwhile, only reads state (status, events, ssh_info),
records events, starts or stops the Redfish service, records a death (a child's state
becomes dead/failed, the lab's degraded) and *queues* what the death entails behind the
running job.  So a job that takes the lock back finds at most
a death it did not see, and each re-checks for one: attach asks whether its VM still runs,
release whether its server still lives, and every queued job whether its GPU is still where
the death left it.  Once the lab stops, ``unlocked`` raises when it takes the lock back, so
no job outlives the stop.  The worker registers a fresh server's pidfd with the selector
while the loop waits in it (epoll allows that).

Why children are started only from these two long-lived threads: every child is started
with PR_SET_PDEATHSIG (and bwrap ``--die-with-parent``), which fires when the *thread*
that forked it exits.  The flip side is intended: when the fabric manager dies, however it
dies, its VMs and servers die with it, and ``vfio-cxl vm down`` only has to clean up files
(see :mod:`.cleanup`).
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
from pathlib import Path
from typing import Callable, Protocol

from ...errors import LabError
from . import protocol
from .dispatch import SLOW_OPS, Dispatcher
from .events import EVENT_HISTORY, EventLog
from .gpuops import GpuOps
from ..topology import Topology
from .registry import LabRecord
from .server import ControlServer
from .state import Child, LabState
from .supervise import Supervisor
from .worker import OpWorker

__all__ = ["EVENT_HISTORY", "Child", "FabricManager", "ManagedLab"]


class ManagedLab(Protocol):
    """What the fabric manager needs of a lab (the real :class:`~..lab.Lab` or a test's fake);
    a lab with a fabric also has ``device_add``, ``device_del``, ``hotplug_ports``..."""

    rundir: Path
    topology: Topology | None   # as loaded by this process (None: a fake lab without one)

    def start(self, log: Callable[[str], None]) -> None: ...
    def children(self) -> list[Child]: ...
    def ssh_info(self, vm: str) -> dict: ...
    def run_state(self, vm: str) -> str: ...
    def stop_processes(self) -> None: ...
    def close(self) -> None: ...


class FabricManager:
    def __init__(self, lab: ManagedLab, record: LabRecord, *, progress=None, log=None):
        self.lab = lab
        self.record = record
        self.progress = progress          # a text stream to `vm up --detach`, or None
        self.log_stream = log or sys.stderr
        self.stop_requested = False
        self.redfish = None               # the Redfish service process (op redfish), or None
        self.eventlog = EventLog()
        self.worker = OpWorker(self._run_job, record.name)
        self.state = LabState(record, self.event, lambda kind, job: self.worker.put(kind, None, job),
                              can_remove=hasattr(lab, "device_del"))
        self.supervisor = Supervisor(record, self.state.exited)
        self.gpuops = GpuOps(lab, self.state, self.supervisor, self.worker.unlocked, self.event,
                             lambda: self.eventlog.seq)
        self.dispatcher = Dispatcher(self)
        self.sel: selectors.BaseSelector | None = None
        self.server: ControlServer | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None

    # -- logging and events --------------------------------------------------------------
    def log(self, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {text}", file=self.log_stream, flush=True)

    def say(self, text: str) -> None:
        """A progress line for the `vm up --detach` terminal (and the FM log)."""
        self.log(text)
        self._report("progress", text)

    def _report(self, kind: str, data) -> None:
        """A line to the `vm up --detach` launcher: ``progress: TEXT``, ``ready: {json}``, ``error: {json}``."""
        if self.progress:
            try:
                self.progress.write(f"{kind}: {data if isinstance(data, str) else json.dumps(data)}\n")
                self.progress.flush()
            except (BrokenPipeError, ValueError):
                self.progress = None   # the CLI went away; the lab carries on

    def event(self, kind: str, message: str, **fields) -> dict:
        """Record an event and send it to every follower (from the worker: the loop sends it)."""
        ev, line = self.eventlog.record(kind, message, **fields)
        self.log(f"event {kind}: {ev['message']}")
        if self.worker.in_worker():
            self.worker.post(None, line)
        elif self.server is not None:
            self.server.broadcast(line)
        return ev

    # -- requests and jobs ---------------------------------------------------------------
    def _handle_request(self, client, request: dict) -> dict | None:
        """In the loop: the answer, or None once a slow op went to the worker."""
        if request["op"] in SLOW_OPS and self.worker.running:
            self.worker.put("op", client, request)
            return None
        return self.dispatcher.run(client, request)

    def _run_job(self, kind: str, client, request: dict) -> None:
        """In the worker, with the lock held: a client's slow op, or what a death entails."""
        if kind == "op":
            self.worker.post(client, protocol.encode(self.dispatcher.run(client, request)))
            return
        job = {"free_gpu": self.gpuops.free_dead_vms_gpu, "auto_restart": self.gpuops.auto_restart,
               "surprise_removal": self.gpuops.surprise_removal}[kind]
        try:
            job(**request)
        except LabError as err:
            self.event(f"{kind.replace('_', '-')}-failed", f"{err.what} ({err.fix})", **request)
        except Exception:
            self.log(f"internal error in {kind}: {traceback.format_exc()}")

    def _send_outbox(self) -> None:
        """In the loop: send what the worker posted (events to followers, answers to their clients)."""
        for client, data in self.worker.take_outbox():
            if client is None:
                self.server.broadcast(data)
            else:
                self.server.answer_later(client, data)

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
            self._serve()
        except BaseException as err:   # whatever went wrong, stop what was started
            self._start_failed(err)
            return 1
        self.state.set_lab("running")
        self.event("lab-ready", f"lab {self.record.name} ready: VMs {', '.join(self.state.vms)}",
                   lab=self.record.name)
        self._report("ready", {"name": self.record.name, "socket": str(self.record.socket)})
        self._detach_stdout()
        try:
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _start_failed(self, err: BaseException) -> None:
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

    def _detach_stdout(self) -> None:
        """The launcher has its answer: stdout goes nowhere from now on (it may exit)."""
        self.progress = None
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)

    def _adopt_children(self) -> None:
        specs = self.lab.gpu_specs() if hasattr(self.lab, "gpu_specs") else {}
        for vm in self.state.adopt(self.lab.children(), specs):
            self.supervisor.find_qemu(vm)
            self.record.vms[vm.name] = {"ssh_port": vm.ssh_port}
            self.event("vm-ready", f"VM {vm.name} ready (ssh 127.0.0.1:{vm.ssh_port}, "
                       f"QEMU pid {vm.qemu_pid})", vm=vm.name, qemu_pid=vm.qemu_pid)
        for child in self.state.children():
            self.supervisor.note(child, save=False)
        self.record.save()

    def _serve(self) -> None:
        """The selector: the control socket, signals, the worker's wake-ups, every child's pidfd."""
        self.sel = selectors.DefaultSelector()
        self.server = ControlServer(self.sel, self._handle_request, self.log)
        self.server.listen(self.record.socket)
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
        self.supervisor.sel = self.sel
        for child in self.state.children():
            if child.popen is not None:
                self.supervisor.watch(child)
        self.sel.register(self.worker.wake[0], selectors.EVENT_READ, ("ops", None))
        self.worker.start()

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stop_requested:
            ready = self.sel.select()
            with self.worker.lock:
                for key, mask in ready:
                    self._handle(key, mask)

    def _handle(self, key, mask) -> None:
        what, data = key.data
        if what == "ops":
            self._send_outbox()
        elif what == "listen":
            self.server.accept()
        elif what == "signal":
            try:
                self._wake[0].recv(256)
            except BlockingIOError:
                pass
        elif what == "exit":
            self.supervisor.ready(data, key.fd)
        elif what == "client":
            self.server.ready(data, mask)

    # -- stop ----------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Stop everything, keep the logs, remove the run directory, then the record.

        Not interruptible by SIGTERM/SIGINT (a second `vm down` or Ctrl-C must not leave it
        half done); SIGKILL still ends it, and `vm down` then sweeps up."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        # The worker's job ends at its next step; wait for it, so nothing it does overlaps the stop.
        if not self.worker.stop(60):
            self.log("the op worker did not end within 60 s; stopping anyway")
        self.state.set_lab("stopping")
        self.event("lab-stopping", f"lab {self.record.name} stopping", lab=self.record.name)
        if self.server is not None:
            self.server.close()
        signal.set_wakeup_fd(-1)
        if self.redfish is not None:   # a client of this FM: it goes first
            self.redfish.stop()
        self.supervisor.forget(self.state.children())
        try:
            self.lab.stop_processes()
        finally:
            self.log(f"lab {self.record.name} stopped; logs in {self.record.logdir}")
            self.state.set_lab("stopped")
            self.lab.close()   # keeps copies of the logs in the log directory, removes the run directory
            self.record.remove()
