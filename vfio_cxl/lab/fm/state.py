"""The lab's state machine: the lab's state and each child's, and what a death makes of them.

:class:`LabState` is the one owner of every transition: nothing else assigns
``state``.  A death (:meth:`LabState.exited`) changes states, records what a
user must know as an event, and queues what it entails (freeing a dead VM's
GPUs, surprise removal, an automatic restart) as jobs for the op worker.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from subprocess import Popen
from typing import Callable

from ...errors import LabError
from .registry import LabRecord

LAB_STATES = ("starting", "running", "degraded", "stopping", "stopped")
VM_STATES = ("running", "dead", "stopped")
GPU_STATES = ("attached", "free", "moving", "failed", "stopped")


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

    @property
    def alive(self) -> bool:
        """It has a process, and the process has not exited."""
        return self.popen is not None and self.popen.poll() is None


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


class LabState:
    """The lab's state and its children by kind.  ``event(kind, message, **fields)`` records an
    event; ``enqueue(kind, request)`` queues a job for the op worker; ``can_remove`` says whether
    the lab can take a device out of a VM (device_del)."""

    def __init__(self, record: LabRecord, event: Callable[..., dict], enqueue: Callable[[str, dict], None],
                 can_remove: bool):
        self.record = record
        self.event = event
        self.enqueue = enqueue
        self.can_remove = can_remove
        self.state = "starting"
        self.vms: dict[str, Child] = {}
        self.gpus: dict[str, Child] = {}
        self.smcs: dict[str, Child] = {}

    def children(self) -> list[Child]:
        return [*self.vms.values(), *self.gpus.values(), *self.smcs.values()]

    def vm(self, name: str) -> Child:
        if name not in self.vms:
            raise LabError(f"lab {self.record.name} has no VM {name!r}", f"VMs: {', '.join(self.vms)}")
        return self.vms[name]

    def gpu(self, name: str) -> Child:
        if name not in self.gpus:
            raise LabError(f"lab {self.record.name} has no GPU {name!r}",
                           f"GPUs: {', '.join(self.gpus) or 'none'}")
        return self.gpus[name]

    # -- transitions -----------------------------------------------------------------------
    def set_lab(self, state: str) -> None:
        assert state in LAB_STATES, state
        if state != self.state:
            self.state = state
            if state in ("running", "stopping"):
                self.record.state = state
                self.record.save()

    def set_child(self, child: Child, state: str) -> None:
        assert state in (VM_STATES if child.kind == "vm" else GPU_STATES), (child.kind, state)
        child.state = state

    def adopt(self, children: list[Child], gpu_specs: dict[str, dict]) -> list[Child]:
        """The children the lab started (running VMs, attached servers) and the topology's GPUs
        (those without a server: free, no server until assigned); the VMs adopted."""
        vms = []
        for child in children:
            if child.kind == "vm":
                self.set_child(child, "running")
                self.vms[child.name] = child
                vms.append(child)
            else:
                self.set_child(child, "attached")
                if child.kind == "smc":
                    self.smcs[child.name] = child
                else:
                    child.dev_id = child.dev_id or child.name
                    self.gpus[child.name] = child
        for name, spec in gpu_specs.items():
            gpu = self.gpus.get(name) or Child("gpu", name, None)
            gpu.irq, gpu.vram_mib = spec["irq"], spec["vram_mib"]
            gpu.restart, gpu.max_restarts = spec.get("restart", "no"), spec.get("max_restarts", 0)
            if name not in self.gpus:
                self.set_child(gpu, "free")
                self.gpus[name] = gpu
        return vms

    # -- deaths ----------------------------------------------------------------------------
    def exited(self, child: Child) -> None:
        """``child``'s process ended (its returncode is set): dead/failed, or stopped if the lab stops."""
        {"vm": self._vm_exited, "smc": self._smc_exited, "gpu": self._gpu_exited}[child.kind](child)

    def _vm_exited(self, vm: Child) -> None:
        self.set_child(vm, "dead" if self.state != "stopping" else "stopped")
        if vm.state == "dead":
            self.event("vm-died", f"VM {vm.name}: QEMU (pid {vm.qemu_pid or vm.popen.pid}) "
                       f"{describe_exit(vm.returncode)}; the other VMs are untouched",
                       vm=vm.name, pid=vm.popen.pid, qemu_pid=vm.qemu_pid, returncode=vm.returncode)
            self.set_lab("degraded")
            for gpu in self.gpus.values():   # its GPUs become free, scrubbed, assignable (the worker)
                if gpu.owner == vm.name:
                    self.enqueue("free_gpu", {"gpu": gpu.name, "vm": vm.name})

    def _gpu_exited(self, gpu: Child) -> None:
        self.set_child(gpu, "failed" if self.state != "stopping" else "stopped")
        if gpu.state != "failed":
            return
        seen = time.monotonic()
        self.event("gpu-server-died", f"GPU {gpu.name} (in VM {gpu.owner}): server pid {gpu.popen.pid} "
                   f"{describe_exit(gpu.returncode)}", gpu=gpu.name, owner=gpu.owner,
                   pid=gpu.popen.pid, returncode=gpu.returncode)
        self.set_lab("degraded")
        if gpu.dev_id and gpu.irq == "msi" and self.can_remove:
            self.enqueue("surprise_removal", {"gpu": gpu.name, "seen": seen})
        if gpu.restart != "on-failure":
            return
        if gpu.restarts < gpu.max_restarts:
            self.enqueue("auto_restart", {"gpu": gpu.name})
        else:
            self.event("gpu-restart-limit", f"GPU {gpu.name}: restarted {gpu.restarts} times already "
                       f"(max_restarts = {gpu.max_restarts}); it stays failed", gpu=gpu.name,
                       restarts=gpu.restarts)

    def _smc_exited(self, smc: Child) -> None:
        self.set_child(smc, "failed" if self.state != "stopping" else "stopped")
        if smc.state == "failed":
            self.event("smc-server-died", f"shared-memory controller {smc.name} (hosts {', '.join(smc.hosts)}): "
                       f"server pid {smc.popen.pid} {describe_exit(smc.returncode)}", smc=smc.name,
                       hosts=list(smc.hosts), pid=smc.popen.pid, returncode=smc.returncode)
            self.set_lab("degraded")
