"""The GPU device server as a child process of the lab (one per VM with a GPU).

It runs in its own Python process so that its DMA engine never competes with
the lab for the GIL; the lab starts QEMU only after the server has printed
``READY <socket>`` (QEMU connects to the socket at start-up).
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


class GpuServerProcess:
    def __init__(self, socket: Path, log: Path, extra_args: list[str] = (), append: bool = False):
        self.socket = socket
        self.log = log
        self.append = append   # one log across a GPU's successive servers
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 15) -> None:
        cmd = [sys.executable, "-m", "vfio_cxl.devices.gpu", "serve", "--socket", str(self.socket), *self.extra_args]
        with open(self.log, "ab" if self.append else "wb") as log:
            self.process = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True,
                preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.process.stdout], [], [], max(left, 0))
            if not ready:
                self.stop()
                raise LabError(f"GPU server did not report READY within {timeout:.0f} s", f"see {self.log}")
            chunk = os.read(self.process.stdout.fileno(), 256)
            if not chunk:
                self.stop()
                raise LabError(f"GPU server exited before it was ready:\n{self.log.read_text()[-2000:]}",
                               "see the server log above")
            line += chunk
        if not line.startswith(b"READY "):
            self.stop()
            raise LabError(f"GPU server said {line!r} instead of READY", f"see {self.log}")

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
        self.socket.unlink(missing_ok=True)
