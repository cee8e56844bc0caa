"""The channel on a MODEL of non-coherent shared memory (tests/fast/noncoherent_memory.py).

Fakes on purpose: these tests check the channel's own ordering logic -- where
it writes back, invalidates and fences -- which the lab's coherent memory can
never show wrong.  Host "a" produces, host "b" consumes, host "c" takes over
when "a" dies.  Every scenario is seeded and reproducible.

* the model itself behaves like write-back caches;
* streams with CPU- and DMA-placed payloads, the consumer looking at memory
  between every two cache operations of the producer;
* the producer crashes at every cache operation of a publish (its process, or
  its whole host) and a restarted producer continues: nothing lost, nothing
  delivered twice, no unacked space reused;
* the mutation test: each flush/invalidate/fence call site of channel.py in
  turn does nothing, and some scenario must then fail.
"""

from __future__ import annotations

import ast
import functools
import random
import struct
import zlib
from pathlib import Path

import pytest
from noncoherent_memory import LINE, Crash, SharedMemoryModel

from vfio_cxl.guest import channel
from vfio_cxl.guest.channel import ChannelFull, ChannelTimeout, Consumer, CorruptRecord, NoChannel, Producer

SIZE = 4096 + 8 * 1024           # header + 8-entry ring, then an 8 KiB data area
RING = 8
ACKED_AT = 128                   # the consumer's acked count (channel layout)


def payload(seq: int, incarnation: int = 0) -> bytes:
    """Seq and producer incarnation, then bytes derived from both."""
    rng = random.Random(seq * 7919 + incarnation)
    n = rng.choice([0, 1, rng.randrange(2, 200), rng.randrange(200, 3000)])
    return struct.pack("<II", seq, incarnation) + rng.randbytes(n)


class Reader:
    """The consumer on host b: takes all it can see, checks each payload, keeps ``hold`` records unacked.

    Held records are checked again before they are acked: the producer must
    not have reused their space.  ack() must be in memory when it returns."""

    def __init__(self, model: SharedMemoryModel, hold: int = 2):
        self.model, self.host, self.hold = model, model.host("b"), hold
        self.consumer: Consumer | None = None
        self.delivered: list[tuple[int, int]] = []          # (seq, incarnation)
        self.held: list = []

    def open(self) -> bool:
        if self.consumer is None:
            try:
                self.consumer = Consumer.open(self.host.view, coherence=self.host.coherence)
            except NoChannel:
                return False
        return True

    @property
    def next_seq(self) -> int:
        return self.consumer.next_seq if self.consumer else 0

    @property
    def acked(self) -> int:
        return self.consumer._acked if self.consumer else 0

    def poll(self) -> None:
        if not self.open():
            return
        while True:
            try:
                rec = self.consumer.receive(timeout=0)
            except ChannelTimeout:
                break
            except CorruptRecord as e:
                raise AssertionError(f"a good record was rejected: {e}") from None
            seq, inc = struct.unpack_from("<II", rec.view)
            assert seq == rec.seq, f"record {rec.seq} carries the payload of record {seq}"
            assert rec.view == payload(seq, inc), f"record {seq} (incarnation {inc}) has wrong bytes"
            self.delivered.append((seq, inc))
            self.held.append((rec, bytes(rec.view)))
            if len(self.held) > self.hold:
                self.ack()

    def ack(self, keep: int | None = None) -> None:
        keep = self.hold if keep is None else keep
        for rec, data in self.held:
            assert rec.view == data, f"record {rec.seq}'s unacked space was overwritten"
        upto = self.held[-keep - 1][0] if keep else self.held[-1][0]
        self.consumer.ack(upto)
        self.held = self.held[len(self.held) - keep:] if keep else []
        acked = struct.unpack_from("<Q", self.model.memory, ACKED_AT)[0]
        assert acked == upto.seq + 1, f"ack({upto.seq}) returned but memory has acked {acked}"

    def drain(self, count: int, tries: int = 20) -> None:
        for _ in range(tries):
            self.poll()
            if self.held:
                self.ack(0)
            if self.next_seq >= count:
                return
        raise AssertionError(f"records {self.next_seq}..{count - 1} never became visible to the consumer")


