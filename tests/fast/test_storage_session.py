"""StorageSession's lifetime, without a VM: a closed session holds nothing, so a second one opens
in the same process -- in each mode (p2p, compat, cmb) and on each backend (type1, iommufd); an
open that fails part-way leaves nothing; a closed session refuses work with a StorageError.

The fake kernel (storage_fake_kernel.py) runs the library's own VFIO stack and GPU driver on
real fds and mmaps, gives a group node the kernel's single open (EBUSY while its fd, a device
fd or a BAR mmap of the group is held) and a device cdev its single bind (EINVAL while bound).  The
two-sessions check runs on QEMU's NVMe and the lab GPU in tests/vm/test_storage.py
(test_two_sessions_one_after_the_other_in_one_process, and its iommufd twin).
"""

from __future__ import annotations

import os
import random

import fdcheck
import pytest
from storage_fake_kernel import BLOCK, GPU, NVME, FakeKernel

from vfio_cxl.errors import LabError
from vfio_cxl.guest.storage import IoParams, StorageError, StorageSession
from vfio_cxl.guest.storage.gpu_initiated import GpuQueue
from vfio_cxl.guest.drivers.nvme.controller import DATA_IOVA
from vfio_cxl.guest.storage.session import CMB_IOVA, DOORBELL_IOVA, MODES, VRAM_IOVA
from vfio_cxl.guest.vfio.errors import VfioError


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    fake = FakeKernel(tmp_path)
    fake.install(monkeypatch)
    return fake


BACKENDS = ("type1", "iommufd")
# what each mode maps in the shared IOMMU context beyond the devices' own control areas
MODE_MAPS = {"p2p": VRAM_IOVA, "compat": DATA_IOVA, "cmb": CMB_IOVA}


def held(kernel: FakeKernel) -> dict:
    """What this process holds: its fds by kind (tests/fdcheck.py), and of the fake kernel its
    fds and mmaps, the DMA mappings (container and IOAS) and the groups in a container."""
    return {"fds": fdcheck.fd_kinds(os.getpid()),
            "kernel": {**kernel.holdings(), "dma": kernel.dma_mapped(), "attached": dict(kernel.attached)}}


NOTHING = {"fds": [], "mmaps": [], "dma": {}, "attached": {}}


def assert_released(kernel: FakeKernel, before: dict) -> None:
    """Nothing more held than ``before``.  Fewer fds of a kind is no leak: in the whole fast
    tier, something an earlier test left for the garbage collector (a subprocess's pipes) may
    be closed meanwhile."""
    now = held(kernel)
    delta = fdcheck.differences({"process": before["fds"]}, {"process": now["fds"]}).get("process", {})
    leaked = {kind: n for kind, n in delta.items() if n > 0}
    assert leaked == {}, f"fds left open: {leaked}"
    assert before["kernel"] == now["kernel"] == NOTHING, now["kernel"]


def read_into_vram(s: StorageSession, seed: int, blocks: int = 64) -> None:
    data = random.Random(seed).randbytes(blocks * BLOCK)
    s.nvme.disk[8 * BLOCK:8 * BLOCK + len(data)] = data
    fh, buf = s.handle_register(1), s.buf_register(0, len(data))
    assert s.read(fh, buf, len(data), file_offset=8 * BLOCK) == len(data)
    assert s.gpu.vram_read(0, len(data)) == data


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_two_sessions_one_after_the_other_in_one_process(kernel, mode, backend):
    """The issue's report: the second open failed with 'GroupError: /dev/vfio/N is already open
    (EBUSY)'; the first session had left its devices and their groups open.  Each mode holds
    something of its own (p2p the VRAM mapping, compat a guest-RAM bounce buffer, cmb the CMB
    mapped for the GPU); after each session, nothing of it is left."""
    before = held(kernel)
    for seed in range(2):
        with StorageSession.open(NVME, GPU, mode=mode, backend=backend) as s:
            assert s.backend == backend and type(s.context).backend == backend
            assert MODE_MAPS[mode] in kernel.dma_mapped(), sorted(kernel.dma_mapped())
            if mode == "p2p":                  # compat and cmb need the GPU's engine to copy
                read_into_vram(s, seed)
        assert_released(kernel, before)
    assert len(kernel.iommufd.destroyed) == (2 if backend == "iommufd" else 0)


def test_a_leaked_device_cdev_makes_the_next_iommufd_session_fail(kernel):
    """The fake kernel's rule that the iommufd test above leans on: a device cdev left open and
    bound makes the next bind of that device fail, as a group left open makes the next open fail."""
    s = StorageSession.open(NVME, GPU, backend="iommufd")
    with pytest.raises(VfioError, match=r"VFIO_DEVICE_BIND_IOMMUFD\(0000:03:00.0\) failed \(EINVAL") as caught:
        StorageSession.open(NVME, GPU, backend="iommufd")
    assert "already bound through another open of its cdev" in caught.value.fix
    s.close()
    with StorageSession.open(NVME, GPU, backend="iommufd") as again:
        read_into_vram(again, 4)


