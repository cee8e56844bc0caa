"""A real fabric-manager process over the FAKE lab of fm_fake_lab.py, for the fast tests.

``env`` (a fixture) gives each test a private cache (registry, logs) and run-directory
parent; ``FakeFm(*flags)`` starts a manager over the fake lab and waits for its
``ready:`` line; ``raw_exchange`` speaks bytes to a control socket.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vfio_cxl.lab.fm import registry
from vfio_cxl.lab.fm.cleanup import down
from vfio_cxl.lab.fm.client import FmClient
from vfio_cxl.lab.fm.procs import wait_gone
from vfio_cxl.paths import REPO_ROOT

FAKE = Path(__file__).with_name("fm_fake_lab.py")


@pytest.fixture
def env(monkeypatch):
    """A private cache (registry, logs) and run-directory parent, short enough for socket paths."""
    root = Path(tempfile.mkdtemp(prefix="fmt-", dir="/tmp"))
    monkeypatch.setenv("VFIO_CXL_CACHE", str(root / "cache"))
    monkeypatch.setenv("VFIO_CXL_RUNDIR", str(root / "run"))
    yield root
    for record in registry.records():
        if record.fm_alive():
            os.kill(record.fm["pid"], signal.SIGKILL)
            wait_gone([record.fm_id()], 10)
        down(record, log=lambda text: None)
    shutil.rmtree(root, ignore_errors=True)


class FakeFm:
    def __init__(self, *extra: str):
        self.name, self.logdir = registry.reserve_name("fake")
        self.proc = subprocess.Popen([sys.executable, str(FAKE), self.name, str(self.logdir), *extra],
                                     stdout=subprocess.PIPE, stderr=open(self.logdir / "fm.log", "ab"),
                                     text=True, cwd=REPO_ROOT, start_new_session=True)
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            if line.startswith("ready: "):
                break
        else:
            raise AssertionError(f"fake FM did not get ready: {lines} {(self.logdir / 'fm.log').read_text()}")
        self.record = registry.find(self.name)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_kib(self) -> int:
        """The manager's resident set (VmRSS, KiB)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def client(self, timeout: float = 10) -> FmClient:
        return FmClient(self.record.socket, lab=self.name, timeout=timeout).connect()

    def wait(self) -> int:
        return self.proc.wait(30)


def raw_exchange(path: Path, data: bytes, timeout: float = 10) -> list[dict]:
    """Send data, close our side, read every answer line until the manager closes."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return [json.loads(line) for line in received.splitlines()]
