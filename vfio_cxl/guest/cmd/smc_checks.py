"""Guest-side programs the SMC VM tests and bench run over SSH; each prints one JSON object.

    python3 -m vfio_cxl.guest.cmd.smc_checks contend  --dax P --base B --sem S --rounds N --nonce K --hosts 0,1
    python3 -m vfio_cxl.guest.cmd.smc_checks pingpong --dax P --base B --peer H --role init|resp
                                                  --mode irq|poll --count N --nonce K
    python3 -m vfio_cxl.guest.cmd.smc_checks hold     --dax P --base B --sem S --peer H --nonce K
        takes S, writes its record stamped with the epoch, tells H the epoch (doorbell), holds S until killed
    python3 -m vfio_cxl.guest.cmd.smc_checks survive  --dax P --base B --sem S --peer H --nonce K
        takes H's doorbell, sees H hold S, publishes ``seen`` (the host's cue to kill H), then after H is
        lost: a stale fenced send (refused), S taken with a new epoch, a fresh fenced send
    python3 -m vfio_cxl.guest.cmd.smc_checks watch    --dax P --base B --sem S --nonce K

The channel on the controller (``vfio_cxl.guest.smc_channel``; the channel lives at ``--chan``):
    ... chan-consume --dax P --base B --peers 0[,1] --count N --nonce K [--sem S --create]
        the consumer, asleep on its doorbell; ``--sem``: fenced records (semaphore S), ``--create``:
        create the (empty) channel first, for fenced producers to attach to
    ... chan-produce --dax P --base B --peer H --count N --nonce K [--gap-ms G]
        one producer: creates the channel, rings H after each record, sleeps until it is acked
    ... chan-fenced  --dax P --base B --peer H --sem S --count N --nonce K
        one of several producers: each record under semaphore S, stamped with its epoch
    ... chan-hold    --dax P --base B --peer H --sem S --nonce K
        takes S, publishes a stamped record, tells H the epoch (doorbell), holds S until killed
    ... chan-survive --dax P --base B --peer H --consumer C --sem S --nonce K
        takes H's doorbell, publishes ``seen``; after H is lost: a write stamped with H's stale epoch
        (a zombie's), then a fresh fenced one
    ... chan-watch   --dax P --base B --sem S --nonce K --count N [--create]
        after a peer is lost: the fenced consumer takes N records and reports which it rejected

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
  +0x98 u64 seen         the epoch the survivor was rung with, once it has it (survive, chan-survive)

Killing a holder (the peer-lost tests): the host kills the holder's QEMU when ``holder_may_die``
says so -- once the survivor has published ``seen``, not when the holder's record appears.  The
holder writes its record *before* it rings (the survivor reads the record when rung), so a kill
timed by the record can land between the two, and the survivor then waits for a ring that never
comes; nothing in the controller could save it: the ring never reached it.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time

from ..channel import COHERENT, ChannelError, Consumer, Producer, StaleRecord
from ...devices.smc.regs import Error
from ..dax import open_dax
from ..smc_channel import DOORBELL_PAYLOAD, FencedProducer, SmcWakeup, fence_tag, semaphore_fence
from ..drivers.smc import SmcDriver, SmcError

U64 = struct.Struct("<Q")
RECORD = struct.Struct("<QQQ")
RECORD_MAGIC = 0x5245434F52445F31   # "RECORD_1"
OFF_COUNTER, OFF_INSIDE, OFF_LAST, OFF_READY, OFF_RECORD, OFF_SEEN = 0x00, 0x08, 0x10, 0x20, 0x80, 0x98


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


def holder_may_die(read) -> tuple[int, int] | None:
    """The host's cue to kill the holder (``hold``, ``chan-hold``) in the peer-lost tests: (epoch, writer)
    of the holder's record once the survivor (``survive``, ``chan-survive``) has published that epoch as
    ``seen`` -- it took the holder's doorbell (and, ``survive``, saw it hold the semaphore) -- else None.
    ``read(offset, length)``: bytes of the shared memory at ``base`` + offset, as the host reads them
    (the backend file) now.  The record alone is no cue: it is written before the ring."""
    magic, epoch, writer = RECORD.unpack(read(OFF_RECORD, RECORD.size))
    seen = U64.unpack(read(OFF_SEEN, U64.size))[0]
    if magic == RECORD_MAGIC and epoch and seen == epoch:
        return epoch, writer
    return None


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
    sh.put(OFF_SEEN, 0)                     # no cue left from an earlier run
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
    sh.put(OFF_SEEN, told)                  # rung, and saw the holder hold it: the host may kill it now
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


# -- the channel on the controller ------------------------------------------------------------
CHANNEL_SIZE = 4 << 20


def _channel(sh, a) -> memoryview:
    return memoryview(sh.m)[a.chan:a.chan + CHANNEL_SIZE]


class _Counting:
    """Counts the consumer's looks at shared memory (a polling consumer makes thousands per record)."""

    def __init__(self, consumer):
        self.looks, inner = 0, consumer._committed

        def committed(seq):
            self.looks += 1
            return inner(seq)
        consumer._committed = committed


