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
GPU_STATES = ("attached", "free", "moving", "failed", "stopped")
RELEASE_TIMEOUT = 15.0   # s for the guest to let go of a GPU (DEVICE_DELETED)
BIND_TIMEOUT = 30.0
MAX_OUTBUF = 4 << 20   # a follower that reads slower than this is dropped


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
            for gpu in self.gpus.values():   # its GPUs become free, scrubbed, assignable
                if gpu.owner == vm.name:
                    self._gpu_left(gpu, keep_vram=False)
                    self.event("gpu-freed", f"GPU {gpu.name}: free (its VM {vm.name} died); VRAM scrubbed "
                               f"by a fresh server (pid {gpu.popen.pid if gpu.popen else None})",
                               gpu=gpu.name, vm=vm.name, scrubbed=gpu.scrubbed)

    def _gpu_exited(self, gpu: Child) -> None:
        self._set_child_state(gpu, "failed" if self.state != "stopping" else "stopped")
        if gpu.state == "failed":
            t0 = time.monotonic()
            self.event("gpu-server-died", f"GPU {gpu.name} (in VM {gpu.owner}): server pid {gpu.popen.pid} "
                       f"{describe_exit(gpu.returncode)}", gpu=gpu.name, owner=gpu.owner,
                       pid=gpu.popen.pid, returncode=gpu.returncode)
            self._set_lab_state("degraded")
            owner = self.vms.get(gpu.owner) if gpu.owner else None
            if gpu.dev_id and owner is not None and owner.state == "running" and gpu.irq == "msi":
                # Surprise removal: take the dead device out of its VM so guest processes get
                # the kernel's release request (and an error) instead of hanging in reset waits.
                try:
                    self.lab.device_del(gpu.owner, gpu.dev_id)
                    self.event("gpu-surprise-removal", f"GPU {gpu.name}: device_del {gpu.dev_id} sent to VM "
                               f"{gpu.owner} {1e3 * (time.monotonic() - t0):.0f} ms after the death was seen",
                               gpu=gpu.name, vm=gpu.owner, dev_id=gpu.dev_id)
                    gpu.files["pending_delete"] = gpu.dev_id
                except Exception as err:
                    self.event("gpu-surprise-removal-failed", f"GPU {gpu.name}: device_del failed: {err}",
                               gpu=gpu.name)

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
        gpu.popen, files = self._fabric().start_server(gpu.name, gpu.generation)
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
                fabric.device_del(vm, dev_id)
            deleted = fabric.wait_deleted(vm, dev_id, timeout)
            if not deleted and force:
                self.event("gpu-force", f"GPU {gpu.name}: VM {vm} did not let go within {timeout:.0f} s; "
                           "surprise removal: its server is stopped", gpu=gpu.name, vm=vm)
                self._unwatch(gpu)
                fabric.stop_server(gpu.name)
                keep_vram = False
                deleted = fabric.wait_deleted(vm, dev_id, timeout)
            if not deleted:
                holders = self._holders(vm)
                raise LabError(f"VM {vm} did not release GPU {gpu.name} within {timeout:.0f} s "
                               f"(no DEVICE_DELETED for {dev_id}); holding it: {holders}",
                               f"stop that process in VM {vm}, or vfio-cxl fm release {gpu.name} --force")
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

    def _holders(self, vm: str) -> str:
        try:
            found = self.lab.guest(vm, "gpu holders", timeout=20)["holders"]
        except Exception as err:
            return f"unknown ({err})"
        return ", ".join(f"pid {h['pid']} ({h['comm']}) on {h['path']}" for h in found) or "no process (kernel?)"

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
        dev_id = f"{gpu.name}-{gpu.generation}-{len(self.events)}"
        t0 = time.monotonic()
        try:
            fabric.device_add(vm, dev_id, port, gpu.files["socket"])
            gpu.owner, gpu.dev_id, gpu.port = vm, dev_id, port
            t_add = time.monotonic() - t0
            count = sum(1 for g in self.gpus.values() if g.owner == vm)   # this one included
            seen = fabric.bind_in_guest(vm, count, BIND_TIMEOUT)
        except BaseException:
            self._set_child_state(gpu, "failed")
            raise
        t_attach = time.monotonic() - t0
        self._set_child_state(gpu, "attached")
        self.event("gpu-attached", f"GPU {gpu.name} attached to VM {vm} on {port} as {dev_id}, bound to "
                   f"{seen['driver']} at {seen['bdf']} in {t_attach * 1e3:.0f} ms", gpu=gpu.name, vm=vm,
                   port=port, dev_id=dev_id, bdf=seen["bdf"], attach_s=t_attach, device_add_s=t_add)
        return {"gpu": gpu.name, "vm": vm, "port": port, "bdf": seen["bdf"], "attach_s": t_attach,
                "device_add_s": t_add, "scrubbed": gpu.scrubbed}

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
        return self.release(self._gpu(request["gpu"]), force=bool(request.get("force", False)),
                            keep_vram=bool(request.get("keep_vram", False)))

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
            if child.popen is not None:
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
        """A fresh server (scrubbed VRAM), re-attached to the VM it was in (if any)."""
        gpu = self._gpu(request["gpu"])
        self._fabric()
        if gpu.state == "moving":
            raise LabError(f"GPU {gpu.name} is moving", "wait for the move to end (vfio-cxl fm events)")
        vm = gpu.owner
        t0 = time.monotonic()
        if gpu.dev_id is not None:
            self._check_removable(gpu)
            self.release(gpu, force=True, keep_vram=False, timeout=10)
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
                                "scrubbed": gpu.scrubbed, "port": gpu.port, "dev_id": gpu.dev_id, **gpu.files}
                     for gpu in self.gpus.values()},
            "smcs": {smc.name: {"hosts": list(smc.hosts), "state": smc.state, "server_pid": smc.popen.pid,
                                "returncode": smc.returncode, **smc.files}
                     for smc in self.smcs.values()},
            "free_hotplug_ports": ({vm: self.free_ports(vm) for vm in self.vms}
                                   if hasattr(self.lab, "hotplug_ports") else {}),
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
