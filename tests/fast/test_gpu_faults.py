"""Faults: a failing descriptor halts the ring, latches ERR_*, raises vector 1,
and nothing else is written until reset."""

import errno

import pytest
from vfio_user_client import (DATA_IOVA, RING_IOVA, Rig, ServerThread, gpu_server,  # noqa: F401
                              eventfd_count, no_leaks)

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.vfio_user import wire
from vfio_cxl.devices.vfio_user.dma import REPORT_BYTES, FaultReports
from vfio_cxl.devices.gpu.regs import DESC_FLAG_INTERRUPT as IRQ, Op, Status, pack_descriptor

UNMAPPED = 0x7000_0000
SENTINEL = b"\xAB" * 4096


def err_regs(c):
    return (c.reg_read(regs.REG_ERR_STATUS), c.reg_read(regs.REG_ERR_DESC_INDEX),
            c.reg_read(regs.REG_ERR_ADDR_LO) | c.reg_read(regs.REG_ERR_ADDR_HI) << 32,
            c.reg_read(regs.REG_ERR_ERRNO))


def run_faulting(rig, bad_desc):
    """good, BAD, good-after: returns after the error vector fired."""
    rig.memory.view(DATA_IOVA + 0x10000, 4096)[:] = SENTINEL
    rig.memory.view(DATA_IOVA + 0x20000, 4096)[:] = SENTINEL
    rig.submit([pack_descriptor(Op.FILL_PRNG, 1, 0, 8192, IRQ, cookie=1),
                bad_desc,
                pack_descriptor(Op.VRAM_TO_HOST, 0, DATA_IOVA + 0x20000, 4096, IRQ, cookie=3)])
    assert rig.wait_vector(regs.VEC_ERROR) == 1


def assert_halted_after(rig, status, addr, err=0):
    c = rig.client
    assert err_regs(c) == (status, 1, addr, err)
    assert c.reg_read(regs.REG_STATUS) & regs.STATUS_HALTED
    assert c.reg_read(regs.REG_RING_HEAD) == 1 and c.reg_read(regs.REG_COMPLETED) == 1
    assert c.reg_read(regs.REG_INTR_STATUS) & regs.INTR_ERROR
    assert eventfd_count(rig.efds[regs.VEC_DMA_DONE]) == 1  # only the good first one
    rec = rig.completion(1)
    assert (rec["status"], rec["cookie"], rec["index"], rec["seq"]) == (status, 2, 1, 2)
    # the descriptor after the fault never ran: no completion, no data
    assert rig.completion(2)["seq"] == 0
    assert rig.host(DATA_IOVA + 0x20000, 4096) == SENTINEL
    assert rig.host(DATA_IOVA + 0x10000, 4096) == SENTINEL


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "message"])
def test_dma_to_an_iova_never_mapped_goes_to_the_client_then_halts(gpu_server, direct):
    # vfio-user: DMA_READ/WRITE addresses "must have been previously exported with
    # DMA_MAP".  The device checks its own table, like an IOMMU, and sends the client the
    # faulting access (its first REPORT_BYTES) so QEMU's vIOMMU records the fault; QEMU
    # refuses it (ENODEV) and the device halts DMA_UNMAPPED at that IOVA all the same.
    rig = Rig(gpu_server, direct=direct)
    try:
        run_faulting(rig, pack_descriptor(Op.VRAM_TO_HOST, 0, UNMAPPED, 4096, IRQ, cookie=2))
        assert_halted_after(rig, Status.DMA_UNMAPPED, UNMAPPED)
        assert rig.client.stats.refusals == [(wire.DMA_WRITE, UNMAPPED, REPORT_BYTES)]
        # message ring: two completion records (the good one, the failed one), no data
        assert rig.client.stats.writes == (0 if direct else 2)
        assert gpu_server.device.fault_reports.sent == 1
    finally:
        rig.close()


def test_local_dma_faults_send_nothing(tmp_path):
    with no_leaks():
        srv = ServerThread(tmp_path, local_dma_faults=True)
        try:
            rig = Rig(srv, direct=True)
            try:
                run_faulting(rig, pack_descriptor(Op.VRAM_TO_HOST, 0, UNMAPPED, 4096, IRQ, cookie=2))
                assert_halted_after(rig, Status.DMA_UNMAPPED, UNMAPPED)
                assert rig.client.stats.refused == 0 and rig.client.stats.writes == 0
            finally:
                rig.close()
        finally:
            srv.stop()