def produce(model, host, p: Producer, reader: Reader, seqs, incarnation: int = 0) -> None:
    """Publish ``seqs``.

    Incarnation 0 reserves two at a time (the second before the first is
    filled), copies even seqs in by CPU and DMAs odd ones; later incarnations
    reserve one at a time and DMA all."""
    seqs = list(seqs)
    step = 2 if incarnation == 0 else 1
    for i in range(0, len(seqs), step):
        batch = [(seq, payload(seq, incarnation), reserve(p, reader, len(payload(seq, incarnation))))
                 for seq in seqs[i:i + step]]
        for seq, data, r in batch:
            assert p.next_seq == seq
            if incarnation == 0 and seq % 2 == 0:
                r.view[:] = data
                got = p.publish(r.offset, r.length, zlib.crc32(data))
            else:
                model.dma_write(r.offset, data)
                got = p.publish(r.offset, r.length)
            assert got == seq
            observer, host.on_event = host.on_event, None
            reader.poll()           # publish() returned: the record must be visible now
            assert reader.next_seq > seq, f"publish({seq}) returned but the consumer cannot see it"
            assert p.acked == reader.acked, "the producer does not see an ack that returned"
            host.on_event = observer


def reserve(p: Producer, reader: Reader, length: int):
    for _ in range(50):
        try:
            return p.reserve(length, timeout=0)
        except ChannelFull:
            reader.poll()
            if reader.held:
                reader.ack(0)
    raise AssertionError(f"the producer never got room for record {p.next_seq}")


def stream(seed: int, count: int = 40) -> None:
    model = SharedMemoryModel(SIZE, seed=seed)
    a = model.host("a")
    reader = Reader(model)
    a.on_event = reader.poll                       # the consumer looks between every two producer steps
    p = Producer.create(a.view, coherence=a.coherence, ring_entries=RING)
    produce(model, a, p, reader, range(count))
    reader.drain(count)
    assert reader.delivered == [(s, 0) for s in range(count)]
    assert reader.consumer.published == count


def open_before_create(seed: int = 0) -> None:
    model = SharedMemoryModel(SIZE, seed=seed)
    a, b = model.host("a"), model.host("b")
    with pytest.raises(NoChannel):
        Consumer.open(b.view, coherence=b.coherence)
    p = Producer.create(a.view, coherence=a.coherence, ring_entries=RING)
    c = Consumer.open(b.view, coherence=b.coherence)     # created: visible at once
    p.send(b"first")
    assert c.receive(0).tobytes() == b"first"


def recreate(seed: int = 0, times: int = 40) -> None:
    """A producer re-creates the channel, again and again, under a consumer that had acked records.

    A consumer that opens at any step of a re-create and sees the new channel
    must start from zero."""
    model = SharedMemoryModel(SIZE, seed=seed, early=0.5)
    a, b = model.host("a"), model.host("b")
    reader = Reader(model)
    produce(model, a, Producer.create(a.view, coherence=a.coherence, ring_entries=RING), reader, range(5))
    reader.drain(5)
    old = reader.consumer
    epochs = {old.geometry.epoch}

    def look():
        try:
            c = Consumer.open(b.view, coherence=b.coherence)
        except (NoChannel, channel.BadHeader):
            return
        if c.geometry.epoch not in epochs:
            assert (c.next_seq, c.published) == (0, 0), "a new channel shows the old one's counters"

    for i in range(times):
        a.will_store(0, 4096)     # create zeroes the consumer's line too, maybe over a stale zero of a's
        a.on_event = look if i % 2 else None      # (look refreshes b's lines: every other time, b stays stale)
        p = Producer.create(a.view, coherence=a.coherence, ring_entries=RING)
        a.on_event = None
        epochs.add(p.geometry.epoch)
        assert p.next_seq == 0
        p.send(b"new channel %d" % i)
        c = Consumer.open(b.view, coherence=b.coherence)
        assert c.next_seq == 0 and c.published == 1
        assert c.receive(0).tobytes() == b"new channel %d" % i
        c.ack()
    with pytest.raises(ChannelTimeout, match="re-created the channel"):
        old.receive(0)


