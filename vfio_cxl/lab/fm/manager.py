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
import queue
import re
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
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
GPU_STATES = ("attached", "free", "moving", "failed", "stopped")
# s for the guest to let go of a GPU (DEVICE_DELETED), and to bind one: see protocol.op_timeout
RELEASE_TIMEOUT, BIND_TIMEOUT = protocol.RELEASE_TIMEOUT, protocol.BIND_TIMEOUT
MAX_OUTBUF = 4 << 20   # a follower that reads slower than this is dropped
EVENT_HISTORY = 1000   # events kept for `events` (older ones are dropped, and counted)
EVENT_PAGE = 100       # events per `events` answer by default ...
EVENT_PAGE_MAX = 1000  # ... and at most
EVENT_PAGE_BYTES = 256 << 10   # and at most this much JSON (an answer stays far below MAX_LINE)
EVENT_MESSAGE_MAX = 2000       # characters of an event's message (it may quote a guest)
SLOW_OPS = ("assign", "release", "restart")   # run by the op worker; the loop stays live meanwhile


@dataclass
class Child:
    """A process the lab started: a VM's QEMU (kind "vm"), a GPU server (kind "gpu") or a
    shared-memory controller's server (kind "smc", serving the VMs in ``hosts``)."""

    kind: str
    name: str
    popen: Popen | None
    owner: str | None = None                 # gpu: the VM it is plugged into
    ssh_port: int | None = None              # vm
    files: dict[str, str] = field(default_factory=dict)   # log name -> live path
    state: str = ""
    returncode: int | None = None
    qemu_pid: int | None = None              # vm: QEMU itself (below bwrap, if any)
    pidfd: int | None = None
    hosts: tuple[str, ...] = ()              # smc: the VMs it serves, host ID = position
    # gpu only: where it sits, how it interrupts, what its VRAM holds
    dev_id: str | None = None                # QEMU device id while it is in a VM
    port: str | None = None                  # the VM's root port it is plugged into
    irq: str = "msix"
    vram_mib: int = 0
    scrubbed: bool = True                    # VRAM zero since its last owner
    generation: int = 0                      # servers started for it (names their sockets)
    restart: str = "no"                      # the topology's restart policy: "no" or "on-failure"
    max_restarts: int = 0
    restarts: int = 0                        # automatic restarts so far


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


def describe_holders(holders: list[dict]) -> str:
    """Guest processes for a message; a name with anything but plain characters is quoted (JSON)."""
    def name(comm: str) -> str:
        return comm if re.fullmatch(r"[\w.+:@/-]+", comm, re.A) else json.dumps(comm)
    return ", ".join(f"pid {h['pid']} ({name(h['comm'])}) on {h['path']}" for h in holders) or \
        "no process (the kernel itself?)"


def attach_parts(t_add_sent: float, t_add_done: float, seen: dict) -> dict:
    """Attach split in its parts (seconds): device_add (QMP round trip, host clock); exec (the
    SSH exec of the guest's check, both ways: host time minus the script's own run); appear
    (the script's start -> it sees the new GPU in sysfs: ACPI hot-plug and enumeration, if not
    done before the script started) and bind (-> vfio-pci has it), both on the guest's clock.
    A fake lab's answer without those times gives only the device_add part."""
    parts = {"device_add_s": t_add_done - t_add_sent}
    guest, host = seen.get("guest"), seen.get("host")
    if not guest or not host:
        return parts
    parts["exec_s"] = max((host["returned"] - host["exec"]) - (guest["bound"] - guest["start"]), 0.0)
    parts["appear_s"] = guest["seen"] - guest["start"]
    parts["bind_s"] = guest["bound"] - guest["seen"]
    return parts


