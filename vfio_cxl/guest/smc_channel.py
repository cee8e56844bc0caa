"""The channel (``vfio_cxl.guest.channel``) on the shared-memory controller: doorbells instead of
polling, and producers on several hosts taking turns under an SMC semaphore.

One producer, one consumer (host IDs on the controller)::

    # producer host (ID 0)                           # consumer host (ID 1)
    smc = SmcDriver.open()                           smc = SmcDriver.open()
    p = Producer.create(view, coherence=C,           c = Consumer.open(view, coherence=C, wait=30,
            wakeup=SmcWakeup(smc, [1]))                      wakeup=SmcWakeup(smc, [0]))
    p.send(data)     # commit, then ring host 1      rec = c.receive(timeout=5)   # asleep on MSI-X
                                                     c.ack(rec)   # rings host 0 (a producer may wait)

The consumer sleeps on its doorbell vector's eventfd (VFIO MSI-X); it never
spins.  A ring that arrives while it is looking at shared memory stays in its
doorbell FIFO, so the next sleep ends at once: no wake-up is lost.  A ring
refused because the FIFO is full (DB_FULL) is dropped on purpose -- the
sleeper has wake-ups queued already -- and so is a ring to a host that is
gone (HOST_ABSENT): nobody is waiting there.

Several producers, one consumer (``FencedProducer``, ``semaphore_fence``)::

    fp = FencedProducer.attach(view, smc, sem=3, consumer=2, coherence=C)  # in each producer host
    fp.send(data, timeout=10)   # acquire 3 -> resume -> stamp (epoch, host) -> publish -> ring 2
                                # -> sleep until acked -> release
    c = Consumer.open(view, coherence=C, wakeup=SmcWakeup(smc, [0, 1]),
                      fence_check=semaphore_fence(smc, 3))                # in the consumer host

The consumer asks the controller (two register reads) whether each record's
stamp -- the semaphore's epoch and the writer's host ID -- is still the
semaphore's holder and epoch, and rejects it otherwise (``StaleRecord``): the
writer died, or its semaphore was forcibly released, before the consumer saw
the record.  See "Several producers" in ``vfio_cxl.guest.channel`` for why a
producer keeps the semaphore until its record is acked.

Someone must create the channel before producers attach (``Producer.create``
once, e.g. on the consumer's host); the drivers must be open before anyone
rings (opening resets a host's doorbell FIFO): hosts publish a "ready" word in
shared memory after opening, as ``vfio_cxl.guest.cmd.smc_checks`` does.
"""

from __future__ import annotations

from .channel import Coherence, Producer, Wakeup
from ..devices.smc.regs import Error
from .drivers.smc import SmcDriver, SmcError, SmcTimeout

__all__ = ["SmcWakeup", "FencedProducer", "semaphore_fence", "fence_tag", "DOORBELL_PAYLOAD"]

DOORBELL_PAYLOAD = 0x4348414E     # "CHAN": what the channel's rings carry
FENCE_TAG_VALID = 1 << 31         # tag = VALID | writer host << 8 | semaphore


class SmcWakeup(Wakeup):
    """notify(): ring each peer's doorbell; wait(): sleep on this host's doorbell vector, then drain the FIFO."""

    def __init__(self, smc: SmcDriver, peers):
        self.smc, self.peers = smc, [int(h) for h in peers]
        for h in self.peers:
            if not 0 <= h < smc.num_hosts:
                raise SmcError(f"no host {h} on this controller", f"use 0..{smc.num_hosts - 1}", Error.BAD_INDEX)
        self.rings = self.dropped = self.wakeups = 0
        self.absent: set[int] = set()

    def notify(self) -> None:
        for h in self.peers:
            try:
                self.smc.ring(h, DOORBELL_PAYLOAD)
                self.rings += 1
            except SmcError as exc:
                if exc.code == Error.DB_FULL:      # it has wake-ups queued: this one adds nothing
                    self.dropped += 1
                elif exc.code == Error.HOST_ABSENT:
                    self.absent.add(h)             # gone: nobody waits there
                else:
                    raise

    def wait(self, timeout: float | None) -> bool:
        try:
            self.smc.wait_doorbell(timeout)
        except SmcTimeout:
            return False
        self.smc.drain_doorbells()                 # rung before this look at shared memory: covered by it
        self.wakeups += 1
        return True

    def describe(self) -> str:
        gone = f"; hosts {sorted(self.absent)} are gone" if self.absent else ""
        return (f"the SMC doorbell of host {self.smc.host_id} (MSI-X vector 0, rung by hosts "
                f"{self.peers}{gone})")


def fence_tag(host: int, sem: int) -> int:
    return FENCE_TAG_VALID | (host & 0xFF) << 8 | sem & 0xFF


def semaphore_fence(smc: SmcDriver, sem: int):
    """A ``fence_check`` for Consumer.open: a record counts only if its writer holds ``sem`` now, with the
    epoch it stamped on the record."""
    def check(token: int, tag: int) -> str | None:
        if not tag & FENCE_TAG_VALID or tag & 0xFF != sem:
            return f"not stamped with semaphore {sem} (token {token}, tag {tag:#x})"
        writer = tag >> 8 & 0xFF
        owner, epoch = smc.state(sem)
        if (owner, epoch) == (writer, token):
            return None
        now = f"held by host {owner} at epoch {epoch}" if owner is not None else f"free at epoch {epoch}"
        return f"stamped by host {writer} with epoch {token} of semaphore {sem}, which is now {now}"
    return check


class FencedProducer:
    """One of several producers of a channel, taking turns under SMC semaphore ``sem``."""

    def __init__(self, producer: Producer, smc: SmcDriver, sem: int):
        self.producer, self.smc, self.sem = producer, smc, sem

    @classmethod
    def attach(cls, buf, smc: SmcDriver, *, sem: int, consumer: int, coherence: Coherence) -> "FencedProducer":
        smc.state(sem)                                  # a bad index fails here, before anything is attached
        return cls(Producer.attach(buf, coherence=coherence, wakeup=SmcWakeup(smc, [consumer])), smc, sem)

    def send(self, data, *, timeout: float | None = 10.0) -> tuple[int, int]:
        """Publish ``data`` as a record stamped with the semaphore's epoch; returns (seq, epoch) once the
        consumer acked it.  The semaphore is held from before the resume until after the ack."""
        p = self.producer
        with self.smc.semaphore(self.sem, timeout) as epoch:
            p.resume()
            p.set_fence(epoch, fence_tag(self.smc.host_id, self.sem))
            seq = p.send(data, timeout=timeout)
            p.wait_acked(seq, timeout)
        return seq, epoch

    def close(self) -> None:
        self.producer.close()
