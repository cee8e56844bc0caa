"""The shared-memory channel: two real processes over one mmap'd file, corruption, back-pressure, headers."""

import ast
import json
import mmap
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from vfio_cxl.guest import channel
from vfio_cxl.guest.channel import (COHERENT, BadHeader, BadMagic, ChannelError, ChannelFull, ChannelTimeout, Consumer,
                              CorruptRecord, NoChannel, Producer, VersionMismatch)

REPO = Path(__file__).resolve().parents[2]
KIB = 1024

# Both processes derive each record's payload from its seq, so the consumer checks exact bytes.
PAYLOAD_SRC = '''
import random
def payload(seq):
    rng = random.Random(seq)
    n = rng.choice([0, 1, rng.randrange(2, 64), rng.randrange(64, 12 * 1024), rng.randrange(64, 12 * 1024)])
    return rng.randbytes(n)
'''
_ns: dict = {}
exec(PAYLOAD_SRC, _ns)
payload = _ns["payload"]

CHILD_PRELUDE = '''
import json, mmap, sys, zlib
from vfio_cxl.guest.channel import COHERENT, ChannelFull, Consumer, Producer
with open(sys.argv[1], "r+b") as f:
    mm = mmap.mmap(f.fileno(), 0)
'''


def child(script: str, *args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + script, *map(str, args)], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return out


def shared_file(tmp_path, size: int) -> tuple[Path, mmap.mmap]:
    path = tmp_path / "cxl-shared"
    with open(path, "wb") as f:
        f.truncate(size)
    with open(path, "r+b") as f:
        return path, mmap.mmap(f.fileno(), size)


@pytest.fixture
def mm(tmp_path):
    _, m = shared_file(tmp_path, 64 * KIB)
    yield m
    m.close()


@pytest.fixture
def pair(mm):
    """A producer and a consumer in this process over a 16-entry ring and a 56 KiB data area."""
    p = Producer.create(mm, coherence=COHERENT, ring_entries=16)
    c = Consumer.open(mm, coherence=COHERENT)
    yield p, c
    p.close()
    c.close()


# --- two processes -------------------------------------------------------------------

STREAM_PRODUCER = PAYLOAD_SRC + '''
count, corrupt = int(sys.argv[2]), {int(s) for s in sys.argv[3].split(",")}
p = Producer.create(mm, coherence=COHERENT, ring_entries=16)
for seq in range(count):
    data = payload(seq)
    if seq in corrupt:                          # a bad record: its checksum does not match
        r = p.reserve(len(data), timeout=20)
        r.view[:] = data
        got = p.publish(r.offset, r.length, checksum=zlib.crc32(data) ^ 1)
    elif seq % 2:                               # reserve -> external write (as the GPU's DMA) -> publish
        r = p.reserve(len(data), timeout=20)
        r.view[:] = data
        got = p.publish(r.offset, r.length)
    else:
        got = p.send(data, timeout=20)
    assert got == seq, (got, seq)
print(json.dumps({"sent": count, "data_size": p.geometry.data_size}))
p.close()
'''


def test_stream_between_two_processes_no_loss_no_duplicate_no_corruption(tmp_path):
    path, m = shared_file(tmp_path, 64 * KIB)
    count, corrupt = 1500, {500, 1001}
    proc = child(STREAM_PRODUCER, path, count, ",".join(map(str, sorted(corrupt))))
    c = Consumer.open(m, coherence=COHERENT, wait=20)
    delivered, rejected, total, since_ack = [], [], 0, 0
    while len(delivered) + len(rejected) < count:
        try:
            rec = c.receive(timeout=20)
        except CorruptRecord as e:
            rejected.append(e.seq)
            assert c.skip() == e.seq
            continue
        assert rec.view.obj is m                # zero copy: a view of the shared mapping itself
        assert rec.view == payload(rec.seq), f"record {rec.seq} delivered with wrong bytes"
        delivered.append(rec.seq)
        total += rec.length
        since_ack += 1
        if since_ack >= 1 + rec.seq % 7:        # cumulative acks in batches of 1..7
            c.ack()
            since_ack = 0
    c.ack()
    report = json.loads(finish(proc))
    assert report["sent"] == count
    assert rejected == sorted(corrupt)
    assert delivered == [s for s in range(count) if s not in corrupt]     # in order, none lost, none twice
    assert total > 20 * report["data_size"]     # the data area wrapped many times under back-pressure
    with pytest.raises(ChannelTimeout):         # and nothing more is there
        c.receive(timeout=0)
    c.close()
    m.close()


