"""GPU operations (vfio_cxl.lab.fm.gpuops) on a FAKE fabric, in this process: assign, release,
restart, the jobs a death queues, and each refusal's text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab.fm.gpuops import GpuOps, attach_parts, describe_holders
from vfio_cxl.lab.fm.state import Child, LabState

BDF = "0000:01:00.0"


class Proc:
    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        return self.returncode


class Fabric:
    """FAKE hot-plug: every call is logged; ``lets_go`` says whether the guest lets a GPU go."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.lets_go = True
        self.holders_found: list[dict] = []
        self.bind_error: LabError | None = None

    def hotplug_ports(self, vm):
        return ["hp0"]

    def start_server(self, gpu, generation):
        self.calls.append(("start_server", gpu, generation))
        return Proc(1000 + generation), {"socket": f"{gpu}-{generation}.sock"}

    def device_add(self, vm, dev_id, port, socket):
        self.calls.append(("device_add", vm, dev_id, port, socket))

    def device_del(self, vm, dev_id):
        self.calls.append(("device_del", vm, dev_id))

    def wait_deleted(self, vm, dev_id, timeout):
        return self.lets_go

    def bind_in_guest(self, vm, count, timeout):
        if self.bind_error:
            raise self.bind_error
        return {"driver": "vfio-pci", "bdf": BDF}

    def guest_bdf(self, vm, dev_id):
        return BDF

    def holders(self, vm, bdf):
        return self.holders_found

    def kill_in_guest(self, vm, bdf, pids):
        self.calls.append(("kill", vm, bdf, pids))
        return pids, {}


class Supervisor:
    def __init__(self):
        self.watched: list[str] = []

    def unwatch(self, child):
        pass

    def watch(self, child):
        self.watched.append(child.name)

    def note(self, child):
        pass


@pytest.fixture
def rig():
    record = SimpleNamespace(name="lab1", state="running", save=lambda: None)
    events = []
    state = LabState(record, lambda kind, message, **f: events.append((kind, message, f)),
                     lambda kind, job: None, can_remove=True)
    state.adopt([Child("vm", "a", Proc(10)), Child("vm", "b", Proc(11)),
                 Child("gpu", "gpu0", Proc(20), owner="a", port="hp0", files={"socket": "gpu0-0.sock"})],
                {"gpu0": {"irq": "msi", "vram_mib": 64}, "gpu1": {"irq": "msi", "vram_mib": 64}})
    fabric = Fabric()
    ops = GpuOps(fabric, state, Supervisor(), lambda fn, *a, **k: fn(*a, **k),
                 lambda kind, message, **f: events.append((kind, message, f)) or {}, lambda: 7)
    return SimpleNamespace(ops=ops, state=state, fabric=fabric, events=events)


def kinds(rig) -> list[str]:
    return [kind for kind, _, _ in rig.events]


def test_assigning_a_free_gpu_starts_its_server_and_plugs_it_in(rig):
    gpu = rig.state.gpus["gpu1"]
    result = rig.ops.assign(gpu, rig.state.vms["b"], keep=False)
    assert (gpu.state, gpu.owner, gpu.dev_id, gpu.port) == ("attached", "b", "gpu1-1-7", "hp0")
    assert rig.fabric.calls == [("start_server", "gpu1", 1), ("device_add", "b", "gpu1-1-7", "hp0", "gpu1-1.sock")]
    assert result["vm"] == "b" and result["bdf"] == BDF and result["from"] is None and result["move_s"] >= 0
    assert kinds(rig) == ["gpu-attached"]


def test_moving_a_gpu_releases_scrubs_and_attaches_it(rig):
    gpu = rig.state.gpus["gpu0"]
    result = rig.ops.assign(gpu, rig.state.vms["b"], keep=False)
    assert result["from"] == "a" and gpu.owner == "b" and gpu.scrubbed and gpu.generation == 1
    assert kinds(rig) == ["gpu-released", "gpu-attached"]
    assert rig.fabric.calls[0] == ("device_del", "a", "gpu0")


def test_keep_vram_keeps_the_server(rig):
    gpu = rig.state.gpus["gpu0"]
    rig.ops.release(gpu, keep_vram=True)
    assert (gpu.state, gpu.owner, gpu.scrubbed, gpu.generation) == ("free", None, False, 0)
    assert "VRAM kept" in rig.events[-1][1]


@pytest.mark.parametrize("setup, what", [
    (lambda s: setattr(s.vms["b"], "state", "dead"), "VM b is dead"),
    (lambda s: setattr(s.gpus["gpu1"], "state", "moving"), "GPU gpu1 is moving"),
])
def test_assign_refusals(rig, setup, what):
    setup(rig.state)
    with pytest.raises(LabError) as err:
        rig.ops.assign(rig.state.gpus["gpu1"], rig.state.vms["b"], keep=False)
    assert err.value.what == what and err.value.fix


