"""The guest programs of the channel VM tests (smc_checks chan-*), run here as threads on the real controller.

Stand-ins, said so: the VFIO layer (``ClientDevice`` from test_smc_driver.py) and the devdax (a
bytearray playing the shared CXL memory).  The programs, the driver, the channel and the controller are
the real ones; the VMs run the same code in tests/vm/test_smc.py and test_pool_smc.py.
"""

import argparse
import threading
import time

from test_smc_driver import ClientDevice, drivers  # noqa: F401  (the fixture)

from vfio_cxl.guest.cmd import smc_checks
from vfio_cxl.guest.cmd.smc_checks import OFF_READY, Shared


class FakeDax:
    def __init__(self, size):
        self.map = bytearray(size)


def args(**kw):
    base = dict(base=0x100000, chan=0x200000, nonce=7, sem=None, peers="0", consumer=2, create=False, gap_ms=0,
                count=5, peer=0)
    base.update(kw)
    return argparse.Namespace(**base)


def run(fn, smc, sh, a, out, key):
    if fn.__name__.replace("_", "-") not in smc_checks.SELF_READY:
        sh.put(OFF_READY + 8 * smc.host_id, a.nonce)      # as main() does
    out[key] = fn(smc, sh, a)


def threads(*jobs):
    ts = [threading.Thread(target=run, args=job) for job in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts)


def test_one_producer_one_sleeping_consumer(drivers):
    _, (a, b, _) = drivers
    sh, out = Shared(FakeDax(8 << 20), 0x100000), {}
    threads((smc_checks.chan_consume, b, sh, args(peers="0", count=8), out, "b"),
            (smc_checks.chan_produce, a, sh, args(peer=1, count=8, gap_ms=5), out, "a"))
    got = out["b"]
    assert got["delivered"] == list(range(8)) and got["bad"] == 0
    assert got["looks"] <= 3 * 8 + 2, got   # asleep between records, not polling


def test_fenced_producers_then_the_holder_dies(drivers):
    _, (a, b, c) = drivers
    sh, out = Shared(FakeDax(8 << 20), 0x100000), {}
    threads((smc_checks.chan_consume, c, sh, args(peers="0,1", sem=3, create=True, count=8), out, "c"),
            (smc_checks.chan_fenced, a, sh, args(peer=2, sem=3, count=4), out, "a"),
            (smc_checks.chan_fenced, b, sh, args(peer=2, sem=3, count=4), out, "b"))
    got = out["c"]
    assert got["delivered"] == list(range(8)) and got["bad"] == 0
    assert sorted(got["writers"]) == [0] * 4 + [1] * 4
    assert got["epochs"] == sorted(got["epochs"]) and len(set(got["epochs"])) == 8
    assert sorted(s for s, _ in out["a"]["sent"] + out["b"]["sent"]) == list(range(8))

    # a holds semaphore 3 with a published record, and dies; b writes as a zombie, then for real; c judges
    hold_done = threading.Event()

    def hold():
        a.wait_peer_lost = lambda timeout=None: hold_done.wait(30) and a.device.close()   # "killed" here
        run(smc_checks.chan_hold, a, sh, args(peer=1, sem=3, nonce=9), out, "hold")

    t = threading.Thread(target=hold)
    w = threading.Thread(target=run, args=(smc_checks.chan_watch, c, sh, args(sem=3, nonce=9, count=3), out, "c2"))
    s = threading.Thread(target=run, args=(smc_checks.chan_survive, b, sh, args(peer=0, consumer=2, sem=3, nonce=9),
                                           out, "b2"))
    for th in (w, t, s):
        th.start()
    deadline = time.monotonic() + 30
    # the VM test's cue, as it reads the backend (test_smc_checks_peer_lost.py: a slow holder)
    while not smc_checks.holder_may_die(lambda off, n: bytes(sh.m[sh.base + off:sh.base + off + n])):
        assert time.monotonic() < deadline, "b never took a's doorbell while a held the semaphore"
    hold_done.set()
    for th in (w, t, s):
        th.join(60)
    a.device = None
    a.vectors.close()
    _, epoch, writer = smc_checks.RECORD.unpack_from(sh.m, sh.base + 0x80)   # what a wrote under the semaphore
    b2, c2 = out["b2"], out["c2"]
    assert writer == 0
    assert b2["lost"] == 0 and b2["told_epoch"] == epoch and b2["epoch_after"] == epoch + 1
    assert b2["my_epoch"] == epoch + 2 and b2["stale_send"] == "STALE_EPOCH"
    assert c2["lost"] == 0 and c2["alive"] == [1, 2]
    recs = c2["records"]
    assert [r["seq"] for r in recs] == [8, 9, 10]
    assert [r["accepted"] for r in recs] == [False, False, True] and recs[2]["ok"]
    assert f"stamped by host 0 with epoch {epoch}" in recs[0]["reason"]
    assert f"stamped by host 0 with epoch {epoch}" in recs[1]["reason"]   # the zombie's write
