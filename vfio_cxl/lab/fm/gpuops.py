"""GPU operations: assign, release, restart and scrub -- the only code that moves a GPU.

They run on the op worker (see :mod:`.worker`): every blocking step (QMP,
the guest's checks over SSH, a server start) goes through ``unlocked``, which
drops the lab's lock for that step only.  Before it drops the lock an
operation marks the GPU "moving" (or owned, for attach), so that what the loop
sees meanwhile -- a status, a death -- finds a consistent state.

Scrub = a fresh server: its VRAM is a new memfd, zero; the old one's memory is gone.
"""

from __future__ import annotations

import json
import re
import time
from typing import Callable

from ...errors import LabError
from . import protocol
from .state import Child, LabState
from .supervise import Supervisor

# s for the guest to let go of a GPU (DEVICE_DELETED), and to bind one: see protocol.op_timeout
RELEASE_TIMEOUT, BIND_TIMEOUT = protocol.RELEASE_TIMEOUT, protocol.BIND_TIMEOUT


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


def no_port(gpu: str, vm: str) -> LabError:
    return LabError(f"VM {vm} has no free hot-plug port for GPU {gpu}",
                    f"release a GPU from {vm}, or give it more: hotplug_ports in the topology")


def not_releasing(gpu: Child, vm: str, dev_id: str, timeout: float, force: bool, holders,
                  known: bool) -> LabError:
    what = describe_holders(holders) if known else f"unknown ({holders})"
    return LabError(f"VM {vm} did not release GPU {gpu.name} within {timeout:g} s "
                    f"(no DEVICE_DELETED for {dev_id}); holding it: {what}",
                    f"stop that process in VM {vm}, or vfio-cxl fm release {gpu.name} --force "
                    f"(kills it)" if not force else
                    f"the guest did not say what holds it; see VM {vm}'s console log and "
                    f"vfio-cxl vm ssh {vm} -- dmesg" if not known else
                    f"the process could not be killed (state D: stuck in the kernel?); see VM {vm}'s "
                    f"dmesg (vfio-cxl vm ssh {vm} -- dmesg)")