BLOCKED_PRODUCER = '''
p = Producer.create(mm, coherence=COHERENT, ring_entries=4)
for i in range(4):
    p.send(b"early %d" % i)
try:
    p.send(b"refused", timeout=0)
except ChannelFull as e:
    print("full", e, flush=True)
print("sent", p.send(b"late", timeout=20), flush=True)
p.close()
'''


def test_producer_blocks_on_a_full_ring_until_the_other_process_acks(tmp_path):
    path, m = shared_file(tmp_path, 64 * KIB)
    proc = child(BLOCKED_PRODUCER, path)
    first = proc.stdout.readline()
    assert first.startswith("full channel full after 0s: all 4 ring records are in use"), first
    c = Consumer.open(m, coherence=COHERENT)
    assert c.published == 4 and proc.poll() is None        # the producer waits in send(b"late")
    assert c.receive(timeout=5).tobytes() == b"early 0"     # slot 0 and its data were not overwritten
    c.ack()                                      # frees one slot: the blocked send goes through
    got = [c.receive(timeout=20).tobytes() for _ in range(4)]
    assert got == [b"early 1", b"early 2", b"early 3", b"late"]
    assert finish(proc) == "sent 4\n"
    c.ack()
    c.close()
    m.close()


EARLY_CONSUMER = '''
print("waiting", flush=True)
c = Consumer.open(mm, coherence=COHERENT, wait=20)
out = []
for _ in range(3):
    r = c.receive(timeout=20)
    out.append([r.seq, r.tobytes().decode()])
    c.ack(r)
print(json.dumps(out))
c.close()
'''


def test_consumer_started_before_the_producer_waits_for_the_header(tmp_path):
    path, m = shared_file(tmp_path, 64 * KIB)
    proc = child(EARLY_CONSUMER, path)
    assert proc.stdout.readline() == "waiting\n"
    assert proc.poll() is None                  # no header yet: it must not have failed
    with Producer.create(m, coherence=COHERENT, ring_entries=8) as p:
        for word in ("one", "two", "three"):
            p.send(word.encode(), timeout=5)
        assert json.loads(finish(proc)) == [[0, "one"], [1, "two"], [2, "three"]]
    m.close()


# --- header -----------------------------------------------------------------------------

