"""Zero-copy sends of large payloads: vmsplice(2) into a pipe, splice(2) into the socket.

``sendmsg`` copies every byte into socket buffers, and the receiver copies
it out again: two copies for a DMA_WRITE piece.  Since Linux 6.5 a UNIX
stream socket takes spliced pages as they are (MSG_SPLICE_PAGES), so
``vmsplice`` of the source into a pipe plus ``splice`` of the pipe into the
socket queues *references* to the source pages: the receiver's copy is the
only one.  The pages stay referenced until the receiver has read them, so
a writer changing the source meanwhile changes what the receiver gets --
the sender must treat the data as being on the wire until the receiver
answered (a DMA_WRITE reply comes only after QEMU read the whole message).

Python has ``os.splice`` but no ``vmsplice``: that one call goes through libc
with cffi (ABI mode; the call releases the GIL).  ``PageSender.available``
is False where the pieces are missing; callers then use ``sendmsg``.
"""

from __future__ import annotations

import errno
import fcntl
import os

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
SPLICE_F_NONBLOCK = getattr(os, "SPLICE_F_NONBLOCK", 2)
PIPE_SIZE = 1 << 20  # bytes per vmsplice/splice round (the default pipe-max-size)

try:
    import cffi

    _ffi = cffi.FFI()
    _ffi.cdef("""
        struct iovec { void *iov_base; size_t iov_len; };
        long vmsplice(int fd, const struct iovec *iov, unsigned long nr_segs, unsigned int flags);
    """)
    try:
        _libc = _ffi.dlopen(None)
    except OSError:
        _libc = _ffi.dlopen("libc.so.6")
    _vmsplice = _libc.vmsplice
except (ImportError, OSError, AttributeError):  # no cffi / no libc vmsplice
    _ffi = _vmsplice = None


class PageSender:
    """One pipe that carries page references from a buffer into a socket.

    Not thread-safe: the transport's send lock serialises its use.  After a
    failed or short ``send`` the pipe may hold stale references: the
    transport is poisoned then and this sender is never used again.
    """

    # vmsplice(2) through libc (cffi); a class attribute so a test can stand in
    # for a kernel that refuses it
    vmsplice = staticmethod(_vmsplice) if _vmsplice is not None else None

    def __init__(self):
        self.available = False
        self.refused = 0  # errno of a vmsplice the kernel refused (then: sendmsg for good)
        self._r = self._w = -1
        self.pipe_size = 0
        if self.vmsplice is None or not hasattr(os, "splice"):
            return
        self._r, self._w = os.pipe2(os.O_CLOEXEC)
        try:
            fcntl.fcntl(self._w, F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:  # over the user's pipe quota: keep the default size
            pass
        self.pipe_size = fcntl.fcntl(self._w, F_GETPIPE_SZ)
        self._iov = _ffi.new("struct iovec *")
        self.available = True

    def send(self, sock, data: memoryview, flags: int) -> int:
        """Queue all of ``data`` on the blocking socket ``sock``; returns the bytes queued.

        Fewer than ``len(data)`` means the socket's send timeout expired with
        the peer not reading; OSError if the socket failed.  If the kernel
        refuses ``vmsplice`` for this buffer (nothing of it in the pipe), the
        rest goes with ``sendmsg`` (``flags``) and this sender is not used again.
        """
        iov, pipe_w, pipe_r, sock_fd = self._iov, self._w, self._r, sock.fileno()
        total, sent = len(data), 0
        with _ffi.from_buffer(data) as base:
            while sent < total:
                iov.iov_base = base + sent
                iov.iov_len = min(self.pipe_size, total - sent)
                got = self.vmsplice(pipe_w, iov, 1, SPLICE_F_NONBLOCK)
                if got <= 0:  # the pipe is empty here: nothing is lost by falling back
                    self.available = False
                    self.refused = _ffi.errno or errno.EIO
                    while True:
                        try:
                            return sent + sock.sendmsg([data[sent:]], [], flags)
                        except InterruptedError:
                            continue
                try:
                    n = os.splice(pipe_r, sock_fd, got)
                except BlockingIOError:  # SO_SNDTIMEO expired before a byte went
                    return sent
                # a blocking splice returns short only when SO_SNDTIMEO expired (or
                # a signal came) mid-way: like a short sendmsg, the stream is cut
                sent += n
                if n < got:
                    return sent
        return sent

    def close(self) -> None:
        for fd in (self._r, self._w):
            if fd >= 0:
                os.close(fd)
        self._r = self._w = -1
        self.available = False