# -- crash and restart -------------------------------------------------------------------------------------

BEFORE, WINDOW, COUNT = 12, 2, 18      # records before the crash window, records in it, records in all


def crash_run(seed: int, crash_at: int | None, *, host_dies: bool) -> tuple[int, int]:
    """Produce COUNT records; the producer may crash at its ``crash_at``-th cache operation.

    Then a new producer (same host, or host c if a's host died) attaches and
    produces the rest.  Returns a's operation numbers around the window."""
    model = SharedMemoryModel(SIZE, seed=seed)
    a, c = model.host("a"), model.host("c")          # c's cache is as stale as can be
    reader = Reader(model)
    a.on_event = reader.poll
    p = Producer.create(a.view, coherence=a.coherence, ring_entries=RING)
    produce(model, a, p, reader, range(BEFORE))
    window = [a.ops + 1]
    a.crash_at = crash_at
    try:
        produce(model, a, p, reader, range(BEFORE, BEFORE + WINDOW))
        window.append(a.ops)
        produce(model, a, p, reader, range(BEFORE + WINDOW, COUNT))
        crashed = False
    except Crash:
        crashed = True
    if crashed:
        reader.poll()                                 # the consumer takes whatever it can see
        if host_dies:
            a.die()
            a.on_event = None
            new_host = c
            new_host.on_event = reader.poll
        else:
            new_host = a
        p2 = Producer.attach(new_host.view, coherence=new_host.coherence)
        restart = p2.next_seq
        assert BEFORE <= restart <= BEFORE + WINDOW, restart
        produce(model, new_host, p2, reader, range(restart, COUNT), incarnation=1)
    else:
        restart = COUNT
    reader.drain(COUNT)
    assert [s for s, _ in reader.delivered] == list(range(COUNT)), "lost or duplicated records"
    wrong = [(s, i) for s, i in reader.delivered if i != (0 if s < restart else 1)]
    assert not wrong, f"records delivered from the wrong producer (restart at {restart}): {wrong}"
    return window[0], window[-1]


@functools.cache
def crash_points(seed: int) -> range:
    first, last = crash_run(seed, None, host_dies=False)
    return range(first, last + 2)       # every operation in the window, and none (crash after the last)


@pytest.mark.parametrize("host_dies", [False, True], ids=["process-restart", "host-failover"])
@pytest.mark.parametrize("seed", [1])
def test_producer_crash_at_every_step_of_a_publish_loses_and_repeats_nothing(seed, host_dies):
    points = crash_points(seed)
    assert len(points) > 2 * WINDOW * 5      # a publish is several steps: each is a crash point
    for n in points:
        try:
            crash_run(seed, n, host_dies=host_dies)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, producer crashed at its cache operation {n}: {e}") from None


# -- scenarios as tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_stream_on_noncoherent_memory_with_the_consumer_looking_at_every_step(seed):
    stream(seed)


def test_consumer_opening_before_create_sees_the_channel_once_created():
    open_before_create()


def test_recreated_channel_is_fresh_for_a_new_consumer_on_a_host_with_stale_lines():
    recreate()


# -- the model itself -------------------------------------------------------------------------------------

def test_model_stale_until_invalidated_and_fenced_and_invisible_until_flushed_and_fenced():
    model = SharedMemoryModel(4 * LINE, early=0, evict=0)
    a, b = model.host("a"), model.host("b")
    a.view[70:72] = b"hi"
    assert model.memory[70:72] == bytes(2) and b.view[70:72] == bytes(2)
    a.coherence.flush(a.view, 70, 2)
    assert model.memory[70:72] == bytes(2)                   # weak: not done before the fence
    a.coherence.fence()
    assert model.memory[64:128] == a.view[64:128]            # the whole line
    assert b.view[70:72] == bytes(2)                         # b still has its stale copy
    b.coherence.invalidate(b.view, 64, 8)
    assert b.view[70:72] == bytes(2)
    b.coherence.fence()
    assert b.view[70:72] == b"hi"


