"""The fd leak check of the VM tests (tests/fdcheck.py) on a real process: an fd held past the
deadline is named as a leak; one closed late (as QEMU finalizes an unplugged device after an RCU
grace period) is waited for."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fdcheck

CHILD = r"""
import os, socket, sys, threading
held = []
listener = socket.create_server(("127.0.0.1", 0))
print("ready", flush=True)
for line in sys.stdin:
    word, *arg = line.split()
    if word == "open":                     # a memfd named like a GPU's VRAM, and an eventfd
        held += [os.memfd_create("vfio-cxl-gpu-vram"), os.eventfd(0)]
    elif word == "socket":                 # an ended connection the process has not closed (as slirp's)
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        client.close()
        accepted.recv(1)                   # the peer's FIN
        accepted.shutdown(socket.SHUT_RDWR)
        held.append(accepted.detach())
    elif word == "unix":                   # a live unix connection, both ends held
        held += [end.detach() for end in socket.socketpair()]
    elif word == "unix-ended":             # a unix connection whose peer has gone (slirp's, after `vm ssh`)
        mine, peer = socket.socketpair()
        peer.close()
        held.append(mine.detach())
    elif word == "standing":               # bound, never listening or connected (as two of QEMU's)
        standing = socket.socket()
        standing.bind(("127.0.0.1", 0))
        held.append(standing.detach())
    elif word == "close-after":            # closed later, by the process itself
        fds, held[:] = list(held), []
        threading.Timer(float(arg[0]), lambda: [os.close(fd) for fd in fds]).start()
    print("done", flush=True)
"""


def _child():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    return child


def _say(child, line: str) -> None:
    child.stdin.write(line + "\n")
    child.stdin.flush()
    assert child.stdout.readline() == "done\n"


def test_a_held_fd_is_a_leak_named_by_its_kind():
    child = _child()
    try:
        reference, _ = fdcheck.settle({"child": child.pid})
        _say(child, "open")
        after, waited = fdcheck.settle({"child": child.pid}, reference, timeout=0.5)
        assert waited >= 0.5
        assert fdcheck.differences(reference, after) == {
            "child": {"/memfd:vfio-cxl-gpu-vram (deleted)": 1, "anon_inode:[eventfd]": 1}}
    finally:
        child.kill()
        child.wait()


def test_a_late_close_is_waited_for_not_reported():
    child = _child()
    try:
        reference, _ = fdcheck.settle({"child": child.pid})
        _say(child, "open")
        assert fdcheck.differences(reference, {"child": fdcheck.fd_kinds(child.pid)})   # held now
        _say(child, "close-after 0.3")
        after, waited = fdcheck.settle({"child": child.pid}, reference, timeout=30)
        assert fdcheck.differences(reference, after) == {} and 0.2 < waited < 30
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("ended", ["socket", "unix-ended"])
def test_an_ended_connection_still_held_is_waited_for_without_a_reference(ended):
    """The reference itself is read once the process holds no late-released socket.  Over TCP
    (slirp's forwarded port) it is one no table lists; over a unix socket (`vfio-cxl vm ssh`
    reaches a guest through the VM's) it is listed and connected, and late only by its gone
    peer: a reference read while slirp still held such sockets made the leak check fail."""
    child = _child()
    try:
        reference, _ = fdcheck.settle({"child": child.pid})
        _say(child, ended)
        assert fdcheck.released_late(child.pid) == 1
        _say(child, "close-after 0.3")
        after, waited = fdcheck.settle({"child": child.pid}, timeout=30)
        assert fdcheck.released_late(child.pid) == 0 and 0.2 < waited < 30
        assert fdcheck.differences(reference, after) == {}
    finally:
        child.kill()
        child.wait()


def test_a_socket_bound_for_good_is_not_taken_for_a_late_one():
    """QEMU holds two TCP sockets no table lists for its whole life: waiting for them to go made
    every settle wait its whole deadline."""
    child = _child()
    try:
        _say(child, "standing")
        assert fdcheck.released_late(child.pid) == 0
        _, waited = fdcheck.settle({"child": child.pid}, timeout=30)
        assert waited < 30   # not its deadline
    finally:
        child.kill()
        child.wait()


def test_a_live_unix_connection_is_not_late():
    child = _child()
    try:
        _say(child, "unix")
        assert fdcheck.released_late(child.pid) == 0
    finally:
        child.kill()
        child.wait()


def test_sockets_compare_by_kind_not_inode():
    before = {"q": fdcheck.Counter({"socket": 2, "anon_inode:[eventfd]": 3})}
    assert fdcheck.differences(before, {"q": fdcheck.Counter({"socket": 2, "anon_inode:[eventfd]": 3})}) == {}
    assert fdcheck.differences(before, {"q": fdcheck.Counter({"socket": 1, "anon_inode:[eventfd]": 4})}) == {
        "q": {"anon_inode:[eventfd]": 1, "socket": -1}}
