"""Real cache-line maintenance for the channel on non-coherent shared memory (x86-64, cffi).

CXL 2.0 memory shared between hosts is not coherent between them, so the
channel (``vfio_cxl.guest.channel``) needs its three cache operations to do real
work.  ``x86()`` returns the ``Coherence`` that does:

* ``flush``      -> CLWB over the lines (CLFLUSHOPT if the CPU has no CLWB, else CLFLUSH);
* ``invalidate`` -> CLFLUSHOPT over the lines (CLFLUSH if the CPU has no CLFLUSHOPT);
* ``fence``      -> MFENCE (waits for both, and orders loads as well as stores).

The instructions are a few lines of C (``cacheline.c``, no libc) loaded with
cffi in ABI mode from a shared object built on the host::

    python -m vfio_cxl.guest.cacheline build        # on the host: needs a C compiler (cc)
    python -m vfio_cxl.guest.cacheline info         # what the CPU has (CPUID), where the library is
    python -m vfio_cxl.guest.cacheline bench [--json]   # ns per 64-byte line and per MiB

The object goes to ``vfio_cxl/_native/`` in the checkout (not committed); the
guests have no compiler but see the checkout, so they load the host's build.
In the lab the memory *is* coherent and the stream passes ``channel.COHERENT``
explicitly; ``--coherence x86`` in ``vfio_cxl.guest.cmd.stream`` exercises these
instructions anyway, to measure what real hardware would pay.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..paths import NATIVE_DIR
from .channel import ChannelError, Coherence

__all__ = ["x86", "X86Coherence", "CachelineError", "build", "load", "features", "measure", "library_path"]

SOURCE = Path(__file__).with_name("cacheline.c")
LINE = 64
HAS_CLFLUSH, HAS_CLFLUSHOPT, HAS_CLWB = 1, 2, 4

CDEF = """
int vcxl_features(void);
int vcxl_line_size(void);
void vcxl_clwb(uintptr_t p, size_t n);   /* char * in C: same ABI */
void vcxl_clflushopt(uintptr_t p, size_t n);   /* char * in C: same ABI */
void vcxl_clflush(uintptr_t p, size_t n);   /* char * in C: same ABI */
void vcxl_mfence(void);
void vcxl_sfence(void);
void vcxl_nop(uintptr_t p, size_t n);   /* char * in C: same ABI */
"""


class CachelineError(ChannelError):
    """The cache-line helper cannot be built or loaded here."""


def library_path() -> Path:
    """Where the build of the current ``cacheline.c`` lives (the name carries the source's hash)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return NATIVE_DIR / f"cacheline-{platform.machine()}-{digest}.so"


def build(cc: str | None = None) -> Path:
    """Compile ``cacheline.c`` into a shared object unless it is there already; returns its path."""
    path = library_path()
    if path.exists():
        return path
    if platform.machine() != "x86_64":
        raise CachelineError(f"the cache-line helper is x86-64 code; this machine is {platform.machine()}",
                             "use channel.COHERENT on coherent memory, or port cacheline.c")
    wanted = cc or os.environ.get("CC")
    cc = shutil.which(wanted) if wanted else shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise CachelineError(f"no C compiler to build the cache-line helper ({wanted or 'cc, gcc'} not found)",
                             "install one (apt-get install gcc) on the host and run: "
                             "python -m vfio_cxl.guest.cacheline build")
    NATIVE_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=NATIVE_DIR) as tmp:
        out = Path(tmp) / path.name
        proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-nostdlib", "-o", str(out), str(SOURCE)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise CachelineError(f"{cc} failed to build {SOURCE.name}: {proc.stderr.strip()}",
                                 "check the compiler; the source needs GCC or clang inline assembly")
        os.replace(out, path)                  # atomic: a concurrent loader sees all of it or nothing
    return path


_lib = None


def load(*, build_if_missing: bool = True):
    """The loaded helper (cffi lib object); built first if missing and a compiler is at hand."""
    global _lib
    if _lib is not None:
        return _lib
    import cffi

    path = library_path()
    if not path.exists():
        if not build_if_missing:
            raise CachelineError(f"no built cache-line helper at {path}",
                                 "run `python -m vfio_cxl.guest.cacheline build` on the host (needs a C compiler); "
                                 "guests see the host's build through the shared checkout")
        try:
            build()
        except CachelineError as e:
            raise CachelineError(f"no built cache-line helper at {path}, and it cannot be built here: {e.what}",
                                 "run `python -m vfio_cxl.guest.cacheline build` on the host; guests see the host's "
                                 "build through the shared checkout") from None
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    lib = ffi.dlopen(str(path))
    _lib = (ffi, lib)
    return _lib


def features() -> dict:
    """What this CPU offers (CPUID), as the helper sees it."""
    _, lib = load()
    f = lib.vcxl_features()
    return {"clflush": bool(f & HAS_CLFLUSH), "clflushopt": bool(f & HAS_CLFLUSHOPT),
            "clwb": bool(f & HAS_CLWB), "line_size": lib.vcxl_line_size()}


