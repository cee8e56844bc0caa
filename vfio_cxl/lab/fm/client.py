"""The fabric manager's Python API: one client per connection to a lab's control socket.

    with FmClient.for_lab("shared-3") as fm:      # or FmClient.for_lab() for the only lab
        fm.status()["gpus"]["gpu0"]["state"]
        for event in fm.follow_events(): ...

Every method is one request of docs/fabric-manager.md; a refusal raises
RemoteError with the manager's what/fix.  A connection that timed out or
broke mid-message is poisoned: later calls fail instead of reading a stale answer.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Iterator

from ...errors import LabError
from . import protocol, registry


class FmClient:
    def __init__(self, socket_path: Path | str, *, lab: str = "", timeout: float = 30):
        self.path = Path(socket_path)
        self.lab = lab or self.path.parent.name
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.reader = None
        self.poisoned = False
        self.dropped = 0   # follow_events: past events the manager no longer kept

    @classmethod
    def for_lab(cls, name: str | None = None, timeout: float = 30) -> "FmClient":
        record = registry.find(name)
        if not record.fm_alive():
            raise LabError(f"the fabric manager of lab {record.name} (pid {record.fm['pid']}) is not running",
                           f"its VMs went with it; vfio-cxl vm down {record.name} cleans up")
        return cls(record.socket, lab=record.name, timeout=timeout)

    def connect(self) -> "FmClient":
        if self.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
            except OSError as err:
                sock.close()
                raise LabError(f"the fabric manager of lab {self.lab} does not answer on {self.path}: "
                               f"{err.strerror or err}",
                               f"see vfio-cxl vm ls; vfio-cxl vm down {self.lab} cleans up") from None
            self.sock = sock
            self.reader = sock.makefile("rb")
        return self

    def close(self) -> None:
        if self.reader:
            self.reader.close()
            self.reader = None
        if self.sock:
            self.sock.close()
            self.sock = None

    def __enter__(self) -> "FmClient":
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the wire ------------------------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        if self.poisoned:
            raise LabError(f"the connection to lab {self.lab}'s fabric manager broke earlier",
                           "open a new FmClient")
        self.connect()
        try:
            self.sock.sendall(data)
        except OSError as err:
            self.poisoned = True
            raise LabError(f"lost the fabric manager of lab {self.lab}: {err}", "see vfio-cxl vm ls") from None

    def read_message(self, timeout: float | None = -1) -> dict | None:
        """The next line from the manager, parsed; None at end of stream (the manager closed)."""
        if timeout != -1:
            self.sock.settimeout(timeout)
        try:
            line = self.reader.readline(protocol.MAX_LINE + 1)
        except OSError as err:   # includes socket.timeout
            self.poisoned = True
            raise LabError(f"no answer from lab {self.lab}'s fabric manager: {err or 'timed out'}",
                           f"see vfio-cxl vm ls and the lab's fm.log") from None
        finally:
            if timeout != -1 and self.sock:
                self.sock.settimeout(self.timeout)
        if not line:
            return None
        if not line.endswith(b"\n"):
            self.poisoned = True
            raise LabError(f"lab {self.lab}'s fabric manager sent a partial line", "see its fm.log")
        return protocol.parse_response(line)

    def call(self, op: str, **fields) -> dict:
        """One request and its answer.  A slow op's answer is awaited as long as the manager may
        work on it (protocol.op_timeout), never less than this client's timeout."""
        self.send_raw(protocol.encode(protocol.request(op, **fields)))
        bound = protocol.op_timeout(op, fields)
        answer = self.read_message(-1 if bound is None else max(bound, self.timeout))
        if answer is None:
            self.poisoned = True
            raise LabError(f"lab {self.lab}'s fabric manager closed the connection during {op!r}",
                           "see vfio-cxl vm ls and the lab's fm.log")
        if not answer.get("ok"):
            err = answer.get("error") or {}
            raise protocol.RemoteError(err.get("what", "request failed"), err.get("fix", ""))
        return answer["result"]

    # -- operations ----------------------------------------------------------------------
    def hello(self) -> dict:
        return self.call("hello")

    def status(self) -> dict:
        return self.call("status")

    def events_page(self, since: int = 0, limit: int | None = None) -> dict:
        """One page of the events after ``since``: ``events``, ``more`` (a later page has more),
        ``oldest`` and ``latest`` (the seqs the manager keeps) and ``dropped`` (events after
        ``since`` it no longer keeps)."""
        return self.call("events", since=since, **({"limit": limit} if limit is not None else {}))

    def events(self, since: int = 0) -> list[dict]:
        """Every event after ``since`` the manager still keeps, page by page."""
        found = []
        while True:
            page = self.events_page(since)
            found += page["events"]
            if not page["more"] or not page["events"]:
                return found
            since = page["events"][-1]["seq"]

    def follow_events(self, since: int = 0, timeout: float | None = None) -> Iterator[dict]:
        """Past events after ``since`` (those the manager still keeps), then each new one as it
        happens, until the lab stops.

        Subscribed when this returns (not at the first ``next``), so nothing that
        happens after the call is missed.  ``timeout``: seconds to wait for the
        next event before raising LabError (None: forever)."""
        first = self.call("events", since=since, follow=True)
        self.dropped = first["dropped"]

        def stream():
            yield from first["events"]
            while True:
                message = self.read_message(timeout)
                if message is None:
                    return
                if "event" in message:
                    yield message["event"]
        return stream()

    def ssh_info(self, vm: str) -> dict:
        return self.call("ssh_info", vm=vm)

    def stop(self) -> dict:
        return self.call("stop")

    def restart(self, gpu: str) -> dict:
        return self.call("restart", gpu=gpu)

    def assign(self, gpu: str, vm: str, keep_vram: bool = False) -> dict:
        return self.call("assign", gpu=gpu, vm=vm, keep_vram=keep_vram)

    def redfish(self, port: int = 0, stop: bool = False) -> dict:
        """Start the lab's Redfish service (port 0: a free one), or ``stop`` it; its url, port, pid."""
        return self.call("redfish", port=port, stop=stop)

    def release(self, gpu: str, force: bool = False, keep_vram: bool = False,
                timeout: float | None = None) -> dict:
        fields = {"timeout": timeout} if timeout is not None else {}
        return self.call("release", gpu=gpu, force=force, keep_vram=keep_vram, **fields)
