"""The peer-lost VM tests, run here as threads on the real controller over its sockets: the guest programs
(smc_checks hold / survive, chan-hold / chan-survive / chan-watch) and the host, which kills the holder when
``smc_checks.holder_may_die`` says so, as tests/vm/test_smc.py and test_pool_smc.py do.

Stand-ins, said so: the VFIO layer (``ClientDevice`` from test_smc_driver.py), the devdax (a bytearray)
and the kill (``Holder``: the holder's connection to the controller drops where its program next touches
the controller, ringing or waiting to be killed -- a SIGKILL of its QEMU could land anywhere).  A slow
holder (a TCG guest under a loaded host) is made deterministic: its ring waits until the host has looked
at the shared memory twice since the holder wrote its record -- so a host that takes the record for its
cue kills the holder before it rings, every time.
"""

import threading
import time

from test_smc_checks_channel import FakeDax, args, run as run_program
from test_smc_driver import drivers  # noqa: F401  (the fixture)

from vfio_cxl.guest.cmd import smc_checks
from vfio_cxl.guest.cmd.smc_checks import Shared


class Killed(Exception):
    """The holder's QEMU is gone: its program runs no further."""


class Holder:
    """The holder's driver ``smc``, killable by ``HostWatch``; its rings come late (see the module)."""

    def __init__(self, smc, watch: "HostWatch"):
        self.smc, self.watch = smc, watch
        self.rang = False
        real_ring = smc.ring

        def ring(target, payload=0):
            watch.wait_two_looks_or_kill(self)
            real_ring(target, payload)
            self.rang = True

        def wait_peer_lost(timeout=None):   # the holder holds on until it is killed
            watch.wait_killed(self)

        smc.ring, smc.wait_peer_lost = ring, wait_peer_lost

    def die(self):
        """The connection drops (its QEMU died): the controller releases what it held, peers get PEER_LOST."""
        self.smc.device.close()
        self.smc.device = None   # gone; the fixture must not reset it
        self.smc.vectors.close()
        raise Killed


class HostWatch:
    """The VM test's host: looks at the shared memory for ``holder_may_die``'s cue, then kills the holder."""

    def __init__(self, sh: Shared):
        self.sh = sh
        self.cond = threading.Condition()
        self.looks = 0
        self.killed = False

    def read(self, off: int, n: int) -> bytes:
        return bytes(self.sh.m[self.sh.base + off:self.sh.base + off + n])

    def watch(self, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while True:
            cue = smc_checks.holder_may_die(self.read)
            with self.cond:
                self.killed = cue is not None      # SIGKILL, before anyone sees this look counted
                self.looks += 1
                self.cond.notify_all()
            if cue:
                return cue
            assert time.monotonic() < deadline, "the host never got its cue to kill the holder"
            time.sleep(0.002)   # the host polling the backend, as the VM test does every 50 ms

    def wait_two_looks_or_kill(self, holder: Holder):
        with self.cond:
            start = self.looks   # a look under way now may have read memory from before the record
            assert self.cond.wait_for(lambda: self.killed or self.looks >= start + 2, 30)
            killed = self.killed
        if killed:
            holder.die()

    def wait_killed(self, holder: Holder):
        with self.cond:
            assert self.cond.wait_for(lambda: self.killed, 30), "the host never killed the holder"
        holder.die()


def capped_doorbell_wait(smc, cap: float):
    """The survivor's doorbell wait, at most ``cap`` seconds (the program's own is 120 s)."""
    real = smc.wait_doorbell
    smc.wait_doorbell = lambda timeout=None, **kw: real(timeout=min(timeout or cap, cap), **kw)


def run(fn, smc, sh, a, out, key):
    try:
        run_program(fn, smc, sh, a, out, key)
    except Exception as exc:   # Killed, or the survivor's error: the test says which
        out[key] = exc


def start(*jobs):
    ts = [threading.Thread(target=run, args=job, daemon=True) for job in jobs]
    for t in ts:
        t.start()
    return ts


def finish(ts, timeout: float = 60) -> None:
    """Every program thread ended within ``timeout`` s each."""
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts)