class X86Coherence(Coherence):
    """The channel's cache operations as x86 instructions (see the module docstring)."""

    def __init__(self):
        ffi, lib = load()
        f = lib.vcxl_features()
        if not f & HAS_CLFLUSH:
            raise CachelineError("this CPU reports no CLFLUSH (CPUID.1:EDX[19])",
                                 "use channel.COHERENT only if the memory is coherent")
        line = lib.vcxl_line_size()
        if line and line != LINE:
            raise CachelineError(f"this CPU's cache line is {line} bytes; the channel's layout assumes {LINE}",
                                 "run on a CPU with 64-byte lines")
        self._ffi = ffi
        self._write_back = lib.vcxl_clwb if f & HAS_CLWB else \
            lib.vcxl_clflushopt if f & HAS_CLFLUSHOPT else lib.vcxl_clflush
        self._drop = lib.vcxl_clflushopt if f & HAS_CLFLUSHOPT else lib.vcxl_clflush
        self._mfence = lib.vcxl_mfence
        names = {lib.vcxl_clwb: "CLWB", lib.vcxl_clflushopt: "CLFLUSHOPT", lib.vcxl_clflush: "CLFLUSH"}
        self.name = f"x86: flush {names[self._write_back]}, invalidate {names[self._drop]}, fence MFENCE"
        self._view = self._base = None

    def _address(self, view, offset: int, length: int) -> int:
        if view is not self._view:              # the channel passes the same view every time
            pointer = self._ffi.from_buffer(view)
            self._base = int(self._ffi.cast("uintptr_t", pointer))
            self._ffi.release(pointer)          # keep no export: the channel must be able to release the view
            self._view = view
        if offset < 0 or offset + length > len(view):
            raise ValueError(f"cache operation on bytes {offset}..{offset + length} of a {len(view)}-byte buffer")
        return self._base + offset

    def flush(self, view, offset, length):
        if length > 0:
            self._write_back(self._address(view, offset, length), length)

    def invalidate(self, view, offset, length):
        if length > 0:
            self._drop(self._address(view, offset, length), length)

    def fence(self):
        self._mfence()


_x86: X86Coherence | None = None


def x86() -> X86Coherence:
    """The x86 cache operations for this process (loads, or builds, the helper once)."""
    global _x86
    if _x86 is None:
        _x86 = X86Coherence()
    return _x86


def measure(size: int = 1 << 20, rounds: int = 20) -> dict:
    """ns per 64-byte line and per ``size`` bytes for each operation (+ fence), on this machine."""
    import mmap
    import zlib

    coh = x86()
    ffi, lib = load()
    buf = mmap.mmap(-1, size)
    view = memoryview(buf)
    lines = size // LINE
    pattern = bytes(range(256)) * (size // 256)

    def timed(prepare, op) -> float:
        best = float("inf")
        for i in range(rounds):
            prepare(i)
            t0 = time.perf_counter_ns()
            op()
            best = min(best, time.perf_counter_ns() - t0)
        return best

    def dirty(i):
        buf[:] = pattern if i % 2 else bytes(size)

    def clean(i):
        dirty(i)
        coh.flush(view, 0, size)
        coh.fence()

    result = {"size": size, "coherence": coh.name, "cpu": features()}
    big = {
        "flush_dirty": timed(dirty, lambda: (coh.flush(view, 0, size), coh.fence())),
        "flush_clean": timed(clean, lambda: (coh.flush(view, 0, size), coh.fence())),
        "invalidate": timed(clean, lambda: (coh.invalidate(view, 0, size), coh.fence())),
        "crc32_warm": timed(clean, lambda: zlib.crc32(view)),
        "crc32_after_invalidate": timed(lambda i: (clean(i), coh.invalidate(view, 0, size), coh.fence()),
                                        lambda: zlib.crc32(view)),
    }
    result["per_size_us"] = {k: v / 1e3 for k, v in big.items()}
    result["per_line_ns_bulk"] = {k: v / lines for k, v in big.items() if not k.startswith("crc")}
    # One line at a time, as the channel does for commit words and counters: a call per line through cffi.
    n = 2000
    base = coh._address(view, 0, size)

    def per_call(fn, with_fence=True) -> float:
        best = float("inf")
        for _ in range(5):
            dirty(1)
            t0 = time.perf_counter_ns()
            for i in range(n):
                fn(base + (i % lines) * LINE, LINE)
                if with_fence:
                    lib.vcxl_mfence()
            best = min(best, (time.perf_counter_ns() - t0) / n)
        return best

    result["per_line_ns_single_call"] = {
        "flush+fence": per_call(coh._write_back), "invalidate+fence": per_call(coh._drop),
        "cffi_call_overhead(nop, no fence)": per_call(lib.vcxl_nop, with_fence=False)}
    view.release()
    buf.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.guest.cacheline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "info", "bench"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build())
            return 0
        if args.command == "info":
            info = {"library": str(library_path()), "built": library_path().exists(), **features(),
                    "coherence": x86().name}
            print(json.dumps(info) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))
            return 0
        r = measure()
    except CachelineError as e:
        print(f"cacheline: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['coherence']}; CPU: {r['cpu']}")
    print(f"{'operation (+ MFENCE)':46} {'per MiB':>12} {'per line':>10}")
    for k, us in r["per_size_us"].items():
        per_line = r["per_line_ns_bulk"].get(k)
        print(f"{k:46} {us:>9.1f} us" + (f" {per_line:>7.2f} ns" if per_line is not None else ""))
    for k, ns in r["per_line_ns_single_call"].items():
        print(f"{'one line per call: ' + k:46} {'':>12} {ns:>7.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
