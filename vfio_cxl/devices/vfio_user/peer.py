"""Peer memory: a server shares its device memory fd with peer servers, and
reaches theirs, over a small UNIX-socket side channel.

* ``MemoryShare(path, fd, size)`` listens on ``path``; every connection gets
  one message: the size (u64) with ``fd`` attached (SCM_RIGHTS), and is then
  kept open for as long as the share lives: its end (EOF) tells the peer that
  this memory's owner is gone (stopped, replaced by a fresh server, dead).
* ``PeerSet(paths)`` fetches each peer's fd lazily (peers may start later),
  mmaps it shared, closes the fd, and keeps the mmap while the share's
  connection stays open; ``views()`` lists what it has.  When a share's
  connection ends, a watcher thread *retires* that peer at once: unmapped,
  ``retired`` set, so a proven DMA mapping into it falls back to the message
  path and nothing of the old owner's memory stays in this process (a new
  server on the same path is fetched anew).

Holding a peer's memory gives a server *no* right to write it: the DMA port
writes there only for an IOVA range it has proven maps there (see
dma.DmaPort and the P2P section of docs/gpu-device.md).
"""

from __future__ import annotations

import logging
import mmap
import os
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
_SIZE = struct.Struct("<Q")


class MemoryShare:
    def __init__(self, path: str, fd: int, size: int):
        self.path, self.fd, self.size = path, fd, size
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            if os.path.exists(path):
                os.unlink(path)
            self.sock.bind(path)
            self.sock.listen(8)
        except BaseException:
            self.sock.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="memory-share", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.conns: list[socket.socket] = []
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            try:
                socket.send_fds(conn, [_SIZE.pack(self.size)], [self.fd])
                conn.shutdown(socket.SHUT_RD)
                self.conns.append(conn)   # open until the share closes: the peer watches it
            except OSError as exc:
                log.warning("memory share: peer went away: %s", exc)
                conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(timeout=5)
        for conn in getattr(self, "conns", ()):
            conn.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass(eq=False)
class PeerMemory:
    path: str
    mm: mmap.mmap
    view: memoryview
    sock: socket.socket | None = None          # the share's connection: its end retires this
    retired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)   # a copy vs. the retirement

    @property
    def size(self) -> int:
        return len(self.mm)

    def retire(self) -> None:
        """The owner is gone: unmap now (a copy in progress finishes first)."""
        with self.lock:
            self.retired = True
            self.view.release()
            self.mm.close()
            if self.sock is not None:
                self.sock.close()
                self.sock = None


def fetch(path: str, timeout: float = 2.0) -> PeerMemory:
    """Connect to a peer's share, take its fd, mmap it; OSError if it is not there.  The
    connection stays open: its end means the memory's owner is gone."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        msg, fds, _, _ = socket.recv_fds(sock, _SIZE.size, 1)
        if len(msg) != _SIZE.size or len(fds) != 1:
            raise OSError(f"peer share {path} sent {len(msg)} bytes and {len(fds)} fds, want 8 and 1")
        (size,) = _SIZE.unpack(msg)
        # populated now, so the first proven copy does not pay the page faults
        mm = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        sock.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    sock.setblocking(False)
    return PeerMemory(path, mm, memoryview(mm), sock)


class PeerSet:
    """The peers' memories, fetched on first need (and retried until each arrives); each
    retired the moment its owner's share connection ends."""

    def __init__(self, paths: list[str]):
        self.paths = list(paths)
        self._have: dict[str, PeerMemory] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.retired = 0   # peers retired so far (owners gone)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._watcher: threading.Thread | None = None

    def __bool__(self) -> bool:
        return bool(self.paths)

    def views(self) -> list[PeerMemory]:
        with self._lock:
            for path in self.paths:
                if path not in self._have:
                    try:
                        peer = self._have[path] = fetch(path)
                    except OSError as exc:
                        log.info("peer memory %s not available yet: %s", path, exc)
                        continue
                    self._sel.register(peer.sock, selectors.EVENT_READ, peer)
                    self._watch()
            return list(self._have.values())

    def _watch(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._run, name="peer-watch", daemon=True)
            self._watcher.start()
        else:
            os.write(self._wake_w, b"x")   # a new socket to watch

    def _run(self) -> None:
        while not self._closed:
            for key, _ in self._sel.select():
                if key.data is None:
                    try:
                        os.read(self._wake_r, 64)
                    except BlockingIOError:
                        pass
                    continue
                peer = key.data
                try:
                    if peer.sock is not None and peer.sock.recv(1):
                        continue   # a share sends nothing after the fd; ignore it
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self._retire(peer)

    def _retire(self, peer: PeerMemory) -> None:
        with self._lock:
            if self._have.get(peer.path) is peer:
                del self._have[peer.path]
            try:
                self._sel.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
            log.info("peer memory %s: its owner is gone; unmapped", peer.path)
            peer.retire()
            self.retired += 1
            self._changed.notify_all()

    def wait_retired(self, count: int, timeout: float) -> bool:
        """Until ``count`` peers were retired in all (for tests and tools); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self.retired >= count, timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._have = list(self._have.values()), {}
        os.write(self._wake_w, b"x")
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        for peer in peers:
            try:
                self._sel.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
            peer.retire()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
