"""The fabric manager's event log: a bounded history of what happened to the lab, in pages.

Every event gets the next sequence number of the lab's life and is encoded once
as the `event` line a follower receives; the newest :data:`EVENT_HISTORY` are
kept (older ones are dropped, and the pages say how many).  Who follows is the
control server's business (:mod:`.server`); this module only keeps and pages.
"""

from __future__ import annotations

import time
from collections import deque

from . import protocol

EVENT_HISTORY = 1000   # events kept for `events` (older ones are dropped, and counted)
EVENT_PAGE = 100       # events per `events` answer by default ...
EVENT_PAGE_MAX = 1000  # ... and at most
EVENT_PAGE_BYTES = 256 << 10   # and at most this much JSON (an answer stays far below MAX_LINE)
EVENT_MESSAGE_MAX = 2000       # characters of an event's message (it may quote a guest)


class EventLog:
    """The newest ``keep`` events, each with its encoded `event` line (its size is known, and
    the line is what a follower gets); ``seq`` counts every event of the lab's life."""

    def __init__(self, keep: int = EVENT_HISTORY):
        self.history: deque[tuple[dict, bytes]] = deque(maxlen=keep)
        self.seq = 0

    def record(self, kind: str, message: str, **fields) -> tuple[dict, bytes]:
        """A new event (its message cut to EVENT_MESSAGE_MAX characters) and its `event` line."""
        if len(message) > EVENT_MESSAGE_MAX:
            message = message[:EVENT_MESSAGE_MAX] + f"... ({len(message)} characters)"
        self.seq += 1
        ev = {"seq": self.seq, "time": time.time(), "monotonic": time.monotonic(),
              "kind": kind, "message": message, **fields}
        line = protocol.encode(protocol.event(ev))
        self.history.append((ev, line))
        return ev, line

    @property
    def events(self) -> list[dict]:
        """The events still kept, oldest first."""
        return [ev for ev, _ in self.history]

    def page(self, since: int, limit: int) -> tuple[dict, list[bytes]]:
        """Events after ``since``: the answer's page (at most ``limit`` events and
        EVENT_PAGE_BYTES of JSON), and the `event` lines of the kept ones after it."""
        oldest = self.history[0][0]["seq"] if self.history else self.seq + 1
        page, size, rest = [], 0, []
        for ev, line in self.history:
            if ev["seq"] <= since:
                continue
            if rest or len(page) >= limit or (page and size + len(line) > EVENT_PAGE_BYTES):
                rest.append(line)
                continue
            page.append(ev)
            size += len(line)
        return {"events": page, "more": bool(rest), "oldest": oldest, "latest": self.seq,
                "dropped": max(oldest - 1 - max(since, 0), 0)}, rest
