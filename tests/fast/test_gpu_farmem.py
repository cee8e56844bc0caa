"""Interface 1.1 against the device (no QEMU): the far window, the compute kernels in
every memory mode, DS + FLUSH, the UVM fault path with the test as the driver, and
the bad cases (docs/gpu-device.md, "Far memory and compute").

The far window is a memfd that is not sealed, mapped with its fd: the server
reaches it with pread/pwrite, as it reaches the CXL memory backend file in a lab.
"""

import gc
import os
import threading
import time

import numpy as np
import pytest

from vfio_user_client import Rig, gpu_server, wait_eventfd  # noqa: F401

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.gpu.regs import DESC_FLAG_INTERRUPT as IRQ, Kernel, Op, Status, pack_descriptor
from vfio_cxl.devices.vfio_user import wire

FAR_IOVA = 0x4000_0000
FAR_SIZE = 8 * regs.MIB
PARAMS_IOVA = 0x3000_0000
FAULTS_IOVA = 0x3001_0000
FAR = regs.FAR_DEVADDR
TIMEOUT = 10


class FarRig:
    def __init__(self, srv, *, far_flags_writable=True, map_far=True, far_direct=True):
        self.rig = Rig(srv, direct=True, entries=16)
        self.c = self.rig.client
        mem = self.rig.memory
        self.far = mem.add(FAR_IOVA, FAR_SIZE, shared=True, writable=far_flags_writable)
        self.params = mem.add(PARAMS_IOVA, 4096, shared=True)
        self.faults = mem.add(FAULTS_IOVA, 4096, shared=True)
        if map_far:
            self.c.map_area(self.far, direct=far_direct)
        self.c.map_area(self.params)
        self.c.map_area(self.faults)
        self.program_far()
        self.far_np = np.frombuffer(self.far.view, dtype=np.uint8)

    def program_far(self):
        """The far window and the fault buffer (a reset clears them, as every 1.1 register)."""
        for reg, value in ((regs.REG_FAR_BASE_LO, FAR_IOVA), (regs.REG_FAR_BASE_HI, 0),
                           (regs.REG_FAR_SIZE_LO, FAR_SIZE), (regs.REG_FAR_SIZE_HI, 0),
                           (regs.REG_FAULT_BASE_LO, FAULTS_IOVA), (regs.REG_FAULT_ENTRIES, 64)):
            self.c.reg_write(reg, value)

    def reset(self):
        self.rig.program()
        self.program_far()

    def u64(self, off, n):
        return self.far_np[off:off + 8 * n].view(np.uint64)

    def u32(self, off, n):
        return self.far_np[off:off + 4 * n].view(np.uint32)

    def mode(self, name, profile="cxl-80ns"):
        self.c.reg_write(regs.REG_MEM_MODE, regs.MODES[name])
        self.c.reg_write(regs.REG_LATENCY_PROFILE, regs.LATENCY_PROFILES.index(profile))

    def counters(self):
        out = {}
        for i, name in enumerate(regs.COUNTERS):
            lo = self.c.reg_read(regs.REG_COUNTERS + 8 * i)
            hi = self.c.reg_read(regs.REG_COUNTERS + 8 * i + 4)
            out[name] = lo | hi << 32
        return out

    def clear(self):
        self.c.reg_write(regs.REG_COUNTER_CONTROL, regs.COUNTERS_CLEAR)

    def launch(self, kernel, n, a=0, b=0, idx=0, aux=0, arg=0):
        self.params.view[:64] = regs.pack_kernel(kernel, n, a, b, idx, aux, arg)
        (i,) = self.rig.submit([pack_descriptor(Op.COMPUTE, PARAMS_IOVA, 0, regs.KERNEL_PARAMS.size,
                                                IRQ, cookie=kernel)])
        return i

    def finish(self, i, timeout=TIMEOUT):
        self.rig.wait_head((i + 1) % 16, timeout)
        rec = self.rig.completion(i)
        assert rec["status"] == Status.OK, rec
        return int.from_bytes(self.params.view[regs.KERNEL_RESULT_OFFSET:64], "little")

    def run(self, *args, **kw):
        return self.finish(self.launch(*args, **kw))

    def failed(self, i):
        assert wait_eventfd(self.rig.efds[regs.VEC_ERROR], TIMEOUT)
        return (Status(self.c.reg_read(regs.REG_ERR_STATUS)),
                self.c.reg_read(regs.REG_ERR_ADDR_LO) | self.c.reg_read(regs.REG_ERR_ADDR_HI) << 32)

    def close(self):
        del self.far_np   # numpy views pin the memfd mapping
        gc.collect()
        self.rig.close()