def test_a_ring_fetch_from_an_unmapped_iova_goes_to_the_client_as_a_read(gpu_server):
    rig = Rig(gpu_server, direct=True)
    try:
        c = rig.client
        assert c.dma_unmap(RING_IOVA, rig.ring.size).ok  # the ring is no longer mapped
        rig.submit([pack_descriptor(Op.NOP, 0, 0, 0, IRQ)])
        rig.wait_vector(regs.VEC_ERROR)
        assert c.reg_read(regs.REG_ERR_STATUS) == Status.RING_FETCH
        assert err_regs(c)[2:] == (RING_IOVA, 0)
        assert c.stats.refusals == [(wire.DMA_READ, RING_IOVA, REPORT_BYTES)]
    finally:
        rig.close()


def test_a_spray_of_unmapped_dmas_is_rate_limited_and_counted(gpu_server, caplog):
    """Each bad descriptor halts the ring; the driver resets and submits the next.  With a
    burst of 3 and a rate too slow to refill during the test, 3 reach the client, the rest
    stay local, and the disconnect's log line counts both."""
    gpu_server.device.fault_reports = FaultReports(rate=1e-6, burst=3)
    rig = Rig(gpu_server, direct=True)
    try:
        for n in range(20):
            rig.program()
            bad = UNMAPPED + n * 0x1000
            rig.submit([pack_descriptor(Op.VRAM_TO_HOST, 0, bad, 64, IRQ)])
            rig.wait_vector(regs.VEC_ERROR)
            assert err_regs(rig.client)[::2] == (Status.DMA_UNMAPPED, bad)
        assert [r[1] for r in rig.client.stats.refusals] == [UNMAPPED, UNMAPPED + 0x1000,
                                                              UNMAPPED + 0x2000]
    finally:
        rig.close()
    gpu_server.wait_idle()
    assert "3 reported to the client, 17 suppressed by the rate limit" in caplog.text


def test_iovas_the_server_never_saw_get_at_most_the_faults_report(gpu_server):
    # e.g. a peer device's BAR that QEMU could reach: without a DMA_MAP it is out of bounds;
    # the client's IOMMU does translate it, so the report (4 bytes of the transfer's own data)
    # lands there, and nothing more
    rig = Rig(gpu_server, direct=True)
    try:
        peer = rig.memory.add(UNMAPPED, 1 << 20, shared=False)
        peer.mapped = True  # the client would serve it, the server was never told
        peer.view[:4096] = SENTINEL
        rig.submit([pack_descriptor(Op.FILL_PRNG, 8, 0, 100_000),
                    pack_descriptor(Op.VRAM_TO_HOST, 0, UNMAPPED, 100_000, IRQ)])
        rig.wait_vector(regs.VEC_ERROR)
        assert err_regs(rig.client)[:3] == (Status.DMA_UNMAPPED, 1, UNMAPPED)
        assert bytes(peer.view[:REPORT_BYTES]) == bytes(gpu_server.device.vram[:REPORT_BYTES])
        assert bytes(peer.view[REPORT_BYTES:4096]) == SENTINEL[REPORT_BYTES:]
        assert rig.client.stats.writes == 1 and rig.client.stats.write_bytes == REPORT_BYTES
        assert gpu_server.device.fault_reports.served == 1
    finally:
        rig.close()


def test_range_running_off_the_end_of_a_mapping_writes_nothing(gpu_server):
    rig = Rig(gpu_server, direct=True)
    end = DATA_IOVA + rig.data.size
    try:
        rig.memory.view(end - 4096, 4096)[:] = SENTINEL
        run_faulting(rig, pack_descriptor(Op.VRAM_TO_HOST, 0, end - 4096, 8192, cookie=2))
        assert_halted_after(rig, Status.DMA_UNMAPPED, end)
        assert rig.host(end - 4096, 4096) == SENTINEL
    finally:
        rig.close()


def test_dma_the_client_refuses_latches_its_errno(gpu_server):
    rig = Rig(gpu_server, direct=False)
    try:
        # mapped for the server, but the "vIOMMU" (client) has no translation
        assert rig.client.dma_map(UNMAPPED, 1 << 20).ok
        run_faulting(rig, pack_descriptor(Op.VRAM_TO_HOST, 0, UNMAPPED, 4096, cookie=2))
        assert_halted_after(rig, Status.DMA_REFUSED, UNMAPPED, errno.ENODEV)
        assert rig.client.stats.refused == 1
    finally:
        rig.close()


