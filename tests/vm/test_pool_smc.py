"""Three hosts of the ``pool`` topology on its shared slice and one shared-memory controller:
all three contend on one semaphore; two produce into one channel, taking turns under a semaphore
with their records fenced by its epoch, and the third consumes, asleep on its doorbell; then a
producer's QEMU is killed while it holds the semaphore (the lab ends with that test)."""

import json
import os
import signal
import struct
import time

import pytest

from vfio_cxl.guest.cmd.smc_checks import holder_may_die
from vfio_cxl.lab.ssh import join_all

CHECKS = "vfio-cxl-m vfio_cxl.guest.cmd.smc_checks"
BASE = 0x200000              # smc_checks' words (counter, ready, record) in the shared slice
CHAN = 0x400000              # the channel, 4 MiB
NAMES = ("a", "b", "c")


@pytest.fixture
def daxes(pool_lab):
    return {n: f"/dev/{pool_lab[n].regions['shared']['dax']}" for n in NAMES}


def results(runs):
    """Each command's JSON report, joined in turn; the first that fails cancels the others, so
    none is left running in the lab the next test gets."""
    done = join_all(dict(enumerate(runs)))
    return [json.loads(done[i].stdout.splitlines()[-1]) for i in range(len(runs))]


def wait_backend(lab, offset, fmt, ok, what, timeout=180):
    deadline = time.monotonic() + timeout
    while True:
        value = struct.unpack(fmt, lab.read_backend("common", offset, struct.calcsize(fmt)))
        if ok(value):
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)   # the host watching shared memory, not synchronising the guests


def wait_cue(lab, timeout=180):
    deadline = time.monotonic() + timeout
    while not (cue := holder_may_die(lambda off, n: lab.read_backend("common", BASE + off, n))):
        assert time.monotonic() < deadline, "b never took a's doorbell while a held the semaphore"
        time.sleep(0.05)   # the host watching shared memory, not synchronising the guests
    return cue


def test_three_hosts_contend_on_one_semaphore(pool_lab, daxes):
    lab, rounds = pool_lab, 20
    runs = [lab[n].start_command(f"{CHECKS} contend --base {BASE:#x} --sem 0 --rounds {rounds} "
                                 f"--hosts 0,1,2 --nonce 41 --dax {daxes[n]}") for n in NAMES]
    got = results(runs)
    assert all(r["violations"] == 0 and r["stale"] == 0 for r in got), got
    assert struct.unpack("<Q", lab.read_backend("common", BASE, 8))[0] == 3 * rounds, "a lost update"
    epochs = sorted(e for r in got for e in r["epochs"])
    assert len(set(epochs)) == 3 * rounds, "every critical section has its own fencing token"
    print(f"\nSMC, 3 hosts: acquire+release per round {[round(r['acquire_release_ms'], 1) for r in got]} ms")


def test_two_fenced_producers_one_consumer_woken_by_doorbells(pool_lab, daxes):
    lab, n = pool_lab, 6
    common = f"--base {BASE:#x} --chan {CHAN:#x} --sem 3 --nonce 43"
    consumer = lab["c"].start_command(f"{CHECKS} chan-consume {common} --peers 0,1 --create --count {2 * n} "
                                      f"--dax {daxes['c']}")
    producers = [lab[h].start_command(f"{CHECKS} chan-fenced {common} --peer 2 --count {n} --dax {daxes[h]}")
                 for h in ("a", "b")]
    got_c, got_a, got_b = results([consumer, *producers])
    assert got_c["bad"] == 0 and got_c["delivered"] == list(range(2 * n))
    assert sorted(got_c["writers"]) == [0] * n + [1] * n            # both hosts' records, each stamped by its writer
    assert got_c["epochs"] == sorted(got_c["epochs"]) and len(set(got_c["epochs"])) == 2 * n   # one epoch per turn
    assert sorted(s for s, _ in got_a["sent"] + got_b["sent"]) == list(range(2 * n))
    assert got_c["looks"] <= 3 * 2 * n + 2, got_c                   # asleep between records, not polling
    print(f"\nfenced channel, 2 producers -> 1 consumer: {2 * n} records in {got_c['seconds']:.1f} s, "
          f"consumer CPU {got_c['cpu_seconds']:.2f} s, {got_c['wakeups']} doorbell wake-ups")


def test_holder_killed_peer_lost_new_epoch_stale_record_rejected(pool_lab, daxes, labs):
    lab, nonce = pool_lab, 44
    common = f"--base {BASE:#x} --chan {CHAN:#x} --sem 3 --nonce {nonce}"
    try:
        watch = lab["c"].start_command(f"{CHECKS} chan-watch {common} --count 3 --create --dax {daxes['c']}")
        wait_backend(lab, BASE + 0x20 + 16, "<Q", lambda v: v[0] == nonce, "c never opened its driver")
        hold = lab["a"].start_command(f"{CHECKS} chan-hold {common} --peer 1 --dax {daxes['a']}")
        survive = lab["b"].start_command(f"{CHECKS} chan-survive {common} --peer 0 --consumer 2 --dax {daxes['b']}")
        # Not a's record (written before a rings b): b's word that it was rung with a's epoch.
        epoch, writer = wait_cue(lab)
        assert writer == 0
        os.killpg(lab["a"].process.pid, signal.SIGKILL)     # a dies holding semaphore 3
        lab["a"].process.wait()
        got_b = results([survive])[0]
        got_c = results([watch])[0]
        try:
            hold.join(check=False)
        except Exception:
            pass   # its SSH connection died with the VM
    finally:
        labs.close()   # the lab lost a VM: never reuse it
    assert got_b["lost"] == 0 and got_c["lost"] == 0                   # both survivors: "peer lost", host 0
    assert got_b["alive"] == [1, 2] and got_c["alive"] == [1, 2]
    assert got_b["told_epoch"] == epoch
    assert got_b["owner_after"] is None and got_b["epoch_after"] == epoch + 1   # released with a new epoch
    assert got_b["my_epoch"] == epoch + 2
    assert got_b["stale_send"] == "STALE_EPOCH"                        # the controller refuses it too
    records = got_c["records"]
    assert [r["seq"] for r in records] == [0, got_b["zombie_seq"], got_b["fresh_seq"]] == [0, 1, 2]
    assert [r["accepted"] for r in records] == [False, False, True], records
    for r in records[:2]:     # the dead holder's record, and a write fenced with its stale epoch
        assert f"stamped by host 0 with epoch {epoch} of semaphore 3" in r["reason"], r
    assert records[2]["ok"]
