"""The fabric manager's side: start, describe and stop the lab's Redfish service process.

The FM binds the listening socket itself (127.0.0.1, the port asked for or a free one) and
hands it to the service process, so a port in use fails the request at once, with the
reason, and the URL it answers with accepts connections from that moment.  The process is
the FM's child (PR_SET_PDEATHSIG): it dies with the FM, and ``vm down`` finds it by its
command line, which names the run directory."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from ....errors import LabError
from ...topology import Topology, handoff
from ...vm import die_with_parent

STOP_TIMEOUT = 5.0


class RedfishService:
    def __init__(self, popen: subprocess.Popen, port: int, log: Path):
        self.popen, self.port, self.log = popen, port, log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/redfish/v1/"

    @classmethod
    def start(cls, *, fm_socket: Path, lab: str, topology: Topology, port: int, log: Path) -> "RedfishService":
        if not 0 <= port <= 65535:
            raise LabError(f"port {port} is out of range", "give a TCP port 1-65535, or 0 for a free one")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("127.0.0.1", port))
            except OSError as err:
                raise LabError(f"cannot listen on 127.0.0.1:{port}: {err.strerror}",
                               "give another --port, or leave it out for a free one") from None
            listener.listen(64)
            port = listener.getsockname()[1]
            with open(log, "ab") as out:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "vfio_cxl.lab.fm.redfish", "--socket", str(fm_socket), "--lab", lab,
                     *handoff(topology), "--fd", str(listener.fileno())],
                    pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                    preexec_fn=die_with_parent)
        finally:
            listener.close()   # the child has its own copy
        return cls(popen, port, log)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def info(self) -> dict:
        return {"url": self.url, "port": self.port, "pid": self.popen.pid, "log": str(self.log),
                "state": "running" if self.alive() else f"exited ({self.popen.returncode})"}

    def stop(self) -> dict:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return {**self.info(), "state": "stopped"}
