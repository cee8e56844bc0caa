"""The real lab behind a fabric manager: :class:`~vfio_cxl.lab.lab.Lab` seen as a ManagedLab."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from ..lab import Lab
from ..logs import archive_logs
from .manager import Child


def gpu_names(lab: Lab) -> dict[str, str]:
    """GPU name -> the VM it is plugged into, for the GPUs the lab started a server for
    (the topology's ``[gpus.NAME]`` with an owner)."""
    return {name: lab.topology.gpus[name].owner for name in lab.gpu_servers}


class RealLab:
    def __init__(self, lab: Lab, timeout: float = 300):
        self.lab = lab
        self.rundir = lab.rundir_request
        self.timeout = timeout

    def start(self, log: Callable[[str], None]) -> None:
        self.lab.log = log
        self.lab.start(self.timeout)
        hosts = [f"[127.0.0.1]:{vm.res.ssh_port} ssh-ed25519 {self.lab.image.host_key}"
                 for vm in self.lab.vms.values()]
        self.known_hosts.write_text("\n".join(hosts) + "\n")

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
            found.append(Child("gpu", gpu, server.process, owner=owner,
                               files={"socket": str(server.socket), "log": str(server.log)}))
        for name, server in self.lab.smc_servers.items():
            found.append(Child("smc", name, server.process, hosts=tuple(self.lab.topology.smcs[name].hosts),
                               files={"sockets": " ".join(map(str, server.sockets)), "log": str(server.log)}))
        return found

    def ssh_info(self, vm: str) -> dict:
        return {"user": "root", "key": str(self.lab.image.ssh_key), "known_hosts": str(self.known_hosts)}

    def run_state(self, vm: str) -> str:
        """QEMU's own view of the VM (QMP query-status: running, paused, ...); the FM holds the
        VM's one QMP connection.  A QEMU that does not answer within 2 s is "unresponsive"."""
        machine = self.lab.vms[vm]
        try:
            qmp = machine.connect_qmp(timeout=2)
            qmp.settimeout(2)
            return str(qmp.cmd("query-status")["status"])
        except Exception as err:   # a broken connection is dropped, never reused
            if machine.qmp is not None:
                try:
                    machine.qmp.close()
                except Exception:
                    pass
                machine.qmp = None
            return f"unresponsive ({type(err).__name__})"

    def stop_processes(self) -> None:
        for vm in self.lab.vms.values():
            vm.stop()
        for server in [*self.lab.gpu_servers.values(), *self.lab.smc_servers.values()]:
            server.stop()

    def close(self) -> None:
        self.lab.stop()   # what is left: connections; keeps the logs, removes the run directory
        if self.rundir.exists():   # the lab failed before it took the directory over
            if self.lab.logdir:
                archive_logs(self.rundir, self.lab.logdir)
            shutil.rmtree(self.rundir, ignore_errors=True)