class GpuOps:
    """``lab``: the ManagedLab; ``unlocked(fn, *args)``: a blocking call without the lab's lock;
    ``event(kind, message, **fields)``: records an event; ``seq()``: the newest event's number."""

    def __init__(self, lab, state: LabState, supervisor: Supervisor, unlocked: Callable, event: Callable,
                 seq: Callable[[], int]):
        self.lab, self.state, self.supervisor = lab, state, supervisor
        self.unlocked, self.event, self.seq = unlocked, event, seq

    def fabric(self):
        if not hasattr(self.lab, "device_add"):
            raise LabError("this lab has no fabric (no hot-plug support)", "use a real lab")
        return self.lab

    def free_ports(self, vm: str) -> list[str]:
        used = {g.port for g in self.state.gpus.values() if g.owner == vm}
        return [p for p in self.fabric().hotplug_ports(vm) if p not in used]

    # -- the requests ---------------------------------------------------------------------
    def assign(self, gpu: Child, vm: Child, keep: bool) -> dict:
        if vm.state != "running":
            raise LabError(f"VM {vm.name} is {vm.state}", f"assign {gpu.name} to a running VM")
        self._not_moving(gpu)
        if gpu.owner == vm.name and gpu.state == "attached":
            return {"gpu": gpu.name, "vm": vm.name, "already": True}
        t0 = time.monotonic()
        result = {"gpu": gpu.name, "vm": vm.name, "from": gpu.owner}
        if gpu.owner is not None:
            if not self.free_ports(vm.name):   # refuse before taking it away from its owner
                raise no_port(gpu.name, vm.name)
            result.update(self.release(gpu, keep_vram=keep))
        elif not keep and not gpu.scrubbed:
            t1 = time.monotonic()
            self.fresh_server(gpu)
            result["scrub_s"] = time.monotonic() - t1
        result.update(self.attach(gpu, vm.name))
        result["vm"] = vm.name
        result["move_s"] = time.monotonic() - t0
        return result

    def restart(self, gpu: Child) -> dict:
        """A fresh server (scrubbed VRAM), re-attached to the VM it was in (if any)."""
        self.fabric()
        self._not_moving(gpu)
        vm = gpu.owner
        t0 = time.monotonic()
        if gpu.dev_id is not None:
            self._check_removable(gpu)
            self.release(gpu, force=True, keep_vram=False, timeout=protocol.RESTART_RELEASE_TIMEOUT)
        elif not gpu.alive or not gpu.scrubbed:
            self.fresh_server(gpu)
            self.state.set_child(gpu, "free")
        result = {"gpu": gpu.name, "server_pid": gpu.popen.pid}
        if vm is not None and self.state.vms[vm].state == "running":
            result.update(self.attach(gpu, vm))
        self.event("gpu-restarted", f"GPU {gpu.name}: fresh server pid {gpu.popen.pid}"
                   + (f", back in VM {vm}" if gpu.owner else ", free"), gpu=gpu.name, vm=gpu.owner,
                   restart_s=time.monotonic() - t0)
        return result

    def release(self, gpu: Child, *, force: bool = False, keep_vram: bool = False,
                timeout: float = RELEASE_TIMEOUT) -> dict:
        self.fabric()
        if gpu.owner is None or gpu.dev_id is None:
            raise LabError(f"GPU {gpu.name} is not in a VM (state {gpu.state})", "nothing to release")
        self._check_removable(gpu)
        vm, was = gpu.owner, gpu.state
        self.state.set_child(gpu, "moving")
        t0 = time.monotonic()
        try:
            self._take_out(gpu, vm, force, timeout)
        except BaseException:
            self.state.set_child(gpu, was if gpu.alive else "failed")
            raise
        t_release = time.monotonic() - t0
        t1 = time.monotonic()
        self._left(gpu, keep_vram)
        t_scrub = time.monotonic() - t1
        self.event("gpu-released", f"GPU {gpu.name} released by VM {vm} in {t_release * 1e3:.0f} ms; "
                   + ("VRAM kept" if keep_vram else f"VRAM scrubbed (fresh server pid {gpu.popen.pid}, "
                                                    f"{t_scrub * 1e3:.0f} ms)"),
                   gpu=gpu.name, vm=vm, release_s=t_release, scrub_s=t_scrub, scrubbed=gpu.scrubbed)
        return {"gpu": gpu.name, "vm": vm, "release_s": t_release, "scrub_s": t_scrub, "scrubbed": gpu.scrubbed}

    def attach(self, gpu: Child, vm: str) -> dict:
        fabric = self.fabric()
        ports = self.free_ports(vm)
        if not ports:
            raise no_port(gpu.name, vm)
        if not gpu.alive:
            self.fresh_server(gpu)
        self.state.set_child(gpu, "moving")
        port = ports[0]
        dev_id = f"{gpu.name}-{gpu.generation}-{self.seq()}"
        t0 = time.monotonic()
        # Owned from before device_add: a VM death handled meanwhile frees the GPU (its free_gpu
        # job finds it owned by the dead VM) instead of leaving it to a dead owner.
        gpu.owner, gpu.dev_id, gpu.port = vm, dev_id, port
        try:
            try:
                self.unlocked(fabric.device_add, vm, dev_id, port, gpu.files["socket"])
            except BaseException:
                if self.state.vms[vm].state == "running":   # QEMU refused it: not in the VM
                    gpu.owner, gpu.dev_id, gpu.port = None, None, None
                raise
            t_add = time.monotonic() - t0
            count = sum(1 for g in self.state.gpus.values() if g.owner == vm)   # this one included
            seen = self.unlocked(fabric.bind_in_guest, vm, count, BIND_TIMEOUT)
            t_attach = time.monotonic() - t0
            parts = attach_parts(t0, t0 + t_add, seen)
        except BaseException as err:
            self._attach_failed(gpu, vm, dev_id, err)
            raise
        self.state.set_child(gpu, "attached")
        message = (f"GPU {gpu.name} attached to VM {vm} on {port} as {dev_id}, bound to "
                   f"{seen['driver']} at {seen['bdf']} in {t_attach * 1e3:.0f} ms ("
                   + ", ".join(f"{k[:-2]} {v * 1e3:.0f} ms" for k, v in parts.items()) + ")")
        self.event("gpu-attached", message, gpu=gpu.name, vm=vm, port=port, dev_id=dev_id, bdf=seen["bdf"],
                   attach_s=t_attach, device_add_s=t_add, attach_parts=parts)
        return {"gpu": gpu.name, "vm": vm, "port": port, "bdf": seen["bdf"], "attach_s": t_attach,
                "device_add_s": t_add, "attach_parts": parts, "scrubbed": gpu.scrubbed}

    # -- the jobs a death queues ------------------------------------------------------------
    def free_dead_vms_gpu(self, gpu: str, vm: str) -> None:
        child = self.state.gpus[gpu]
        if child.owner != vm:   # an op moved it meanwhile
            return
        self._left(child, keep_vram=False)
        self.event("gpu-freed", f"GPU {gpu}: free (its VM {vm} died); VRAM scrubbed by a fresh server "
                   f"(pid {child.popen.pid if child.popen else None})", gpu=gpu, vm=vm, scrubbed=child.scrubbed)

    def auto_restart(self, gpu: str) -> None:
        """The topology's restart = "on-failure": what `fm restart` does, counted."""
        child = self.state.gpus[gpu]
        if child.state != "failed":
            return   # restarted by hand meanwhile
        child.restarts += 1
        self.event("gpu-auto-restart", f"GPU {gpu}: restart {child.restarts} of {child.max_restarts} "
                   "(restart = \"on-failure\")", gpu=gpu, restart=child.restarts)
        self.restart(child)

    def surprise_removal(self, gpu: str, seen: float) -> None:
        """Take a dead server's device out of its VM so guest processes get the kernel's release
        request (and an error) instead of hanging in reset waits."""
        child = self.state.gpus[gpu]
        owner = self.state.vms.get(child.owner) if child.owner else None
        if child.state != "failed" or not child.dev_id or owner is None or owner.state != "running":
            return   # restarted, moved or its VM gone meanwhile
        dev_id, vm = child.dev_id, child.owner
        self.unlocked(self.lab.device_del, vm, dev_id)
        child.files["pending_delete"] = dev_id
        self.event("gpu-surprise-removal", f"GPU {gpu}: device_del {dev_id} sent to VM {vm} "
                   f"{1e3 * (time.monotonic() - seen):.0f} ms after the death was seen",
                   gpu=gpu, vm=vm, dev_id=dev_id)

    # -- steps ------------------------------------------------------------------------------
    def fresh_server(self, gpu: Child) -> None:
        """Scrub: a new server for ``gpu`` (new, zero VRAM), watched and kept in the record."""
        self.supervisor.unwatch(gpu)
        gpu.generation += 1
        gpu.popen = None
        gpu.popen, files = self.unlocked(self.fabric().start_server, gpu.name, gpu.generation)
        if hasattr(self.lab, "prepare_standby"):   # the next scrub's server starts now, in the background
            self.lab.prepare_standby(gpu.name)
        gpu.files.update(files)
        gpu.returncode = None
        gpu.scrubbed = True
        self.supervisor.note(gpu)
        self.supervisor.watch(gpu)

    def _not_moving(self, gpu: Child) -> None:
        if gpu.state == "moving":
            raise LabError(f"GPU {gpu.name} is moving", "wait for the move to end (vfio-cxl fm events)")

    def _check_removable(self, gpu: Child) -> None:
        if gpu.irq != "msi":
            raise LabError(
                f"GPU {gpu.name} uses MSI-X, and hot-removing a vfio-user device with MSI-X aborts "
                f"this QEMU (11.1.3: memory_region_del_subregion assertion in vfio-user's finalize; "
                f"fixed upstream by 'vfio-user: Do not delete the subregion')",
                f'set irq = "msi" under [gpus.{gpu.name}] in the topology (as the fabric topology does) '
                f"and boot the lab again")

    def _take_out(self, gpu: Child, vm: str, force: bool, timeout: float) -> None:
        """device_del, and wait for DEVICE_DELETED; with ``force``, kill what holds it and wait again."""
        fabric, dev_id = self.lab, gpu.dev_id
        if gpu.files.get("pending_delete") != dev_id:
            self.unlocked(fabric.device_del, vm, dev_id)
        if self.unlocked(fabric.wait_deleted, vm, dev_id, timeout):
            return
        holders, known, bdf = self._holders(vm, dev_id)
        if force and known and holders:
            self._kill_holders(gpu, vm, bdf, holders, timeout)
            if self.unlocked(fabric.wait_deleted, vm, dev_id, timeout):
                return
            holders, known, bdf = self._holders(vm, dev_id)
        raise not_releasing(gpu, vm, dev_id, timeout, force, holders, known)

    def _kill_holders(self, gpu: Child, vm: str, bdf: str, holders: list[dict], timeout: float) -> None:
        pids = [h["pid"] for h in holders]
        self.event("gpu-force", f"GPU {gpu.name}: VM {vm} did not let go within {timeout:g} s; "
                   f"killing what holds it: {describe_holders(holders)}", gpu=gpu.name, vm=vm, pids=pids)
        killed, skipped = self.unlocked(self.lab.kill_in_guest, vm, bdf, pids)
        if skipped:
            self.event("gpu-force-skipped", f"GPU {gpu.name}: VM {vm}: not killed: " + ", ".join(
                f"pid {p} ({why})" for p, why in skipped.items()), gpu=gpu.name, vm=vm,
                killed=killed, skipped=skipped)

    def _holders(self, vm: str, dev_id: str) -> tuple:
        """(holders, True, bdf): the guest processes that hold dev_id's VFIO nodes; (reason, False,
        bdf) if that cannot be found out."""
        bdf = None
        try:
            bdf = self.unlocked(self.lab.guest_bdf, vm, dev_id)
            if bdf is None:
                return f"QEMU of VM {vm} does not list {dev_id}", False, None
            return self.unlocked(self.lab.holders, vm, bdf), True, bdf
        except Exception as err:
            return str(err), False, bdf

    def _left(self, gpu: Child, keep_vram: bool) -> None:
        """The GPU is out of its VM (DEVICE_DELETED, or the VM died): free, scrubbed unless kept."""
        gpu.owner, gpu.dev_id, gpu.port = None, None, None
        gpu.files.pop("pending_delete", None)
        if not keep_vram or not gpu.alive:
            self.fresh_server(gpu)
        else:
            gpu.scrubbed = False
        self.state.set_child(gpu, "free")

    def _attach_failed(self, gpu: Child, vm: str, dev_id: str, err: BaseException) -> None:
        self.state.set_child(gpu, "free" if gpu.owner is None and gpu.alive else "failed")
        if gpu.dev_id == dev_id and self.state.vms[vm].state == "running":   # in the VM: the guest's check failed
            reason = f"{err.what} ({err.fix})" if isinstance(err, LabError) else repr(err)
            self.event("gpu-attach-failed", f"GPU {gpu.name}: in VM {vm} as {dev_id}, but the guest's "
                       f"check failed: {reason}; vfio-cxl fm restart {gpu.name} or fm release "
                       f"{gpu.name} --force takes it back", gpu=gpu.name, vm=vm, dev_id=dev_id)
