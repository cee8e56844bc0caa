"""Peer memory: a server shares its device memory fd with peer servers, and
reaches theirs, over a small UNIX-socket side channel.

* ``MemoryShare(path, fd, size)`` listens on ``path``; every connection gets
  one message: the size (u64) with ``fd`` attached (SCM_RIGHTS), then EOF.
* ``PeerSet(paths)`` fetches each peer's fd lazily (peers may start later),
  mmaps it shared and keeps the mmap; ``views()`` lists what it has.

Holding a peer's memory gives a server *no* right to write it: the DMA port
writes there only for an IOVA range it has proven maps there (see
dma.DmaPort and the P2P section of docs/gpu-device.md).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import threading
from dataclasses import dataclass

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
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    socket.send_fds(conn, [_SIZE.pack(self.size)], [self.fd])
                except OSError as exc:
                    log.warning("memory share: peer went away: %s", exc)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass(eq=False)
class PeerMemory:
    path: str
    mm: mmap.mmap
    view: memoryview

    @property
    def size(self) -> int:
        return len(self.mm)


def fetch(path: str, timeout: float = 2.0) -> PeerMemory:
    """Connect to a peer's share, take its fd, mmap it; OSError if it is not there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        msg, fds, _, _ = socket.recv_fds(sock, _SIZE.size, 1)
    try:
        if len(msg) != _SIZE.size or len(fds) != 1:
            raise OSError(f"peer share {path} sent {len(msg)} bytes and {len(fds)} fds, want 8 and 1")
        (size,) = _SIZE.unpack(msg)
        # populated now, so the first proven copy does not pay the page faults
        mm = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        for fd in fds:
            os.close(fd)
    return PeerMemory(path, mm, memoryview(mm))


class PeerSet:
    """The peers' memories, fetched on first need (and retried until each arrives)."""

    def __init__(self, paths: list[str]):
        self.paths = list(paths)
        self._have: dict[str, PeerMemory] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.paths)

    def views(self) -> list[PeerMemory]:
        with self._lock:
            for path in self.paths:
                if path not in self._have:
                    try:
                        self._have[path] = fetch(path)
                    except OSError as exc:
                        log.info("peer memory %s not available yet: %s", path, exc)
            return list(self._have.values())

    def close(self) -> None:
        with self._lock:
            for peer in self._have.values():
                peer.view.release()
                try:
                    peer.mm.close()
                except BufferError:
                    pass
            self._have.clear()
