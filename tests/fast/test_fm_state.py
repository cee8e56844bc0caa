"""The lab's state machine (vfio_cxl.lab.fm.state): adoption, transitions, and what each death
records and queues -- in this process, no lab."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab.fm.state import Child, LabState, describe_exit


class Proc:
    def __init__(self, pid: int, returncode: int | None = None):
        self.pid, self.returncode = pid, returncode

    def poll(self):
        return self.returncode


def make(can_remove=True, specs=None):
    record = SimpleNamespace(name="lab1", state="starting", saves=0)
    record.save = lambda: setattr(record, "saves", record.saves + 1)
    events, jobs = [], []
    state = LabState(record, lambda kind, message, **fields: events.append((kind, message, fields)),
                     lambda kind, job: jobs.append((kind, job)), can_remove=can_remove)
    children = [Child("vm", "a", Proc(10), ssh_port=2222), Child("vm", "b", Proc(11)),
                Child("gpu", "gpu0", Proc(20), owner="a"), Child("smc", "smc0", Proc(30), hosts=("a", "b"))]
    specs = specs if specs is not None else {
        "gpu0": {"irq": "msi", "vram_mib": 64, "restart": "on-failure", "max_restarts": 1},
        "gpu1": {"irq": "msix", "vram_mib": 32}}
    adopted = state.adopt(children, specs)
    return state, record, events, jobs, adopted


def died(state: LabState, child: Child, returncode: int) -> Child:
    child.returncode = returncode
    state.exited(child)
    return child


def test_adoption_sorts_children_and_frees_the_gpus_without_a_server():
    state, _, _, _, adopted = make()
    assert [vm.name for vm in adopted] == ["a", "b"]
    assert {n: c.state for n, c in state.vms.items()} == {"a": "running", "b": "running"}
    assert (state.gpus["gpu0"].state, state.gpus["gpu0"].dev_id, state.gpus["gpu0"].irq) == ("attached", "gpu0", "msi")
    gpu1 = state.gpus["gpu1"]
    assert (gpu1.state, gpu1.popen, gpu1.irq, gpu1.vram_mib, gpu1.restart) == ("free", None, "msix", 32, "no")
    assert state.smcs["smc0"].state == "attached"
    assert [c.name for c in state.children()] == ["a", "b", "gpu0", "gpu1", "smc0"]


def test_running_and_stopping_are_written_to_the_record():
    state, record, *_ = make()
    state.set_lab("running")
    state.set_lab("running")   # no change: not written again
    state.set_lab("degraded")  # not written
    assert (record.state, record.saves) == ("running", 1)
    with pytest.raises(AssertionError):
        state.set_lab("exploded")
    with pytest.raises(AssertionError):
        state.set_child(state.vms["a"], "moving")   # a GPU's state, not a VM's


def test_a_vm_death_degrades_the_lab_and_queues_freeing_its_gpus():
    state, _, events, jobs, _ = make()
    state.vms["a"].qemu_pid = 12
    vm = died(state, state.vms["a"], -9)
    assert (vm.state, state.state) == ("dead", "degraded")
    assert [(k, m) for k, m, _ in events] == [
        ("vm-died", "VM a: QEMU (pid 12) was killed by SIGKILL; the other VMs are untouched")]
    assert jobs == [("free_gpu", {"gpu": "gpu0", "vm": "a"})]


def test_a_death_while_the_lab_stops_is_no_news():
    state, _, events, jobs, _ = make()
    state.set_lab("stopping")
    for child in state.children():
        if child.popen is not None:
            child.returncode = 0
            state.exited(child)
    assert {c.name: c.state for c in state.children() if c.popen} == {
        "a": "stopped", "b": "stopped", "gpu0": "stopped", "smc0": "stopped"}
    assert events == [] and jobs == []


def test_a_gpu_server_death_queues_removal_and_a_restart_within_its_budget():
    state, _, events, jobs, _ = make()
    gpu = died(state, state.gpus["gpu0"], 1)
    assert gpu.state == "failed" and state.state == "degraded"
    assert events[0][:2] == ("gpu-server-died", "GPU gpu0 (in VM a): server pid 20 exited with 1")
    assert [k for k, _ in jobs] == ["surprise_removal", "auto_restart"]
    assert jobs[0][1]["gpu"] == "gpu0" and jobs[0][1]["seen"] > 0


def test_a_gpu_past_its_restart_budget_stays_failed():
    state, _, events, jobs, _ = make(can_remove=False)
    state.gpus["gpu0"].restarts = 1
    died(state, state.gpus["gpu0"], 1)
    assert jobs == []   # no device_del in this lab, no restarts left
    assert events[-1][:2] == ("gpu-restart-limit", "GPU gpu0: restarted 1 times already (max_restarts = 1); "
                                                   "it stays failed")


def test_an_smc_death_is_reported_with_its_hosts():
    state, _, events, _, _ = make()
    smc = died(state, state.smcs["smc0"], 139)
    assert smc.state == "failed" and state.state == "degraded"
    assert events[0][1] == ("shared-memory controller smc0 (hosts a, b): server pid 30 exited with 139 "
                            "(SIGSEGV)")


def test_unknown_names_are_refused_with_the_known_ones():
    state, *_ = make(specs={})
    with pytest.raises(LabError) as err:
        state.vm("c")
    assert (err.value.what, err.value.fix) == ("lab lab1 has no VM 'c'", "VMs: a, b")
    with pytest.raises(LabError) as err:
        state.gpu("gpu9")
    assert err.value.fix == "GPUs: gpu0"


@pytest.mark.parametrize("code, text", [(None, "is running"), (0, "exited with 0"), (-15, "was killed by SIGTERM"),
                                        (-99, "was killed by signal 99"), (137, "exited with 137 (SIGKILL)"),
                                        (250, "exited with 250")])
def test_describe_exit(code, text):
    assert describe_exit(code) == text