@pytest.fixture
def far(gpu_server):
    r = FarRig(gpu_server)
    yield r
    r.close()


def fill(r, off, n, seed, top=60):
    x = np.random.default_rng(seed).integers(0, 1 << top, size=n, dtype=np.uint64)
    r.u64(off, n)[:] = x
    return x


CXL_MODES = ["cxl", "cxl+sr", "cxl+ds", "cxl+sr+ds"]


def test_version_and_caps_announce_interface_1_1(far):
    version = far.c.reg_read(regs.REG_VERSION)
    assert version >> 16 == 1 and version & 0xFFFF >= 1   # 1.1 or a later 1.x (the compatibility rule)
    assert far.c.reg_read(regs.REG_CAPS) & 0xFF == 0xFF    # COMPUTE (6) and FLUSH (7) beside the 1.0 ops
    assert far.c.reg_read(regs.REG_CAPS2) == regs.CAPS2


@pytest.mark.parametrize("mode", CXL_MODES)
def test_every_kernel_verifies_in_every_cxl_mode(far, mode):
    far.mode(mode)
    n = 20000
    x = fill(far, 0, n, 1)
    assert far.run(Kernel.STREAM, n, FAR) == int(x.sum(dtype=np.uint64))
    far.run(Kernel.COPY, n, FAR, FAR + (1 << 20))
    far.run(Kernel.STENCIL, n, FAR, FAR + (2 << 20))
    # gather / scatter over a random index
    m = 5000
    table = fill(far, 3 << 20, m, 2)
    ix = np.random.default_rng(3).integers(0, m, size=n, dtype=np.uint32)
    far.u32(4 << 20, n)[:] = ix
    far.run(Kernel.GATHER, n, FAR + (3 << 20), FAR + (5 << 20), FAR + (4 << 20), m)
    far.run(Kernel.SCATTER, n, FAR + (3 << 20), 0, FAR + (4 << 20), m)
    # a BFS over a ring-with-chords graph
    nv = 1000
    nbrs = [sorted({(v + 1) % nv, (v - 1) % nv, (v * 7) % nv}) for v in range(nv)]
    row = np.cumsum([0] + [len(e) for e in nbrs]).astype(np.uint64)
    col = np.array([u for e in nbrs for u in e], dtype=np.uint32)
    far.u64(6 << 20, nv + 1)[:] = row
    far.u32(6 << 20 | 1 << 16, len(col))[:] = col
    reached = far.run(Kernel.BFS, nv, FAR + (6 << 20), FAR + (7 << 20), FAR + (6 << 20 | 1 << 16),
                      len(col), 0)
    far.run(Kernel.STREAM, 1, FAR)  # flushes whatever DS kept staged
    assert (far.u64(1 << 20, n) == x).all()
    want = x.copy()
    want[1:] += x[:-1]
    want[:-1] += x[1:]
    assert (far.u64(2 << 20, n) == want).all()
    assert (far.u64(5 << 20, n) == table[ix]).all()
    scattered = table.copy()
    np.add.at(scattered, ix, np.uint64(1))
    assert (far.u64(3 << 20, m) == scattered).all()
    level = far.u32(7 << 20, nv)
    dist = {0: 0}
    frontier = [0]
    while frontier:
        nxt = []
        for v in frontier:
            for u in nbrs[v]:
                if u not in dist:
                    dist[u] = dist[v] + 1
                    nxt.append(u)
        frontier = nxt
    assert reached == len(dist) == nv and list(level) == [dist[v] for v in range(nv)]
    c = far.counters()
    assert c["far_lines_read"] > 0 and c["far_lines_written"] > 0 and c["modelled_ns"] > 0
    if "sr" in mode:
        assert c["sr_hits"] > 0 and c["sr_issued"] >= c["sr_hits"]
    else:
        assert c["sr_issued"] == c["sr_hits"] == 0
    assert (c["ds_staged"] > 0) == ("ds" in mode)


def test_stream_counts_one_read_per_line_and_sr_hides_most(far):
    n = 1 << 17     # 1 MiB
    fill(far, 0, n, 4)
    far.mode("cxl")
    far.clear()
    far.run(Kernel.STREAM, n, FAR)
    plain = far.counters()
    assert plain["far_lines_read"] == n * 8 // 64 and plain["far_lines_written"] == 0
    far.mode("cxl+sr")
    far.clear()
    far.run(Kernel.STREAM, n, FAR)
    sr = far.counters()
    assert sr["sr_hits"] >= 0.9 * plain["far_lines_read"]
    assert sr["far_lines_read"] + sr["sr_hits"] == plain["far_lines_read"]


