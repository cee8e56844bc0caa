"""The channel's own logic for wake-ups and for producers taking turns under a fencing lock.

Fakes, said so: ``QueueWakeup`` stands in for the SMC doorbell (a counting
semaphore between two threads of one process: notifications queue, as the
doorbell FIFO does), and ``FakeLock`` for the SMC semaphore (an epoch that
grows with every grant and every forced release).  The real doorbell and
semaphore are tested in tests/fast/test_smc_channel.py (real controller) and
tests/vm/test_smc.py (real VMs).
"""

import threading
import time

import pytest

from vfio_cxl.guest.channel import (COHERENT, ChannelError, ChannelTimeout, Consumer, Producer, StaleRecord,
                              Wakeup)

KIB = 1024


class QueueWakeup(Wakeup):
    """One direction each way: ``notify`` posts to the peer's queue, ``wait`` takes from our own."""

    def __init__(self, mine: threading.Semaphore, peer: threading.Semaphore, name: str):
        self.mine, self.peer, self.name = mine, peer, name
        self.waits = self.notifies = 0

    def notify(self) -> None:
        self.notifies += 1
        self.peer.release()

    def wait(self, timeout):
        self.waits += 1
        return self.mine.acquire(timeout=timeout)

    def describe(self) -> str:
        return f"the fake {self.name} queue"


def wakeups():
    to_producer, to_consumer = threading.Semaphore(0), threading.Semaphore(0)
    return QueueWakeup(to_producer, to_consumer, "producer"), QueueWakeup(to_consumer, to_producer, "consumer")


@pytest.fixture
def mm():
    return bytearray(256 * KIB)


def test_consumer_sleeps_until_notified_and_never_polls(mm):
    wp, wc = wakeups()
    p = Producer.create(mm, coherence=COHERENT, ring_entries=16, wakeup=wp)
    c = Consumer.open(mm, coherence=COHERENT, wakeup=wc)
    got, checks = [], []
    committed = c._committed

    def counting(seq):
        checks.append(seq)
        return committed(seq)

    c._committed = counting   # counts looks at shared memory: polling would make thousands
    t = threading.Thread(target=lambda: got.extend(c.receive(timeout=10).tobytes() for _ in range(3)))
    t.start()
    for i in range(3):
        time.sleep(0.05)      # the producer is slow on purpose: a polling consumer would spin meanwhile
        p.send(b"record %d" % i)
    t.join(10)
    assert got == [b"record 0", b"record 1", b"record 2"]
    assert len(checks) <= 3 * 2 + 1, f"{len(checks)} looks at shared memory for 3 records: the consumer polled"
    assert wp.notifies == 4          # create + 3 publishes
    c.ack()
    assert wc.notifies == 1          # the ack told the producer
    p.wait_acked(2, timeout=1)


def test_a_notification_before_the_wait_is_not_lost(mm):
    wp, wc = wakeups()
    p = Producer.create(mm, coherence=COHERENT, ring_entries=16, wakeup=wp)
    c = Consumer.open(mm, coherence=COHERENT, wakeup=wc)
    p.send(b"early")                 # published and notified before the consumer looks
    assert c.receive(timeout=1).tobytes() == b"early"


def test_timeout_says_what_the_consumer_slept_on(mm):
    wp, wc = wakeups()
    Producer.create(mm, coherence=COHERENT, ring_entries=16, wakeup=wp)
    c = Consumer.open(mm, coherence=COHERENT, wakeup=wc)
    with pytest.raises(ChannelTimeout, match=r"no record 0 within 0.1s .*the consumer slept on the fake consumer "
                                             r"queue and was not woken for it"):
        while True:                  # the create's notification is one spurious wake-up; then it times out
            c.receive(timeout=0.1)
    p2 = Producer.attach(mm, coherence=COHERENT, wakeup=wp)
    with pytest.raises(ChannelTimeout, match=r"record 0 not acked within 0.1s .*slept on the fake producer queue"):
        p2.send(b"x")
        p2.wait_acked(0, timeout=0.1)


