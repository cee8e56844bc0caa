"""The channel woken by SMC doorbells and fenced by an SMC semaphore, against the real controller.

As in test_smc_driver.py, only the VFIO layer is a stand-in (``ClientDevice``: the vfio-user client
plays QEMU's part, MSI-X eventfds included); the controller, the driver, the channel and the shared
buffer logic are real.  Three "hosts" are three drivers in this process; the shared memory is one
bytearray.  The same flows run in real VMs in tests/vm/test_smc.py and test_pool_smc.py.
"""

import threading

import pytest
from test_smc_driver import ClientDevice, drivers  # noqa: F401  (the fixture)

from vfio_cxl.guest.channel import COHERENT, ChannelTimeout, Consumer, Producer, StaleRecord
from vfio_cxl.guest.smc_channel import FencedProducer, SmcWakeup, fence_tag, semaphore_fence
from vfio_cxl.guest.drivers.smc import SmcError

KIB = 1024


def test_the_doorbell_wakes_a_blocked_consumer(drivers):
    _, (a, b, _) = drivers
    mm = bytearray(256 * KIB)
    p = Producer.create(mm, coherence=COHERENT, ring_entries=16, wakeup=SmcWakeup(a, [1]))
    wake_b = SmcWakeup(b, [0])
    c = Consumer.open(mm, coherence=COHERENT, wakeup=wake_b)
    got = []

    def consume():
        for _ in range(5):
            rec = c.receive(timeout=10)
            got.append(rec.tobytes())
            c.ack(rec)

    t = threading.Thread(target=consume)
    t.start()
    for i in range(5):
        seq = p.send(b"rec %d" % i)
        p.wait_acked(seq, timeout=10)       # sleeps on a's doorbell: b rings after each ack
    t.join(10)
    assert got == [b"rec %d" % i for i in range(5)]
    assert 1 <= wake_b.wakeups <= 6         # woken per record (the create's ring may be one more)
    with pytest.raises(ChannelTimeout, match=r"slept on the SMC doorbell of host 1 \(MSI-X vector 0, rung by "
                                             r"hosts \[0\]\) and was not woken"):
        c.receive(timeout=0.2)
    with pytest.raises(SmcError, match="no host 7"):
        SmcWakeup(a, [7])


def test_fenced_producers_take_turns_and_a_dead_holders_record_is_stale(drivers):
    _, (a, b, c) = drivers
    mm = bytearray(256 * KIB)
    Producer.create(mm, coherence=COHERENT, ring_entries=16).close()
    producers = [FencedProducer.attach(mm, d, sem=3, consumer=2, coherence=COHERENT) for d in (a, b)]
    consumer = Consumer.open(mm, coherence=COHERENT, wakeup=SmcWakeup(c, [0, 1]), fence_check=semaphore_fence(c, 3))
    sent: dict[int, list] = {0: [], 1: []}
    got = []

    def produce(i):
        for k in range(6):
            sent[i].append(producers[i].send(b"host %d record %d" % (i, k), timeout=20))

    threads = [threading.Thread(target=produce, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for _ in range(12):
        rec = consumer.receive(timeout=20)
        got.append((rec.seq, rec.tobytes(), rec.fence))
        consumer.ack(rec)
    for t in threads:
        t.join(20)
    assert [s for s, _, _ in got] == list(range(12))
    assert sorted(seq for i in (0, 1) for seq, _ in sent[i]) == list(range(12))
    for seq, data, (token, tag) in got:                 # each record carries its writer's epoch and host ID
        writer = 0 if data.startswith(b"host 0") else 1
        assert tag == fence_tag(writer, 3) and (seq, token) in sent[writer]
    assert sorted(t for _, _, (t, _) in got) == [t for _, _, (t, _) in got]   # epochs grow with seq

    # a holds the semaphore and publishes, then its connection drops (its QEMU died) before the ack
    p = producers[0].producer
    epoch = a.acquire(3)
    p.resume()
    p.set_fence(epoch, fence_tag(0, 3))
    p.send(b"dead holder")
    a.device.close()
    assert b.wait_peer_lost(timeout=10) == 0
    with pytest.raises(StaleRecord, match=rf"record 12 rejected: stamped by host 0 with epoch {epoch} of "
                                          rf"semaphore 3, which is now free at epoch {epoch + 1}"):
        consumer.receive(timeout=10)
    consumer.skip()
    consumer.ack()                                      # rings hosts 0 (gone: HOST_ABSENT, ignored) and 1
    assert consumer.wakeup.absent == {0}
    done = []
    t = threading.Thread(target=lambda: done.append(producers[1].send(b"survivor", timeout=10)))
    t.start()
    rec = consumer.receive(timeout=10)
    assert rec.tobytes() == b"survivor"
    consumer.ack(rec)
    t.join(10)
    assert done == [(13, epoch + 2)]
    a.device = None      # already gone; the fixture must not reset it
    a.vectors.close()
