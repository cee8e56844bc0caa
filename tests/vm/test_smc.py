"""The shared-memory controller between two VMs: real QEMU vfio-user-pci, the guest's
vfio-pci and intel-iommu, MSI-X through eventfds, the shared CXL devdax.

The last test kills VM "a"'s QEMU, so it ends the lab (the pool boots a new one if
another test needs it)."""

import json
import os
import signal
import struct
import time

import pytest

from vfio_cxl.guest.cmd.smc_checks import holder_may_die
from vfio_cxl.lab.ssh import join_all

CHECKS = "vfio-cxl-m vfio_cxl.guest.cmd.smc_checks"
BASE = 0x100000


@pytest.fixture
def daxes(smc_lab):
    return {name: json.loads(smc_lab[name].run("vfio-cxl-m vfio_cxl.guest.cmd.cxltool up").stdout)["path"]
            for name in ("a", "b")}


def both(lab, daxes, args_a, args_b):
    """Run the checks program in a and b at once; both results (JSON).  One that fails cancels the
    other: the lab goes to the next test with neither left running."""
    with lab["a"].start_command(f"{CHECKS} {args_a} --dax {daxes['a']}") as ra, \
            lab["b"].start_command(f"{CHECKS} {args_b} --dax {daxes['b']}") as rb:
        out = join_all({"b": rb, "a": ra})
    return json.loads(out["a"].stdout.splitlines()[-1]), json.loads(out["b"].stdout.splitlines()[-1])


def test_the_controller_is_a_pci_function_in_both_vms(smc_lab):
    for vm in ("a", "b"):
        assert "0580: 0601:5c01" in smc_lab[vm].run("lspci -n -d 0601:5c01").stdout


def test_semaphore_mutual_exclusion_with_a_shared_counter(smc_lab, daxes):
    rounds = 40
    common = f"contend --base {BASE:#x} --sem 0 --rounds {rounds} --hosts 0,1 --nonce 11"
    ra, rb = both(smc_lab, daxes, common, common)
    assert ra["violations"] == rb["violations"] == 0
    assert ra["stale"] == rb["stale"] == 0
    counter = struct.unpack("<Q", smc_lab.read_backend("shared", BASE, 8))[0]
    assert counter == 2 * rounds, "a lost update: the semaphore did not exclude"
    epochs = sorted(ra["epochs"] + rb["epochs"])
    assert len(set(epochs)) == 2 * rounds, "every critical section has its own fencing token"
    print(f"\nSMC acquire+release under contention: a {ra['acquire_release_ms']:.2f} ms, "
          f"b {rb['acquire_release_ms']:.2f} ms per round")


@pytest.mark.parametrize("mode", ["irq", "poll"])
def test_doorbell_wakes_the_other_vm(smc_lab, daxes, mode):
    n = 20
    ra, rb = both(smc_lab, daxes,
                  f"pingpong --base {BASE:#x} --peer 1 --role init --mode {mode} --count {n} --sem 2 --nonce {20 + len(mode)}",
                  f"pingpong --base {BASE:#x} --peer 0 --role resp --mode {mode} --count {n} --nonce {20 + len(mode)}")
    assert ra["bad"] == 0 and len(ra["rtt_ms"]) == n and rb["answered"] == n + 1
    print(f"\nSMC doorbell ({mode}): round trip median {ra['rtt_ms_median']:.2f} ms "
          f"(one way {ra['one_way_ms_median']:.2f} ms); register read {ra['register_read_ms']:.2f} ms; "
          f"acquire {ra['acquire_ms_median']:.2f} ms")


def test_doorbell_wakes_a_blocked_channel_consumer_in_the_other_vm(smc_lab, daxes):
    """a produces into the channel in the shared CXL memory and rings b's doorbell after each commit; b's
    consumer sleeps on its doorbell's MSI-X eventfd between records (a pauses 20 ms between them)."""
    n = 12
    common = f"--base {BASE:#x} --chan 0x400000 --nonce 51 --count {n}"
    rb = smc_lab["b"].start_command(f"{CHECKS} chan-consume {common} --peers 0 --dax {daxes['b']}")
    ra = smc_lab["a"].start_command(f"{CHECKS} chan-produce {common} --peer 1 --gap-ms 20 --dax {daxes['a']}")
    got = json.loads(rb.join().stdout.splitlines()[-1])
    assert json.loads(ra.join().stdout.splitlines()[-1])["sent"] == n
    assert got["delivered"] == list(range(n)) and got["bad"] == 0
    # A polling consumer looks at the commit word thousands of times in 20 ms; a sleeping one about once
    # per wake-up (the create's ring, one per record, and a stray one at most).
    assert got["looks"] <= 3 * n + 2, got
    assert 1 <= got["wakeups"] <= 2 * n + 1, got
    print(f"\nchannel woken by doorbells: {n} records in {got['seconds']:.2f} s, consumer CPU "
          f"{got['cpu_seconds']:.2f} s, {got['looks']} looks at shared memory, {got['wakeups']} wake-ups")


def test_holder_killed_peer_lost_new_epoch_stale_write_rejected(smc_lab, daxes, labs):
    nonce = 31
    try:
        hold = smc_lab["a"].start_command(
            f"{CHECKS} hold --base {BASE:#x} --sem 5 --peer 1 --nonce {nonce} --dax {daxes['a']}")
        survive = smc_lab["b"].start_command(
            f"{CHECKS} survive --base {BASE:#x} --sem 5 --peer 0 --nonce {nonce} --dax {daxes['b']}")
        deadline = time.monotonic() + 180
        # Not a's record (written before a rings b): b's word that it was rung and saw a hold semaphore 5.
        while not (cue := holder_may_die(lambda off, n: smc_lab.read_backend("shared", BASE + off, n))):
            assert time.monotonic() < deadline, "b never took a's doorbell while a held the semaphore"
            time.sleep(0.05)   # the host watching shared memory, not synchronising the guests
        epoch, writer = cue
        assert writer == 0
        os.killpg(smc_lab["a"].process.pid, signal.SIGKILL)   # a dies holding the semaphore
        smc_lab["a"].process.wait()
        got = json.loads(survive.join().stdout.splitlines()[-1])
        try:
            hold.join(check=False)
        except Exception:
            pass   # its SSH connection died with the VM
    finally:
        labs.close()   # the lab lost a VM: never reuse it
    assert got["doorbell_from"] == 0 and got["told_epoch"] == epoch
    assert got["held_by_before"] == 0
    assert got["lost"] == 0 and got["alive"] == [1]
    assert got["owner_after"] is None and got["epoch_after"] == epoch + 1
    assert got["my_epoch"] == epoch + 2
    assert got["record"]["epoch"] == epoch and got["record_accepted"] is False
    assert got["stale_send"] == "STALE_EPOCH"
    assert got["fresh_recv"] == "fresh write"
    print(f"\nSMC: b re-acquired the dead holder's semaphore {got['reacquire_ms']:.1f} ms after peer lost")
