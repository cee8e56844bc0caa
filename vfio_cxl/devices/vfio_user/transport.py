"""Framed vfio-user messages over a connected UNIX stream socket.

One thread reads (the connection's reader), any thread may send: sends are
serialised by a lock so messages never interleave.  Every wait is bounded:
once the first byte of a message has arrived, the rest must keep arriving
(no gap longer than ``partial_timeout``) or ``MessageTimeout`` is raised, so a
half-sent message cannot wedge the server.  File descriptors arrive as
SCM_RIGHTS on any chunk of a message and are all collected; the caller owns
them and must keep or close each one.

Receiving: one ``recvmsg(MSG_DONTWAIT)`` per chunk while data is queued (one
syscall), and ``poll(POLLIN)`` only when nothing is.  A thread asleep *in*
``recvmsg`` would share the socket's wait queue with senders waiting for
buffer space, and the kernel's "space freed" wake-ups (one per consumed skb
once the send queue is below a quarter of SO_SNDBUF) would wake it for
nothing -- measured: half of the GPU server's context switches during a
DMA_WRITE transfer.  ``poll`` for POLLIN is woken by data (and hang-ups) only.
Sending: the socket stays in blocking mode with a kernel timeout (SO_SNDTIMEO).

Large payloads: the send buffer is raised to SEND_BUFFER (capped by the
kernel's net.core.wmem_max), or further with ``set_send_buffer`` (as root,
past that cap: SO_SNDBUFFORCE), and a caller may ask for a **zero-copy** send
of a message's last part (splice.py): its pages are queued by reference,
so the receiver's copy is the only copy of the data.
"""

from __future__ import annotations

import array
import os
import select
import socket
import struct
import threading

from . import wire
from .splice import PageSender

_CMSG_FD_SPACE = socket.CMSG_SPACE(64 * array.array("i").itemsize)
_SEND_FLAGS = socket.MSG_NOSIGNAL
_RECV_FLAGS = socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT  # _recv polls when empty
# SO_SNDBUF: a UNIX stream socket holds at most this much unread data (the
# receiver's SO_RCVBUF plays no part).  With the usual default (~208 KiB) a
# sender blocked on an 8 MiB message is woken ~50 times, each wake-up a
# cross-CPU hand-off; with 4 MiB (the kernel doubles it) a few times.
SEND_BUFFER = 4 << 20
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)  # Linux; needs CAP_NET_ADMIN
ZERO_COPY_MIN = 128 * 1024  # smaller payloads: one sendmsg copy costs less than two splices


class ConnectionClosed(Exception):
    """The peer closed the socket (or it broke)."""


class MessageTimeout(Exception):
    """A message stopped arriving within the timeout."""


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1_000_000))


def _fds_from_ancdata(ancdata, into: list[int]) -> None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            into.extend(fds)


