"""Three hosts, one shared-memory controller: all three contend on one semaphore, then the
holder's QEMU is killed and both survivors see it (the lab ends with the test)."""

import json
import os
import signal
import struct
import time

CHECKS = "python3 -m vfio_cxl.guest.smc_checks"
BASE = 0x200000
RECORD_MAGIC = 0x5245434F52445F31
NAMES = ("a", "b", "c")


def daxes(lab):
    return {n: json.loads(lab[n].run("python3 -m vfio_cxl.guest.cxltool up").stdout)["path"] for n in NAMES}


def wait_backend(lab, offset, fmt, ok, what, timeout=180):
    deadline = time.monotonic() + timeout
    while True:
        value = struct.unpack(fmt, lab.read_backend("shared", offset, struct.calcsize(fmt)))
        if ok(value):
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)   # the host watching shared memory, not synchronising the guests


def test_three_hosts_contend_then_the_holder_dies(smc3_lab, labs):
    lab, dax, rounds = smc3_lab, daxes(smc3_lab), 20
    try:
        runs = [lab[n].start_command(f"{CHECKS} contend --base {BASE:#x} --sem 0 --rounds {rounds} "
                                     f"--hosts 0,1,2 --nonce 41 --dax {dax[n]}") for n in NAMES]
        results = [json.loads(r.join().stdout.splitlines()[-1]) for r in runs]
        assert all(r["violations"] == 0 and r["stale"] == 0 for r in results), results
        assert struct.unpack("<Q", lab.read_backend("shared", BASE, 8))[0] == 3 * rounds
        epochs = sorted(e for r in results for e in r["epochs"])
        assert len(set(epochs)) == 3 * rounds

        nonce = 42
        watch = lab["c"].start_command(f"{CHECKS} watch --base {BASE:#x} --sem 5 --nonce {nonce} --dax {dax['c']}")
        wait_backend(lab, BASE + 0x20 + 16, "<Q", lambda v: v[0] == nonce, "c never opened its driver")
        hold = lab["a"].start_command(f"{CHECKS} hold --base {BASE:#x} --sem 5 --peer 1 --nonce {nonce} --dax {dax['a']}")
        survive = lab["b"].start_command(f"{CHECKS} survive --base {BASE:#x} --sem 5 --peer 0 --nonce {nonce} --dax {dax['b']}")
        _, epoch, _ = wait_backend(lab, BASE + 0x80, "<QQQ", lambda v: v[0] == RECORD_MAGIC and v[2] == 0 and v[1],
                                   "a never wrote its record under the semaphore")
        os.killpg(lab["a"].process.pid, signal.SIGKILL)
        lab["a"].process.wait()
        got_b = json.loads(survive.join().stdout.splitlines()[-1])
        got_c = json.loads(watch.join().stdout.splitlines()[-1])
        try:
            hold.join(check=False)
        except Exception:
            pass   # its SSH connection died with the VM
    finally:
        labs.close()
    assert got_c["lost"] == 0 and got_b["lost"] == 0
    assert got_c["alive"] == [1, 2]
    assert got_c["epoch_after"] >= epoch + 1
    assert got_b["epoch_after"] == epoch + 1 and got_b["my_epoch"] == epoch + 2
    assert got_b["stale_send"] == "STALE_EPOCH" and got_b["record_accepted"] is False
    print(f"\nSMC, 3 hosts: acquire+release per round {[round(r['acquire_release_ms'], 1) for r in results]} ms")
