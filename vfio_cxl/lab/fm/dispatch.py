"""Request dispatch: a parsed request -> the part of the fabric manager that answers it.

Each op of :data:`protocol.OPS` is a method ``op_NAME(client, request)`` that
returns the answer's result or raises :class:`LabError`; :meth:`Dispatcher.run`
turns either into the protocol's answer, and a bug in an op into an error
answer (the lab stays up).  Ops in :data:`SLOW_OPS` run on the op worker; the
rest in the loop.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

from ...errors import LabError
from . import protocol
from .events import EVENT_PAGE, EVENT_PAGE_MAX
from .state import describe_exit

SLOW_OPS = ("assign", "release", "restart")   # run by the op worker; the loop stays live meanwhile


class Dispatcher:
    """The ops of one fabric manager ``fm`` (its lab, record, state, events, GPU ops)."""

    def __init__(self, fm):
        self.fm = fm

    def run(self, client, request: dict) -> dict:
        """The answer to ``request``: ok with the op's result, or an error."""
        try:
            return protocol.ok(getattr(self, f"op_{request['op']}")(client, request))
        except LabError as err:
            return protocol.error(err.what, err.fix)
        except Exception as err:   # a bug in an op must not take the lab down
            self.fm.log(f"internal error: {traceback.format_exc()}")
            return protocol.error(f"fabric manager internal error: {err!r}",
                                  f"see {self.fm.record.logdir}/fm.log and report it")

    # -- answered in the loop -------------------------------------------------------------
    def op_hello(self, client, request) -> dict:
        return {"protocol": protocol.VERSION, "lab": self.fm.record.name, "pid": os.getpid(),
                "ops": list(protocol.OPS)}

    def op_status(self, client, request) -> dict:
        return self.status()

    def op_events(self, client, request) -> dict:
        since = request.get("since", 0)
        limit = request.get("limit", EVENT_PAGE)
        if not 1 <= limit <= EVENT_PAGE_MAX:
            raise LabError(f"events limit {limit} is out of range", f"give 1 <= limit <= {EVENT_PAGE_MAX}")
        result, rest = self.fm.eventlog.page(since, limit)
        if request.get("follow", False):
            # The rest of the history, then every new event, as `event` lines after this answer:
            # sent in this loop turn, so none is missed or repeated.
            client.follow = True
            client.backlog = rest
        return result

    def op_ssh_info(self, client, request) -> dict:
        record = self.fm.record
        vm = self.fm.state.vm(request["vm"])
        if vm.state != "running":
            raise LabError(f"VM {vm.name} of lab {record.name} is {vm.state}: "
                           f"its QEMU {describe_exit(vm.returncode)}",
                           f"see {vm.files.get('qemu_log', record.logdir)} (kept in "
                           f"{record.logdir} after vm down); vfio-cxl vm down {record.name} "
                           f"removes the lab")
        return {"vm": vm.name, "port": vm.ssh_port, **self.fm.lab.ssh_info(vm.name)}

    def op_stop(self, client, request) -> dict:
        self.fm.event("stop-requested", f"stop requested for lab {self.fm.record.name}")
        self.fm.stop_requested = True
        return {"stopping": self.fm.record.name, "pid": os.getpid()}

    def op_redfish(self, client, request) -> dict:
        """Start the lab's Redfish service (a child of the FM and a client of this socket), report
        it if it runs, or end it (``stop``); see docs/redfish.md."""
        from .redfish.process import RedfishService

        fm, name = self.fm, self.fm.record.name
        running = fm.redfish is not None and fm.redfish.alive()
        if request.get("stop"):
            if fm.redfish is None:
                raise LabError(f"lab {name} has no Redfish service",
                               f"start one: vfio-cxl fm redfish --lab {name}")
            result, fm.redfish = fm.redfish.stop(), None
            fm.event("redfish-stopped", f"Redfish service pid {result['pid']} stopped", **result)
            return result
        port = request.get("port", 0)
        if fm.lab.topology is None:
            raise LabError(f"lab {name} has no topology for a Redfish service to model", "use a real lab")
        if running:
            if port not in (0, fm.redfish.port):
                raise LabError(f"lab {name}'s Redfish service already listens on {fm.redfish.url}",
                               f"stop it first: vfio-cxl fm redfish --lab {name} --stop")
            return {**fm.redfish.info(), "already": True}
        fm.redfish = RedfishService.start(fm_socket=fm.record.socket, lab=name, topology=fm.lab.topology,
                                          port=port, log=Path(fm.record.rundir) / "redfish.log")
        fm.event("redfish-started", f"Redfish service on {fm.redfish.url} (pid {fm.redfish.popen.pid})",
                 **fm.redfish.info())
        return fm.redfish.info()

    # -- run by the op worker (SLOW_OPS) --------------------------------------------------
    def op_assign(self, client, request) -> dict:
        gpu, vm = self.fm.state.gpu(request["gpu"]), self.fm.state.vm(request["vm"])
        return self.fm.gpuops.assign(gpu, vm, keep=bool(request.get("keep_vram", False)))

    def op_release(self, client, request) -> dict:
        timeout = float(request.get("timeout", protocol.RELEASE_TIMEOUT))
        if not 0 < timeout <= protocol.RELEASE_TIMEOUT_MAX:
            raise LabError(f"release timeout {timeout:g} s is out of range",
                           f"give 0 < timeout <= {protocol.RELEASE_TIMEOUT_MAX:g} seconds")
        return self.fm.gpuops.release(self.fm.state.gpu(request["gpu"]), force=bool(request.get("force", False)),
                                      keep_vram=bool(request.get("keep_vram", False)), timeout=timeout)

    def op_restart(self, client, request) -> dict:
        return self.fm.gpuops.restart(self.fm.state.gpu(request["gpu"]))

    # -- status ----------------------------------------------------------------------------
    def status(self) -> dict:
        fm, record, state = self.fm, self.fm.record, self.fm.state
        now = time.time()
        return {
            "name": record.name, "topology": record.topology, "state": state.state,
            "kernel": getattr(fm.lab, "kernel_label", None),
            "fm_pid": os.getpid(), "created": record.created, "uptime": now - record.created,
            "rundir": record.rundir, "logdir": record.logdir, "socket": str(record.socket),
            "vms": {vm.name: {"state": vm.state, "ssh_port": vm.ssh_port, "pid": vm.popen.pid,
                              "run_state": fm.lab.run_state(vm.name) if vm.state == "running" else None,
                              "qemu_pid": vm.qemu_pid, "returncode": vm.returncode, **vm.files}
                    for vm in state.vms.values()},
            "gpus": {gpu.name: {"owner": gpu.owner, "state": gpu.state,
                                "server_pid": gpu.popen.pid if gpu.popen else None,
                                "returncode": gpu.returncode, "vram_mib": gpu.vram_mib, "irq": gpu.irq,
                                "scrubbed": gpu.scrubbed, "port": gpu.port, "dev_id": gpu.dev_id,
                                "restart": gpu.restart, "restarts": gpu.restarts, **gpu.files}
                     for gpu in state.gpus.values()},
            "smcs": {smc.name: {"hosts": list(smc.hosts), "state": smc.state, "server_pid": smc.popen.pid,
                                "returncode": smc.returncode, **smc.files}
                     for smc in state.smcs.values()},
            "free_hotplug_ports": ({vm: fm.gpuops.free_ports(vm) for vm in state.vms}
                                   if hasattr(fm.lab, "hotplug_ports") else {}),
            "redfish": fm.redfish.info() if fm.redfish is not None else None,
        }
