"""The real lab behind a fabric manager: :class:`~vfio_cxl.lab.lab.Lab` seen as a ManagedLab."""

from __future__ import annotations

import json
import shlex
import shutil
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable

from ...errors import LabError
from ..gpu_process import GpuServerProcess
from ..lab import Lab, gpu_server_args
from ..ssh import ShellSession, join_all
from ..logs import archive_logs
from .guestscripts import (BIND_OUTPUT_MAX, BIND_SCRIPT, HOLDERS_OUTPUT_MAX, HOLDERS_SCRIPT, KILL_OUTPUT_MAX,
                           KILL_SCRIPT, PREPARE_SCRIPT, parse_bind, parse_holders, parse_kills, show)
from .state import Child


def gpu_names(lab: Lab) -> dict[str, str]:
    """GPU name -> the VM it is plugged into, for the GPUs the lab started a server for
    (the topology's ``[gpus.NAME]`` with an owner)."""
    return {name: lab.topology.gpus[name].owner for name in lab.gpu_servers}


class RealLab:
    def __init__(self, lab: Lab, timeout: float = 300):
        self.lab = lab
        self.rundir = lab.rundir_request
        self.timeout = timeout
        # One QMP connection per VM, used from the FM's loop (status) and its op worker: one at a time.
        self._qmp_locks: dict[str, threading.Lock] = {vm.name: threading.Lock() for vm in lab.topology.vms}
        self.standby: dict[str, GpuServerProcess] = {}   # GPU -> its next server, started ahead
        self.sessions: dict[str, ShellSession] = {}        # VM -> the FM's guest shell (op worker only)
        # VM -> ids of devices QEMU reported DEVICE_DELETED for and no wait has taken yet
        self.deleted: dict[str, set[str]] = {vm.name: set() for vm in lab.topology.vms}

    def start(self, log: Callable[[str], None]) -> None:
        self.lab.log = log
        self.lab.start(self.timeout)
        hosts = [f"[127.0.0.1]:{vm.res.ssh_port} ssh-ed25519 {self.lab.image.host_key}"
                 for vm in self.lab.vms.values()]
        self.known_hosts.write_text("\n".join(hosts) + "\n")
        if self.lab.topology.gpus:   # every VM may receive a GPU: its kernel binds GPUs itself
            log("guests: vfio-pci binds GPUs (0601:1991) on its own")
            with ExitStack() as started:   # one that fails cancels the others (join_all)
                join_all({vm.name: started.enter_context(
                    vm.start_command(f"sh -c {shlex.quote(PREPARE_SCRIPT)}", timeout=120))
                    for vm in self.lab.vms.values()})
            for vm in self.lab.vms.values():   # opened now: the first move does not pay for it
                self._session(vm.name).run("true", [], 60)

    @property
    def topology(self):
        """The lab's topology, as loaded (once) by this process."""
        return self.lab.topology

    @property
    def kernel_label(self) -> str:
        """The kernel the lab booted: "debian" (the image's), "lab", or "custom" (a --kernel PATH)."""
        return self.lab.kernel.label if self.lab.kernel else "debian"

    @property
    def known_hosts(self) -> Path:
        return self.rundir / "known_hosts"

    def children(self) -> list[Child]:
        found = []
        for vm in self.lab.vms.values():
            found.append(Child("vm", vm.name, vm.process, ssh_port=vm.res.ssh_port,
                               files={"console_log": str(vm.res.console_log), "qemu_log": str(vm.qemu_log)}))
        for gpu, owner in gpu_names(self.lab).items():
            server = self.lab.gpu_servers[gpu]
            spec = self.lab.topology.gpus[gpu]
            found.append(Child("gpu", gpu, server.process, owner=owner, port=spec.at or spec.root_port,
                               dev_id=gpu, files={"socket": str(server.socket), "log": str(server.log)}))
        for name, server in self.lab.smc_servers.items():
            found.append(Child("smc", name, server.process, hosts=tuple(self.lab.topology.smcs[name].hosts),
                               files={"sockets": " ".join(map(str, server.sockets)), "log": str(server.log)}))
        return found

    def ssh_info(self, vm: str) -> dict:
        return {"user": "root", "key": str(self.lab.image.ssh_key), "known_hosts": str(self.known_hosts),
                "socket": str(self.lab.vms[vm].res.ssh_socket)}

    def run_state(self, vm: str) -> str:
        """QEMU's own view of the VM (QMP query-status: running, paused, ...); the FM holds the
        VM's one QMP connection.  A QEMU that does not answer within 2 s is "unresponsive"."""
        machine = self.lab.vms[vm]
        lock = self._qmp_locks[vm]
        if not lock.acquire(timeout=0.5):
            return "busy (a fabric op is using QMP)"
        try:
            qmp = machine.connect_qmp(timeout=2)
            qmp.settimeout(2)
            state = str(qmp.cmd("query-status")["status"])
            self._note_events(vm, qmp)
            return state
        except Exception as err:   # a broken connection is dropped, never reused
            if machine.qmp is not None:
                try:
                    self._note_events(vm, machine.qmp)   # what it had received is kept
                except Exception:
                    pass
                try:
                    machine.qmp.close()
                except Exception:
                    pass
                machine.qmp = None
            return f"unresponsive ({type(err).__name__})"
        finally:
            lock.release()

    # -- the fabric: GPU servers, QMP hot-plug, the guest's view ---------------------------
    def gpu_specs(self) -> dict[str, dict]:
        """Every GPU of the topology: initial owner, interrupt mode, VRAM size, restart policy."""
        return {name: {"owner": g.owner, "irq": g.irq, "vram_mib": g.vram >> 20, "restart": g.restart,
                       "max_restarts": g.max_restarts}
                for name, g in self.lab.topology.gpus.items()}

    def hotplug_ports(self, vm: str) -> list[str]:
        return self.lab.topology.vm(vm).hotplug_port_ids()

    def _server(self, gpu: str) -> GpuServerProcess:
        """A GPU server on whichever of the GPU's two socket paths (fabric/GPU.a.sock, .b.sock)
        neither its running server nor its standby uses; one log per GPU, appended to."""
        fabric = self.rundir / "fabric"
        fabric.mkdir(exist_ok=True)
        taken = {s.socket for s in (self.lab.gpu_servers.get(gpu), self.standby.get(gpu)) if s is not None}
        path = next(p for p in (fabric / f"{gpu}.a.sock", fabric / f"{gpu}.b.sock") if p not in taken)
        return GpuServerProcess(path, fabric / f"{gpu}.log",
                                [*gpu_server_args(self.lab.topology.gpus[gpu]), *self.lab.gpu_args], append=True)

    def start_server(self, gpu: str, generation: int) -> tuple:
        """A fresh GPU server (fresh VRAM: a new zeroed memfd) replacing the running one; (Popen,
        files).  The standby (``prepare_standby``), started while the GPU was in use, is taken when
        it is there: a Python start (~1 s under load) leaves the move."""
        old = self.lab.gpu_servers.pop(gpu, None)
        if old is not None:
            old.stop()
        server = self.standby.pop(gpu, None)
        if server is not None:
            try:
                server.wait_ready()
            except LabError:   # it died meanwhile (its log says why): start one the slow way
                server.stop()
                server = None
        if server is None:
            server = self._server(gpu)
            server.start()
        self.lab.gpu_servers[gpu] = server
        return server.process, {"socket": str(server.socket), "log": str(server.log)}

    def prepare_standby(self, gpu: str) -> None:
        """Start the GPU's next server now, without waiting for it (a fresh, zero VRAM memfd of
        its own; nothing connects to it until it replaces the running one)."""
        if gpu not in self.standby:
            server = self._server(gpu)
            server.spawn()
            self.standby[gpu] = server

    def stop_server(self, gpu: str) -> None:
        for server in (self.lab.gpu_servers.pop(gpu, None), self.standby.pop(gpu, None)):
            if server is not None:
                server.stop()

    @contextmanager
    def _qmp(self, vm: str):
        with self._qmp_locks[vm]:
            qmp = self.lab.vms[vm].connect_qmp(timeout=5)
            qmp.settimeout(10)
            try:
                yield qmp
            finally:
                try:
                    self._note_events(vm, qmp)
                except Exception:
                    pass   # a broken connection: what it had queued is lost (see _wait_deleted)

    def device_add(self, vm: str, dev_id: str, port: str, socket: str) -> None:
        with self._qmp(vm) as qmp:
            answer = qmp.cmd_obj({"execute": "device_add", "arguments": {
                "driver": "vfio-user-pci", "id": dev_id, "bus": port,
                "socket": {"type": "unix", "path": socket}}})
        if "error" in answer:
            raise LabError(f"QEMU of VM {vm} refused device_add of {dev_id} on {port}: "
                           f"{answer['error'].get('desc')}", f"see {self.lab.vms[vm].qemu_log}")

    def device_del(self, vm: str, dev_id: str) -> None:
        with self._qmp(vm) as qmp:
            answer = qmp.cmd_obj({"execute": "device_del", "arguments": {"id": dev_id}})
        if "error" in answer:
            raise LabError(f"QEMU of VM {vm} refused device_del of {dev_id}: {answer['error'].get('desc')}",
                           f"see {self.lab.vms[vm].qemu_log}")

    def wait_deleted(self, vm: str, dev_id: str, timeout: float) -> bool:
        """True once dev_id is out of QEMU: its DEVICE_DELETED seen now or earlier on any of the
        VM's QMP connections, or QEMU no longer has it (an event lost with a connection that was
        dropped); False on timeout."""
        with self._qmp(vm) as qmp:
            return self._wait_deleted(vm, qmp, dev_id, timeout)

    def _note_events(self, vm: str, qmp) -> None:
        """Keep every DEVICE_DELETED the connection has queued, per device (a wait for one
        device must not lose another's)."""
        for event in qmp.get_events(wait=False):
            if event.get("event") == "DEVICE_DELETED" and event.get("data", {}).get("device"):
                self.deleted[vm].add(event["data"]["device"])

    @staticmethod
    def _present(qmp, dev_id: str) -> bool:
        """Does QEMU still have a device with id dev_id (/machine/peripheral/<id>)?"""
        return any(child.get("name") == dev_id for child in qmp.cmd("qom-list", path="/machine/peripheral"))

    def _wait_deleted(self, vm: str, qmp, dev_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        self._note_events(vm, qmp)
        while dev_id not in self.deleted[vm]:
            if not self._present(qmp, dev_id):
                break   # gone: its event went with a connection that was dropped
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                event = qmp.pull_event(wait=min(left, 1.0))
            except Exception:   # this slice's timeout: look again
                continue
            if event and event.get("event") == "DEVICE_DELETED" and event.get("data", {}).get("device"):
                self.deleted[vm].add(event["data"]["device"])
        self.deleted[vm].discard(dev_id)
        return True

    def guest_bdf(self, vm: str, dev_id: str) -> str | None:
        """The guest's PCI address of QEMU device dev_id (QMP query-pci: bus numbers as the guest
        programmed its bridges), or None if QEMU does not list it."""
        def walk(devices: list[dict]) -> str | None:
            for dev in devices:
                if dev.get("qdev_id") == dev_id:
                    return f"0000:{dev['bus']:02x}:{dev['slot']:02x}.{dev['function']}"
                found = walk(dev.get("pci_bridge", {}).get("devices", []))
                if found:
                    return found
            return None
        with self._qmp(vm) as qmp:
            buses = qmp.cmd("query-pci")
        for bus in buses:
            found = walk(bus.get("devices", []))
            if found:
                return found
        return None

    def holders(self, vm: str, bdf: str) -> list[dict]:
        """The guest processes holding the GPU at bdf (its IOMMU group or its iommufd cdev)."""
        status, out = self._session(vm).run(HOLDERS_SCRIPT, [bdf], 60, limit=HOLDERS_OUTPUT_MAX)
        if status != 0:
            raise LabError(f"VM {vm}: no IOMMU group for {bdf}: {show(out.strip()[-300:])}",
                           "see vfio-cxl gpu ls there")
        return parse_holders(vm, out)

    def kill_in_guest(self, vm: str, bdf: str, pids: list[int]) -> tuple[list[int], dict[str, str]]:
        """SIGKILL to those of ``pids`` that hold the GPU at bdf at the moment of the kill (checked
        in the guest), never pid 1; (killed, pid -> why skipped)."""
        status, out = self._session(vm).run(KILL_SCRIPT, [bdf, *(str(int(p)) for p in pids)], 30,
                                            limit=KILL_OUTPUT_MAX)
        if status != 0:
            raise LabError(f"VM {vm}: could not check what holds {bdf}: {show(out.strip()[-300:])}",
                           "see vfio-cxl gpu ls there")
        return parse_kills(vm, out)

    def _session(self, vm: str) -> ShellSession:
        if vm not in self.sessions or self.sessions[vm].shell is not self.lab.vms[vm].shell:
            self.sessions[vm] = ShellSession(self.lab.vms[vm].shell)
        return self.sessions[vm]

    def bind_in_guest(self, vm: str, count: int, timeout: float) -> dict:
        """Wait until VM has ``count`` GPUs, all bound to vfio-pci; the new one's BDF."""
        t0 = time.monotonic()
        status, out = self._session(vm).run(BIND_SCRIPT, [str(count), f"{timeout:.0f}"], timeout + 30,
                                            limit=BIND_OUTPUT_MAX)
        t1 = time.monotonic()
        if status != 0:
            raise LabError(f"VM {vm}: the hot-plugged GPU is not bound to vfio-pci: {show(out.strip()[-500:], 500)}",
                           f"see VM {vm}'s dmesg (vfio-cxl vm ssh {vm} -- dmesg) and its console log")
        answer = parse_bind(vm, out)
        answer["host"] = {"exec": t0, "returned": t1}
        return answer

    def guest(self, vm: str, args: str, timeout: float = 60) -> dict:
        """Run the guest's `vfio-cxl` CLI over SSH; its JSON answer."""
        out = self.lab.vms[vm].run(f"vfio-cxl {args} --json", timeout=timeout)
        return json.loads(out.stdout)

    def stop_processes(self) -> None:
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()
        for vm in self.lab.vms.values():
            vm.stop()
        for server in [*self.lab.gpu_servers.values(), *self.lab.smc_servers.values(), *self.standby.values()]:
            server.stop()
        self.standby.clear()

    def close(self) -> None:
        self.lab.stop()   # what is left: connections; keeps the logs, removes the run directory
        if self.rundir.exists():   # the lab failed before it took the directory over
            if self.lab.logdir:
                archive_logs(self.rundir, self.lab.logdir)
            shutil.rmtree(self.rundir, ignore_errors=True)
