"""The host's TSC frequency, so a guest kernel need not calibrate its own.

Under TCG a guest's RDTSC reads the host's TSC (QEMU's ``cpu_get_ticks()`` is
the host's tick counter while the VM runs), so the guest TSC runs at the host
TSC's frequency.  A guest kernel that is not told that frequency calibrates it
at boot against the emulated PIT, fails ("Fast TSC calibration failed",
"Unable to calibrate against PIT": the emulated timer is too jittery), falls
back to HPET, and each secondary CPU, lacking an invariant-TSC flag (TCG does
not offer ``invtsc``), calibrates its delay loop as well.  Measured on a
2-core TCG host: ~0.4 s of a 4.4 s boot.  With ``tsc_early_khz=`` and ``lpj=``
on the command line the kernel skips both; its delayed "refined TSC
calibration" still runs a second later and corrects a value off by a little.

The frequency is measured here: RDTSC against CLOCK_MONOTONIC, the median of
3 x 40 ms (within 0.01 % of the host kernel's own figure on the lab machine).
RDTSC is one instruction Python cannot issue, so it runs from a 10-byte
function in an executable anonymous page (as py-cpuinfo runs CPUID).  Where
that is not possible (not x86-64, W^X policy), the guest calibrates as before.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform
import time

# rdtsc; shl rdx, 32; or rax, rdx; ret   -- the 64-bit counter in rax
_RDTSC = bytes([0x0F, 0x31, 0x48, 0xC1, 0xE2, 0x20, 0x48, 0x09, 0xD0, 0xC3])
SAMPLE_SECONDS = 0.04
SAMPLES = 3
# Each TSC read is bracketed by clock reads; a bracket wider than this (the thread was
# preempted) would skew the figure, and the guest keeps a value more than 1 % off.
MAX_BRACKET_NS = 20_000


@functools.cache
def host_tsc_khz() -> int | None:
    """The host TSC frequency in kHz, or None where it cannot be read."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, AttributeError):   # an executable mapping refused
        return None
    try:
        page.write(_RDTSC)
        rdtsc = ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(ctypes.c_char.from_buffer(page)))

        def stamp() -> tuple[int, int, int]:
            """A TSC read bracketed by two clock reads (after a warm-up read: the first
            call after a sleep takes ~20 us, cold caches)."""
            rdtsc()
            before = time.monotonic_ns()
            tsc = rdtsc()
            return tsc, before, time.monotonic_ns()

        rates = []
        for _ in range(SAMPLES * 4):
            if len(rates) == SAMPLES:
                break
            c0, t0, t1 = stamp()
            time.sleep(SAMPLE_SECONDS)
            c1, t2, t3 = stamp()
            if max(t1 - t0, t3 - t2) <= MAX_BRACKET_NS:   # not preempted between the reads
                rates.append((c1 - c0) * 1e6 / (((t2 + t3) - (t0 + t1)) / 2))
        del rdtsc
    finally:
        try:
            page.close()
        except BufferError:   # a ctypes view still alive: the page goes with the process
            pass
    if len(rates) < SAMPLES:   # preempted again and again: let the guest calibrate
        return None
    khz = round(sorted(rates)[len(rates) // 2])
    return khz if khz > 100_000 else None


def boot_arguments(khz: int | None, hz: int | None) -> str:
    """The kernel command line that skips the guest's TSC and delay-loop calibration.

    ``hz`` is the guest kernel's CONFIG_HZ (None: unknown, then its delay loop is calibrated)."""
    if not khz:
        return ""
    # x86 delays use the TSC once it is known, so lpj (loops per jiffy) only spares the
    # secondary CPUs' delay-loop calibration (and sets their BogoMIPS figure).
    return f"tsc_early_khz={khz}" + (f" lpj={khz * 1000 // hz}" if hz else "")
