"""The op worker: the one thread that runs the fabric manager's slow operations, one at a time.

Slow ops (assign, release, restart) and what a death entails (surprise
removal, freeing a dead VM's GPUs) block on QMP, SSH and server starts; they
run here so that the loop keeps reporting deaths and answering status.  The
thread lives as long as the FM: GPU servers it starts (PR_SET_PDEATHSIG fires
when the *thread* that forked them exits) live as long as the FM too.

The worker holds :attr:`OpWorker.lock` while it runs a job and drops it only
inside :meth:`OpWorker.unlocked`, around one blocking call.  It never touches a
socket: what it has to say goes to an outbox (:meth:`post`) and a wake-up byte
tells the loop to send it.
"""

from __future__ import annotations

import queue
import socket
import threading
from typing import Callable

from ...errors import LabError


class OpWorker:
    def __init__(self, run_job: Callable[[str, object, dict], None], lab_name: str):
        self.lock = threading.Lock()        # guards all of the lab's state (the loop takes it too)
        self._run_job = run_job             # (kind, client, request) -> None, called with the lock held
        self._lab_name = lab_name
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._outbox: list[tuple[object, bytes]] = []
        self._stopping = False
        # The loop waits on wake[0]; the worker writes a byte to wake[1] when the outbox has lines.
        self.wake = socket.socketpair()
        for sock in self.wake:
            sock.setblocking(False)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="fm-ops", daemon=True)
        self._thread.start()

    def put(self, kind: str, client, request: dict) -> None:
        """Queue a job: ``op`` (a client's slow request) or a death's consequence (``free_gpu``...)."""
        self._jobs.put((kind, client, request))

    def in_worker(self) -> bool:
        return self._ident is not None and threading.get_ident() == self._ident

    def post(self, client, data: bytes) -> None:
        """From the worker: a line for the loop to send (client None: to every follower)."""
        self._outbox.append((client, data))
        try:
            self.wake[1].send(b"x")
        except OSError:
            pass   # a wake-up is pending already (BlockingIOError), or the loop is gone (stopping)

    def take_outbox(self) -> list[tuple[object, bytes]]:
        """In the loop, with the lock held: what the worker posted since the last call."""
        try:
            while self.wake[0].recv(4096):
                pass
        except BlockingIOError:
            pass
        out, self._outbox = self._outbox, []
        return out

    def unlocked(self, fn, *args, **kwargs):
        """A blocking call (QMP, SSH, a server start) made without the lock when in the worker.
        Once the lab stops meanwhile, the job ends here (LabError) instead of going on."""
        if not self.in_worker():
            return fn(*args, **kwargs)
        self.lock.release()
        try:
            return fn(*args, **kwargs)
        finally:
            self.lock.acquire()
            if self._stopping:
                raise LabError(f"lab {self._lab_name} is stopping", "start it again")

    def stop(self, timeout: float) -> bool:
        """End the worker: its job ends at its next :meth:`unlocked` step; queued jobs are skipped.
        False if it did not end within ``timeout`` s."""
        if self._thread is not None:
            with self.lock:
                self._stopping = True
            self._jobs.put(None)
            self._thread.join(timeout)
        for sock in self.wake:
            sock.close()
        return self._thread is None or not self._thread.is_alive()

    def _work(self) -> None:
        self._ident = threading.get_ident()
        while (job := self._jobs.get()) is not None:
            with self.lock:
                if not self._stopping:
                    self._run_job(*job)
