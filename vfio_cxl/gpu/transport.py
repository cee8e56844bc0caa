"""Framed vfio-user messages over a connected UNIX stream socket.

One thread reads (the connection's reader), any thread may send: sends are
serialised by a lock so messages never interleave.  Every wait is bounded:
once the first byte of a message has arrived, the rest must keep arriving
(no gap longer than ``partial_timeout``) or ``MessageTimeout`` is raised, so a
half-sent message cannot wedge the server.  File descriptors arrive as
SCM_RIGHTS on any chunk of a message and are all collected; the caller owns
them and must keep or close each one.
"""

from __future__ import annotations

import array
import os
import select
import socket
import threading
import time

from . import wire

_CMSG_FD_SPACE = socket.CMSG_SPACE(64 * array.array("i").itemsize)
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_RECV_FLAGS = socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
_POLL_IN = select.POLLIN | select.POLLPRI
_POLL_BAD = select.POLLERR | select.POLLNVAL


class ConnectionClosed(Exception):
    """The peer closed the socket (or it broke)."""


class MessageTimeout(Exception):
    """A message stopped arriving (or could not be sent) within the timeout."""


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _fds_from_ancdata(ancdata, into: list[int]) -> None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            into.extend(fds)


class Transport:
    def __init__(self, sock: socket.socket, *, partial_timeout: float = 2.0,
                 send_timeout: float = 5.0):
        sock.setblocking(True)  # we poll ourselves; MSG_DONTWAIT keeps calls non-blocking
        self.sock = sock
        self.partial_timeout = partial_timeout
        self.send_timeout = send_timeout
        self._send_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------ receiving
    def _wait_readable(self, timeout: float | None) -> None:
        poller = select.poll()
        poller.register(self.sock, _POLL_IN)
        ms = None if timeout is None else max(0, int(timeout * 1000))
        if not poller.poll(ms):
            raise MessageTimeout("message cut off: no data for "
                                 f"{self.partial_timeout:.1f}s")

    def _recv_some(self, view: memoryview, fds: list[int], timeout: float | None) -> int:
        while True:
            try:
                n, ancdata, flags, _ = self.sock.recvmsg_into([view], _CMSG_FD_SPACE, _RECV_FLAGS)
            except BlockingIOError:
                self._wait_readable(timeout)
                continue
            except OSError as exc:
                raise ConnectionClosed(str(exc)) from None
            _fds_from_ancdata(ancdata, fds)
            if n == 0:
                raise ConnectionClosed("peer closed the socket")
            return n

    def recv_header(self, fds: list[int]) -> wire.Header:
        """Wait (unbounded) for the next message, then read its 16-byte header.

        Raises ConnectionClosed on EOF, MessageTimeout if the header stalls.
        """
        buf = bytearray(wire.HEADER_SIZE)
        view = memoryview(buf)
        got = self._recv_some(view, fds, None)
        if got < wire.HEADER_SIZE:
            self.recv_into(view[got:], fds)
        return wire.Header.unpack(buf)

    def recv_into(self, view: memoryview, fds: list[int]) -> None:
        """Fill ``view`` exactly; each chunk must come within partial_timeout."""
        pos, end = 0, len(view)
        while pos < end:
            pos += self._recv_some(view[pos:], fds, self.partial_timeout)

    def discard(self, count: int, fds: list[int]) -> None:
        """Read and drop ``count`` bytes (to skip a body we will not use)."""
        scratch = memoryview(bytearray(min(count, 1 << 16)))
        while count > 0:
            n = min(count, len(scratch))
            self.recv_into(scratch[:n], fds)
            count -= n

    # ------------------------------------------------------------ sending
    def send(self, parts, fds=()) -> None:
        """Send one whole message (a list of bytes-like parts) plus optional fds."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        ancillary = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                     if fds else [])
        with self._send_lock:
            if self._closed:
                raise ConnectionClosed("transport closed")
            deadline = time.monotonic() + self.send_timeout
            while views:
                try:
                    sent = self.sock.sendmsg(views, ancillary, _SEND_FLAGS)
                except BlockingIOError:
                    self._wait_writable(deadline)
                    continue
                except OSError as exc:
                    raise ConnectionClosed(str(exc)) from None
                ancillary = []  # fds travel with the first byte only
                while sent and views:
                    if sent >= len(views[0]):
                        sent -= len(views.pop(0))
                    else:
                        views[0] = views[0][sent:]
                        sent = 0

    def _wait_writable(self, deadline: float) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(int(remaining * 1000) + 1):
            raise MessageTimeout(f"peer not reading: send stalled {self.send_timeout:.1f}s")

    # ------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """Wake a reader blocked in recv (it sees EOF); safe from any thread."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        with self._send_lock:
            self._closed = True
        self.shutdown()
        self.sock.close()
