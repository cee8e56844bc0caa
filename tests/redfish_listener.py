"""A Redfish event destination for the tests: a real HTTP listener on 127.0.0.1 that queues
what the service POSTs to it, each with the time it arrived (used by tests/fast/test_redfish.py
and tests/vm/test_redfish.py)."""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

MAX_BODY = 1 << 20   # an event POST is a few hundred bytes; refuse anything past this


class Listener:
    def __init__(self):
        received = self.received = queue.Queue()    # (arrival time.time(), the POSTed JSON)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY:
                    self.send_error(413 if length else 411)
                    return
                received.put((time.time(), json.loads(self.rfile.read(length))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/events"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def next(self, timeout: float = 10) -> dict:
        """The next POSTed event (raises queue.Empty after ``timeout`` s)."""
        return self.received.get(timeout=timeout)[1]

    def until(self, kind: str, timeout: float = 60) -> tuple[float, dict]:
        """Skip events up to the first whose record is of the FM's ``kind``: (arrival time, record)."""
        deadline = time.monotonic() + timeout
        while True:
            seen, event = self.received.get(timeout=max(deadline - time.monotonic(), 0.01))
            (record,) = event["Events"]
            if record["Oem"]["VfioCxl"]["kind"] == kind:
                return seen, record

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
