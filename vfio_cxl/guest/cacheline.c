/* Cache-line maintenance for memory shared between hosts without hardware coherence (x86-64).
 *
 * Loaded by vfio_cxl/cacheline.py through cffi (ABI mode), built on the host by
 * `python -m vfio_cxl.cacheline build`.  No libc: the guests load the same file.
 *
 * Each function walks the 64-byte lines that overlap [p, p + n).  CLWB and
 * CLFLUSHOPT are weakly ordered: only a fence (MFENCE here) waits for them.
 */
#include <cpuid.h>
#include <stddef.h>
#include <stdint.h>

#define LINE 64

enum { HAS_CLFLUSH = 1, HAS_CLFLUSHOPT = 2, HAS_CLWB = 4 };

/* CPUID.1:EDX[19] CLFSH, CPUID.(7,0):EBX[23] CLFLUSHOPT, EBX[24] CLWB. */
int vcxl_features(void)
{
    unsigned a, b, c, d;
    int f = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) && (d & (1u << 19)))
        f |= HAS_CLFLUSH;
    if (__get_cpuid_max(0, 0) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        if (b & (1u << 23))
            f |= HAS_CLFLUSHOPT;
        if (b & (1u << 24))
            f |= HAS_CLWB;
    }
    return f;
}

/* CPUID.1:EBX[15:8]: the CLFLUSH line size in 8-byte units. */
int vcxl_line_size(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    return (int)((b >> 8) & 0xff) * 8;
}

#define WALK(insn)                                                                 \
    do {                                                                           \
        char *q = (char *)((uintptr_t)p & ~(uintptr_t)(LINE - 1));                 \
        for (; q < p + n; q += LINE)                                               \
            __asm__ volatile(insn " %0" : "+m"(*(volatile char *)q));              \
    } while (0)

/* Write modified lines back, keeping them cached (may invalidate on older CPUs). */
void vcxl_clwb(char *p, size_t n) { WALK("clwb"); }

/* Write modified lines back and invalidate them; weakly ordered. */
void vcxl_clflushopt(char *p, size_t n) { WALK("clflushopt"); }

/* Write modified lines back and invalidate them; ordered with stores, not with loads. */
void vcxl_clflush(char *p, size_t n) { WALK("clflush"); }

void vcxl_mfence(void) { __asm__ volatile("mfence" ::: "memory"); }

void vcxl_sfence(void) { __asm__ volatile("sfence" ::: "memory"); }

/* For measuring the cost of a call through cffi itself. */
void vcxl_nop(char *p, size_t n) { (void)p; (void)n; }