def test_host_to_vram_from_a_refused_iova(gpu_server):
    rig = Rig(gpu_server, direct=False)
    try:
        assert rig.client.dma_map(UNMAPPED, 1 << 20).ok
        run_faulting(rig, pack_descriptor(Op.HOST_TO_VRAM, UNMAPPED, 0, 4096, cookie=2))
        assert_halted_after(rig, Status.DMA_REFUSED, UNMAPPED, errno.ENODEV)
    finally:
        rig.close()


def test_write_to_a_read_only_mapping(gpu_server):
    rig = Rig(gpu_server, direct=True)
    try:
        ro = rig.memory.add(UNMAPPED, 1 << 20, shared=True, writable=False)
        rig.client.map_area(ro)
        run_faulting(rig, pack_descriptor(Op.VRAM_TO_HOST, 0, UNMAPPED, 4096, cookie=2))
        assert_halted_after(rig, Status.DMA_PERMISSION, UNMAPPED)
    finally:
        rig.close()


@pytest.mark.parametrize("bad,status,addr", [
    (pack_descriptor(Op.VRAM_TO_HOST, 16 * regs.MIB - 100, DATA_IOVA, 4096, cookie=2),
     Status.VRAM_RANGE, 16 * regs.MIB - 100),
    (pack_descriptor(9, 0, 0, 0, cookie=2), Status.BAD_OPCODE, 0),
    (pack_descriptor(Op.NOP, 0, 0, 0, flags=0x80, cookie=2), Status.BAD_FLAGS, 0),
    (regs.DESC.pack(0, 0, 0, Op.NOP, 0, 1, 2), Status.BAD_FLAGS, 0),
], ids=["vram-range", "opcode", "flags", "reserved"])
def test_malformed_descriptors(gpu_server, bad, status, addr):
    rig = Rig(gpu_server, direct=True)
    try:
        run_faulting(rig, bad)
        assert_halted_after(rig, status, addr)
    finally:
        rig.close()


def test_ring_outside_mapped_memory(gpu_server):
    rig = Rig(gpu_server, direct=True)
    c = rig.client
    try:
        c.reg_write(regs.REG_CONTROL, regs.CONTROL_RESET)
        c.reg_write(regs.REG_RING_BASE_LO, UNMAPPED)
        c.reg_write(regs.REG_RING_SIZE, 16)
        c.reg_write(regs.REG_COMPL_BASE_LO, RING_IOVA)
        c.reg_write(regs.REG_CONTROL, regs.CONTROL_ENABLE)
        c.reg_write(regs.REG_RING_TAIL, 3)
        rig.wait_vector(regs.VEC_ERROR)
        assert err_regs(c) == (Status.RING_FETCH, 0, UNMAPPED, 0)
        assert c.reg_read(regs.REG_RING_HEAD) == 0
    finally:
        rig.close()


def test_unwritable_completion_area(gpu_server):
    rig = Rig(gpu_server, direct=True)
    c = rig.client
    try:
        c.reg_write(regs.REG_CONTROL, 0)
        c.reg_write(regs.REG_COMPL_BASE_LO, UNMAPPED)
        c.reg_write(regs.REG_CONTROL, regs.CONTROL_ENABLE)
        rig.submit([pack_descriptor(Op.FILL_PATTERN, 0x42, 0, 64, IRQ)])
        rig.wait_vector(regs.VEC_ERROR)
        assert err_regs(c) == (Status.COMPLETION_WRITE, 0, UNMAPPED, 0)
        assert eventfd_count(rig.efds[regs.VEC_DMA_DONE]) == 0
    finally:
        rig.close()


def test_doorbell_beyond_the_ring_and_bad_ring_config(gpu_server):
    rig = Rig(gpu_server, direct=True, entries=16)
    c = rig.client
    try:
        c.reg_write(regs.REG_RING_TAIL, 16)
        rig.wait_vector(regs.VEC_ERROR)
        assert err_regs(c)[:3] == (Status.BAD_TAIL, 0, 16)
        for size, base in ((3, RING_IOVA), (0, RING_IOVA), (16, RING_IOVA + 8),
                           (regs.RING_SIZE_MAX * 2, RING_IOVA)):
            c.reg_write(regs.REG_CONTROL, regs.CONTROL_RESET)
            c.reg_write(regs.REG_RING_BASE_LO, base)
            c.reg_write(regs.REG_RING_SIZE, size)
            c.reg_write(regs.REG_CONTROL, regs.CONTROL_ENABLE)
            rig.wait_vector(regs.VEC_ERROR)
            assert c.reg_read(regs.REG_ERR_STATUS) == Status.BAD_RING_CONFIG, (size, base)
            assert c.reg_read(regs.REG_STATUS) == regs.STATUS_HALTED
    finally:
        rig.close()