def test_model_invalidate_writes_a_dirty_line_back_and_dma_bypasses_caches():
    model = SharedMemoryModel(4 * LINE, early=0, evict=0)
    a = model.host("a")
    a.view[0:4] = b"cpu!"
    model.dma_write(64, b"dma!")
    assert a.view[64:68] == bytes(4)
    a.coherence.invalidate(a.view, 0, 128)
    a.coherence.fence()
    assert model.memory[0:4] == b"cpu!" and a.view[64:68] == b"dma!"


def test_model_eviction_early_completion_crash_and_death_are_seeded():
    def run(seed):
        model = SharedMemoryModel(64 * LINE, seed=seed, early=0.5, evict=0.5)
        a = model.host("a")
        for i in range(64):
            a.view[i * LINE] = i + 1
            a.coherence.flush(a.view, i * LINE, 1)
        return bytes(model.memory), len(a.queue)

    assert run(1) == run(1) and run(1) != run(2)
    memory, queued = run(1)
    assert 0 < queued < 64 and any(memory)                   # some early, some still queued
    model = SharedMemoryModel(4 * LINE, early=0, evict=0)
    a = model.host("a")
    a.crash_at = 2
    a.view[0] = 1
    a.coherence.flush(a.view, 0, 1)
    with pytest.raises(Crash):
        a.coherence.fence()
    assert a.queue and a.view[0] == 1 and model.memory[0] == 0   # the process died, its cache did not
    a.die()
    assert not a.queue and a.view[0] == 0 == model.memory[0]


# -- mutation test ---------------------------------------------------------------------------------------

CHANNEL_FILE = channel.__file__
OPS = ("flush", "invalidate", "fence")


def cache_operation_sites() -> list[tuple[str, int, str, str]]:
    """(file, line, function, operation) of every flush/invalidate/fence call in channel.py."""
    tree = ast.parse(Path(CHANNEL_FILE).read_text())
    sites = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in OPS \
                        and fn.name not in OPS:
                    sites.append((CHANNEL_FILE, node.lineno, fn.name, node.func.attr))
    return sorted(set(sites), key=lambda s: s[1])


def scenarios():
    """Cheap ones first; each raises if the channel misbehaves."""
    yield "open before create", open_before_create
    yield "re-create", recreate
    for seed in range(4):
        yield f"stream seed {seed}", lambda seed=seed: stream(seed)
    for host_dies in (False, True):
        for seed in (1,):
            def crashes(seed=seed, host_dies=host_dies):
                for n in crash_points(seed):
                    crash_run(seed, n, host_dies=host_dies)
            yield f"crash seed {seed}{' host dies' if host_dies else ''}", crashes


def run_with_skipped(site: tuple[str, int] | None) -> tuple[str | None, set]:
    """Run the scenarios with ``site``'s cache operations doing nothing; the first failure, and the sites seen."""
    seen: set = set()
    original = SharedMemoryModel.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.skip = {site} if site else set()
        self.seen = seen

    SharedMemoryModel.__init__ = init
    try:
        for name, scenario in scenarios():
            try:
                scenario()
            except (AssertionError, channel.ChannelError, pytest.fail.Exception) as e:
                return f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", seen
        return None, seen
    finally:
        SharedMemoryModel.__init__ = original


def test_every_flush_invalidate_and_fence_of_the_channel_is_needed():
    sites = cache_operation_sites()
    assert len(sites) >= 15, sites
    failure, seen = run_with_skipped(None)
    assert failure is None, f"the unmutated channel fails: {failure}"
    untested = [s for s in sites if s[:2] not in seen]
    assert not untested, f"call sites no scenario reaches: {untested}"
    survivors, killed = [], []
    for site in sites:
        failure, _ = run_with_skipped(site[:2])
        (killed if failure else survivors).append((site[1:], failure))
    assert not survivors, "channel.py works without these cache operations (remove them, or add the scenario " \
                          "that needs them): " + ", ".join(f"line {s[0]} in {s[1]}(): {s[2]}" for s, _ in survivors)
