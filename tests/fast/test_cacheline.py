"""The real x86 cache operations (vfio_cxl.guest.cacheline): built, loaded through cffi, run under the channel."""

import mmap
import platform
import shutil
import random
import zlib
from pathlib import Path

import pytest

from vfio_cxl.guest import cacheline
from vfio_cxl.guest.cacheline import CachelineError
from vfio_cxl.guest.channel import Consumer, Producer

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instructions")
needs_helper = pytest.mark.skipif(not (cacheline.library_path().exists() or shutil.which("cc")),
                                  reason="no C compiler to build the helper, and no build of it")


def cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@needs_helper
def test_cpuid_agrees_with_the_kernel_and_the_choice_follows_it():
    f = cacheline.features()
    flags = cpuinfo_flags()
    assert (f["clflush"], f["clflushopt"], f["clwb"]) == ("clflush" in flags, "clflushopt" in flags,
                                                          "clwb" in flags)
    assert f["line_size"] == 64
    name = cacheline.x86().name
    assert name.startswith("x86: flush " + ("CLWB" if f["clwb"] else "CLFLUSHOPT" if f["clflushopt"] else "CLFLUSH"))
    assert name.endswith("fence MFENCE")


@needs_helper
def test_operations_cover_the_first_and_last_line_of_a_mapping_without_faulting():
    coh = cacheline.x86()
    with mmap.mmap(-1, 2 * mmap.PAGESIZE) as m:
        view = memoryview(m)
        view[:] = bytes(range(256)) * (len(view) // 256)
        for offset, length in [(0, 1), (63, 2), (len(view) - 1, 1), (0, len(view)), (100, 0)]:
            coh.flush(view, offset, length)
            coh.invalidate(view, offset, length)
        coh.fence()
        assert view[:256] == bytes(range(256))           # write-back and invalidation keep the data
        with pytest.raises(ValueError, match="bytes 8192..8193 of a 8192-byte buffer"):
            coh.flush(view, len(view), 1)                # never past the buffer
        view.release()                                   # the operations keep no export of it


@needs_helper
def test_channel_streams_with_the_real_instructions():
    coh = cacheline.x86()
    rng = random.Random(3)
    with mmap.mmap(-1, 4096 + 64 * 1024) as m:
        p = Producer.create(m, coherence=coh, ring_entries=16)
        c = Consumer.open(m, coherence=coh)
        sent = []
        for i in range(300):
            data = rng.randbytes(rng.choice([0, 1, 100, 5000, 20000]))
            p.send(data, timeout=0)
            sent.append(zlib.crc32(data))
            rec = c.receive(timeout=0)
            assert (rec.seq, zlib.crc32(rec.view)) == (i, sent[-1])
            c.ack(rec)
        assert c.published == 300 and p.acked == 300
        p.close()
        c.close()


def test_missing_helper_without_a_compiler_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(cacheline, "NATIVE_DIR", tmp_path / "native")
    monkeypatch.setattr(cacheline, "_lib", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(CachelineError, match="no built cache-line helper at .*cannot be built here.*no-such-cc "
                                             "not found") as e:
        cacheline.load()
    assert "python -m vfio_cxl.guest.cacheline build" in e.value.fix
    with pytest.raises(CachelineError, match="no built cache-line helper") as e:
        cacheline.load(build_if_missing=False)
    assert not list(tmp_path.glob("native/*.so")) and not list(tmp_path.glob("native/tmp*"))   # nothing half-built