def _fresh_channel(smc, sh, a, view) -> None:
    """Before this host's ready word: no header left from an earlier run (open() waits for the new one),
    or with ``--create`` an empty channel for producers to attach to."""
    if a.create:
        Producer.create(view, coherence=COHERENT, ring_entries=64).close()
    else:
        view[:64] = bytes(64)
    sh.put(OFF_READY + 8 * smc.host_id, a.nonce)   # only now may the producers start


def chan_consume(smc, sh, a) -> dict:
    view = _channel(sh, a)
    _fresh_channel(smc, sh, a, view)
    peers = [int(h) for h in a.peers.split(",")]
    wake = SmcWakeup(smc, peers)
    fence = semaphore_fence(smc, a.sem) if a.sem is not None else None
    t0, cpu0 = time.monotonic(), time.process_time()
    c = Consumer.open(view, coherence=COHERENT, wait=120, wakeup=wake, fence_check=fence)
    looks = _Counting(c)
    delivered, writers, epochs, bad = [], [], [], 0
    try:
        for _ in range(a.count):
            rec = c.receive(timeout=120)
            if rec.tobytes() != _payload(rec.seq, rec.length):
                bad += 1
            delivered.append(rec.seq)
            writers.append(rec.fence[1] >> 8 & 0xFF if rec.fence[1] else None)
            epochs.append(rec.fence[0])
            c.ack(rec)
    finally:
        c.close()
        view.release()
    return {"host": smc.host_id, "delivered": delivered, "writers": writers, "epochs": epochs, "bad": bad,
            "looks": looks.looks, "wakeups": wake.wakeups, "rings": wake.rings,
            "seconds": time.monotonic() - t0, "cpu_seconds": time.process_time() - cpu0}