def test_a_closed_session_holds_nothing(kernel):
    before = held(kernel)
    with StorageSession.open(NVME, GPU) as s:
        read_into_vram(s, 1)
        gpu_group, nvme_group, container = s.gpu.device.group, s.nvme.device.group, s.context
        assert kernel.group_busy(5) and kernel.type1.mapped
    # the GPU's VFIO group fd is its VfioPciDevice's Group (GpuDriver.device.group): GpuDriver.close
    # closes it; the NVMe's likewise, and the container the session opened
    assert (gpu_group.fd, nvme_group.fd, container.fd) == (-1, -1, -1)
    assert kernel.group_busy(5) == [] and kernel.group_busy(6) == []
    assert_released(kernel, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("failure", ["nvme bring-up", "VRAM mapping"])
def test_an_open_that_fails_part_way_leaves_nothing(kernel, failure, backend):
    before = held(kernel)
    if failure == "nvme bring-up":       # after the GPU opened
        kernel.refuse_nvme_open = True
    else:                                # after both devices opened
        kernel.refuse_map.add(VRAM_IOVA)
    with pytest.raises(VfioError):
        StorageSession.open(NVME, GPU, backend=backend)
    assert_released(kernel, before)
    kernel.refuse_nvme_open, kernel.refuse_map = False, set()
    with StorageSession.open(NVME, GPU, backend=backend) as s:
        read_into_vram(s, 2)


def test_closing_releases_everything_even_when_a_step_fails(kernel):
    before = held(kernel)
    s = StorageSession.open(NVME, GPU)
    shutdown = s.nvme.shutdown
    calls = []

    def failing_shutdown():
        calls.append(1)
        if len(calls) == 1:
            raise VfioError("the controller's CSTS read failed", "the test said so")
        shutdown()
    s.nvme.shutdown = failing_shutdown
    with pytest.raises(VfioError, match="CSTS read failed"):
        s.close()
    assert_released(kernel, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sq_in_cmb", [False, True], ids=["sq-in-vram", "sq-in-cmb"])
def test_a_gpu_queue_left_open_is_closed_with_its_session(kernel, backend, sq_in_cmb):
    """A GpuQueue holds views of VRAM (its SQ and CQ) and a mapping of the NVMe's BAR0 (with
    its SQ in the CMB, the CMB mapped too): left open, the GPU's BAR cannot be unmapped, and the
    GPU's device -- so its group or its cdev -- stays held."""
    before = held(kernel)
    with StorageSession.open(NVME, GPU, backend=backend) as s:
        q = GpuQueue(s, entries=16, sq_in_cmb=sq_in_cmb)
        assert s.nvme.queues[q.qid] is q.queue
        assert DOORBELL_IOVA in kernel.dma_mapped() and (CMB_IOVA in kernel.dma_mapped()) == sq_in_cmb
    assert q.qid not in s.nvme.queues and q.closed
    assert_released(kernel, before)
    with StorageSession.open(NVME, GPU, backend=backend) as s:
        with GpuQueue(s, entries=16, sq_in_cmb=sq_in_cmb) as q:   # closed by its own with: the session's close is a no-op for it
            pass
        assert DOORBELL_IOVA not in kernel.dma_mapped() and s.cmb_claims == {}
    assert_released(kernel, before)


def test_a_gpu_queue_that_fails_part_way_leaves_nothing(kernel):
    before = held(kernel)
    with StorageSession.open(NVME, GPU) as s:
        s.nvme.refuse_create = True
        with pytest.raises(VfioError, match="Invalid Queue Identifier"):
            GpuQueue(s, entries=16)
        mapped = sorted(kernel.type1.mapped)
        assert not any(iova >= 0x20_0000_0000 for iova in mapped), mapped   # the doorbells went again
        read_into_vram(s, 3)
    assert_released(kernel, before)


@pytest.mark.parametrize("mode", MODES)
def test_a_closed_session_refuses_work_with_a_storage_error(kernel, mode):
    """Before: the read reached the controller's deleted queues and raised a bare KeyError (and
    the CMB calls an AttributeError, or answered as if the session were open)."""
    s = StorageSession.open(NVME, GPU, mode=mode)
    fh, buf = s.handle_register(1), s.buf_register(0, 1 << 20)
    q = GpuQueue(s, entries=16)
    s.close()
    calls = {"read": lambda: s.read(fh, buf, 4096), "write": lambda: s.write(fh, buf, 4096),
             "batch_submit": lambda: s.batch_submit([IoParams("read", fh, buf, 4096, 0, 0)]),
             "handle_register": lambda: s.handle_register(1), "buf_register": lambda: s.buf_register(0, 4096),
             "map_vram": s.map_vram, "map_cmb": s.map_cmb, "cmb_staging": lambda: s.cmb_staging,
             "claim_cmb": lambda: s.claim_cmb(8192), "set_cmb_window": s.set_cmb_window,
             "set_window": lambda: s.set_window(DOORBELL_IOVA, 4096, "doorbells"), "gpu_copy": s.gpu_copy,
             "GpuQueue": lambda: GpuQueue(s), "GpuQueue.run": lambda: q.run([(0, 4096, 0)])}
    for name, call in calls.items():
        with pytest.raises(StorageError) as caught:
            call()
        err = caught.value
        assert isinstance(err, LabError), name
        assert "storage session" in err.what and "is closed" in err.what, (name, str(err))
        assert f"StorageSession.open({NVME!r}, {GPU!r})" in err.fix, (name, str(err))
    s.close()                                  # again: nothing to do


def test_a_closed_gpu_queue_refuses_to_run(kernel):
    with StorageSession.open(NVME, GPU) as s:
        with GpuQueue(s, entries=16) as q:
            pass
        with pytest.raises(StorageError, match="GPU queue 2: it is closed"):
            q.run([(0, 4096, 0)])


def test_a_gpu_queue_refuses_an_unknown_op(kernel):
    """run(op=...) takes "read" or "write" (docs/storage.md); anything else was run as a write."""
    with StorageSession.open(NVME, GPU) as s, GpuQueue(s, entries=16) as q:
        with pytest.raises(StorageError, match="op 'trim'") as caught:
            q.run([(0, 4096, 0)], op="trim")
        assert '"read"' in caught.value.fix and '"write"' in caught.value.fix


@pytest.mark.parametrize("entries", [2, 16, 63, 64, 100, 2048])
def test_a_gpu_queue_s_sq_and_cq_each_start_on_a_page(kernel, entries):
    """QEMU's nvme refuses a queue that does not start on a page (PRP Offset Invalid); the CQ
    used to follow the SQ directly, off a page for fewer than 64 entries (the VM test's 16)."""
    with StorageSession.open(NVME, GPU) as s, GpuQueue(s, entries=entries) as q:
        assert q.queue.sq_iova % 4096 == q.queue.cq_iova % 4096 == 0
        assert q.cq_off + entries * 16 <= q.block_off          # still below the queue block


@pytest.mark.parametrize("mode", ["p2p", "compat"])
def test_cmb_calls_on_a_session_without_the_cmb_name_the_mode(kernel, mode):
    """Before: an AttributeError on NoneType (the controller's CMB was never turned on)."""
    with StorageSession.open(NVME, GPU, mode=mode) as s:
        for call in (lambda: s.cmb_staging, lambda: s.claim_cmb(8192), s.set_cmb_window):
            with pytest.raises(StorageError, match=f"CMB is not on in this {mode} session") as caught:
                call()
            assert 'mode="cmb"' in caught.value.fix and "map_cmb()" in caught.value.fix


def test_the_documented_gpu_initiated_program_runs_as_typed(kernel, monkeypatch, capsys):
    """docs/storage.md's gpu_initiated_reads.py, as the page shows it, on the library's own
    StorageSession and GpuQueue (queue set-up, request checks, the request list it writes, the
    statuses it reads back); the GPU's engine and the NVMe are stand-ins, and the two devices are
    named rather than found in sysfs.  Its run on the lab GPU and QEMU's nvme:
    tests/vm/test_storage.py::test_the_documented_gpu_initiated_program_runs_as_typed."""
    from documented_commands import program_and_output
    from storage_fake_kernel import StandInGpuEngine

    import vfio_cxl.guest.drivers.nvme as nvme_package
    import vfio_cxl.guest.p2p as p2p
    import vfio_cxl.guest.vfio as vfio_package

    program, shown = program_and_output("docs/storage.md", '"""gpu_initiated_reads.py')
    monkeypatch.setattr(vfio_package, "find_pci_devices", lambda vendor, device: [GPU])
    monkeypatch.setattr(nvme_package, "find_controllers", lambda: [NVME])
    monkeypatch.setattr(p2p, "route", lambda a, b: {"kind": "switch"})
    StandInGpuEngine(kernel).install(monkeypatch)
    before = held(kernel)
    exec(compile(program, "gpu_initiated_reads.py", "exec"), {})
    assert capsys.readouterr().out.strip() == shown
    assert_released(kernel, before)
