"""Leak checks on processes we can see in /proc: what each holds, by kind, compared like with like.

A process's fds are read as the multiset of their targets (``readlink /proc/PID/fd/N``) with the
numbers that change from run to run taken out (``socket:[81921]`` is a ``socket``), so a leak
names what leaked (``/memfd:vfio-cxl-gpu-vram (deleted)``, ``anon_inode:[eventfd]``), not just
that a count moved.

What QEMU closes late: the host socket of a finished SSH connection to a guest.  Behind slirp
(user networking with a forwarded port) every `vfio-cxl vm ssh` is a TCP connection that QEMU
accepts; when it ends, the kernel drops the connection from its tables at once, but slirp keeps
the fd until its own TCP state machine lets go (measured: about 9 s after the client exits).
Over TCP such a socket is in none of the process's socket tables (``/proc/PID/net/{tcp,tcp6,udp,
udp6,unix}``) and still has the local port of the listener that accepted it; over a unix socket
(the lab's own SSH path, `vfio-cxl vm ssh`) it is listed, connected, with its peer gone.
``released_late`` counts those, and ``settle`` polls until none is left (or the deadline passes)
before holdings are compared, so a late close is waited for and a real leak still fails.  QEMU
also holds two TCP sockets no table lists for as long as it runs (bound to ports of their own,
never listening or connected): they are not late, and taking them for late ones made every
settle wait its whole deadline.  Each socket is looked at through a copy of its fd
(pidfd_getfd(2)); where that is not allowed, every unlisted socket counts, as before.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import socket
import time
from collections import Counter

Holdings = dict[str, Counter]


def fd_kinds(pid: int) -> Counter:
    """The fds of ``pid`` by target, with socket/pipe inode numbers taken out."""
    kinds: Counter = Counter()
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{fd}")
        except FileNotFoundError:      # closed while we looked
            continue
        kinds[re.sub(r"^(socket|pipe):\[\d+\]$", r"\1", target)] += 1
    return kinds


_SYS_PIDFD_GETFD = 438   # x86_64 and every architecture with the common syscall table
_UNIX_CONNECTED = "03"    # /proc/net/unix's St column: SS_CONNECTED (the kernel's TCP_ESTABLISHED)


def _socket_tables(pid: int) -> tuple[set[str], set[int], set[str]]:
    """One read of the socket tables of ``pid``'s network namespace: every inode they list, the
    TCP ports in LISTEN, and the unix sockets in connected state (a peer that has gone leaves
    them so)."""
    listed: set[str] = set()
    listening: set[int] = set()
    connected: set[str] = set()
    for table, column in (("tcp", 9), ("tcp6", 9), ("udp", 9), ("udp6", 9), ("unix", 6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for fields in (line.split() for line in f):
                    if len(fields) <= column:
                        continue
                    listed.add(fields[column])
                    if table.startswith("tcp") and fields[3] == "0A":   # LISTEN
                        listening.add(int(fields[1].rsplit(":", 1)[1], 16))
                    elif table == "unix" and fields[5] == _UNIX_CONNECTED:
                        connected.add(fields[column])
        except FileNotFoundError:
            continue
    return listed, listening, connected


def _ended(pidfd: int, fd: int, listening: set[int], tcp_unlisted: bool, unix_connected: bool) -> bool | None:
    """Whether socket ``fd`` of the process behind ``pidfd`` is an ended connection it has not
    closed yet, looked at through a copy of it (None: no copy could be had).  TCP: no table
    lists it and its local port is one the process listens on (an accepted connection; QEMU's
    two standing sockets have ports of their own).  Unix: connected, and its peer is gone
    (POLLHUP: both directions shut)."""
    copy = ctypes.CDLL(None, use_errno=True).syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if copy < 0:
        return None
    try:
        with socket.socket(fileno=copy) as sock:
            try:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    return tcp_unlisted and sock.getsockname()[1] in listening
                if sock.family == socket.AF_UNIX and unix_connected:
                    poller = select.poll()
                    poller.register(copy, select.POLLIN)
                    return any(mask & select.POLLHUP for _, mask in poller.poll(0))
                return False
            finally:
                sock.detach()
    finally:
        os.close(copy)


def released_late(pid: int) -> int:
    """Sockets ``pid`` holds for connections that have ended: slirp's, after an SSH session
    ended, which it closes seconds later (over TCP, one no table lists any more; over a unix
    socket, one whose peer has gone).  Where no copy of an fd can be had, a socket no table
    lists counts, as before."""
    listed, listening, connected = _socket_tables(pid)
    sockets = []
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"{base}/{fd}"))
        except FileNotFoundError:
            continue
        # only an unlisted socket (TCP) or a connected unix one can be late: the rest need no look
        if m and (m.group(1) not in listed or m.group(1) in connected):
            sockets.append((int(fd), m.group(1)))
    if not sockets:
        return 0
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return sum(1 for _, inode in sockets if inode not in listed)
    try:
        ended = [(_ended(pidfd, fd, listening, inode not in listed, inode in connected), inode)
                 for fd, inode in sockets]
    finally:
        os.close(pidfd)
    return sum(1 for late, inode in ended if late or (late is None and inode not in listed))


def differences(before: Holdings, after: Holdings) -> dict[str, dict[str, int]]:
    """Per process, what ``after`` holds more (+n) or less (-n) of than ``before``, by kind."""
    out = {}
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key, Counter()), after.get(key, Counter())
        delta = {kind: a[kind] - b[kind] for kind in sorted(set(a) | set(b)) if a[kind] != b[kind]}
        if delta:
            out[key] = delta
    return out


def settle(pids: dict[str, int], reference: Holdings | None = None, timeout: float = 30,
           interval: float = 0.05) -> tuple[Holdings, float]:
    """The holdings of ``pids`` (name -> pid) once none holds a socket released late and, with a
    ``reference``, they equal it -- or at the deadline; and how long that took.  ``interval`` is
    the poll period of that condition."""
    t0 = time.monotonic()
    while True:
        quiet = not any(released_late(pid) for pid in pids.values())
        now = {name: fd_kinds(pid) for name, pid in pids.items()}
        if (quiet and (reference is None or not differences(reference, now))) or time.monotonic() - t0 >= timeout:
            return now, time.monotonic() - t0
        time.sleep(interval)