def _payload(seq: int, length: int) -> bytes:
    """Record ``seq``'s bytes: the consumer checks them exactly."""
    return (b"record %08d " % seq * (length // 16 + 1))[:length]


def chan_produce(smc, sh, a) -> dict:
    view = _channel(sh, a)
    sh.wait_ready([a.peer], a.nonce)
    p = Producer.create(view, coherence=COHERENT, ring_entries=64, wakeup=SmcWakeup(smc, [a.peer]))
    try:
        for i in range(a.count):
            time.sleep(a.gap_ms / 1000)     # the load's shape (a slow producer), not synchronisation
            seq = p.send(_payload(i, 64 + 97 * i))
            p.wait_acked(seq, timeout=120)  # asleep on this host's doorbell: the consumer rings after its ack
    finally:
        p.close()
        view.release()
    return {"host": smc.host_id, "sent": a.count}


def chan_fenced(smc, sh, a) -> dict:
    view = _channel(sh, a)
    sh.wait_ready([a.peer], a.nonce)
    fp = FencedProducer.attach(view, smc, sem=a.sem, consumer=a.peer, coherence=COHERENT)
    sent = []
    try:
        for _ in range(a.count):
            # the payload depends on the seq, which is known only under the semaphore: reserve there
            p = fp.producer
            with smc.semaphore(a.sem, 120) as epoch:
                p.resume()
                p.set_fence(epoch, fence_tag(smc.host_id, a.sem))
                seq = p.next_seq
                p.send(_payload(seq, 200 + 31 * seq), timeout=120)
                p.wait_acked(seq, timeout=120)
            sent.append([seq, epoch])
    finally:
        fp.close()
        view.release()
    return {"host": smc.host_id, "sent": sent}


def chan_hold(smc, sh, a) -> dict:
    view = _channel(sh, a)
    sh.wait_ready([a.peer], a.nonce)
    p = Producer.attach(view, coherence=COHERENT)
    epoch = smc.acquire(a.sem, timeout=60)
    p.resume()
    p.set_fence(epoch, fence_tag(smc.host_id, a.sem))
    seq = p.next_seq
    p.send(_payload(seq, 128))              # published; the holder dies before it is acked
    sh.put(OFF_SEEN, 0)                     # no cue left from an earlier run
    RECORD.pack_into(sh.m, sh.base + OFF_RECORD, RECORD_MAGIC, epoch, smc.host_id)
    smc.ring(a.peer, epoch)
    print(json.dumps({"host": smc.host_id, "epoch": epoch, "seq": seq}), flush=True)
    smc.wait_peer_lost(timeout=None)        # keep holding until this VM is killed
    return {}


def chan_survive(smc, sh, a) -> dict:
    view = _channel(sh, a)
    sh.wait_ready([a.peer], a.nonce)
    while True:                             # the holder's ring with its epoch, not a channel's wake-up ring
        src, told = smc.wait_doorbell(timeout=120)
        if src == a.peer and told != DOORBELL_PAYLOAD:
            break
    sh.put(OFF_SEEN, told)                  # rung with the holder's epoch: the host may kill it now
    lost = smc.wait_peer_lost(timeout=300)
    owner_after, epoch_after = smc.state(a.sem)
    # A zombie's write: stamped with the lost holder's epoch and ID, published without the semaphore.
    zombie = Producer.attach(view, coherence=COHERENT, wakeup=SmcWakeup(smc, [a.consumer]))
    zombie.set_fence(told, fence_tag(a.peer, a.sem))
    zseq = zombie.next_seq
    zombie.send(_payload(zseq, 128))
    zombie.close()
    try:                                    # the controller's own check of the same stale epoch
        smc.send(smc.host_id, b"stale write", fence=(a.sem, told))
        stale_send = "delivered"
    except SmcError as exc:
        stale_send = Error(exc.code).name
    fp = FencedProducer.attach(view, smc, sem=a.sem, consumer=a.consumer, coherence=COHERENT)
    with smc.semaphore(a.sem, 60) as mine:
        p = fp.producer
        p.resume()
        p.set_fence(mine, fence_tag(smc.host_id, a.sem))
        fseq = p.next_seq
        p.send(_payload(fseq, 128), timeout=60)
        p.wait_acked(fseq, timeout=60)
    fp.close()
    view.release()
    return {"host": smc.host_id, "doorbell_from": src, "told_epoch": told, "lost": lost,
            "owner_after": owner_after, "epoch_after": epoch_after, "my_epoch": mine,
            "zombie_seq": zseq, "fresh_seq": fseq, "stale_send": stale_send, "alive": sorted(smc.alive())}


def chan_watch(smc, sh, a) -> dict:
    view = _channel(sh, a)
    if a.create:
        _fresh_channel(smc, sh, a, view)
    else:
        sh.put(OFF_READY + 8 * smc.host_id, a.nonce)
    lost = smc.wait_peer_lost(timeout=300)
    owner, epoch = smc.state(a.sem)
    peers = [h for h in range(smc.num_hosts) if h != smc.host_id]
    c = Consumer.open(view, coherence=COHERENT, wakeup=SmcWakeup(smc, peers), fence_check=semaphore_fence(smc, a.sem))
    seen = []
    try:
        while len(seen) < a.count:
            try:
                rec = c.receive(timeout=120)
                seen.append({"seq": rec.seq, "accepted": True, "ok": rec.tobytes() == _payload(rec.seq, rec.length)})
            except StaleRecord as exc:
                seen.append({"seq": exc.seq, "accepted": False, "reason": exc.reason})
                c.skip()
            c.ack()
    finally:
        c.close()
        view.release()
    return {"host": smc.host_id, "lost": lost, "owner_after": owner, "epoch_after": epoch, "records": seen,
            "alive": sorted(smc.alive())}


SELF_READY = ("chan-consume", "chan-watch")
COMMANDS = {"contend": contend, "pingpong": pingpong, "hold": hold, "survive": survive, "watch": watch,
            "chan-consume": chan_consume, "chan-produce": chan_produce, "chan-fenced": chan_fenced,
            "chan-hold": chan_hold, "chan-survive": chan_survive, "chan-watch": chan_watch}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="smc_checks")
    p.add_argument("command", choices=tuple(COMMANDS))
    p.add_argument("--dax", required=True)
    p.add_argument("--base", type=lambda t: int(t, 0), default=0x100000)
    p.add_argument("--sem", type=int, default=None)
    p.add_argument("--chan", type=lambda t: int(t, 0), default=0x400000, help="the channel's offset in the dax")
    p.add_argument("--peers", default="0")
    p.add_argument("--consumer", type=int, default=2)
    p.add_argument("--create", action="store_true")
    p.add_argument("--gap-ms", type=float, default=0)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--count", type=int, default=30)
    p.add_argument("--hosts", default="0,1")
    p.add_argument("--peer", type=int, default=0)
    p.add_argument("--role", choices=("init", "resp"), default="init")
    p.add_argument("--mode", choices=("irq", "poll"), default="irq")
    p.add_argument("--nonce", type=int, required=True)
    a = p.parse_args(argv)
    if a.sem is None and not a.command.startswith("chan-"):
        a.sem = 0
    if a.sem is None and a.command in ("chan-fenced", "chan-hold", "chan-survive", "chan-watch"):
        p.error(f"{a.command} needs --sem")
    try:
        with open_dax(a.dax) as dax, SmcDriver.open() as smc:
            sh = Shared(dax, a.base)
            if a.command not in SELF_READY:         # these publish it once the channel is ready
                sh.put(OFF_READY + 8 * smc.host_id, a.nonce)
            result = COMMANDS[a.command](smc, sh, a)
    except (SmcError, ChannelError) as err:
        print(f"smc_checks: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