def test_assigning_a_gpu_where_it_is_is_a_no_op(rig):
    assert rig.ops.assign(rig.state.gpus["gpu0"], rig.state.vms["a"], keep=False) == {
        "gpu": "gpu0", "vm": "a", "already": True}
    assert rig.fabric.calls == []


def test_a_vm_without_a_free_port_is_refused_before_the_gpu_leaves_its_owner(rig):
    rig.ops.assign(rig.state.gpus["gpu1"], rig.state.vms["b"], keep=False)   # b's one port
    with pytest.raises(LabError, match="VM b has no free hot-plug port for GPU gpu0"):
        rig.ops.assign(rig.state.gpus["gpu0"], rig.state.vms["b"], keep=False)
    assert rig.state.gpus["gpu0"].owner == "a"


def test_an_msix_gpu_is_not_hot_removed(rig):
    gpu = rig.state.gpus["gpu0"]
    gpu.irq = "msix"
    with pytest.raises(LabError) as err:
        rig.ops.release(gpu)
    assert "uses MSI-X" in err.value.what and 'irq = "msi"' in err.value.fix
    assert gpu.state == "attached" and rig.fabric.calls == []


def test_a_release_the_guest_refuses_names_the_holders_and_leaves_the_gpu_in_place(rig):
    rig.fabric.lets_go = False
    rig.fabric.holders_found = [{"pid": 42, "comm": "train", "path": "/dev/vfio/7"}]
    gpu = rig.state.gpus["gpu0"]
    with pytest.raises(LabError) as err:
        rig.ops.release(gpu, timeout=1)
    assert err.value.what == ("VM a did not release GPU gpu0 within 1 s (no DEVICE_DELETED for gpu0); "
                              "holding it: pid 42 (train) on /dev/vfio/7")
    assert err.value.fix == "stop that process in VM a, or vfio-cxl fm release gpu0 --force (kills it)"
    assert (gpu.state, gpu.owner) == ("attached", "a")


def test_a_forced_release_kills_the_holders(rig):
    rig.fabric.lets_go = False
    rig.fabric.holders_found = [{"pid": 42, "comm": "train", "path": "/dev/vfio/7"}]
    with pytest.raises(LabError, match="could not be killed"):
        rig.ops.release(rig.state.gpus["gpu0"], force=True, timeout=1)
    assert ("kill", "a", BDF, [42]) in rig.fabric.calls
    assert kinds(rig) == ["gpu-force"]


def test_a_failed_guest_check_leaves_the_gpu_failed_and_says_how_to_take_it_back(rig):
    rig.fabric.bind_error = LabError("not bound", "look")
    gpu = rig.state.gpus["gpu1"]
    with pytest.raises(LabError, match="not bound"):
        rig.ops.assign(gpu, rig.state.vms["b"], keep=False)
    assert (gpu.state, gpu.owner) == ("failed", "b")
    assert kinds(rig) == ["gpu-attach-failed"] and "fm restart gpu1" in rig.events[0][1]


def test_restart_gives_a_fresh_server_back_in_its_vm(rig):
    gpu = rig.state.gpus["gpu0"]
    result = rig.ops.restart(gpu)
    assert result["server_pid"] == 1001 and gpu.owner == "a" and gpu.state == "attached"
    assert kinds(rig) == ["gpu-released", "gpu-attached", "gpu-restarted"]


def test_freeing_a_dead_vms_gpu_skips_one_that_moved_meanwhile(rig):
    rig.ops.free_dead_vms_gpu("gpu0", "b")
    assert rig.state.gpus["gpu0"].owner == "a" and rig.events == []
    rig.ops.free_dead_vms_gpu("gpu0", "a")
    assert rig.state.gpus["gpu0"].state == "free" and kinds(rig) == ["gpu-freed"]


def test_surprise_removal_sends_device_del_once_and_release_does_not_repeat_it(rig):
    gpu = rig.state.gpus["gpu0"]
    rig.state.set_child(gpu, "failed")
    rig.ops.surprise_removal("gpu0", seen=0.0)
    assert rig.fabric.calls == [("device_del", "a", "gpu0")] and gpu.files["pending_delete"] == "gpu0"
    rig.ops.restart(gpu)
    assert [c for c in rig.fabric.calls if c[0] == "device_del"] == [("device_del", "a", "gpu0")]


def test_a_lab_without_hot_plug_has_no_fabric():
    ops = GpuOps(object(), None, None, None, None, None)
    with pytest.raises(LabError, match="this lab has no fabric"):
        ops.fabric()


def test_describe_holders_quotes_odd_names():
    assert describe_holders([{"pid": 1, "comm": "a b\n", "path": "/x"}]) == 'pid 1 ("a b\\n") on /x'
    assert describe_holders([]) == "no process (the kernel itself?)"


def test_attach_parts_without_guest_times_is_device_add_only():
    assert attach_parts(1.0, 1.5, {}) == {"device_add_s": 0.5}