def test_consumer_open_sleeps_until_the_producer_creates_the_channel(mm):
    wp, wc = wakeups()
    opened = []
    t = threading.Thread(target=lambda: opened.append(Consumer.open(mm, coherence=COHERENT, wait=10, wakeup=wc)))
    t.start()
    time.sleep(0.05)
    Producer.create(mm, coherence=COHERENT, ring_entries=16, wakeup=wp)
    t.join(10)
    assert len(opened) == 1 and wc.waits >= 1


def test_a_full_channel_sleeps_the_producer_until_the_consumer_acks(mm):
    wp, wc = wakeups()
    p = Producer.create(mm, coherence=COHERENT, ring_entries=4, wakeup=wp)
    c = Consumer.open(mm, coherence=COHERENT, wakeup=wc)
    for i in range(4):
        p.send(bytes([i]))
    done = []
    t = threading.Thread(target=lambda: done.append(p.send(b"fifth", timeout=10)))
    t.start()
    time.sleep(0.05)
    assert not done                  # the ring is full: it sleeps
    c.receive(timeout=1)
    c.ack()
    t.join(10)
    assert done == [4]


class FakeLock:
    """Stands in for an SMC semaphore: owner and an epoch bumped on every grant and every forced release."""

    def __init__(self):
        self.owner, self.epoch = None, 0

    def acquire(self, who: int) -> int:
        assert self.owner is None
        self.owner, self.epoch = who, self.epoch + 1
        return self.epoch

    def release(self, who: int) -> None:
        assert self.owner == who
        self.owner = None

    def force_release(self) -> None:   # the holder died
        self.owner, self.epoch = None, self.epoch + 1

    def check(self, token: int, tag: int):
        if self.owner != tag or token != self.epoch:
            return f"stamped ({token}, writer {tag}) but the lock is ({self.epoch}, holder {self.owner})"
        return None


def test_producers_take_turns_and_a_stale_stamp_is_refused(mm):
    lock = FakeLock()
    a = Producer.create(mm, coherence=COHERENT, ring_entries=16)
    b = Producer.attach(mm, coherence=COHERENT)
    c = Consumer.open(mm, coherence=COHERENT, fence_check=lock.check)
    for i in range(6):               # a and b take turns: each resumes under the lock and waits for its ack
        who, p = (1, a) if i % 2 == 0 else (2, b)
        token = lock.acquire(who)
        p.resume()
        p.set_fence(token, who)
        seq = p.send(b"turn %d" % i)
        rec = c.receive(timeout=1)
        assert (rec.seq, rec.tobytes(), rec.fence) == (seq, b"turn %d" % i, (token, who))
        c.ack(rec)
        p.wait_acked(seq, timeout=1)
        lock.release(who)

    token = lock.acquire(1)          # a publishes under the lock, then dies before its ack
    a.resume()
    a.set_fence(token, 1)
    a.send(b"dead holder's record")
    lock.force_release()
    with pytest.raises(StaleRecord, match=r"record 6 rejected: stamped \(7, writer 1\) but the lock is \(8, holder "
                                          r"None\)"):
        c.receive(timeout=1)
    assert c.skip() == 6
    a.send(b"zombie write")          # a's stale stamp again, after the forced release
    with pytest.raises(StaleRecord):
        c.receive(timeout=1)
    c.skip()
    c.ack()

    token = lock.acquire(2)          # b takes over: its records count
    b.resume()
    assert b.next_seq == 8
    b.set_fence(token, 2)
    b.send(b"new holder")
    assert c.receive(timeout=1).tobytes() == b"new holder"


def test_unfenced_record_in_a_fenced_channel_and_bad_fences(mm):
    lock = FakeLock()
    p = Producer.create(mm, coherence=COHERENT, ring_entries=16)
    c = Consumer.open(mm, coherence=COHERENT, fence_check=lock.check)
    p.send(b"no stamp")
    with pytest.raises(StaleRecord, match=r"stamped \(0, writer 0\)"):
        c.receive(timeout=1)
    with pytest.raises(ValueError, match="token is 1..2"):
        p.set_fence(0, 1)
    r = p.reserve(4)
    with pytest.raises(ChannelError, match="1 reservations outstanding"):
        p.resume()
    p.publish(r.offset, r.length)
    with pytest.raises(ChannelError, match="no notify/wait/describe"):
        Consumer.open(mm, coherence=COHERENT, wakeup=object())