def test_consumer_before_producer_times_out_clearly(mm):
    with pytest.raises(NoChannel, match="producer has not created the channel") as e:
        Consumer.open(mm, coherence=COHERENT)   # wait=0: look once
    assert "start the producer first" in str(e.value)
    t0 = time.monotonic()
    with pytest.raises(NoChannel, match=r"no valid channel after waiting 0.2s: no channel header"):
        Consumer.open(mm, coherence=COHERENT, wait=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2


def test_wrong_magic(mm):
    mm[0:8] = b"NOTACHAN"
    with pytest.raises(BadMagic, match=r"magic is b'NOTACHAN', expected b'VCXLCHAN'") as e:
        Consumer.open(mm, coherence=COHERENT)
    assert isinstance(e.value, NoChannel) and "offset is wrong" in e.value.fix


def test_wrong_version_fails_at_once_even_when_waiting(mm):
    Producer.create(mm, coherence=COHERENT).close()
    struct.pack_into("<I", mm, 8, channel.VERSION + 1)
    t0 = time.monotonic()
    with pytest.raises(VersionMismatch, match=f"version {channel.VERSION + 1}, this code speaks version "
                                              f"{channel.VERSION}"):
        Consumer.open(mm, coherence=COHERENT, wait=10)
    assert time.monotonic() - t0 < 2


def test_corrupt_header_and_geometry_that_does_not_fit(tmp_path, mm):
    Producer.create(mm, coherence=COHERENT).close()
    mm[41] ^= 0xFF                              # data size
    with pytest.raises(BadHeader, match="fails its checksum"):
        Consumer.open(mm, coherence=COHERENT)
    Producer.create(mm, coherence=COHERENT).close()
    small = mmap.mmap(-1, 16 * KIB)
    small[:64] = mm[:64]                        # same header, a smaller mapping
    with pytest.raises(BadHeader, match="does not fit this 16384-byte buffer"):
        Consumer.open(small, coherence=COHERENT)
    small.close()


def test_create_refuses_unusable_buffers(mm):
    with pytest.raises(ChannelError, match="cannot hold a channel with 1024 ring entries"):
        Producer.create(mm, coherence=COHERENT, ring_entries=1024)
    with pytest.raises(ChannelError, match="writable"):
        Producer.create(bytes(64 * KIB), coherence=COHERENT)


def test_memory_layout_matches_the_docstring(mm):
    p = Producer.create(mm, coherence=COHERENT, ring_entries=16)
    c = Consumer.open(mm, coherence=COHERENT)
    assert mm[0:8] == b"VCXLCHAN"
    magic, version, entries, rec, flags, ring, data_off, data_size, epoch, _, crc = struct.unpack_from(
        "<8sIIIIQQQQII", mm, 0)
    assert (version, entries, rec, flags, ring) == (3, 16, 64, 0, 192)
    assert data_off == 4096 and data_size == 60 * KIB and crc == zlib.crc32(mm[8:60]) and epoch & 1
    seq = p.send(b"payload")
    rec0 = c.receive(0)
    assert rec0.offset == data_off
    assert struct.unpack_from("<QQ", mm, 64) == (1, 0)                      # published (a hint), reserved
    fields = struct.unpack_from("<QQQQIIII", mm, 192)
    assert fields[:7] == (seq, data_off, 7, 7, zlib.crc32(b"payload"), 0, 0)          # unfenced
    assert fields[7] == zlib.crc32(mm[192:192 + 44], epoch & 0xFFFFFFFF)
    assert struct.unpack_from("<Q", mm, 192 + 56)[0] == (epoch & 0xFFFFFFFF) << 32 | 1
    assert struct.unpack_from("<QQ", mm, 128) == (0, 0)
    c.ack()
    assert struct.unpack_from("<QQ", mm, 128) == (1, 7)                     # acked, tail
    p.close()
    c.close()


# --- records -------------------------------------------------------------------------------

def test_zero_copy_views_and_release_on_ack(mm, pair):
    p, c = pair
    r = p.reserve(5)
    mm[r.offset:r.offset + 5] = b"HELLO"        # stands in for the GPU's DMA
    p.publish(r.offset, r.length)
    rec = c.receive(timeout=1)
    assert rec.view.obj is mm and rec.view == b"HELLO"
    mm[rec.offset] = ord("J")                   # the view is the shared memory, not a copy
    assert rec.tobytes() == b"JELLO"
    c.ack(rec)
    with pytest.raises(ValueError):             # released: the producer may reuse that space now
        rec.view[0]


def test_payload_flipped_after_publish_is_rejected_and_never_delivered(mm, pair):
    p, c = pair
    s0 = p.send(b"A" * 100)
    p.send(b"good")
    mm[c.geometry.data_offset + 42] ^= 0x01
    for _ in range(2):                          # asking again does not turn it into good data
        with pytest.raises(CorruptRecord, match=r"record 0 rejected: the 100-byte payload .* fails its checksum"):
            c.receive(timeout=1)
    assert c.skip() == s0
    assert c.receive(timeout=1).tobytes() == b"good"
    c.ack()
    assert struct.unpack_from("<Q", mm, 136)[0] > 100     # the skipped record's space was freed too


def test_bad_checksum_torn_fields_duplicate_and_out_of_bounds_records(mm, pair):
    p, c = pair
    p.publish(*_reserve_and_fill(p, b"x" * 10), checksum=zlib.crc32(b"x" * 10) ^ 0x8000)
    with pytest.raises(CorruptRecord, match="payload .* fails its checksum") as e:
        c.receive(timeout=1)
    assert e.value.seq == 0
    c.skip()

    p.send(b"torn")                             # seq 1: a field changes after the commit
    mm[192 + 64 + 16] ^= 0x04
    with pytest.raises(CorruptRecord, match="record 1 rejected: its fields fail their checksum"):
        c.receive(timeout=1)
    c.skip()

    p.send(b"two")
    p.send(b"three")                            # seq 3's slot gets seq 2's (valid) fields: a duplicate
    mm[192 + 3 * 64:192 + 3 * 64 + 48] = mm[192 + 2 * 64:192 + 2 * 64 + 48]
    assert c.receive(timeout=1).tobytes() == b"two"
    with pytest.raises(CorruptRecord, match="record 3 rejected: its slot holds seq 2"):
        c.receive(timeout=1)
    c.skip()

    geo = c.geometry                            # seq 4: self-consistent fields pointing past the data area
    bad_off = geo.data_offset + geo.data_size - 10
    slot = 192 + 4 * 64
    mm[slot:slot + 48] = channel._record_bytes(geo.epoch, 4, bad_off, 100, 10 ** 6, 0)
    struct.pack_into("<Q", mm, slot + 56, channel._marker(geo.epoch, 4))
    with pytest.raises(CorruptRecord, match="record 4 rejected: payload .* is outside"):
        c.receive(timeout=1)
    assert c.skip() == 4
    with pytest.raises(ChannelError, match="no rejected record"):
        c.skip()


def test_record_pointing_at_unreleased_data_is_rejected(mm, pair):
    p, c = pair
    p.send(b"first")
    first = c.receive(0)                        # not acked: its bytes are still in use
    geo = c.geometry
    slot = 192 + 64                             # seq 1 claims seq 0's bytes, with self-consistent fields
    mm[slot:slot + 48] = channel._record_bytes(geo.epoch, 1, first.offset, 5, 5, zlib.crc32(b"first"))
    struct.pack_into("<Q", mm, slot + 56, channel._marker(geo.epoch, 1))
    with pytest.raises(CorruptRecord, match="record 1 rejected: payload .* outside the free part"):
        c.receive(0)


def _reserve_and_fill(p, data):
    r = p.reserve(len(data))
    r.view[:] = data
    return r.offset, r.length


def test_receive_timeout_expect_and_recreated_channel(mm, pair):
    p, c = pair
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout, match=r"no record 0 within 0.05s \(the producer has published 0 records; "
                                               r"the consumer polled shared memory\)") \
            as e:
        c.receive(timeout=0.05)
    assert isinstance(e.value, TimeoutError) and time.monotonic() - t0 >= 0.05
    p.send(b"a")
    with pytest.raises(ChannelError, match="told that record 1 is ready, but the next record in order is 0"):
        c.receive(timeout=0, expect=1)
    assert c.receive(timeout=0, expect=0).tobytes() == b"a"
    Producer.create(mm, coherence=COHERENT, ring_entries=16).close()   # re-created under the consumer
    with pytest.raises(ChannelTimeout, match="re-created the channel"):
        c.receive(timeout=0)


