"""The NVMe driver's bring-up verbs and its request side, against a controller model
(``nvme_fake_controller.FakeNvme``): each step alone, ``bring_up`` as exactly those steps, the
errors of a step taken out of order, and I/O through the queues the steps made."""

import pytest
from nvme_fake_controller import BLOCK, FakeNvme

from vfio_cxl.guest.drivers.nvme import NvmeController, NvmeError, NvmeFatalError, NvmeTimeout, rq
from vfio_cxl.guest.drivers.nvme.errors import NvmeCommandError
from vfio_cxl.guest.drivers.nvme.spec import PAGE, PSDT_PRP, PSDT_SGL, Completion, IoOp
from vfio_cxl.guest.drivers.nvme.tracker import RequestTracker

CC_ENABLE = "CC=0x460001"          # EN, NVM command set, 4 KiB pages, 64/16-byte entries
BRING_UP = ["AQA=0x1f001f", "ASQ=0x1000000", "ASQ+4=0x0", "ACQ=0x1001000", "ACQ+4=0x0", CC_ENABLE,
            "IDENTIFY 0x1", "IDENTIFY 0x2", "IDENTIFY 0x0 nsid 1", "IDENTIFY 0x0 nsid 2",
            "SET_FEATURES 0x7", "CREATE_CQ 0x7f0001", "CREATE_SQ 0x7f0001"]


def opened(fake: FakeNvme, **kwargs) -> NvmeController:
    return NvmeController(fake, **kwargs)


def test_open_brings_the_controller_up_in_the_spec_order():
    fake = FakeNvme(namespaces={1: 256, 2: 64})
    nvme = opened(fake)
    assert fake.log == BRING_UP
    assert sorted(nvme.queues) == [0, 1] and fake.sqs.keys() == fake.cqs.keys() == {0, 1}
    assert {n: ns.size for n, ns in nvme.namespaces.items()} == {1: 256 * BLOCK, 2: 64 * BLOCK}
    assert nvme.info.serial == "fake-nvme" and nvme.failed is None


def test_the_steps_one_at_a_time_are_what_bring_up_does():
    fake = FakeNvme(namespaces={1: 256, 2: 64})
    nvme = opened(fake, bring_up=False)
    assert fake.log == [] and nvme.admin is None and nvme.namespaces == {}
    nvme.disable()
    assert fake.log == []                                   # disabled at power-on: nothing to write
    admin = nvme.configure_admin_queue()
    assert (admin.qid, admin.entries) == (0, 32) and fake.log == BRING_UP[:5]
    nvme.enable()
    assert fake.log[-1] == CC_ENABLE
    nvme.wait_ready()
    assert nvme.identify_controller().model == "vfio-cxl FakeNvme"
    assert nvme.max_transfer == 2 << 20                     # MDTS 0: no limit but one PRP list page's
    assert sorted(nvme.identify_namespaces()) == [1, 2]
    assert nvme.set_queue_count() == 4                      # the controller's allocation
    nvme.create_io_queues()
    assert fake.log == BRING_UP


def test_reset_disables_and_runs_every_step_again():
    fake = FakeNvme()
    nvme = opened(fake)
    fake.log.clear()
    nvme.reset()
    assert fake.log[0] == "CC=0x460000" and fake.log[1:] == [e for e in BRING_UP if "nsid 2" not in e]


def test_configure_admin_queue_needs_a_disabled_controller():
    nvme = opened(FakeNvme())
    with pytest.raises(NvmeError, match=r"while the controller is enabled \(CC.EN = 1\)") as err:
        nvme.configure_admin_queue()
    assert err.value.fix == "disable() it first"


def test_enable_needs_the_admin_queue():
    nvme = opened(FakeNvme(), bring_up=False)
    with pytest.raises(NvmeError, match="enabling a controller with no admin queue") as err:
        nvme.enable()
    assert err.value.fix == "configure_admin_queue() first (after disable())"


def test_an_admin_command_before_the_admin_queue_names_the_steps():
    nvme = opened(FakeNvme(), bring_up=False)
    with pytest.raises(NvmeError, match="Identify CNS 1 before the admin queue exists") as err:
        nvme.identify_controller()
    assert "disable(), configure_admin_queue(), enable(), wait_ready()" in err.value.fix


def test_wait_ready_times_out_naming_cap_to():
    nvme = opened(FakeNvme(ready=False, timeout_units=1), bring_up=False)
    nvme.configure_admin_queue()
    nvme.enable()
    with pytest.raises(NvmeTimeout, match=r"CSTS.RDY did not become 1 within CAP.TO \(500 ms\) after CC.EN = 1"):
        nvme.wait_ready()


def test_wait_ready_fails_at_once_on_controller_fatal_status():
    nvme = opened(FakeNvme(fatal=True), bring_up=False)
    nvme.configure_admin_queue()
    nvme.enable()
    with pytest.raises(NvmeFatalError, match=r"Controller Fatal Status \(CSTS.CFS\) while enabling"):
        nvme.wait_ready()
    assert "CSTS.CFS" in nvme.failed


def test_set_queue_count_says_how_many_to_ask_for():
    fake = FakeNvme(max_queue_pairs=2)
    with pytest.raises(NvmeError, match="grants 2 I/O queue pairs, 3 asked for") as err:
        opened(fake, io_queues=2, spare_queues=1)
    assert err.value.fix == "open it with io_queues=2 or fewer"
    assert fake.mappings == []                              # nothing left mapped by the failed open


