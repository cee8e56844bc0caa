"""The GPU's compute kernels (docs/gpu-device.md, "Far memory and compute"), in numpy.

A kernel has two outputs: its *result* (the bytes it writes, and a u64 result) and
its *access stream*: the 64-byte lines it touches, in program order, with a
read/write flag and the load/store instruction ("pc") that issued each one.  The
device uses the stream to count far accesses, to run the SR prefetcher and the DS
backlog, and (uvm) to walk the page table; the numpy arrays compute the bytes.

Lines are device addresses // 64; consecutive accesses of one instruction to the
same line are merged (one request per line, as a coalescing load unit does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .regs import LINE_SIZE, Kernel

U64, U32 = np.dtype("<u8"), np.dtype("<u4")
UNREACHED = 0xFFFFFFFF
MAX_ELEMENTS = 1 << 32  # n, aux: 32-bit indices
MAX_GEMV_N = 1 << 14  # GEMV: W of at most 2 GiB


class KernelError(Exception):
    """Bad parameters or data (an index out of its table): status BAD_KERNEL, ``detail`` in ERR_ADDR."""

    def __init__(self, why: str, detail: int = 0):
        self.detail = detail
        super().__init__(why)


@dataclass(frozen=True)
class Operand:
    name: str
    addr: int  # device address
    size: int  # bytes
    writes: bool = False


@dataclass
class KernelRun:
    result: int = 0
    outputs: list = field(default_factory=list)  # (device address, np.ndarray) to store
    lines: np.ndarray = None  # int64 line numbers, program order
    is_write: np.ndarray = None  # bool
    pcs: np.ndarray = None  # int8


def operands(kernel: int, n: int, a: int, b: int, idx: int, aux: int, arg: int) -> list[Operand]:
    """The memory a kernel touches; KernelError if the parameters are not sensible."""
    if kernel not in Kernel._value2member_map_:
        raise KernelError(f"unknown kernel {kernel}: one of "
                          + ", ".join(f"{k.value} {k.name}" for k in Kernel), kernel)
    k = Kernel(kernel)
    if not 0 < n < MAX_ELEMENTS:
        raise KernelError(f"{k.name}: n = {n} must be in [1, 2**32)", n)
    if k in (Kernel.GATHER, Kernel.SCATTER, Kernel.BFS) and not 0 < aux < MAX_ELEMENTS:
        raise KernelError(f"{k.name}: aux = {aux} must be in [1, 2**32)", aux)
    if k is Kernel.STREAM:
        return [Operand("a", a, 8 * n)]
    if k in (Kernel.COPY, Kernel.STENCIL):
        return [Operand("a", a, 8 * n), Operand("b", b, 8 * n, True)]
    if k is Kernel.GATHER:
        return [Operand("idx", idx, 4 * n), Operand("a", a, 8 * aux), Operand("b", b, 8 * n, True)]
    if k is Kernel.SCATTER:
        return [Operand("idx", idx, 4 * n), Operand("a", a, 8 * aux, True)]
    if k is Kernel.GEMV:
        if not 0 < arg < MAX_ELEMENTS:
            raise KernelError(f"GEMV: arg = {arg} tokens must be in [1, 2**32)", arg)
        if n > MAX_GEMV_N:
            raise KernelError(f"GEMV: n = {n} is above {MAX_GEMV_N} (W is n x n u64)", n)
        return [Operand("a", a, 8 * n * n), Operand("idx", idx, 8 * n), Operand("b", b, 8 * n, True)]
    if arg >= n:
        raise KernelError(f"BFS: source vertex {arg} is not below n = {n}", arg)
    return [Operand("a", a, 8 * (n + 1)), Operand("idx", idx, 4 * aux), Operand("b", b, 4 * n, True)]


def _seq_lines(addr: int, nbytes: int) -> np.ndarray:
    return np.arange(addr // LINE_SIZE, (addr + nbytes - 1) // LINE_SIZE + 1, dtype=np.int64)


def _merge(parts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Interleave per-instruction streams by program position: parts are
    (lines, key, is_write, pc) with ``key`` the element index each access belongs to."""
    lines = np.concatenate([p[0] for p in parts])
    keys = np.concatenate([p[1] for p in parts]).astype(np.float64)
    writes = np.concatenate([np.full(len(p[0]), p[2]) for p in parts])
    pcs = np.concatenate([np.full(len(p[0]), p[3], dtype=np.int8) for p in parts])
    order = np.argsort(keys, kind="stable")
    return lines[order], writes[order], pcs[order]