@pytest.mark.parametrize("how", ["control-reset", "device-reset"])
def test_reset_clears_the_fault_and_every_register(gpu_server, how):
    rig = Rig(gpu_server, direct=True)
    c = rig.client
    try:
        c.reg_write(regs.REG_SCRATCH, 0x1234)
        run_faulting(rig, pack_descriptor(Op.VRAM_TO_HOST, 0, UNMAPPED, 4096, cookie=2))
        assert eventfd_count(rig.efds[regs.VEC_DMA_DONE]) == 1  # drain: the good first one
        c.reg_write(regs.REG_RING_TAIL, 2)  # halted: the doorbell does nothing
        assert c.reg_read(regs.REG_RING_HEAD) == 1
        if how == "control-reset":
            c.reg_write(regs.REG_CONTROL, regs.CONTROL_RESET | regs.CONTROL_ENABLE)
        else:
            c.reset()
        for offset, value in regs.reset_values(16 * regs.MIB).items():
            assert c.reg_read(offset) == value, hex(offset)
        # and the device works again once reprogrammed
        rig.program()
        rig.submit([pack_descriptor(Op.FILL_PRNG, 4, 0, 4096),
                    pack_descriptor(Op.VRAM_TO_HOST, 0, DATA_IOVA, 4096, IRQ)])
        rig.wait_vector(regs.VEC_DMA_DONE)
        assert rig.host(DATA_IOVA, 4096) == regs.prng_bytes(4, 4096)
        assert rig.completion(1)["seq"] == 2
    finally:
        rig.close()


def test_dma_after_unmap_faults(gpu_server):
    rig = Rig(gpu_server, direct=True)
    try:
        assert rig.client.dma_unmap(DATA_IOVA, rig.data.size).ok
        rig.submit([pack_descriptor(Op.VRAM_TO_HOST, 0, DATA_IOVA, 4096)])
        rig.wait_vector(regs.VEC_ERROR)
        assert err_regs(rig.client) == (Status.DMA_UNMAPPED, 0, DATA_IOVA, 0)
        assert rig.host(DATA_IOVA, 4096) == bytes(4096)
    finally:
        rig.close()


def test_client_that_never_answers_dma_times_out(tmp_path):
    with no_leaks():
        srv = ServerThread(tmp_path, dma_timeout=0.3)
        try:
            rig = Rig(srv, direct=False)
            rig.client._serve_dma = lambda header, body, fds: rig.client.transport.discard(body, fds)
            rig.submit([pack_descriptor(Op.NOP, 0, 0, 0, IRQ)])
            rig.wait_vector(regs.VEC_ERROR)
            assert err_regs(rig.client) == (Status.RING_FETCH, 0, RING_IOVA, errno.ETIMEDOUT)
            rig.close()
        finally:
            srv.stop()


def test_fault_reports_refill_at_their_rate_and_summarise_once_per_interval(caplog):
    now = [0.0]
    reports = FaultReports(rate=10, burst=2, interval=10, clock=lambda: now[0])
    assert [reports.admit(0x1000, True) for _ in range(4)] == [True, True, False, False]
    now[0] = 0.1  # one token back
    assert [reports.admit(0x1000, True) for _ in range(2)] == [True, False]
    assert (reports.sent, reports.suppressed) == (3, 3)
    # the first fault, and the first one suppressed; nothing more until the interval is up
    assert [r.message for r in caplog.records][1:] == [
        "unmapped DMA faults beyond 10/s (burst 2) now stay local: not reported to the client"]
    assert "0x1000" in caplog.records[0].message
    now[0] = 10.0
    assert reports.admit(0x2000, False)
    assert len(caplog.records) == 3
    assert "since the last summary: 3 reported to the client, 3 suppressed" in caplog.records[2].message


@pytest.mark.parametrize("rate, burst", [(0, 1), (1, 0), (-1, 5)])
def test_fault_reports_refuse_a_rate_or_burst_that_is_not_positive(rate, burst):
    with pytest.raises(ValueError, match="must be positive"):
        FaultReports(rate=rate, burst=burst)
