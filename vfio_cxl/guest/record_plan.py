"""A plan of records for the channel benchmarks: ``SIZE:COUNT:MODE,...``.

MODE ``paced`` sends one record in flight (each waits for the previous one's ack: latency),
``stream`` sends them back to back (throughput).  The host's ``bench share`` checks a plan
before it boots anything and reads the figures by it; the guests'
``vfio_cxl.guest.cmd.share_bench`` sends and receives by the same plan.
"""

from __future__ import annotations

from .cxl import CxlError

__all__ = ["DEFAULT_PLAN", "parse_plan"]

DEFAULT_PLAN = ("64:100:paced,64:2000:stream,4096:100:paced,4096:1000:stream,"
                "65536:50:paced,65536:200:stream,1048576:20:paced,1048576:40:stream")


def parse_plan(text: str) -> list[tuple[int, int, str]]:
    """``text`` as (size, count, mode) items, in order; a bad item is a ``CxlError`` naming it."""
    plan = []
    for item in text.split(","):
        try:
            size, count, mode = item.split(":")
            size, count = int(size), int(count)
        except ValueError:
            raise CxlError(f"bad plan item {item!r}", "write SIZE:COUNT:paced|stream, comma-separated") from None
        if mode not in ("paced", "stream") or size < 1 or count < 2:
            raise CxlError(f"bad plan item {item!r}", "mode paced or stream, size >= 1, count >= 2")
        plan.append((size, count, mode))
    return plan