class _Client:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()
        self.scanned = 0            # inbuf[:scanned] has no newline
        self.outbuf = bytearray()
        self.mask = 0               # what the loop's selector waits for on it (0: not registered)
        self.follow = False
        self.close_after_flush = False
        self.busy = False           # a slow op of this connection runs: its later requests wait
        self.backlog: list[bytes] = []   # `event` lines owed to a new follower after its answer
        self.eof = False            # the client shut its side: no more requests


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
        # The newest EVENT_HISTORY events, each with its encoded `event` line (its size is known,
        # and the line is what a follower gets); seq counts every event of the lab's life.
        self.history: deque[tuple[dict, bytes]] = deque(maxlen=EVENT_HISTORY)
        self.seq = 0
        self.clients: dict[int, _Client] = {}
        self.stop_requested = False
        self.sel: selectors.BaseSelector | None = None
        self.listener: socket.socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        # The op worker: one thread for the lab's whole life runs the slow ops (assign, release,
        # restart) and what deaths entail (surprise removal, freeing a dead VM's GPUs), one at a
        # time, so the loop keeps reporting deaths and answering status meanwhile.  ``lock``
        # guards all state; the worker drops it around every blocking call (_unlocked).  It
        # lives as long as the FM, so the GPU servers it starts (PR_SET_PDEATHSIG: killed when the
        # thread that forked them exits) live as long as the FM too.
        self.lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._worker_ident: int | None = None
        self._outbox: list[tuple[_Client | None, bytes]] = []   # from the worker to the loop
        self._opwake: tuple[socket.socket, socket.socket] | None = None
        self._stopping_ops = False
        self.redfish = None   # the Redfish service process (op redfish), or None

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
        if len(message) > EVENT_MESSAGE_MAX:
            message = message[:EVENT_MESSAGE_MAX] + f"... ({len(message)} characters)"
        self.seq += 1
        ev = {"seq": self.seq, "time": time.time(), "monotonic": time.monotonic(),
              "kind": kind, "message": message, **fields}
        line = protocol.encode(protocol.event(ev))
        self.history.append((ev, line))
        self.log(f"event {kind}: {message}")
        if self._in_worker():
            self._post(None, line)   # the loop sends it (sockets are the loop's)
            return ev
        for client in list(self.clients.values()):
            if client.follow:
                self._send(client, line)
        return ev

    @property
    def events(self) -> list[dict]:
        """The events still kept, oldest first."""
        return [ev for ev, _ in self.history]

    def events_page(self, since: int, limit: int) -> tuple[dict, list[bytes]]:
        """Events after ``since``: the answer's page (at most ``limit`` events and
        EVENT_PAGE_BYTES of JSON), and the `event` lines of the kept ones after it."""
        oldest = self.history[0][0]["seq"] if self.history else self.seq + 1
        page, size, rest = [], 0, []
        for ev, line in self.history:
            if ev["seq"] <= since:
                continue
            if rest or len(page) >= limit or (page and size + len(line) > EVENT_PAGE_BYTES):
                rest.append(line)
                continue
            page.append(ev)
            size += len(line)
        return {"events": page, "more": bool(rest), "oldest": oldest, "latest": self.seq,
                "dropped": max(oldest - 1 - max(since, 0), 0)}, rest

    # -- the op worker -------------------------------------------------------------------
    def _in_worker(self) -> bool:
        return self._worker_ident is not None and threading.get_ident() == self._worker_ident

    def _post(self, client: "_Client | None", data: bytes) -> None:
        """From the worker: a line for the loop to send (client None: to every follower)."""
        self._outbox.append((client, data))
        if self._opwake is not None:
            try:
                self._opwake[1].send(b"x")
            except (BlockingIOError, OSError):
                pass   # a wake-up is pending already, or the loop is gone (stopping)

    def _unlocked(self, fn, *args, **kwargs):
        """A blocking call (QMP, SSH, a server start) made without the lock when in the worker."""
        if not self._in_worker():
            return fn(*args, **kwargs)
        self.lock.release()
        try:
            return fn(*args, **kwargs)
        finally:
            self.lock.acquire()
            if self._stopping_ops:
                raise LabError(f"lab {self.record.name} is stopping", "start it again")

    def _start_worker(self) -> None:
        self._opwake = socket.socketpair()
        for s in self._opwake:
            s.setblocking(False)
        self.sel.register(self._opwake[0], selectors.EVENT_READ, ("ops", None))
        self._worker = threading.Thread(target=self._work, name="fm-ops", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        self._worker_ident = threading.get_ident()
        while (job := self._jobs.get()) is not None:
            kind, client, request = job
            with self.lock:
                if self._stopping_ops:
                    continue
                if kind == "op":
                    self._post(client, protocol.encode(self._run_op(client, request)))
                else:
                    try:
                        getattr(self, f"_job_{kind}")(**request)
                    except LabError as err:
                        self.event(f"{kind.replace('_', '-')}-failed", f"{err.what} ({err.fix})", **request)
                    except Exception:
                        self.log(f"internal error in {kind}: {traceback.format_exc()}")

    def _drain_outbox(self) -> None:
        """In the loop: send what the worker left (events, answers); a connection whose slow op
        ended goes on with its next request."""
        try:
            while self._opwake[0].recv(4096):
                pass
        except BlockingIOError:
            pass
        out, self._outbox = self._outbox, []
        for client, data in out:
            if client is None:
                for c in list(self.clients.values()):
                    if c.follow:
                        self._send(c, data)
            elif client.sock.fileno() in self.clients and self.clients[client.sock.fileno()] is client:
                client.busy = False
                self._send(client, data)
                self._serve_lines(client)

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
            for gpu in self.gpus.values():   # its GPUs become free, scrubbed, assignable (the worker)
                if gpu.owner == vm.name:
                    self._jobs.put(("free_gpu", None, {"gpu": gpu.name, "vm": vm.name}))

    def _job_free_gpu(self, gpu: str, vm: str) -> None:
        child = self.gpus[gpu]
        if child.owner != vm:   # an op moved it meanwhile
            return
        self._gpu_left(child, keep_vram=False)
        self.event("gpu-freed", f"GPU {gpu}: free (its VM {vm} died); VRAM scrubbed by a fresh server "
                   f"(pid {child.popen.pid if child.popen else None})", gpu=gpu, vm=vm, scrubbed=child.scrubbed)

    def _gpu_exited(self, gpu: Child) -> None:
        self._set_child_state(gpu, "failed" if self.state != "stopping" else "stopped")
        if gpu.state == "failed":
            t0 = time.monotonic()
            self.event("gpu-server-died", f"GPU {gpu.name} (in VM {gpu.owner}): server pid {gpu.popen.pid} "
                       f"{describe_exit(gpu.returncode)}", gpu=gpu.name, owner=gpu.owner,
                       pid=gpu.popen.pid, returncode=gpu.returncode)
            self._set_lab_state("degraded")
            if gpu.dev_id and gpu.irq == "msi" and hasattr(self.lab, "device_del"):
                self._jobs.put(("surprise_removal", None, {"gpu": gpu.name, "seen": t0}))
            if gpu.restart == "on-failure":
                if gpu.restarts < gpu.max_restarts:
                    self._jobs.put(("auto_restart", None, {"gpu": gpu.name}))
                else:
                    self.event("gpu-restart-limit", f"GPU {gpu.name}: restarted {gpu.restarts} times already "
                               f"(max_restarts = {gpu.max_restarts}); it stays failed", gpu=gpu.name,
                               restarts=gpu.restarts)

    def _job_auto_restart(self, gpu: str) -> None:
        """The topology's restart = "on-failure": what `fm restart` does, counted."""
        child = self.gpus[gpu]
        if child.state != "failed":
            return   # restarted by hand meanwhile
        child.restarts += 1
        self.event("gpu-auto-restart", f"GPU {gpu}: restart {child.restarts} of {child.max_restarts} "
                   "(restart = \"on-failure\")", gpu=gpu, restart=child.restarts)
        self.op_restart(None, {"gpu": gpu})

    def _job_surprise_removal(self, gpu: str, seen: float) -> None:
        """Take a dead server's device out of its VM so guest processes get the kernel's release
        request (and an error) instead of hanging in reset waits."""
        child = self.gpus[gpu]
        owner = self.vms.get(child.owner) if child.owner else None
        if child.state != "failed" or not child.dev_id or owner is None or owner.state != "running":
            return   # restarted, moved or its VM gone meanwhile
        dev_id, vm = child.dev_id, child.owner
        self._unlocked(self.lab.device_del, vm, dev_id)
        child.files["pending_delete"] = dev_id
        self.event("gpu-surprise-removal", f"GPU {gpu}: device_del {dev_id} sent to VM {vm} "
                   f"{1e3 * (time.monotonic() - seen):.0f} ms after the death was seen",
                   gpu=gpu, vm=vm, dev_id=dev_id)

    # -- the fabric: assign, release, restart (GPU state changes only through these) -------
    def _fabric(self):
        if not hasattr(self.lab, "device_add"):
            raise LabError("this lab has no fabric (no hot-plug support)", "use a real lab")
        return self.lab

    def _unwatch(self, child: Child) -> None:
        if child.pidfd is not None:
            self.sel.unregister(child.pidfd)
            os.close(child.pidfd)
            child.pidfd = None

    def _fresh_server(self, gpu: Child) -> None:
        """Scrub = a fresh server: its VRAM is a new memfd, zero; the old one's memory is gone."""
        self._unwatch(gpu)
        gpu.generation += 1
        gpu.popen = None
        gpu.popen, files = self._unlocked(self._fabric().start_server, gpu.name, gpu.generation)
        if hasattr(self.lab, "prepare_standby"):   # the next scrub's server starts now, in the background
            self.lab.prepare_standby(gpu.name)
        gpu.files.update(files)
        gpu.returncode = None
        gpu.scrubbed = True
        ident = ProcessId.of(gpu.popen.pid)
        if ident:
            self.record.processes[f"gpu:{gpu.name}"] = ident.to_json()
            self.record.save()
        if self.sel is not None:
            self._watch(gpu)

    def _gpu_left(self, gpu: Child, keep_vram: bool) -> None:
        """The GPU is out of its VM (DEVICE_DELETED, or the VM died): free, scrubbed unless kept."""
        gpu.owner, gpu.dev_id, gpu.port = None, None, None
        gpu.files.pop("pending_delete", None)
        if not keep_vram or gpu.popen is None or gpu.popen.poll() is not None:
            self._fresh_server(gpu)
        else:
            gpu.scrubbed = False
        self._set_child_state(gpu, "free")

    def free_ports(self, vm: str) -> list[str]:
        used = {g.port for g in self.gpus.values() if g.owner == vm}
        return [p for p in self._fabric().hotplug_ports(vm) if p not in used]

    def _check_removable(self, gpu: Child) -> None:
        if gpu.irq != "msi":
            raise LabError(
                f"GPU {gpu.name} uses MSI-X, and hot-removing a vfio-user device with MSI-X aborts "
                f"this QEMU (11.1.3: memory_region_del_subregion assertion in vfio-user's finalize; "
                f"fixed upstream by 'vfio-user: Do not delete the subregion')",
                f'set irq = "msi" under [gpus.{gpu.name}] in the topology (as the fabric topology does) '
                f"and boot the lab again")

    def release(self, gpu: Child, *, force: bool = False, keep_vram: bool = False,
                timeout: float = RELEASE_TIMEOUT) -> dict:
        fabric = self._fabric()
        if gpu.owner is None or gpu.dev_id is None:
            raise LabError(f"GPU {gpu.name} is not in a VM (state {gpu.state})", "nothing to release")
        self._check_removable(gpu)
        vm, dev_id, was = gpu.owner, gpu.dev_id, gpu.state
        self._set_child_state(gpu, "moving")
        t0 = time.monotonic()
        try:
            if gpu.files.get("pending_delete") != dev_id:
                self._unlocked(fabric.device_del, vm, dev_id)
            deleted = self._unlocked(fabric.wait_deleted, vm, dev_id, timeout)
            if not deleted:
                holders, known, bdf = self._holders(vm, dev_id)
                if force and known and holders:
                    pids = [h["pid"] for h in holders]
                    self.event("gpu-force", f"GPU {gpu.name}: VM {vm} did not let go within {timeout:g} s; "
                               f"killing what holds it: {describe_holders(holders)}", gpu=gpu.name, vm=vm,
                               pids=pids)
                    killed, skipped = self._unlocked(fabric.kill_in_guest, vm, bdf, pids)
                    if skipped:
                        self.event("gpu-force-skipped", f"GPU {gpu.name}: VM {vm}: not killed: " + ", ".join(
                            f"pid {p} ({why})" for p, why in skipped.items()), gpu=gpu.name, vm=vm,
                            killed=killed, skipped=skipped)
                    deleted = self._unlocked(fabric.wait_deleted, vm, dev_id, timeout)
                    if not deleted:
                        holders, known, bdf = self._holders(vm, dev_id)
            if not deleted:
                what = describe_holders(holders) if known else f"unknown ({holders})"
                raise LabError(f"VM {vm} did not release GPU {gpu.name} within {timeout:g} s "
                               f"(no DEVICE_DELETED for {dev_id}); holding it: {what}",
                               f"stop that process in VM {vm}, or vfio-cxl fm release {gpu.name} --force "
                               f"(kills it)" if not force else
                               f"the guest did not say what holds it; see VM {vm}'s console log and "
                               f"vfio-cxl vm ssh {vm} -- dmesg" if not known else
                               f"the process could not be killed (state D: stuck in the kernel?); see VM {vm}'s "
                               f"dmesg (vfio-cxl vm ssh {vm} -- dmesg)")
        except BaseException:
            self._set_child_state(gpu, was if gpu.popen is not None and gpu.popen.poll() is None else "failed")
            raise
        t_release = time.monotonic() - t0
        t1 = time.monotonic()
        self._gpu_left(gpu, keep_vram)
        t_scrub = time.monotonic() - t1
        self.event("gpu-released", f"GPU {gpu.name} released by VM {vm} in {t_release * 1e3:.0f} ms; "
                   + ("VRAM kept" if keep_vram else f"VRAM scrubbed (fresh server pid {gpu.popen.pid}, "
                                                    f"{t_scrub * 1e3:.0f} ms)"),
                   gpu=gpu.name, vm=vm, release_s=t_release, scrub_s=t_scrub, scrubbed=gpu.scrubbed)
        return {"gpu": gpu.name, "vm": vm, "release_s": t_release, "scrub_s": t_scrub, "scrubbed": gpu.scrubbed}

    def _holders(self, vm: str, dev_id: str) -> tuple:
        """(holders, True, bdf): the guest processes that hold dev_id's VFIO nodes; (reason, False,
        bdf) if that cannot be found out."""
        bdf = None
        try:
            bdf = self._unlocked(self.lab.guest_bdf, vm, dev_id)
            if bdf is None:
                return f"QEMU of VM {vm} does not list {dev_id}", False, None
            return self._unlocked(self.lab.holders, vm, bdf), True, bdf
        except Exception as err:
            return str(err), False, bdf

    def attach(self, gpu: Child, vm: str) -> dict:
        fabric = self._fabric()
        ports = self.free_ports(vm)
        if not ports:
            raise LabError(f"VM {vm} has no free hot-plug port for GPU {gpu.name}",
                           f"release a GPU from {vm}, or give it more: hotplug_ports in the topology")
        if gpu.popen is None or gpu.popen.poll() is not None:
            self._fresh_server(gpu)
        self._set_child_state(gpu, "moving")
        port = ports[0]
        dev_id = f"{gpu.name}-{gpu.generation}-{self.seq}"
        t0 = time.monotonic()
        # Owned from before device_add: a VM death handled meanwhile frees the GPU (its free_gpu
        # job finds it owned by the dead VM) instead of leaving it to a dead owner.
        gpu.owner, gpu.dev_id, gpu.port = vm, dev_id, port
        try:
            try:
                self._unlocked(fabric.device_add, vm, dev_id, port, gpu.files["socket"])
            except BaseException:
                if self.vms[vm].state == "running":   # QEMU refused it: not in the VM
                    gpu.owner, gpu.dev_id, gpu.port = None, None, None
                raise
            t_add = time.monotonic() - t0
            count = sum(1 for g in self.gpus.values() if g.owner == vm)   # this one included
            seen = self._unlocked(fabric.bind_in_guest, vm, count, BIND_TIMEOUT)
            t_attach = time.monotonic() - t0
            parts = attach_parts(t0, t0 + t_add, seen)
            message = (f"GPU {gpu.name} attached to VM {vm} on {port} as {dev_id}, bound to "
                       f"{seen['driver']} at {seen['bdf']} in {t_attach * 1e3:.0f} ms ("
                       + ", ".join(f"{k[:-2]} {v * 1e3:.0f} ms" for k, v in parts.items()) + ")")
        except BaseException as err:
            alive = gpu.popen is not None and gpu.popen.poll() is None
            self._set_child_state(gpu, "free" if gpu.owner is None and alive else "failed")
            if gpu.dev_id == dev_id and self.vms[vm].state == "running":   # in the VM: the guest's check failed
                reason = f"{err.what} ({err.fix})" if isinstance(err, LabError) else repr(err)
                self.event("gpu-attach-failed", f"GPU {gpu.name}: in VM {vm} as {dev_id}, but the guest's "
                           f"check failed: {reason}; vfio-cxl fm restart {gpu.name} or fm release "
                           f"{gpu.name} --force takes it back", gpu=gpu.name, vm=vm, dev_id=dev_id)
            raise
        self._set_child_state(gpu, "attached")
        self.event("gpu-attached", message, gpu=gpu.name, vm=vm, port=port, dev_id=dev_id, bdf=seen["bdf"],
                   attach_s=t_attach, device_add_s=t_add, attach_parts=parts)
        return {"gpu": gpu.name, "vm": vm, "port": port, "bdf": seen["bdf"], "attach_s": t_attach,
                "device_add_s": t_add, "attach_parts": parts, "scrubbed": gpu.scrubbed}

    def op_assign(self, client, request) -> dict:
        gpu, vm = self._gpu(request["gpu"]), self._vm(request["vm"])
        keep = bool(request.get("keep_vram", False))
        if vm.state != "running":
            raise LabError(f"VM {vm.name} is {vm.state}", f"assign {gpu.name} to a running VM")
        if gpu.state == "moving":
            raise LabError(f"GPU {gpu.name} is moving", "wait for the move to end (vfio-cxl fm events)")
        if gpu.owner == vm.name and gpu.state == "attached":
            return {"gpu": gpu.name, "vm": vm.name, "already": True}
        t0 = time.monotonic()
        result = {"gpu": gpu.name, "vm": vm.name, "from": gpu.owner}
        if gpu.owner is not None:
            if not self.free_ports(vm.name):   # refuse before taking it away from its owner
                raise LabError(f"VM {vm.name} has no free hot-plug port for GPU {gpu.name}",
                               f"release a GPU from {vm.name}, or give it more: hotplug_ports in the topology")
            result.update(self.release(gpu, keep_vram=keep))
        elif not keep and not gpu.scrubbed:
            t1 = time.monotonic()
            self._fresh_server(gpu)
            result["scrub_s"] = time.monotonic() - t1
        result.update(self.attach(gpu, vm.name))
        result["vm"] = vm.name
        result["move_s"] = time.monotonic() - t0
        return result

    def op_release(self, client, request) -> dict:
        timeout = float(request.get("timeout", RELEASE_TIMEOUT))
        if not 0 < timeout <= protocol.RELEASE_TIMEOUT_MAX:
            raise LabError(f"release timeout {timeout:g} s is out of range",
                           f"give 0 < timeout <= {protocol.RELEASE_TIMEOUT_MAX:g} seconds")
        return self.release(self._gpu(request["gpu"]), force=bool(request.get("force", False)),
                            keep_vram=bool(request.get("keep_vram", False)), timeout=timeout)

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
                if child.kind == "smc":
                    self.smcs[child.name] = child
                else:
                    child.dev_id = child.dev_id or child.name
                    self.gpus[child.name] = child
        specs = self.lab.gpu_specs() if hasattr(self.lab, "gpu_specs") else {}
        for name, spec in specs.items():
            gpu = self.gpus.get(name) or Child("gpu", name, None)
            gpu.irq, gpu.vram_mib = spec["irq"], spec["vram_mib"]
            gpu.restart, gpu.max_restarts = spec.get("restart", "no"), spec.get("max_restarts", 0)
            if name not in self.gpus:   # unowned: no server until it is assigned
                self._set_child_state(gpu, "free")
                self.gpus[name] = gpu
        for child in [*self.vms.values(), *self.gpus.values(), *self.smcs.values()]:
            if child.popen is None:
                continue
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
        self.listener.listen(128)
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
            if child.popen is not None:
                self._watch(child)
        self._start_worker()

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
            ready = self.sel.select()
            with self.lock:
                for key, mask in ready:
                    self._handle(key, mask)

    def _handle(self, key, mask) -> None:
        what, data = key.data
        if what == "ops":
            self._drain_outbox()
        elif what == "listen":
            self._accept()
        elif what == "signal":
            try:
                self._wake[0].recv(256)
            except BlockingIOError:
                pass
        elif what == "exit":
            if data.pidfd == key.fd:   # not a server the worker replaced meanwhile
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
        self._interest(client)

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:   # the client sends no more: answer what it sent, then close
            client.eof = True
            self._serve_lines(client)
            return
        client.inbuf += data   # a bytearray: appending does not copy what is there
        self._serve_lines(client)

    def _serve_lines(self, client: _Client) -> None:
        """Answer the complete request lines of a connection, in order; a slow op goes to the
        worker, and the connection's next requests wait for its answer.

        What a connection may have buffered is bounded: past MAX_LINE bytes not yet served the
        loop stops reading it (the client's writes block) until its slow op ends, and a line
        longer than MAX_LINE is refused and the connection closed."""
        buf, start = client.inbuf, 0
        while not client.close_after_flush and not client.busy and client.sock.fileno() >= 0:
            end = buf.find(b"\n", max(start, client.scanned))
            if end < 0:
                client.scanned = len(buf)
                break
            if end - start > protocol.MAX_LINE:
                client.scanned = end   # refused below, as a line without its newline
                break
            line = bytes(buf[start:end])
            start = end + 1
            try:
                request = protocol.parse_request(line)
            except LabError as err:
                self._send(client, protocol.encode(protocol.error(err.what, err.fix)))
                continue
            except Exception as err:   # whatever a client sends, the lab stays up
                self.log(f"internal error parsing a request: {traceback.format_exc()}")
                self._send(client, protocol.encode(protocol.error(
                    f"fabric manager could not parse the request: {type(err).__name__}",
                    'send one JSON object per line, e.g. {"version": 1, "op": "status"}')))
                continue
            if request["op"] in SLOW_OPS and self._worker is not None:
                client.busy = True
                self._jobs.put(("op", client, request))
                break
            self._send(client, protocol.encode(self._run_op(client, request)))
            if client.backlog:
                backlog, client.backlog = client.backlog, []
                for line in backlog:
                    if client.sock.fileno() < 0:
                        break
                    self._send(client, line)
        del buf[:start]   # once per call, not once per line
        client.scanned = max(client.scanned - start, 0)
        if client.sock.fileno() < 0:
            return   # dropped while answering (a follower that does not read)
        if client.eof and not client.busy and not client.close_after_flush:
            client.close_after_flush = True   # a partial last line is dropped
            self._flush(client)
            return
        if client.close_after_flush:
            buf.clear()
        elif not client.busy and client.scanned > protocol.MAX_LINE:
            buf.clear()
            client.scanned = 0
            client.close_after_flush = True
            self._send(client, protocol.encode(protocol.error(
                f"request longer than {protocol.MAX_LINE} bytes without a newline",
                "end each JSON request with a newline")))
            return
        self._interest(client)

    def _interest(self, client: _Client) -> None:
        """Read a connection unless it has a full request line's worth waiting (backpressure);
        write to it while it has output."""
        reading = len(client.inbuf) <= protocol.MAX_LINE and not client.close_after_flush and not client.eof
        events = (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if client.outbuf else 0)
        # events == 0: nothing to do until its slow op ends (a hang-up is seen when it answers)
        if events != client.mask:
            if client.mask == 0:
                self.sel.register(client.sock, events, ("client", client))
            elif events == 0:
                self.sel.unregister(client.sock)
            else:
                self.sel.modify(client.sock, events, ("client", client))
            client.mask = events

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
                del client.outbuf[:sent]
        except BlockingIOError:
            pass
        except OSError:
            self._drop(client)   # a failed write poisons the connection
            return
        if not client.outbuf and client.close_after_flush:
            self._drop(client)
            return
        self._interest(client)

    def _drop(self, client: _Client) -> None:
        if self.clients.pop(client.sock.fileno(), None) is not None and client.mask:
            self.sel.unregister(client.sock)
        client.mask = 0
        client.sock.close()

    # -- requests ------------------------------------------------------------------------
    def _run_op(self, client: _Client, request: dict) -> dict:
        try:
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
        limit = request.get("limit", EVENT_PAGE)
        if not 1 <= limit <= EVENT_PAGE_MAX:
            raise LabError(f"events limit {limit} is out of range", f"give 1 <= limit <= {EVENT_PAGE_MAX}")
        result, rest = self.events_page(since, limit)
        if request.get("follow", False):
            # The rest of the history, then every new event, as `event` lines after this answer:
            # sent in this loop turn, so none is missed or repeated.
            client.follow = True
            client.backlog = rest
        return result

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
        """A fresh server (scrubbed VRAM), re-attached to the VM it was in (if any)."""
        gpu = self._gpu(request["gpu"])
        self._fabric()
        if gpu.state == "moving":
            raise LabError(f"GPU {gpu.name} is moving", "wait for the move to end (vfio-cxl fm events)")
        vm = gpu.owner
        t0 = time.monotonic()
        if gpu.dev_id is not None:
            self._check_removable(gpu)
            self.release(gpu, force=True, keep_vram=False, timeout=protocol.RESTART_RELEASE_TIMEOUT)
        elif gpu.popen is None or gpu.popen.poll() is not None or not gpu.scrubbed:
            self._fresh_server(gpu)
            self._set_child_state(gpu, "free")
        result = {"gpu": gpu.name, "server_pid": gpu.popen.pid}
        if vm is not None and self.vms[vm].state == "running":
            result.update(self.attach(gpu, vm))
        self.event("gpu-restarted", f"GPU {gpu.name}: fresh server pid {gpu.popen.pid}"
                   + (f", back in VM {vm}" if gpu.owner else ", free"), gpu=gpu.name, vm=gpu.owner,
                   restart_s=time.monotonic() - t0)
        return result

    def op_redfish(self, client, request) -> dict:
        """Start the lab's Redfish service (a child of the FM and a client of this socket), report
        it if it runs, or end it (``stop``); see docs/redfish.md."""
        from .redfish.process import RedfishService

        running = self.redfish is not None and self.redfish.alive()
        if request.get("stop"):
            if self.redfish is None:
                raise LabError(f"lab {self.record.name} has no Redfish service",
                               f"start one: vfio-cxl fm redfish --lab {self.record.name}")
            result, self.redfish = self.redfish.stop(), None
            self.event("redfish-stopped", f"Redfish service pid {result['pid']} stopped", **result)
            return result
        port = request.get("port", 0)
        if running:
            if port not in (0, self.redfish.port):
                raise LabError(f"lab {self.record.name}'s Redfish service already listens on {self.redfish.url}",
                               f"stop it first: vfio-cxl fm redfish --lab {self.record.name} --stop")
            return {**self.redfish.info(), "already": True}
        self.redfish = RedfishService.start(fm_socket=self.record.socket, lab=self.record.name,
                                            topology=getattr(self.lab, "topology_arg", self.record.topology),
                                            port=port, log=Path(self.record.rundir) / "redfish.log")
        self.event("redfish-started", f"Redfish service on {self.redfish.url} (pid {self.redfish.popen.pid})",
                   **self.redfish.info())
        return self.redfish.info()

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
            "gpus": {gpu.name: {"owner": gpu.owner, "state": gpu.state,
                                "server_pid": gpu.popen.pid if gpu.popen else None,
                                "returncode": gpu.returncode, "vram_mib": gpu.vram_mib, "irq": gpu.irq,
                                "scrubbed": gpu.scrubbed, "port": gpu.port, "dev_id": gpu.dev_id,
                                "restart": gpu.restart, "restarts": gpu.restarts, **gpu.files}
                     for gpu in self.gpus.values()},
            "smcs": {smc.name: {"hosts": list(smc.hosts), "state": smc.state, "server_pid": smc.popen.pid,
                                "returncode": smc.returncode, **smc.files}
                     for smc in self.smcs.values()},
            "free_hotplug_ports": ({vm: self.free_ports(vm) for vm in self.vms}
                                   if hasattr(self.lab, "hotplug_ports") else {}),
            "redfish": self.redfish.info() if self.redfish is not None else None,
        }

    # -- stop ----------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Stop everything, keep the logs, remove the run directory, then the record.

        Not interruptible by SIGTERM/SIGINT (a second `vm down` or Ctrl-C must not leave it
        half done); SIGKILL still ends it, and `vm down` then sweeps up."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        if self._worker is not None:
            # The worker's op ends at its next step (_unlocked raises once _stopping_ops is set);
            # wait for it so that nothing it does overlaps the stop.
            with self.lock:
                self._stopping_ops = True
            self._jobs.put(None)
            self._worker.join(60)
            if self._worker.is_alive():
                self.log("the op worker did not end within 60 s; stopping anyway")
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
        for sock in self._opwake or ():
            sock.close()
        signal.set_wakeup_fd(-1)
        if self.redfish is not None:   # a client of this FM: it goes first
            self.redfish.stop()
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
