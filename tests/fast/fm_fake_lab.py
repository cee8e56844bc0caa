"""FAKE lab for the fabric manager's own logic (control socket, supervision, registry, cleanup).

Its "VMs" and "GPU servers" are sleeping Python processes started the way the
real lab starts QEMU and the GPU server (own session, PR_SET_PDEATHSIG), so
the manager watches, reports and stops them exactly as it would real ones.
Nothing here boots QEMU; the VM tests do that.

    python tests/fast/fm_fake_lab.py NAME LOGDIR [--orphan]

runs a fabric manager over a FakeLab, speaking the same stdout protocol as
``python -m vfio_cxl.lab.fm serve``.  ``--orphan`` adds a process that does
NOT die with the manager (as a child forked in the instant the manager died
would), for the cleanup test.  ``--fabric`` gives it fake hot-plug (FakeFabricLab);
``--auto-release`` makes its guests let go of a GPU at once (no file to wait for).
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vfio_cxl.errors import LabError  # noqa: E402
from vfio_cxl.lab.fm.guestscripts import (BIND_OUTPUT_MAX, BIND_SCRIPT, HOLDERS_OUTPUT_MAX,  # noqa: E402
                                          HOLDERS_SCRIPT, KILL_OUTPUT_MAX, KILL_SCRIPT, parse_bind,
                                          parse_holders, parse_kills, show)
from vfio_cxl.lab.logs import archive_logs  # noqa: E402
from vfio_cxl.lab.ssh import ShellSession  # noqa: E402
from vfio_cxl.lab import topology  # noqa: E402
from vfio_cxl.lab.fm.manager import FabricManager  # noqa: E402
from vfio_cxl.lab.fm.state import Child  # noqa: E402
from vfio_cxl.lab.fm.procs import ProcessId  # noqa: E402
from vfio_cxl.lab.fm.registry import RUNDIR_MARKER, LabRecord  # noqa: E402
from vfio_cxl.lab.vm import die_with_parent  # noqa: E402
from vfio_cxl.paths import runtime_root  # noqa: E402


_SLEEP = "import time; time.sleep(3600)"


class FakeLab:
    VMS = ("a", "b")
    GPUS = {"gpu0": "a"}
    SMCS = {"smc0": ("a", "b")}
    topology = None   # no topology for a Redfish service to model

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
        found += [Child("gpu", gpu, self.procs[("gpu", gpu)], owner=owner,
                        files={"socket": str(self.rundir / f"{gpu}.sock")})
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


class LocalChannel:
    """An SSH session channel's part that ShellSession uses, over a local ``sh`` (FAKE guest)."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen(["sh"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
        self.timeout = None

    def exec_command(self, command: str) -> None:
        pass   # the channel runs sh already

    def sendall(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def recv(self, size: int) -> bytes:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            raise TimeoutError("timed out")
        return os.read(self.proc.stdout.fileno(), size)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class FakeGuest:
    """A FAKE guest for the guest scripts the FM runs (guestscripts.py): a local ``sh`` on a tree
    ``<rundir>/guest-<vm>`` whose ``proc`` is the host's /proc (real processes, real fds, real
    names) and whose ``sys`` and ``dev/vfio`` are made up: one PCI function per GPU in the VM,
    bound to vfio-pci, its IOMMU group node a plain file.  A process "holds" a GPU by opening
    that file.  ``<tree>/hostile-<script>`` (bind, holders), if there, runs instead of that script:
    a guest whose root replaced the tools."""

    def __init__(self, rundir: Path, vm: str):
        self.vm = vm
        self.root = rundir / f"guest-{vm}"
        for d in ("sys/bus/pci/devices", "sys/bus/pci/drivers/vfio-pci", "sys/kernel/iommu_groups", "dev/vfio"):
            (self.root / d).mkdir(parents=True)
        (self.root / "proc").symlink_to("/proc")
        self.bdfs: dict[str, str] = {}   # dev_id -> its BDF
        self.session = ShellSession(SimpleNamespace(vm_name=vm, connection=SimpleNamespace(client=SimpleNamespace(
            get_transport=lambda: SimpleNamespace(is_active=lambda: True, open_session=self._channel)))))

    def _channel(self) -> LocalChannel:
        return LocalChannel({"PATH": os.environ["PATH"], "VFIO_CXL_SYSROOT": str(self.root)})

    def plug(self, dev_id: str) -> str:
        slot = next(n for n in range(1, 200) if f"0000:{n + 1:02x}:00.0" not in self.bdfs.values())
        bdf, group = f"0000:{slot + 1:02x}:00.0", 10 + slot
        dev = self.root / "sys/bus/pci/devices" / bdf
        dev.mkdir()
        (dev / "vendor").write_text("0x0601\n")
        (dev / "device").write_text("0x1991\n")
        (self.root / "sys/kernel/iommu_groups" / str(group)).mkdir(exist_ok=True)
        (dev / "iommu_group").symlink_to(f"../../../../kernel/iommu_groups/{group}")
        (self.root / "sys/bus/pci/drivers/vfio-pci" / bdf).symlink_to(f"../../devices/{bdf}")
        (self.root / "dev/vfio" / str(group)).touch()
        self.bdfs[dev_id] = bdf
        return bdf

    def unplug(self, dev_id: str) -> None:
        bdf = self.bdfs.pop(dev_id, None)
        if bdf is not None:
            (self.root / "sys/bus/pci/drivers/vfio-pci" / bdf).unlink()
            shutil.rmtree(self.root / "sys/bus/pci/devices" / bdf)

    def node(self, dev_id: str) -> Path:
        """The file a process opens to hold dev_id (its group's /dev/vfio/N)."""
        link = os.readlink(self.root / "sys/bus/pci/devices" / self.bdfs[dev_id] / "iommu_group")
        return self.root / "dev/vfio" / link.rsplit("/", 1)[1]

    def script(self, name: str, script: str) -> str:
        hostile = self.root / f"hostile-{name}"
        return hostile.read_text() if hostile.exists() else script


class FakeFabricLab(FakeLab):
    """FAKE hot-plug, for the manager's own handling of slow ops: device_del "completes"
    (DEVICE_DELETED) only once the test creates ``<rundir>/deleted-<dev_id>``, so a release
    stays in progress as long as the test wants; "GPU servers" are sleeping processes.  The guest
    side is real code on a FAKE guest (FakeGuest): the FM's guest scripts, run by a ShellSession,
    parsed by guestscripts' parsers.  At start a process named "holder" holds gpu0 in VM a
    (its pid in ``<rundir>/holder.pid``)."""

    GPUS = {"gpu0": "a", "gpu1": "b"}
    auto_release = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.topology = topology.load("fabric")   # what the Redfish service models (VMs a, b)

    def start(self, log) -> None:
        super().start(log)
        self.guests = {vm: FakeGuest(self.rundir, vm) for vm in self.VMS}
        for gpu, vm in self.GPUS.items():
            self.guests[vm].plug(gpu)
        holder = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fm_holder.py")), "holder",
                                   str(self.guests["a"].node("gpu0"))], stdout=subprocess.PIPE,
                                  start_new_session=True, preexec_fn=die_with_parent)
        holder.stdout.readline()   # it holds the node
        self.procs[("holder", "gpu0")] = holder
        (self.rundir / "holder.pid").write_text(f"{holder.pid}\n")

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
        (self.rundir / "device-add-started").touch()
        while (self.rundir / "hold-device-add").exists():   # the test decides when QEMU answers
            time.sleep(0.02)
        self.guests[vm].plug(dev_id)

    def device_del(self, vm: str, dev_id: str) -> None:
        pass

    def wait_deleted(self, vm: str, dev_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.auto_release and not (self.rundir / f"deleted-{dev_id}").exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)   # the fake's stand-in for QEMU's event; polling a file
        self.guests[vm].unplug(dev_id)
        return True

    def guest_bdf(self, vm: str, dev_id: str) -> str | None:
        return self.guests[vm].bdfs.get(dev_id)

    def bind_in_guest(self, vm: str, count: int, timeout: float) -> dict:
        guest = self.guests[vm]
        status, out = guest.session.run(guest.script("bind", BIND_SCRIPT), [str(count), f"{timeout:.0f}"],
                                        timeout + 30, limit=BIND_OUTPUT_MAX)
        if status != 0:
            raise LabError(f"VM {vm}: the hot-plugged GPU is not bound to vfio-pci: {show(out[-500:])}", "-")
        return parse_bind(vm, out)

    def holders(self, vm: str, bdf: str) -> list[dict]:
        guest = self.guests[vm]
        status, out = guest.session.run(guest.script("holders", HOLDERS_SCRIPT), [bdf], 60,
                                        limit=HOLDERS_OUTPUT_MAX)
        if status != 0:
            raise LabError(f"VM {vm}: no IOMMU group for {bdf}: {show(out[-300:])}", "-")
        return parse_holders(vm, out)

    def kill_in_guest(self, vm: str, bdf: str, pids: list[int]) -> tuple:
        (self.rundir / "killed").write_text(" ".join(map(str, pids)))
        status, out = self.guests[vm].session.run(KILL_SCRIPT, [bdf, *map(str, pids)], 30, limit=KILL_OUTPUT_MAX)
        return parse_kills(vm, out)

    def stop_processes(self) -> None:
        for guest in getattr(self, "guests", {}).values():
            guest.session.close()
        super().stop_processes()


def main(argv: list[str]) -> int:
    name, logdir = argv[0], Path(argv[1])
    rundir = Path(tempfile.mkdtemp(prefix="vfio-cxl-", dir=runtime_root()))
    (rundir / RUNDIR_MARKER).write_text(name + "\n")
    record = LabRecord(name=name, topology="fake", rundir=str(rundir), logdir=str(logdir),
                       fm=ProcessId.of(os.getpid()).to_json(), created=time.time())
    record.save()
    lab = (FakeFabricLab if "--fabric" in argv else FakeLab)(rundir, logdir, orphan="--orphan" in argv)
    lab.auto_release = "--auto-release" in argv
    return FabricManager(lab, record, progress=sys.stdout).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