def _seq(addr: int, elem: int, n: int, write: bool, pc: int, after: float = 0.0):
    """Sequential accesses to n elements of ``elem`` bytes at ``addr``, one per line;
    each line keyed by the element that first touches it (+ ``after`` to order ties)."""
    lines = _seq_lines(addr, elem * n)
    first_byte = np.maximum(lines * LINE_SIZE, addr) - addr
    key = first_byte // elem + after
    if write:  # a store line is complete once its last element is written
        last_byte = np.minimum((lines + 1) * LINE_SIZE, addr + elem * n) - 1 - addr
        key = last_byte // elem + after
    return lines, key, write, pc


def coalesce(lines: np.ndarray, is_write: np.ndarray, pcs: np.ndarray):
    """Drop an access that repeats the previous access of the same instruction (same line)."""
    keep = np.ones(len(lines), dtype=bool)
    for p in np.unique(pcs):
        g = np.flatnonzero(pcs == p)
        if len(g) > 1:
            keep[g[1:][lines[g[1:]] == lines[g[:-1]]]] = False
    return lines[keep], is_write[keep], pcs[keep]


def _per_element(addrs: np.ndarray, key: np.ndarray, write: bool, pc: int):
    return (np.asarray(addrs, dtype=np.int64) // LINE_SIZE, key, write, pc)


def run(kernel: int, n: int, a: int, b: int, idx: int, aux: int, arg: int,
        load: Callable[[int, int], np.ndarray]) -> KernelRun:
    """Execute a kernel; ``load(addr, nbytes)`` returns the bytes at a device address."""
    k = Kernel(kernel)
    out = KernelRun()
    if k is Kernel.STREAM:
        x = load(a, 8 * n).view(U64)
        out.result = int(x.sum(dtype=np.uint64))
        lines = _seq_lines(a, 8 * n)
        out.lines, out.is_write, out.pcs = lines, np.zeros(len(lines), bool), np.zeros(len(lines), np.int8)
        return out
    if k in (Kernel.COPY, Kernel.STENCIL):
        x = load(a, 8 * n).view(U64)
        if k is Kernel.COPY:
            y = x.copy()
        else:
            y = x.copy()
            y[1:] += x[:-1]
            y[:-1] += x[1:]
        out.result = n
        out.outputs = [(b, y)]
        # the stencil's extra reads (a[i-1], a[i+1]) fall in lines the instruction already read
        out.lines, out.is_write, out.pcs = _merge([_seq(a, 8, n, False, 0, 0.0),
                                                   _seq(b, 8, n, True, 1, 0.5)])
        return out
    if k in (Kernel.GATHER, Kernel.SCATTER):
        ix = load(idx, 4 * n).view(U32).astype(np.int64)
        bad = np.flatnonzero(ix >= aux)
        if len(bad):
            raise KernelError(f"{k.name}: idx[{bad[0]}] = {ix[bad[0]]} is not below the table's "
                              f"{aux} elements", int(bad[0]))
        table = load(a, 8 * aux).view(U64)
        i = np.arange(n, dtype=np.float64)
        idx_part = _seq(idx, 4, n, False, 0, 0.0)
        data_addr = a + 8 * ix
        if k is Kernel.GATHER:
            out.outputs = [(b, table[ix])]
            out.result = n
            parts = [idx_part, _per_element(data_addr, i + 0.25, False, 1), _seq(b, 8, n, True, 2, 0.5)]
        else:
            table = table.copy()
            np.add.at(table, ix, np.uint64(1))
            out.outputs = [(a, table)]
            out.result = n
            parts = [idx_part, _per_element(data_addr, i + 0.25, False, 1),
                     _per_element(data_addr, i + 0.5, True, 2)]
        out.lines, out.is_write, out.pcs = coalesce(*_merge(parts))
        return out
    if k is Kernel.GEMV:
        return _gemv(n, a, b, idx, arg, load)
    # BFS over CSR
    row = load(a, 8 * (n + 1)).view(U64)
    down = np.flatnonzero(row[1:] < row[:-1])   # compared as u64
    if row[0] != 0 or len(down) or row[-1] > aux:
        # detail: the position of the first entry that breaks the rule
        pos = 0 if row[0] != 0 else int(down[0]) + 1 if len(down) else n
        raise KernelError(f"BFS: row_ptr[{pos}] = {row[pos]}: row_ptr must start at 0, not decrease "
                          f"and end at most at aux = {aux}", pos)
    row = row.astype(np.int64)   # every entry <= aux < 2**32 now
    col = load(idx, 4 * aux).view(U32).astype(np.int64)
    bad = np.flatnonzero(col[:row[-1]] >= n)
    if len(bad):
        raise KernelError(f"BFS: column[{bad[0]}] = {col[bad[0]]} is not a vertex (n = {n})", int(bad[0]))
    level = np.full(n, UNREACHED, dtype=U32)
    level[arg] = 0
    frontier = np.array([arg], dtype=np.int64)
    parts, depth, t = [], 0, 0.0
    while len(frontier):
        starts, ends = row[frontier], row[frontier + 1]
        counts = ends - starts
        owner = np.repeat(np.arange(len(frontier)), counts)
        edge = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        nbrs = col[edge]
        vkey = t + np.arange(len(frontier), dtype=np.float64)
        parts.append(_per_element(a + 8 * frontier, vkey, False, 0))
        ekey = t + owner + 0.5
        parts.append(_per_element(idx + 4 * edge, ekey, False, 1))
        parts.append(_per_element(b + 4 * nbrs, ekey, False, 2))
        new = np.unique(nbrs[level[nbrs] == UNREACHED])
        depth += 1
        level[new] = depth
        t += len(frontier)
        parts.append(_per_element(b + 4 * new, np.full(len(new), t - 0.25), True, 3))
        frontier = new
    out.outputs = [(b, level)]
    out.result = int(np.count_nonzero(level != UNREACHED))
    out.lines, out.is_write, out.pcs = coalesce(*_merge(parts))
    return out


def _gemv(n: int, a: int, b: int, idx: int, tokens: int, load) -> KernelRun:
    """LLM decoding: per token, y = W x (mod 2**64); x_0 = x at ``idx``, x_(t+1) = y.

    Access stream per token: x_t read whole first (from ``idx``, later from ``b``: it fits
    on chip), then W row by row, y[i] written once row i is done.  W, larger than VRAM
    in the bench, is read in full once per token: a cyclic pattern."""
    w = load(a, 8 * n * n).view(U64).reshape(n, n)
    x = load(idx, 8 * n).view(U64).copy()
    for _ in range(tokens):
        x = w @ x   # uint64 arithmetic wraps mod 2**64
    out = KernelRun(result=int(x.sum(dtype=np.uint64)), outputs=[(b, x)])
    parts = []
    for t in range(tokens):
        base = t * (n + 2.0)
        xl = _seq_lines(idx if t == 0 else b, 8 * n)
        parts.append((xl, np.full(len(xl), base), False, 0))
        wl, wkey, _, _ = _seq(a, 8, n * n, False, 1)
        parts.append((wl, base + 1 + wkey // n, False, 1))
        yl, ykey, _, _ = _seq(b, 8, n, True, 2)
        parts.append((yl, base + 1 + ykey + 0.5, True, 2))
    out.lines, out.is_write, out.pcs = _merge(parts)
    return out
