"""Process supervision: one pidfd per child, in the loop's selector, and the registry's process ids.

A pidfd becomes readable the moment its process exits, so a death is seen
within one loop turn, not on a polling interval.  The loop reaps (the selector
key's data is ``("exit", child)``); the op worker re-watches a GPU it gave a
fresh server (epoll lets one thread register while another waits in it).
"""

from __future__ import annotations

import os
import selectors
from typing import Callable

from .procs import ProcessId, find_qemu
from .registry import LabRecord
from .state import Child


class Supervisor:
    def __init__(self, record: LabRecord, exited: Callable[[Child], None]):
        self.record = record
        self.exited = exited                 # called once a child's returncode is set
        self.sel: selectors.BaseSelector | None = None   # set once the loop has one

    def watch(self, child: Child) -> None:
        """Report ``child``'s exit (at once, if it is gone already)."""
        if self.sel is None:
            return   # not serving yet: watched when the loop starts
        try:
            child.pidfd = os.pidfd_open(child.popen.pid)
        except ProcessLookupError:   # already reaped: handle the exit now
            self.reap(child)
            return
        self.sel.register(child.pidfd, selectors.EVENT_READ, ("exit", child))

    def unwatch(self, child: Child) -> None:
        if child.pidfd is not None:
            self.sel.unregister(child.pidfd)
            os.close(child.pidfd)
            child.pidfd = None

    def ready(self, child: Child, fd: int) -> None:
        """The selector says pidfd ``fd`` of ``child`` is readable."""
        if child.pidfd == fd:   # not a server the worker replaced meanwhile
            self.reap(child)

    def reap(self, child: Child) -> None:
        self.unwatch(child)
        child.returncode = child.popen.wait()
        self.exited(child)

    def forget(self, children: list[Child]) -> None:
        """Stop watching (the lab stops): close every pidfd."""
        for child in children:
            if child.pidfd is not None:
                os.close(child.pidfd)
                child.pidfd = None

    def note(self, child: Child, *, save: bool = True) -> None:
        """Keep ``child``'s process id (and its QEMU's) in the lab's record, for `vm down`'s sweep."""
        if child.popen is None:
            return
        ident = ProcessId.of(child.popen.pid)
        if ident:
            self.record.processes[f"{child.kind}:{child.name}"] = ident.to_json()
        qemu = ProcessId.of(child.qemu_pid) if child.qemu_pid else None
        if qemu:
            self.record.processes[f"qemu:{child.name}"] = qemu.to_json()
        if save:
            self.record.save()

    @staticmethod
    def find_qemu(vm: Child) -> None:
        vm.qemu_pid = find_qemu(vm.popen.pid)