def test_io_through_the_queues_bring_up_made_splits_at_mdts():
    fake = FakeNvme(mdts=2)                                 # 16 KiB per command
    nvme = opened(fake, io_queues=2)
    buf = nvme.dma_buffer(64 << 10)
    buf.mem[:] = bytes(range(256)) * 256
    assert nvme.write(1, 8 * BLOCK, buf.iova, 64 << 10, qid=2) == 4
    assert fake.namespaces[1].read(8 * BLOCK, 64 << 10) == bytes(range(256)) * 256
    buf.mem[:] = bytes(64 << 10)
    assert nvme.read(1, 8 * BLOCK, buf.iova, 64 << 10) == 4
    assert buf.mem[:] == bytes(range(256)) * 256
    nvme.flush(1)


def test_an_error_status_names_the_command_and_its_fix():
    fake = FakeNvme()
    nvme = opened(fake)
    fake.namespaces[1].size = BLOCK                         # the namespace shrank under the driver
    buf = nvme.dma_buffer(PAGE)
    with pytest.raises(NvmeCommandError, match=r"read nsid 1 bytes \[0x0, 0x1000\) failed: LBA Out of Range") as err:
        nvme.read(1, 0, buf.iova, PAGE)
    assert err.value.fix == "stay inside the namespace (Identify Namespace NSZE)"


def test_close_deletes_the_io_queues_disables_and_unmaps():
    fake = FakeNvme()
    nvme = opened(fake)
    nvme.dma_buffer(PAGE)
    fake.log.clear()
    nvme.close()
    assert fake.log == ["DELETE_SQ 0x1", "DELETE_CQ 0x1", "CC=0x460000"]
    assert fake.mappings == [] and fake.device is None


# -- the request side alone ---------------------------------------------------------------------

def request():
    tracker = RequestTracker(2, bytearray(2 * PAGE), 0x40000)
    return tracker, tracker.alloc("read", IoOp.READ)


def test_data_pointer_is_prps_or_an_sgl_in_the_requests_page():
    _, req = request()
    assert rq.data_pointer(req, [(0x10000, 3 * PAGE)], sgl=False) == ((0x10000, req.page_iova), PSDT_PRP)
    assert req.page[:16] == (0x11000).to_bytes(8, "little") + (0x12000).to_bytes(8, "little")
    (address, _), psdt = rq.data_pointer(req, [(0x10000, 512), (0x30000, 512)], sgl=True)
    assert (address, psdt) == (req.page_iova, PSDT_SGL)


def test_rw_command_addresses_whole_blocks():
    _, req = request()
    sqe = rq.rw_command(IoOp.WRITE, req, 3, 512, (5 << 32) * 512, 8 * 512, (0x1000, 0), PSDT_PRP)
    opcode, cid, nsid = sqe[0], int.from_bytes(sqe[2:4], "little"), int.from_bytes(sqe[4:8], "little")
    cdw10, cdw11, cdw12 = (int.from_bytes(sqe[o:o + 4], "little") for o in (40, 44, 48))
    assert (opcode, cid, nsid, cdw10, cdw11, cdw12) == (IoOp.WRITE, req.cid, 3, 0, 5, 7)


def test_pieces_cover_the_transfer_at_most_limit_each():
    assert rq.pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert rq.pieces(8, 4) == [(0, 4), (4, 4)]


def test_check_passes_success_and_raises_an_error_status_with_its_fix():
    tracker, req = request()
    req.completion = Completion(0, 0, 1, req.cid, 1, 0, False)
    rq.check("0000:04:00.0", req)
    req.completion = Completion(0, 0, 1, req.cid, 1, 0x004, False)
    with pytest.raises(NvmeCommandError, match=r"0000:04:00.0: read failed: Data Transfer Error \(SCT 0x0 SC 0x04\)") \
            as err:
        rq.check("0000:04:00.0", req)
    assert "is every IOVA of the buffer mapped" in err.value.fix and err.value.status == 0x004


def test_the_documented_step_by_step_program_takes_the_steps_of_bring_up(monkeypatch, capsys):
    """docs/storage.md's nvme_steps.py, as typed, against the model (its exact output on QEMU's
    nvme: tests/vm/test_storage.py)."""
    from documented_commands import program_and_output

    program, shown = program_and_output("docs/storage.md", '"""nvme_steps.py')
    fake = FakeNvme(model="QEMU NVMe Ctrl", max_queue_pairs=16, namespaces={1: (256 << 20) // BLOCK})
    monkeypatch.setattr(NvmeController, "open", classmethod(lambda cls, bdf, **kw: cls(fake, **kw)))
    exec(compile(program, "nvme_steps.py", "exec"), {})
    assert [e for e in fake.log if e not in ("DELETE_SQ 0x1", "DELETE_CQ 0x1", "CC=0x460000")] == BRING_UP[:9] + \
        BRING_UP[10:]
    printed = capsys.readouterr().out.strip()
    assert printed == shown                                 # the model answers as QEMU's nvme0 does
    assert fake.namespaces[1].read(248 << 20, 4096) == bytes(range(256)) * 16