def test_ds_keeps_the_tail_staged_until_flush(far):
    n = 1 << 16
    x = fill(far, 0, n, 5)
    far.u64(1 << 20, n)[:] = 0
    far.mode("cxl+ds")
    far.clear()
    far.run(Kernel.COPY, n, FAR, FAR + (1 << 20))
    pending = far.c.reg_read(regs.REG_DS_PENDING_LINES)
    assert pending > 0
    out = far.u64(1 << 20, n)
    assert (out != x).sum() > 0, "DS staged lines must not be in the far window before FLUSH"
    assert far.counters()["ds_backlog_hwm"] >= 0
    (i,) = far.rig.submit([pack_descriptor(Op.FLUSH, 0, 0, 0, IRQ, cookie=7)])
    far.rig.wait_head(i + 1)
    rec = far.rig.completion(i)
    assert rec["status"] == Status.OK and rec["bytes_done"] == pending * 64
    assert far.c.reg_read(regs.REG_DS_PENDING_LINES) == 0
    assert (far.u64(1 << 20, n) == x).all()


def test_bad_input_gets_a_clear_status(gpu_server):
    r = FarRig(gpu_server)
    try:
        fill(r, 0, 100, 6)
        r.launch(99, 10, FAR)
        assert r.failed(0) == (Status.BAD_KERNEL, 99)
        r.reset()
        r.launch(Kernel.STREAM, FAR_SIZE // 8 + 1, FAR)    # past the end of the window
        assert r.failed(0)[0] == Status.FAR_RANGE
        r.reset()
        r.u32(1 << 20, 4)[:] = [0, 1, 7, 2]
        r.launch(Kernel.GATHER, 4, FAR, FAR + (2 << 20), FAR + (1 << 20), 5)
        assert r.failed(0) == (Status.BAD_KERNEL, 2)      # idx[2] = 7 is not below 5
        r.reset()
        r.c.reg_write(regs.REG_MEM_MODE, regs.MODE_UVM | regs.MODE_SR)
        r.launch(Kernel.STREAM, 10, FAR)
        assert r.failed(0)[0] == Status.BAD_MODE
    finally:
        r.close()


def test_far_window_not_mapped_or_read_only(gpu_server):
    r = FarRig(gpu_server, map_far=False)
    try:
        r.launch(Kernel.STREAM, 10, FAR)
        assert r.failed(0) == (Status.DMA_UNMAPPED, FAR_IOVA)
    finally:
        r.close()
    gpu_server.wait_idle()
    r = FarRig(gpu_server, far_flags_writable=False)
    try:
        r.mode("cxl")
        assert r.run(Kernel.STREAM, 10, FAR) == 0          # reading is fine
        r.launch(Kernel.COPY, 10, FAR, FAR + 4096)
        assert r.failed(1) == (Status.DMA_PERMISSION, FAR_IOVA + 4096)
    finally:
        r.close()


class UvmDriver(threading.Thread):
    """The test as the UVM driver: LRU over the VRAM slots, migration through the copy engine."""

    def __init__(self, r, slots, page_shift=16, vram_base=1 << 20):
        super().__init__(name="test-uvm-driver", daemon=True)
        self.r, self.c = r, r.c
        self.page = 1 << page_shift
        self.slots = [vram_base + i * self.page for i in range(slots)]
        self.lru = {}        # page -> slot, oldest first
        self.stop = threading.Event()
        self.served = 0
        self.c.reg_write(regs.REG_UVM_PAGE_SHIFT, page_shift)
        self.get = 0
        self.tag = 0

    def migrate(self, src, dst):
        self.c.reg_write(regs.REG_MIG_SRC_LO, src & 0xFFFFFFFF)
        self.c.reg_write(regs.REG_MIG_SRC_HI, src >> 32)
        self.c.reg_write(regs.REG_MIG_DST_LO, dst & 0xFFFFFFFF)
        self.c.reg_write(regs.REG_MIG_DST_HI, dst >> 32)
        self.c.reg_write(regs.REG_MIG_LENGTH, self.page)
        self.tag += 1
        for _ in range(2):   # the second GO repeats the tag: ignored (QEMU under TCG can do this)
            self.c.reg_write(regs.REG_MIG_CONTROL, regs.MIG_GO | self.tag << regs.CMD_TAG_SHIFT)
        while (status := self.c.reg_read(regs.REG_MIG_STATUS)) & regs.MIG_BUSY:
            pass
        assert status == regs.MIG_DONE, hex(status)

    def service(self, addr):
        page = (addr - FAR) // self.page
        if page in self.lru:
            return
        if len(self.lru) == len(self.slots):
            victim, slot = next(iter(self.lru.items()))
            del self.lru[victim]
            self.c.reg_write(regs.REG_PT_INDEX, victim)
            dirty = self.c.reg_read(regs.REG_PT_ENTRY) & regs.PTE_DIRTY
            self.c.reg_write(regs.REG_PT_ENTRY, 0)
            if dirty:
                self.migrate(slot, FAR + victim * self.page)
        else:
            slot = self.slots[len(self.lru)]
        self.migrate(FAR + page * self.page, slot)
        self.c.reg_write(regs.REG_PT_INDEX, page)
        self.c.reg_write(regs.REG_PT_ENTRY, slot | regs.PTE_VALID)
        self.lru[page] = slot

    def run(self):
        efd = self.r.rig.efds[regs.VEC_FAULT]
        while not self.stop.is_set():
            if not wait_eventfd(efd, 0.05):
                continue
            put = self.c.reg_read(regs.REG_FAULT_PUT)
            seq = 0
            while self.get != put:
                addr, flags, seq = regs.FAULT_RECORD.unpack_from(self.r.faults.view, 16 * self.get)
                self.service(addr)
                self.get = (self.get + 1) % 64
                self.served += 1
            self.c.reg_write(regs.REG_FAULT_GET, self.get)
            self.c.reg_write(regs.REG_UVM_CONTROL, regs.UVM_REPLAY | seq << regs.CMD_TAG_SHIFT)
            self.c.reg_write(regs.REG_UVM_CONTROL, regs.UVM_REPLAY | seq << regs.CMD_TAG_SHIFT)  # a repeat: ignored

    def writeback_all(self):
        for page, slot in self.lru.items():
            self.c.reg_write(regs.REG_PT_INDEX, page)
            if self.c.reg_read(regs.REG_PT_ENTRY) & regs.PTE_DIRTY:
                self.migrate(slot, FAR + page * self.page)


def test_uvm_faults_once_per_page_of_a_stream_and_evicts_lru(far):
    n = 1 << 17                         # 1 MiB = 16 pages of 64 KiB; 4 slots
    x = fill(far, 0, n, 7)
    far.mode("uvm")
    far.clear()
    drv = UvmDriver(far, slots=4)
    drv.start()
    try:
        assert far.run(Kernel.STREAM, n, FAR) == int(x.sum(dtype=np.uint64))
        c = far.counters()
        assert c["faults"] == c["migrations"] == 16 and c["evictions"] == 12
        assert drv.served == 16     # a repeated REPLAY did not make the device go on early
        assert c["bytes_migrated"] == 16 * 65536 and c["far_lines_read"] == 0
        assert c["vram_lines"] == n * 8 // 64
        # copy: reads and writes, dirty pages go back on eviction
        far.clear()
        far.run(Kernel.COPY, n, FAR, FAR + (2 << 20))
        c = far.counters()
        assert c["faults"] == 32 and c["evictions"] == 32
        # input and output pages alternate in the 4 slots: 2 output pages stay resident, the
        # other 14 were written while resident and went back to far when evicted
        assert c["bytes_migrated"] == (32 + 14) * 65536
        drv.writeback_all()
        assert (far.u64(2 << 20, n) == x).all()
    finally:
        drv.stop.set()
        drv.join()


def test_uvm_fault_never_serviced_times_out(far):
    far.mode("uvm")
    far.c.reg_write(regs.REG_UVM_FAULT_TIMEOUT_MS, 200)
    far.launch(Kernel.STREAM, 10, FAR)
    assert wait_eventfd(far.rig.efds[regs.VEC_FAULT], TIMEOUT)
    assert far.c.reg_read(regs.REG_UVM_STATUS) == regs.UVM_FAULT_PENDING
    assert far.failed(0) == (Status.FAULT_TIMEOUT, FAR)
    assert far.c.reg_read(regs.REG_UVM_STATUS) == 0


def test_reset_while_a_fault_waits_leaves_nothing_pending(far):
    far.mode("uvm")
    far.launch(Kernel.STREAM, 10, FAR)
    assert wait_eventfd(far.rig.efds[regs.VEC_FAULT], TIMEOUT)
    far.c.reg_write(regs.REG_CONTROL, regs.CONTROL_RESET)
    assert far.c.reg_read(regs.REG_UVM_STATUS) == 0
    assert far.c.reg_read(regs.REG_STATUS) == 0          # IDLE, not busy
    assert far.rig.completion(0)["seq"] == 0              # the op never completed
    assert far.c.reg_read(regs.REG_MEM_MODE) == 0 and far.c.reg_read(regs.REG_FAR_SIZE_LO) == 0


# ---- BAD_KERNEL: ERR_ADDR is the value that was bad (docs/gpu-device.md, "Status codes")
@pytest.mark.parametrize("desc,addr", [
    (pack_descriptor(Op.COMPUTE, PARAMS_IOVA, 0x1000, 0x40), 0x1000),   # dst, not the (good) length
    (pack_descriptor(Op.COMPUTE, PARAMS_IOVA, 0, 0x20), 0x20),
    (pack_descriptor(Op.COMPUTE, PARAMS_IOVA, 0x1000, 0x20), 0x1000),   # both bad: dst first
    (pack_descriptor(Op.FLUSH, 0, 0x2000, 0), 0x2000),
    (pack_descriptor(Op.FLUSH, 7, 0x2000, 64), 7),                      # the first nonzero: src
    (pack_descriptor(Op.FLUSH, 0, 0, 64), 64),
], ids=["compute-dst", "compute-length", "compute-both", "flush-dst", "flush-src", "flush-length"])
def test_bad_kernel_descriptor_reports_the_bad_value(far, desc, addr):
    far.params.view[:64] = regs.pack_kernel(Kernel.STREAM, 10, FAR)
    (i,) = far.rig.submit([desc])
    assert far.failed(i) == (Status.BAD_KERNEL, addr)
    rec = far.rig.completion(i)
    assert (rec["status"], rec["bytes_done"]) == (Status.BAD_KERNEL, 0)


def _bfs_graph(r, row, col):
    r.u64(0, len(row))[:] = row
    r.u32(1 << 20, len(col))[:] = col
    return dict(a=FAR, b=FAR + (2 << 20), idx=FAR + (1 << 20), aux=len(col))


@pytest.mark.parametrize("case", ["reserved", "kernel", "n-zero", "n-too-big", "aux-zero", "bfs-source",
                                  "row0", "row-decreasing", "row-end", "column"])
def test_bad_kernel_parameters_report_the_bad_value_or_position(far, case):
    """A bad parameter: its value; bad data in an index array: the element's position."""
    if case == "reserved":
        far.params.view[:64] = regs.KERNEL_PARAMS.pack(Kernel.STREAM, 0x55, 10, FAR, 0, 0, 0, 0, 0)
        (i,) = far.rig.submit([pack_descriptor(Op.COMPUTE, PARAMS_IOVA, 0, 64)])
        assert far.failed(i) == (Status.BAD_KERNEL, 0x55)
        return
    g = _bfs_graph(far, [0, 1, 2, 3, 4], [1, 2, 3, 0])          # a 4-vertex ring
    launches = {
        "kernel": ((77, 10, FAR), 77),
        "n-zero": ((Kernel.STREAM, 0, FAR), 0),
        "n-too-big": ((Kernel.STREAM, 1 << 32, FAR), 1 << 32),
        "aux-zero": ((Kernel.GATHER, 4, FAR, FAR + 4096, FAR + 8192, 0), 0),
        "bfs-source": ((Kernel.BFS, 4, g["a"], g["b"], g["idx"], 4, 9), 9),
    }
    if case in launches:
        args, addr = launches[case]
        assert far.failed(far.launch(*args)) == (Status.BAD_KERNEL, addr)
        return
    row, col, pos = {
        "row0": ([1, 1, 2, 3, 4], [1, 2, 3, 0], 0),              # row_ptr[0] != 0
        "row-decreasing": ([0, 1, 3, 2, 4], [1, 2, 3, 0], 3),    # row_ptr[3] < row_ptr[2]
        "row-end": ([0, 1, 2, 3, 5], [1, 2, 3, 0], 4),           # row_ptr[n] = 5 > aux = 4
        "column": ([0, 1, 2, 3, 4], [1, 2, 7, 0], 2),            # column[2] = 7 is not a vertex
    }[case]
    g = _bfs_graph(far, row, col)
    assert far.failed(far.launch(Kernel.BFS, 4, g["a"], g["b"], g["idx"], g["aux"], 0)) == (
        Status.BAD_KERNEL, pos)


@pytest.mark.parametrize("mode,reg,value", [
    (regs.MODE_UVM | regs.MODE_DS, None, regs.MODE_UVM | regs.MODE_DS),
    (regs.MODE_SR, regs.REG_SR_DEGREE, 0),
    (regs.MODE_SR, regs.REG_SR_DISTANCE, 0),                       # degree 8 is fine: distance is bad
    (regs.MODE_SR, regs.REG_SR_DISTANCE, regs.SR_BUFFER_LINES),    # 8 + 1024 > 1024
    (regs.MODE_DS, regs.REG_DS_BACKLOG_LINES, 0),                  # the stage base is fine: backlog is bad
    (regs.MODE_DS, regs.REG_DS_STAGE_BASE, 32),
], ids=["uvm+ds", "sr-degree", "sr-distance-0", "sr-distance-big", "ds-backlog", "ds-stage"])
def test_bad_mode_reports_the_offending_register_value(far, mode, reg, value):
    far.c.reg_write(regs.REG_MEM_MODE, mode)
    if reg is not None:
        far.c.reg_write(reg, value)
    assert far.failed(far.launch(Kernel.STREAM, 10, FAR)) == (Status.BAD_MODE, value)


# ---- the copy engine (docs/gpu-device.md, "The copy engine")
FAR_RANGE_AT_ONCE = regs.MIG_ERROR | Status.FAR_RANGE << 8      # 0x1904
ABORTED = regs.MIG_ERROR | Status.DMA_ABORTED << 8              # 0x0804
SLOT = 1 << 20                                                  # a VRAM offset to migrate into


def go(r, src, dst, length, tag, *, posted=False):
    """Program a migration and write GO; returns the first MIG_STATUS read after it (None if posted)."""
    for reg, value in ((regs.REG_MIG_SRC_LO, src & 0xFFFFFFFF), (regs.REG_MIG_SRC_HI, src >> 32),
                       (regs.REG_MIG_DST_LO, dst & 0xFFFFFFFF), (regs.REG_MIG_DST_HI, dst >> 32),
                       (regs.REG_MIG_LENGTH, length),
                       (regs.REG_MIG_CONTROL, regs.MIG_GO | tag << regs.CMD_TAG_SHIFT)):
        r.c.reg_write(reg, value, posted=posted)
    return None if posted else r.c.reg_read(regs.REG_MIG_STATUS)


def mig_end(r, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while (status := r.c.reg_read(regs.REG_MIG_STATUS)) & regs.MIG_BUSY:
        assert time.monotonic() < deadline, "MIG_STATUS stays BUSY"
    return status


def vram(r, off, n):
    return r.c.read(regs.BAR_VRAM, off, n)


@pytest.mark.parametrize("length", [0, 1, 32, 63, 65, 100, 4096 + 8])
def test_a_migration_length_not_a_nonzero_multiple_of_64_is_far_range_at_once(far, length):
    far.far_np[:8192] = 0x5A
    before = vram(far, SLOT, 8192)
    far.clear()
    assert go(far, FAR, SLOT, length, tag=1) == FAR_RANGE_AT_ONCE == 0x1904
    assert vram(far, SLOT, 8192) == before                    # nothing copied
    c = far.counters()
    assert c["migrations"] == c["bytes_migrated"] == 0
    # the failed GO was accepted: its tag is the last one, so the same tag again is ignored
    assert go(far, FAR, SLOT, 128, tag=1) == FAR_RANGE_AT_ONCE
    assert vram(far, SLOT, 128) == before[:128]
    go(far, FAR, SLOT, 128, tag=2)
    assert mig_end(far) == regs.MIG_DONE
    assert vram(far, SLOT, 128) == b"\x5A" * 128
    # the other direction, and a range that is right but a length that is not
    assert go(far, SLOT, FAR + 4096, 96, tag=3) == FAR_RANGE_AT_ONCE


def test_mig_status_is_busy_at_once_after_go_and_until_the_copy_ends(far, gpu_server):
    far.far_np[:1 << 16] = 7
    with gpu_server.device.engine.gate:     # the copy engine can touch no memory: the copy cannot end
        assert go(far, FAR, SLOT, 1 << 16, tag=1) == regs.MIG_BUSY
        assert far.c.reg_read(regs.REG_MIG_STATUS) == regs.MIG_BUSY
        # ignored while busy, even with a new tag: MIG_STATUS unchanged
        assert go(far, FAR, SLOT + (1 << 16), 64, tag=2) == regs.MIG_BUSY
    assert mig_end(far) == regs.MIG_DONE
    assert vram(far, SLOT, 1 << 16) == b"\x07" * (1 << 16)
    assert vram(far, SLOT + (1 << 16), 64) != b"\x07" * 64       # the ignored GO copied nothing


def test_a_read_after_go_never_shows_the_previous_migrations_status(far):
    """A quick copy may be over by the first read (DONE), but the read never shows what was
    there before the GO (here an ERROR, told apart from this migration's outcome)."""
    far.far_np[:64] = 9
    tag = 0
    for _ in range(40):
        tag += 1
        assert go(far, FAR, SLOT, 0, tag) == FAR_RANGE_AT_ONCE     # the status before the GO
        tag += 1
        first = go(far, FAR, SLOT, 64, tag)
        assert first in (regs.MIG_BUSY, regs.MIG_DONE), hex(first)
        assert mig_end(far) == regs.MIG_DONE


def test_a_reset_forgets_the_last_tag(far):
    go(far, FAR, SLOT, 64, tag=5)
    assert mig_end(far) == regs.MIG_DONE
    far.reset()
    assert far.c.reg_read(regs.REG_MIG_STATUS) == 0
    assert go(far, FAR, SLOT, 64, tag=5) in (regs.MIG_BUSY, regs.MIG_DONE)
    assert mig_end(far) == regs.MIG_DONE


def test_a_go_without_bus_master_enable_copies_nothing(far):
    far.far_np[:4096] = 3
    before = vram(far, SLOT, 4096)
    far.c.set_bus_master(False)
    assert go(far, FAR, SLOT, 4096, tag=1) == ABORTED == 0x0804
    assert vram(far, SLOT, 4096) == before
    far.c.set_bus_master(True)
    go(far, FAR, SLOT, 4096, tag=2)
    assert mig_end(far) == regs.MIG_DONE and vram(far, SLOT, 4096) == b"\x03" * 4096


@pytest.mark.parametrize("how", ["enable-cleared", "bad-tail", "bus-master-cleared", "reset"])
def test_a_dropped_migration_ends_at_once_and_never_stays_busy(gpu_server, how):
    """The far window on the message path, and the client holds back its answer to the
    copy's first DMA_READ: the copy cannot end.  The input drops it; MIG_STATUS says so
    (it used to stay BUSY for good: the copy engine threw its work away silently)."""
    r = FarRig(gpu_server, far_direct=False)
    entered, release = threading.Event(), threading.Event()

    def hold(header):
        entered.set()
        release.wait(TIMEOUT)

    try:
        r.c.before_dma = hold
        go(r, FAR, SLOT, 1 << 16, tag=1, posted=True)    # posted: the client's reader is about to block
        assert entered.wait(TIMEOUT)
        if how == "enable-cleared":
            r.c.reg_write(regs.REG_CONTROL, 0, posted=True)
        elif how == "bad-tail":
            r.c.reg_write(regs.REG_RING_TAIL, r.rig.entries, posted=True)
        elif how == "bus-master-cleared":
            r.c.write(wire.PCI_CONFIG_REGION, 0x04, (0x2).to_bytes(2, "little"), posted=True)  # memory on, BME off
        else:
            r.c.reg_write(regs.REG_CONTROL, regs.CONTROL_RESET, posted=True)
        r.c.before_dma = None
        release.set()
        status = r.c.reg_read(regs.REG_MIG_STATUS)
        assert status == (0 if how == "reset" else ABORTED), hex(status)
        assert r.counters()["bytes_migrated"] == 0
    finally:
        release.set()
        r.close()


# ---- fault seq (docs/gpu-device.md, "Fault seq")
def fault_once(r, page, *, resolve=True):
    """Start a STREAM over one far page in uvm mode, wait for its fault; returns the record's
    (slot, seq).  ``resolve``: map the page (any VRAM slot) and replay, the op completes;
    else cancel it (the ring halts with FAULT_CANCELLED)."""
    r.mode("uvm")
    slot = r.c.reg_read(regs.REG_FAULT_PUT)
    i = r.launch(Kernel.STREAM, 8, FAR + (page << 16))
    assert wait_eventfd(r.rig.efds[regs.VEC_FAULT], TIMEOUT)
    assert r.c.reg_read(regs.REG_FAULT_PUT) == (slot + 1) % 64
    addr, _flags, seq = regs.FAULT_RECORD.unpack_from(r.faults.view, 16 * slot)
    assert addr == FAR + (page << 16)
    r.c.reg_write(regs.REG_FAULT_GET, (slot + 1) % 64)
    if resolve:
        r.c.reg_write(regs.REG_PT_INDEX, page)
        r.c.reg_write(regs.REG_PT_ENTRY, SLOT | regs.PTE_VALID)
        r.c.reg_write(regs.REG_UVM_CONTROL, regs.UVM_REPLAY | (seq & regs.CMD_TAG_MASK) << regs.CMD_TAG_SHIFT)
        r.finish(i)
    else:
        r.c.reg_write(regs.REG_UVM_CONTROL, regs.UVM_CANCEL | (seq & regs.CMD_TAG_MASK) << regs.CMD_TAG_SHIFT)
        assert r.failed(i) == (Status.FAULT_CANCELLED, FAR + (page << 16))
    return slot, seq


@pytest.mark.parametrize("how", ["control-reset", "device-reset"])
def test_fault_seq_counts_from_1_and_restarts_at_reset_only(far, how):
    assert fault_once(far, 0) == (0, 1)
    assert fault_once(far, 1) == (1, 2)
    far.c.reg_write(regs.REG_FAULT_ENTRIES, 64)          # PUT = GET = 0: seq goes on
    assert fault_once(far, 2) == (0, 3)
    assert fault_once(far, 3, resolve=False) == (1, 4)   # a cancelled fault: seq goes on
    if how == "control-reset":
        far.reset()
    else:
        far.c.reset()                                     # VFIO_USER_DEVICE_RESET
        far.rig.program()
        far.program_far()
    assert fault_once(far, 4) == (0, 1)                  # the count starts again
    assert fault_once(far, 5) == (1, 2)


def test_fault_seq_goes_on_across_a_disconnect(gpu_server):
    r = FarRig(gpu_server)
    try:
        assert fault_once(r, 0) == (0, 1)                 # the op completed: the ring is empty
        head = r.c.reg_read(regs.REG_RING_HEAD)
        # the client goes and comes back without resetting the device
        for fd in r.rig.efds:
            os.close(fd)
        r.c.close()
        gpu_server.wait_idle()
        c = gpu_server.client(r.rig.memory)
        for area in r.rig.memory.areas:
            area.mapped = False
            c.map_area(area)
        r.rig.client = r.c = c
        r.rig.efds = c.attach_msix(regs.MSIX_VECTORS)
        c.set_bus_master()
        assert c.reg_read(regs.REG_STATUS) & regs.STATUS_ENABLED and c.reg_read(regs.REG_RING_HEAD) == head
        r.rig.tail = head
        assert fault_once(r, 1) == (1, 2)
    finally:
        r.close()


@pytest.mark.parametrize("reg,first,offset,data,want", [
    (regs.REG_MIG_LENGTH, 0x1240, 2, b"\x01\x00", 0x0001_1240),
    (regs.REG_SR_DISTANCE, 0x0180, 0, b"\x20", 0x0120),
    (regs.REG_UVM_FAULT_TIMEOUT_MS, 5000, 1, b"\x00", 5000 & 0xFF),
    (regs.REG_PT_INDEX, 0x0003_0005, 2, b"\x00\x00", 5),
    (regs.REG_DS_STAGE_BASE, 0x00F0_0000, 0, b"\x40", 0x00F0_0040),
], ids=["mig-length-high-half", "sr-distance-low-byte", "timeout-byte-1", "pt-index-high-half", "stage-low-byte"])
def test_a_partial_write_to_a_far_memory_register_only_touches_its_bytes(far, reg, first, offset, data, want):
    """docs/gpu-device.md, "BAR0 registers": narrower accesses work; a partial write only
    touches the bytes written (the 1.1 registers used to take the written bytes as the value)."""
    far.c.reg_write(reg, first)
    far.c.write(regs.BAR_REGS, reg + offset, data)
    assert far.c.reg_read(reg) == want


def test_a_far_window_beyond_16_gib_is_ignored(far):
    """1.7: FAR_SIZE is bounded (docs/gpu-device.md): a guest writing 2^64 - 1 must not make the
    server allocate a page-table entry per page of it (the fuzz test found the 1.6 device did)."""
    before = far.c.reg_read(regs.REG_FAR_SIZE_LO) | far.c.reg_read(regs.REG_FAR_SIZE_HI) << 32
    far.c.reg_write(regs.REG_FAR_SIZE_HI, 0xFFFFFFFF)
    assert far.c.reg_read(regs.REG_FAR_SIZE_HI) << 32 | far.c.reg_read(regs.REG_FAR_SIZE_LO) == before
    far.c.reg_write(regs.REG_FAR_SIZE_LO, 0)
    far.c.reg_write(regs.REG_FAR_SIZE_HI, regs.FAR_SIZE_MAX >> 32)      # exactly 16 GiB: taken
    assert far.c.reg_read(regs.REG_FAR_SIZE_HI) << 32 == regs.FAR_SIZE_MAX