class Transport:
    def __init__(self, sock: socket.socket, *, partial_timeout: float = 2.0,
                 send_timeout: float = 5.0, send_buffer: int = SEND_BUFFER):
        sock.setblocking(True)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_timeout))
        self.sock = sock
        if send_buffer:
            try:  # the kernel caps it at net.core.wmem_max (and doubles it)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
            except OSError:
                pass
        self.partial_timeout = partial_timeout
        self._partial_ms = max(1, round(partial_timeout * 1000))
        self._readable = select.poll()  # POLLIN only (module doc)
        self._readable.register(sock, select.POLLIN)
        self.send_timeout = send_timeout
        self._send_lock = threading.Lock()
        self._closed = False
        self.poisoned = ""  # why the stream can no longer be trusted ("" = it can)
        self._header = bytearray(wire.HEADER_SIZE)
        self._header_view = memoryview(self._header)
        self._pages: PageSender | None = None  # created on the first zero-copy send

    # ------------------------------------------------------------ receiving
    def _recv(self, buffers, fds: list[int], idle_ok: bool) -> int:
        """One recvmsg into ``buffers``; waits at most partial_timeout unless idle_ok."""
        while True:
            try:
                n, ancdata, _, _ = self.sock.recvmsg_into(buffers, _CMSG_FD_SPACE, _RECV_FLAGS)
            except BlockingIOError:  # nothing queued: sleep until data (only data) comes
                # between messages silence is fine; within one, each chunk must come in time
                if not self._readable.poll(-1 if idle_ok else self._partial_ms):
                    raise MessageTimeout(
                        f"message cut off: no data for {self.partial_timeout:.1f}s") from None
                continue
            except InterruptedError:
                continue
            except OSError as exc:
                raise ConnectionClosed(str(exc)) from None
            if ancdata:
                _fds_from_ancdata(ancdata, fds)
            if n == 0:
                raise ConnectionClosed("peer closed the socket")
            return n

    def recv_header(self, fds: list[int]) -> wire.Header:
        """Wait (unbounded) for the next message, then read its 16-byte header.

        Raises ConnectionClosed on EOF, MessageTimeout if the header stalls.
        """
        view = self._header_view
        got = self._recv([view], fds, idle_ok=True)
        if got < wire.HEADER_SIZE:
            self.recv_into(view[got:], fds)
        return wire.Header(*wire.HEADER.unpack(self._header))

    def recv_into(self, view: memoryview, fds: list[int]) -> None:
        """Fill ``view`` exactly; each chunk must come within partial_timeout."""
        pos, end = 0, len(view)
        while pos < end:
            pos += self._recv([view[pos:]], fds, idle_ok=False)

    def recv_scatter(self, views: list[memoryview], fds: list[int]) -> None:
        """Fill several buffers in order, in as few syscalls as the data allows."""
        views = [v for v in views if len(v)]
        while views:
            n = self._recv(views, fds, idle_ok=False)
            while n:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0] = views[0][n:]
                    n = 0

    def discard(self, count: int, fds: list[int]) -> None:
        """Read and drop ``count`` bytes (to skip a body we will not use)."""
        if count <= 0:
            return
        scratch = memoryview(bytearray(min(count, 1 << 16)))
        while count > 0:
            n = min(count, len(scratch))
            self.recv_into(scratch[:n], fds)
            count -= n

    # ------------------------------------------------------------ sending
    def set_send_buffer(self, size: int) -> int:
        """Let the socket hold ``size`` bytes of unread data; returns what it now holds.

        SO_SNDBUF is capped at net.core.wmem_max; a process with CAP_NET_ADMIN
        may go past it with SO_SNDBUFFORCE, which is tried first.  Never lowers
        the buffer.  (The kernel grants twice what is asked: skb overhead.)
        """
        have = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        if have >= 2 * size:
            return have
        for option in (SO_SNDBUFFORCE, socket.SO_SNDBUF):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, option, size)
                break
            except OSError:  # EPERM without CAP_NET_ADMIN: the capped option then
                continue
        got = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        if got < have:  # capped below what we had: keep what we had
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, have // 2)
            got = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        return got

    def send(self, parts, fds=(), guard=None, zero_copy: bool = False) -> None:
        """Send one whole message (a list of bytes-like parts) plus optional fds.

        ``guard()``, if given, runs under the send lock before the first byte
        goes out; an exception from it cancels the message (nothing is sent).

        ``zero_copy``: the last part, if at least ZERO_COPY_MIN bytes, is
        spliced into the socket by page reference instead of copied
        (splice.py): the caller must not change it until the peer has
        answered the message.

        If the message cannot be sent whole in one ``sendmsg`` (it failed, or it
        returned short because the send timeout expired), the transport is **poisoned**: the
        stream may be mid-message, so nothing more is ever sent on it, the socket
        is shut down (the reader sees EOF and the connection ends), and this and
        every later send raise ConnectionClosed.
        """
        views = [p if isinstance(p, (bytes, bytearray)) else memoryview(p).cast("B")
                 for p in parts if len(p)]
        ancillary = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                     if fds else [])
        with self._send_lock:
            if self.poisoned:
                raise ConnectionClosed(f"connection poisoned: {self.poisoned}")
            if self._closed:
                raise ConnectionClosed("transport closed")
            if guard is not None:
                guard()
            total = sum(len(v) for v in views)
            spliced = None
            if zero_copy and len(views) > 1 and len(views[-1]) >= ZERO_COPY_MIN:
                if self._pages is None:
                    self._pages = PageSender()
                if self._pages.available:
                    spliced = views.pop()
            sent_total = 0
            try:
                while True:
                    try:
                        sent_total = self.sock.sendmsg(views, ancillary, _SEND_FLAGS)
                    except InterruptedError:  # nothing sent yet: try again
                        continue
                    break
                if spliced is not None and sent_total == total - len(spliced):
                    sent_total += self._pages.send(self.sock, spliced, _SEND_FLAGS)
                if sent_total < total:
                    # a blocking send returns short only when SO_SNDTIMEO expired (or a
                    # signal came) mid-message: the peer is not reading; never finish
                    # a cut message later, the stream is done
                    raise BlockingIOError()
            except BlockingIOError:  # SO_SNDTIMEO expired
                self._poison(f"send stalled {self.send_timeout:.1f}s after "
                             f"{sent_total} of {total} bytes")
                raise ConnectionClosed(f"peer not reading: connection poisoned after "
                                       f"{sent_total} of {total} bytes") from None
            except OSError as exc:
                self._poison(f"{exc} after {sent_total} of {total} bytes")
                raise ConnectionClosed(f"{exc}: connection poisoned") from None
            except BaseException:  # e.g. KeyboardInterrupt mid-message: same story
                self._poison(f"interrupted after {sent_total} of {total} bytes")
                raise

    @property
    def page_sender(self) -> PageSender | None:
        """The zero-copy sender, once a zero-copy send was asked for (else None)."""
        return self._pages

    def _poison(self, why: str) -> None:
        """Send lock held.  Never send again; make the reader see EOF."""
        self.poisoned = why
        self.shutdown()

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
            if self._pages is not None:
                self._pages.close()
        self.shutdown()
        self.sock.close()
