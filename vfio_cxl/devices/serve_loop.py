"""The serve loop of the device servers' commands (``vfio-cxl gpu serve``, ``vfio-cxl smc serve``).

Listen, print one ``READY <socket>`` line per socket (the lab starts QEMU only after
them), serve until SIGTERM or SIGINT, and put the previous signal handlers back.

A signal sent to the process may land on any of its threads.  Python runs the handler in
the main thread, but only once that thread runs again: a main thread blocked without a
timeout (``poll()``, a lock) is not interrupted when another thread took the signal, and
waits on (seen: a SIGINT'd ``vfio-cxl gpu serve`` that never exited).  So ``run`` either
waits with a timeout, or its wait includes a pipe whose write end is ``wakeup_fd``: the
signal writes a byte there, whichever thread takes it (``signal.set_wakeup_fd``).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable


def serve_until_signalled(prog: str, sockets: list[str], *, listen: Callable[[], None],
                          run: Callable[[], None], stop: Callable[[], None],
                          wakeup_fd: int | None = None) -> int:
    """``listen()`` binds ``sockets`` (and starts whatever serves them); ``run()`` serves
    until ``stop()``, which SIGTERM and SIGINT call; ``wakeup_fd``, a non-blocking pipe's
    write end that ``run`` waits on (see the module doc).  Returns 1 if the sockets cannot
    listen (said on stderr, prefixed ``prog``), else 0.  Closing the server is the caller's."""
    try:
        listen()
    except OSError as exc:
        print(f"{prog}: cannot listen on {', '.join(sockets)}: {exc}", file=sys.stderr)
        return 1
    previous_wakeup = signal.set_wakeup_fd(wakeup_fd, warn_on_full_buffer=False) if wakeup_fd is not None else None
    previous = {sig: signal.signal(sig, lambda *_: stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for path in sockets:
            print(f"READY {path}", flush=True)
        run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if previous_wakeup is not None:
            signal.set_wakeup_fd(previous_wakeup)
    return 0
