"""FAKE lab for the fabric manager's own logic (control socket, supervision, registry, cleanup).

Its "VMs" and "GPU servers" are sleeping Python processes started the way the
real lab starts QEMU and the GPU server (own session, PR_SET_PDEATHSIG), so
the manager watches, reports and stops them exactly as it would real ones.
Nothing here boots QEMU; the VM tests do that.

    python tests/fast/fm_fake_lab.py NAME LOGDIR [--orphan]

runs a fabric manager over a FakeLab, speaking the same stdout protocol as
``python -m vfio_cxl.lab.fm serve``.  ``--orphan`` adds a process that does
NOT die with the manager (as a child forked in the instant the manager died
would), for the cleanup test.  ``--fabric`` gives it fake hot-plug (FakeFabricLab).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vfio_cxl.lab.logs import archive_logs  # noqa: E402
from vfio_cxl.lab.fm.manager import Child, FabricManager  # noqa: E402
from vfio_cxl.lab.fm.procs import ProcessId  # noqa: E402
from vfio_cxl.lab.fm.registry import RUNDIR_MARKER, LabRecord  # noqa: E402
from vfio_cxl.lab.vm import die_with_parent  # noqa: E402
from vfio_cxl.paths import runtime_root  # noqa: E402


_SLEEP = "import time; time.sleep(3600)"


class FakeLab:
    VMS = ("a", "b")
    GPUS = {"gpu0": "a"}
    SMCS = {"smc0": ("a", "b")}

    def __init__(self, rundir: Path, logdir: Path, orphan: bool = False):
        self.rundir = rundir
        self.logdir = logdir
        self.orphan = orphan
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.orphan_proc: subprocess.Popen | None = None

    def _spawn(self, tag: str) -> subprocess.Popen:
        # The run directory in the command line, as QEMU's and the GPU server's have it.
        return subprocess.Popen([sys.executable, "-c", _SLEEP, f"{self.rundir}/{tag}"], start_new_session=True,
                                preexec_fn=die_with_parent, stdin=subprocess.DEVNULL)

    def start(self, log) -> None:
        for vm in self.VMS:
            self.procs[("vm", vm)] = self._spawn(vm)
            log(f"[{vm}] fake VM started")
        for gpu in self.GPUS:
            self.procs[("gpu", gpu)] = self._spawn(gpu)
        for smc in self.SMCS:
            self.procs[("smc", smc)] = self._spawn(smc)
        if self.orphan:   # no PDEATHSIG: survives the manager
            self.orphan_proc = subprocess.Popen(
                [sys.executable, "-c", _SLEEP, f"vfio_cxl-orphan {self.rundir}"],
                start_new_session=True, stdin=subprocess.DEVNULL)
        (self.rundir / "a").mkdir()
        (self.rundir / "a" / "console.log").write_text("fake console\n")

    def children(self) -> list[Child]:
        found = [Child("vm", vm, self.procs[("vm", vm)], ssh_port=22000 + i, files={})
                 for i, vm in enumerate(self.VMS)]
        found += [Child("gpu", gpu, self.procs[("gpu", gpu)], owner=owner, files={})
                  for gpu, owner in self.GPUS.items()]
        found += [Child("smc", smc, self.procs[("smc", smc)], hosts=hosts, files={})
                  for smc, hosts in self.SMCS.items()]
        return found

    def ssh_info(self, vm: str) -> dict:
        return {"user": "root", "key": "/nonexistent", "known_hosts": "/nonexistent"}

    def run_state(self, vm: str) -> str:
        return "running (fake)"

    def stop_processes(self) -> None:
        for proc in [*self.procs.values(), *([self.orphan_proc] if self.orphan_proc else [])]:
            if proc.poll() is None:
                proc.terminate()
            proc.wait()

    def close(self) -> None:   # as the real lab's: keep the logs, remove the run directory
        archive_logs(self.rundir, self.logdir)
        shutil.rmtree(self.rundir, ignore_errors=True)


class FakeFabricLab(FakeLab):
    """FAKE hot-plug, for the manager's own handling of slow ops: device_del "completes"
    (DEVICE_DELETED) only once the test creates ``<rundir>/deleted-<dev_id>``, so a release
    stays in progress as long as the test wants; "GPU servers" are sleeping processes."""

    GPUS = {"gpu0": "a", "gpu1": "b"}
    topology_arg = "fabric"   # what the Redfish service models (the real fabric topology: VMs a, b)

    def gpu_specs(self) -> dict:
        # gpu0 has the topology's restart = "on-failure" with max_restarts = 1; gpu1 none
        return {name: {"owner": owner, "irq": "msi", "vram_mib": 64, "restart": "on-failure" if name == "gpu0" else "no",
                       "max_restarts": 1} for name, owner in self.GPUS.items()}

    def hotplug_ports(self, vm: str) -> list[str]:
        return ["hp0"]

    def start_server(self, gpu: str, generation: int) -> tuple:
        old = self.procs.pop(("gpu", gpu), None)
        if old is not None and old.poll() is None:
            old.terminate()
            old.wait()
        self.procs[("gpu", gpu)] = proc = self._spawn(gpu)
        return proc, {"socket": str(self.rundir / f"{gpu}.sock")}

    def device_add(self, vm: str, dev_id: str, port: str, socket: str) -> None:
        pass

    def device_del(self, vm: str, dev_id: str) -> None:
        pass

    def wait_deleted(self, vm: str, dev_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not (self.rundir / f"deleted-{dev_id}").exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)   # the fake's stand-in for QEMU's event; polling a file
        return True

    def bind_in_guest(self, vm: str, count: int, timeout: float) -> dict:
        return {"bdf": "0000:02:00.0", "driver": "vfio-pci"}

    def guest_bdf(self, vm: str, dev_id: str) -> str:
        return "0000:02:00.0"

    def holders(self, vm: str, bdf: str) -> list[dict]:
        return [{"pid": 4242, "comm": "holder", "path": "/dev/vfio/13"}]

    def kill_in_guest(self, vm: str, pids: list[int]) -> None:
        (self.rundir / "killed").write_text(" ".join(map(str, pids)))


def main(argv: list[str]) -> int:
    name, logdir = argv[0], Path(argv[1])
    rundir = Path(tempfile.mkdtemp(prefix="vfio-cxl-", dir=runtime_root()))
    (rundir / RUNDIR_MARKER).write_text(name + "\n")
    record = LabRecord(name=name, topology="fake", rundir=str(rundir), logdir=str(logdir),
                       fm=ProcessId.of(os.getpid()).to_json(), created=time.time())
    record.save()
    kind = FakeFabricLab if "--fabric" in argv else FakeLab
    return FabricManager(kind(rundir, logdir, orphan="--orphan" in argv), record, progress=sys.stdout).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
