"""Guest-side programs the SMC VM tests and bench run over SSH; each prints one JSON object.

    python3 -m vfio_cxl.guest.smc_checks contend  --dax P --base B --sem S --rounds N --nonce K --hosts 0,1
    python3 -m vfio_cxl.guest.smc_checks pingpong --dax P --base B --peer H --role init|resp
                                                  --mode irq|poll --count N --nonce K
    python3 -m vfio_cxl.guest.smc_checks hold     --dax P --base B --sem S --peer H --nonce K
    python3 -m vfio_cxl.guest.smc_checks survive  --dax P --base B --sem S --peer H --nonce K
    python3 -m vfio_cxl.guest.smc_checks watch    --dax P --base B --sem S --nonce K

Opening the controller through VFIO resets this host's view of it (the
kernel resets the function on open), so queued doorbells from before the
open are gone: every program first opens the driver, then publishes
``nonce`` in its ready word in the shared CXL memory and waits for its
peers' ready words -- only then does anyone ring or send.

Shared memory at ``base`` (devdax, the topology's shared backend):
  +0x00 u64 counter      incremented only under the semaphore (contend)
  +0x08 u64 inside       host ID + 1 while a host is in the critical section, else 0
  +0x10 u64 last_epoch   the epoch of the last critical section (must grow)
  +0x20 u64 ready[h]     host h's nonce once its driver is open (8 hosts)
  +0x80 record: u64 magic, u64 epoch, u64 writer  (written by a semaphore holder, fenced)
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time

from ..devices.smc.regs import Error
from .dax import open_dax
from .smc_driver import SmcDriver, SmcError

U64 = struct.Struct("<Q")
RECORD = struct.Struct("<QQQ")
RECORD_MAGIC = 0x5245434F52445F31   # "RECORD_1"
OFF_COUNTER, OFF_INSIDE, OFF_LAST, OFF_READY, OFF_RECORD = 0x00, 0x08, 0x10, 0x20, 0x80


class Shared:
    def __init__(self, dax, base: int):
        self.m, self.base = dax.map, base

    def get(self, off: int) -> int:
        return U64.unpack_from(self.m, self.base + off)[0]

    def put(self, off: int, value: int) -> None:
        U64.pack_into(self.m, self.base + off, value)

    def wait_ready(self, hosts, nonce: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while any(self.get(OFF_READY + 8 * h) != nonce for h in hosts):
            if time.monotonic() > deadline:
                raise SmcError(f"hosts {list(hosts)} did not all publish nonce {nonce} within {timeout} s",
                               "start the program in every VM")
            time.sleep(0.001)   # waiting for another VM's process to start, not for the device


def contend(smc, sh, a) -> dict:
    hosts = [int(h) for h in a.hosts.split(",")]
    sh.wait_ready(hosts, a.nonce)
    violations = stale = 0
    epochs = []
    t0 = time.perf_counter()
    for _ in range(a.rounds):
        epoch = smc.acquire(a.sem, timeout=120)
        if sh.get(OFF_INSIDE) != 0:
            violations += 1
        sh.put(OFF_INSIDE, smc.host_id + 1)
        value = sh.get(OFF_COUNTER)
        smc.alive()                         # a device round trip inside the critical section
        sh.put(OFF_COUNTER, value + 1)
        if sh.get(OFF_LAST) >= epoch:
            stale += 1
        sh.put(OFF_LAST, epoch)
        sh.put(OFF_INSIDE, 0)
        smc.release(a.sem, epoch)
        epochs.append(epoch)
    seconds = time.perf_counter() - t0
    return {"host": smc.host_id, "rounds": a.rounds, "violations": violations, "stale": stale,
            "epochs": epochs, "acquire_release_ms": seconds * 1000 / a.rounds}


def pingpong(smc, sh, a) -> dict:
    sh.wait_ready([a.peer], a.nonce)
    poll = a.mode == "poll"
    if a.role == "resp":
        for _ in range(a.count + 1):
            src, payload = smc.wait_doorbell(timeout=120, poll=poll)
            smc.ring(src, payload | 0x80000000)
        return {"host": smc.host_id, "answered": a.count + 1}
    rtts, bad = [], 0
    for i in range(a.count + 1):            # round 0 warms up, untimed
        t0 = time.perf_counter()
        smc.ring(a.peer, i)
        src, payload = smc.wait_doorbell(timeout=120, poll=poll)
        rtt = time.perf_counter() - t0
        if (src, payload) != (a.peer, i | 0x80000000):
            bad += 1
        if i:
            rtts.append(rtt * 1000)
    rtts.sort()
    t0 = time.perf_counter()
    for _ in range(a.count):
        smc.bar0.read32(0)
    reg_ms = (time.perf_counter() - t0) * 1000 / a.count
    acq = []
    for _ in range(a.count):
        t0 = time.perf_counter()
        granted, epoch = smc.try_acquire(a.sem)
        acq.append((time.perf_counter() - t0) * 1000)
        if granted:
            smc.release(a.sem, epoch)
    acq.sort()
    return {"host": smc.host_id, "mode": a.mode, "bad": bad, "rtt_ms": rtts,
            "rtt_ms_median": rtts[len(rtts) // 2], "one_way_ms_median": rtts[len(rtts) // 2] / 2,
            "register_read_ms": reg_ms, "acquire_ms_median": acq[len(acq) // 2]}


def hold(smc, sh, a) -> dict:
    sh.wait_ready([a.peer], a.nonce)
    epoch = smc.acquire(a.sem, timeout=60)
    RECORD.pack_into(sh.m, sh.base + OFF_RECORD, RECORD_MAGIC, epoch, smc.host_id)
    smc.ring(a.peer, epoch)
    print(json.dumps({"host": smc.host_id, "epoch": epoch}), flush=True)
    smc.wait_peer_lost(timeout=None)        # keep holding until this VM is killed
    return {}


def survive(smc, sh, a) -> dict:
    sh.wait_ready([a.peer], a.nonce)
    src, told = smc.wait_doorbell(timeout=120)
    magic, stamped, writer = RECORD.unpack_from(sh.m, sh.base + OFF_RECORD)
    held_by = smc.state(a.sem)
    lost = smc.wait_peer_lost(timeout=300)
    t_lost = time.perf_counter()
    owner_after, epoch_after = smc.state(a.sem)
    mine = smc.acquire(a.sem, timeout=30)
    acquire_ms = (time.perf_counter() - t_lost) * 1000
    # the consumer's rule: a record counts only if stamped with the current holder's epoch
    record_accepted = magic == RECORD_MAGIC and stamped == mine
    try:
        smc.send(smc.host_id, b"stale write", fence=(a.sem, stamped))
        stale_send = "delivered"
    except SmcError as exc:
        stale_send = Error(exc.code).name
    smc.send(smc.host_id, b"fresh write", fence=(a.sem, mine))
    fresh = smc.recv(timeout=10)
    smc.release(a.sem, mine)
    return {"host": smc.host_id, "doorbell_from": src, "told_epoch": told,
            "record": {"magic_ok": magic == RECORD_MAGIC, "epoch": stamped, "writer": writer},
            "held_by_before": held_by[0], "lost": lost, "owner_after": owner_after,
            "epoch_after": epoch_after, "my_epoch": mine, "record_accepted": record_accepted,
            "stale_send": stale_send, "fresh_recv": fresh.data.decode(), "reacquire_ms": acquire_ms,
            "alive": sorted(smc.alive())}


def watch(smc, sh, a) -> dict:
    """A bystander: wait for a lost peer, then report what the semaphore looks like."""
    lost = smc.wait_peer_lost(timeout=300)
    owner, epoch = smc.state(a.sem)
    return {"host": smc.host_id, "lost": lost, "owner_after": owner, "epoch_after": epoch,
            "alive": sorted(smc.alive())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="smc_checks")
    p.add_argument("command", choices=("contend", "pingpong", "hold", "survive", "watch"))
    p.add_argument("--dax", required=True)
    p.add_argument("--base", type=lambda t: int(t, 0), default=0x100000)
    p.add_argument("--sem", type=int, default=0)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--count", type=int, default=30)
    p.add_argument("--hosts", default="0,1")
    p.add_argument("--peer", type=int, default=0)
    p.add_argument("--role", choices=("init", "resp"), default="init")
    p.add_argument("--mode", choices=("irq", "poll"), default="irq")
    p.add_argument("--nonce", type=int, required=True)
    a = p.parse_args(argv)
    try:
        with open_dax(a.dax) as dax, SmcDriver.open() as smc:
            sh = Shared(dax, a.base)
            sh.put(OFF_READY + 8 * smc.host_id, a.nonce)
            result = {"contend": contend, "pingpong": pingpong, "hold": hold, "survive": survive,
                      "watch": watch}[a.command](smc, sh, a)
    except SmcError as err:
        print(f"smc_checks: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