def test_survivor_rung_before_a_slow_holder_is_killed(drivers):
    """tests/vm/test_smc.py's peer-lost test: b must get a's doorbell although a rings late, and see a hold
    semaphore 5 before it dies; then the controller refuses a's stale epoch and b takes the next."""
    _, (a, b, _) = drivers
    sh, out = Shared(FakeDax(1 << 21), 0x100000), {}
    host = HostWatch(sh)
    holder = Holder(a, host)
    capped_doorbell_wait(b, 10)
    ts = start((smc_checks.hold, a, sh, args(peer=1, sem=5, nonce=31), out, "a"),
               (smc_checks.survive, b, sh, args(peer=0, sem=5, nonce=31), out, "b"))
    epoch, writer = host.watch()
    finish(ts)
    got = out["b"]
    assert isinstance(got, dict), got     # not SmcTimeout: "waiting for a doorbell: timed out ... vector 0"
    assert holder.rang and isinstance(out["a"], Killed)
    assert writer == 0
    assert got["doorbell_from"] == 0 and got["told_epoch"] == epoch
    assert got["held_by_before"] == 0
    assert got["lost"] == 0 and got["alive"] == [1, 2]
    assert got["owner_after"] is None and got["epoch_after"] == epoch + 1
    assert got["my_epoch"] == epoch + 2
    assert got["record"]["epoch"] == epoch and got["record_accepted"] is False
    assert got["stale_send"] == "STALE_EPOCH"
    assert got["fresh_recv"] == "fresh write"


def test_channel_survivor_rung_before_a_slow_holder_is_killed(drivers):
    """tests/vm/test_pool_smc.py's peer-lost test: c watches the channel, a holds semaphore 3 with a record
    published in it and rings b late; b gets the ring, a dies, b writes as a zombie and then for real; c
    rejects the dead holder's record and the zombie's, and takes b's."""
    _, (a, b, c) = drivers
    sh, out = Shared(FakeDax(8 << 20), 0x100000), {}
    host = HostWatch(sh)
    holder = Holder(a, host)
    capped_doorbell_wait(b, 10)
    watch = start((smc_checks.chan_watch, c, sh, args(sem=3, nonce=44, count=3, create=True), out, "c"))
    deadline = time.monotonic() + 30
    while sh.get(smc_checks.OFF_READY + 8 * 2) != 44:   # c's channel and driver are ready (the VM test waits too)
        assert time.monotonic() < deadline, "c never opened its driver"
        time.sleep(0.002)
    ts = start((smc_checks.chan_hold, a, sh, args(peer=1, sem=3, nonce=44), out, "a"),
               (smc_checks.chan_survive, b, sh, args(peer=0, consumer=2, sem=3, nonce=44), out, "b"))
    epoch, writer = host.watch()
    finish(ts)
    got_b = out["b"]
    assert isinstance(got_b, dict), got_b   # not SmcTimeout: "waiting for a doorbell: timed out ... vector 0"
    finish(watch)                           # c takes the records b wrote
    got_c = out["c"]
    assert isinstance(got_c, dict), got_c
    assert holder.rang and isinstance(out["a"], Killed)
    assert writer == 0
    assert got_b["lost"] == 0 and got_c["lost"] == 0
    assert got_b["alive"] == [1, 2] and got_c["alive"] == [1, 2]
    assert got_b["told_epoch"] == epoch
    assert got_b["owner_after"] is None and got_b["epoch_after"] == epoch + 1
    assert got_b["my_epoch"] == epoch + 2 and got_b["stale_send"] == "STALE_EPOCH"
    records = got_c["records"]
    assert [r["seq"] for r in records] == [0, got_b["zombie_seq"], got_b["fresh_seq"]] == [0, 1, 2]
    assert [r["accepted"] for r in records] == [False, False, True], records
    for r in records[:2]:
        assert f"stamped by host 0 with epoch {epoch} of semaphore 3" in r["reason"], r
    assert records[2]["ok"]