def test_notification_hook_and_wait_for(mm):
    told = []
    with Producer.create(mm, coherence=COHERENT, ring_entries=8, on_publish=lambda *a: told.append(a)) as p, \
            Consumer.open(mm, coherence=COHERENT) as c:
        for word in (b"zero", b"one", b"two"):
            p.send(word)
        assert [t[0] for t in told] == [0, 1, 2] and told[1][2] == 3
        seq, offset, length = told[2]
        c.wait_for(seq, timeout=0)              # committed: returns at once
        with pytest.raises(ChannelTimeout, match="no record 3 within 0s"):
            c.wait_for(3, timeout=0)
        with pytest.raises(ChannelError, match="record 8 cannot be published before records up to 0 are acked"):
            c.wait_for(8, timeout=0)
        got = [c.receive(0, expect=s) for s, _, _ in told]
        assert (got[2].offset, got[2].length, got[2].tobytes()) == (offset, length, b"two")


def test_ring_full_back_pressure(mm):
    with Producer.create(mm, coherence=COHERENT, ring_entries=4) as p, Consumer.open(mm, coherence=COHERENT) as c:
        for i in range(4):
            p.send(b"%d" % i)
        with pytest.raises(ChannelFull, match="all 4 ring records are in use .*acked up to seq 0"):
            p.send(b"x", timeout=0)
        c.receive(0)
        with pytest.raises(ChannelFull):       # received is not enough: space comes back with the ack
            p.send(b"x", timeout=0)
        c.ack()
        assert p.send(b"x", timeout=0) == 4


def test_a_payload_filling_the_whole_data_area_blocks_the_next_byte(tmp_path):
    _, m = shared_file(tmp_path, 4096 + 8 * KIB)
    with Producer.create(m, coherence=COHERENT, ring_entries=16) as p, Consumer.open(m, coherence=COHERENT) as c:
        full = bytes(range(256)) * 32
        p.send(full, timeout=0)
        with pytest.raises(ChannelFull, match="no room for 1 bytes"):
            p.send(b"x", timeout=0)
        assert c.receive(0).view == full
        c.ack()
        assert p.send(b"x", timeout=0) == 1
    m.close()


