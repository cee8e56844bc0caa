"""The serve loop of the device servers' commands (``vfio-cxl gpu serve``, ``vfio-cxl smc serve``).

Listen, print one ``READY <socket>`` line per socket (the lab starts QEMU only after
them), serve until SIGTERM or SIGINT, and put the previous signal handlers back.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable


def serve_until_signalled(prog: str, sockets: list[str], *, listen: Callable[[], None],
                          run: Callable[[], None], stop: Callable[[], None]) -> int:
    """``listen()`` binds ``sockets`` (and starts whatever serves them); ``run()`` serves
    until ``stop()``, which SIGTERM and SIGINT call.  Returns 1 if the sockets cannot
    listen (said on stderr, prefixed ``prog``), else 0.  Closing the server is the caller's."""
    try:
        listen()
    except OSError as exc:
        print(f"{prog}: cannot listen on {', '.join(sockets)}: {exc}", file=sys.stderr)
        return 1
    previous = {sig: signal.signal(sig, lambda *_: stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for path in sockets:
            print(f"READY {path}", flush=True)
        run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
