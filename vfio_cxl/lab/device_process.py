"""A device server (``python -m vfio_cxl.devices.<device> serve ...``) as a child process of the lab.

It runs in its own Python process so that its device model never competes
with the lab for the GIL; the lab starts QEMU only after the server has
printed one ``READY <socket>`` line per socket it serves (QEMU connects at
start-up).  The lab knows the server only by its command line.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..errors import LabError
from ..paths import REPO_ROOT
from .vm import die_with_parent


class DeviceServerProcess:
    def __init__(self, what: str, module: str, args: list[str], sockets: list[Path], log: Path,
                 append: bool = False):
        self.what = what              # for messages: "GPU server", "SMC server smc0"
        self.module = module
        self.args = list(args)
        self.sockets = list(sockets)
        self.log = log
        self.append = append   # append to the log instead of starting it afresh
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 15) -> None:
        self.spawn()
        self.wait_ready(timeout)

    def spawn(self) -> None:
        """Start the process and return at once (``wait_ready`` waits for its READY lines)."""
        cmd = [sys.executable, "-m", self.module, "serve", *self.args]
        with open(self.log, "ab" if self.append else "wb") as log:
            self.process = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True,
                preexec_fn=die_with_parent)

    def wait_ready(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        out = b""
        want = [f"READY {s}".encode() for s in self.sockets]
        while out.count(b"\n") < len(want):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.process.stdout], [], [], max(left, 0))
            if not ready:
                self.stop()
                raise LabError(f"{self.what} did not report READY within {timeout:.0f} s", f"see {self.log}")
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                self.stop()
                raise LabError(f"{self.what} exited before it was ready:\n{self.log.read_text()[-2000:]}",
                               "see the server log above")
            out += chunk
        lines = out.splitlines()[:len(want)]
        if lines != want:
            self.stop()
            raise LabError(f"{self.what} said {lines!r} instead of {want!r}", f"see {self.log}")

    def stop(self, timeout: float = 5) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()
        self.process = None
        for s in self.sockets:
            s.unlink(missing_ok=True)


def smc_server(name: str, sockets: list[Path], log: Path) -> DeviceServerProcess:
    """The shared-memory controller ``name``, host h on ``sockets[h]``."""
    args = [a for s in sockets for a in ("--socket", str(s))]
    return DeviceServerProcess(f"SMC server {name}", "vfio_cxl.devices.smc", args, sockets, log)