def test_data_area_back_pressure_and_wrap(tmp_path):
    _, m = shared_file(tmp_path, 4096 + 8 * KIB)    # data area: 8 KiB
    with Producer.create(m, coherence=COHERENT, ring_entries=16) as p, Consumer.open(m, coherence=COHERENT) as c:
        base = p.geometry.data_offset
        first = p.reserve(5000)
        assert first.offset == base
        p.publish(first.offset, first.length)
        t0 = time.monotonic()
        with pytest.raises(ChannelFull, match=r"after 0.05s: the data area has no room for 5000 bytes"):
            p.reserve(5000, timeout=0.05)
        assert time.monotonic() - t0 >= 0.05
        with pytest.raises(ChannelError, match="can never fit the 8192-byte data area"):
            p.reserve(8193)
        with pytest.raises(ValueError):
            p.reserve(10, align=3)
        c.receive(0)
        c.ack()
        second = p.reserve(3000, timeout=0)
        assert second.offset == base + 5056     # after the first payload, 64-byte aligned
        third = p.reserve(4000, align=1024, timeout=0)
        assert third.offset == base             # does not fit before the end: wraps to the start
        with pytest.raises(ChannelError, match="does not match the oldest reservation"):
            p.publish(third.offset, third.length)
        p.publish(second.offset, second.length)
        p.publish(third.offset, third.length)
        assert [r.seq for r in (c.receive(0), c.receive(0))] == [1, 2]
    m.close()


def test_consumer_and_producer_resume_after_reopen(mm, pair):
    p, c = pair
    for i in range(3):
        p.send(b"r%d" % i)
    c.ack(c.receive(0))
    c.receive(0)                                # received but not acked: delivered again after a reopen
    c.close()
    p.close()
    with Consumer.open(mm, coherence=COHERENT) as c2, Producer.attach(mm, coherence=COHERENT) as p2:
        assert p2.next_seq == 3 and c2.next_seq == 1
        assert c2.receive(0).tobytes() == b"r1"
        assert p2.send(b"r3") == 3
        assert [c2.receive(0).tobytes() for _ in range(2)] == [b"r2", b"r3"]


class Recording(channel.Coherence):
    """Records each cache operation with the commit word of slot 0 at that moment (coherent memory)."""

    def __init__(self, mm):
        self.mm, self.ops = mm, []

    def _log(self, op, offset=None, length=None):
        self.ops.append((op, offset, length, struct.unpack_from("<Q", self.mm, 192 + 56)[0]))

    def flush(self, view, offset, length):
        self._log("flush", offset, length)

    def invalidate(self, view, offset, length):
        self._log("invalidate", offset, length)

    def fence(self):
        self._log("fence")


def test_ordering_payload_then_fields_then_commit_each_written_back_and_fenced(mm):
    rec = Recording(mm)
    p = Producer.create(mm, coherence=rec, ring_entries=16)
    c = Consumer.open(mm, coherence=rec)
    r = p.reserve(100)
    assert rec.ops[-2:] == [("flush", r.offset, 100, 0), ("fence", None, None, 0)]   # before a DMA fills it
    r.view[:] = bytes(range(100))
    rec.ops.clear()
    p.publish(r.offset, r.length)
    marker = channel._marker(p.geometry.epoch, 0)
    assert [op[:3] for op in rec.ops] == [
        ("invalidate", r.offset, 100), ("fence", None, None),      # no checksum given: CRC over memory
        ("flush", r.offset, 100), ("fence", None, None),           # the payload
        ("flush", 192 + 56, 8), ("flush", 64, 8), ("fence", None, None)]   # commit word (with the fields' line), hint
    assert [op[3] for op in rec.ops] == [0] * 4 + [marker] * 3      # the commit word is stored after the fence
    rec.ops.clear()
    got = c.receive(0)
    assert [op[:3] for op in rec.ops] == [("invalidate", 192 + 56, 8), ("fence", None, None),
                                          ("invalidate", r.offset, 100), ("fence", None, None)]
    rec.ops.clear()
    c.ack(got)
    assert [op[:3] for op in rec.ops] == [("flush", 128, 16), ("fence", None, None)]
    rec.ops.clear()
    assert p.acked == 1 and [op[:3] for op in rec.ops] == [("invalidate", 128, 16), ("fence", None, None)]
    p.close()
    c.close()


def test_coherence_must_be_chosen_explicitly(mm):
    with pytest.raises(TypeError, match="coherence"):
        Producer.create(mm)                       # pylint: disable=missing-kwoa
    with pytest.raises(ChannelError, match="has no flush/invalidate/fence") as e:
        Producer.create(mm, coherence=None)
    assert "channel.COHERENT" in e.value.fix


def test_module_imports_only_the_standard_library():
    tree = ast.parse(Path(channel.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports: the module must stand alone"
            imported.add(node.module.split(".")[0])
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names
