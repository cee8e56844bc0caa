"""The fabric manager's event log (vfio_cxl.lab.fm.events): bounded history, sequence numbers, pages."""

from __future__ import annotations

import json

from vfio_cxl.lab.fm import protocol
from vfio_cxl.lab.fm.events import EVENT_MESSAGE_MAX, EVENT_PAGE_BYTES, EventLog


def test_an_event_has_the_next_seq_and_its_follower_line():
    log = EventLog()
    first, _ = log.record("lab-starting", "starting", lab="x")
    ev, line = log.record("vm-ready", "VM a ready", vm="a")
    assert (first["seq"], ev["seq"], log.seq) == (1, 2, 2)
    assert ev["kind"] == "vm-ready" and ev["vm"] == "a" and ev["time"] > 0
    assert protocol.parse_response(line) == protocol.event(ev)
    assert log.events == [first, ev]


def test_a_long_message_is_cut_and_says_how_long_it_was():
    ev, _ = EventLog().record("gpu-force", "x" * (EVENT_MESSAGE_MAX + 5))
    assert ev["message"] == "x" * EVENT_MESSAGE_MAX + f"... ({EVENT_MESSAGE_MAX + 5} characters)"


def test_history_keeps_the_newest_and_pages_count_what_was_dropped():
    log = EventLog(keep=3)
    for i in range(5):
        log.record("tick", f"tick {i}")
    assert [ev["seq"] for ev in log.events] == [3, 4, 5]
    page, rest = log.page(since=0, limit=10)
    assert [ev["seq"] for ev in page["events"]] == [3, 4, 5] and rest == []
    assert (page["oldest"], page["latest"], page["dropped"], page["more"]) == (3, 5, 2, False)
    page, _ = log.page(since=3, limit=10)
    assert [ev["seq"] for ev in page["events"]] == [4, 5] and page["dropped"] == 0


def test_a_page_stops_at_its_limit_and_hands_back_the_rest_as_lines():
    log = EventLog()
    for i in range(5):
        log.record("tick", f"tick {i}")
    page, rest = log.page(since=1, limit=2)
    assert [ev["seq"] for ev in page["events"]] == [2, 3] and page["more"] is True
    assert [json.loads(line)["event"]["seq"] for line in rest] == [4, 5]


def test_a_page_stops_at_its_byte_budget_but_holds_at_least_one_event():
    log = EventLog()
    big = "y" * (EVENT_MESSAGE_MAX - 10)
    count = EVENT_PAGE_BYTES // EVENT_MESSAGE_MAX + 10
    for _ in range(count):
        log.record("big", big)
    page, rest = log.page(since=0, limit=1000)
    assert 1 <= len(page["events"]) < count and len(page["events"]) + len(rest) == count
    assert len(json.dumps(page).encode()) <= EVENT_PAGE_BYTES + 2 * EVENT_MESSAGE_MAX


def test_an_empty_log_pages_nothing():
    page, rest = EventLog().page(since=0, limit=5)
    assert page == {"events": [], "more": False, "oldest": 1, "latest": 0, "dropped": 0} and rest == []
