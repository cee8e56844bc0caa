"""Request dispatch (vfio_cxl.lab.fm.dispatch): every answer is ok or a clear error, a bug in an
op included, and the loop's own ops refuse what they cannot do."""

from __future__ import annotations

from types import SimpleNamespace

from vfio_cxl.errors import LabError
from vfio_cxl.lab.fm import protocol
from vfio_cxl.lab.fm.dispatch import SLOW_OPS, Dispatcher
from vfio_cxl.lab.fm.events import EVENT_PAGE_MAX, EventLog
from vfio_cxl.lab.fm.state import Child, LabState


def fm(lab=None):
    record = SimpleNamespace(name="lab1", logdir="LOGS", save=lambda: None)
    logs = []
    fm = SimpleNamespace(record=record, eventlog=EventLog(), log=logs.append, logs=logs, redfish=None,
                         lab=lab or SimpleNamespace(topology=None), stop_requested=False)
    fm.event = lambda kind, message, **fields: fm.eventlog.record(kind, message, **fields)[0]
    fm.state = LabState(record, fm.event, lambda kind, job: None, can_remove=False)
    return fm


def run(fm, op, **fields):
    return Dispatcher(fm).run(SimpleNamespace(follow=False, backlog=[]), protocol.request(op, **fields))


def test_slow_ops_are_the_ones_that_move_gpus():
    assert set(SLOW_OPS) == {"assign", "release", "restart"} and set(SLOW_OPS) <= set(protocol.OPS)
    assert all(hasattr(Dispatcher, f"op_{op}") for op in protocol.OPS)


def test_a_bug_in_an_op_is_an_error_answer_and_a_log_line():
    lab = fm()
    lab.state = None   # status raises AttributeError
    answer = run(lab, "status")
    assert answer["ok"] is False
    assert answer["error"]["what"].startswith("fabric manager internal error: AttributeError(")
    assert answer["error"]["fix"] == "see LOGS/fm.log and report it"
    assert "Traceback" in lab.logs[0]


def test_events_limit_out_of_range():
    answer = run(fm(), "events", limit=EVENT_PAGE_MAX + 1)
    assert answer["error"] == {"what": f"events limit {EVENT_PAGE_MAX + 1} is out of range",
                               "fix": f"give 1 <= limit <= {EVENT_PAGE_MAX}"}


def test_follow_hands_the_client_the_rest_of_the_history():
    lab = fm()
    for i in range(3):
        lab.event("tick", f"tick {i}")
    client = SimpleNamespace(follow=False, backlog=[])
    answer = Dispatcher(lab).run(client, protocol.request("events", limit=1, follow=True))
    assert [ev["seq"] for ev in answer["result"]["events"]] == [1] and client.follow
    assert len(client.backlog) == 2


def test_ssh_info_of_a_dead_vm_says_why_and_where_the_log_is():
    lab = fm()
    lab.state.adopt([Child("vm", "a", SimpleNamespace(pid=5), files={"qemu_log": "Q"})], {})
    lab.state.vms["a"].state, lab.state.vms["a"].returncode = "dead", -9
    answer = run(lab, "ssh_info", vm="a")
    assert answer["error"]["what"] == "VM a of lab lab1 is dead: its QEMU was killed by SIGKILL"
    assert answer["error"]["fix"].startswith("see Q (kept in LOGS after vm down)")


def test_stop_records_the_request_and_stops_the_loop():
    lab = fm()
    assert run(lab, "stop")["result"]["stopping"] == "lab1"
    assert lab.stop_requested and lab.eventlog.events[-1]["kind"] == "stop-requested"


def test_redfish_needs_a_topology_to_model():
    answer = run(fm(), "redfish")
    assert answer["error"] == {"what": "lab lab1 has no topology for a Redfish service to model",
                               "fix": "use a real lab"}


def test_a_lab_error_is_the_answer():
    lab = fm()
    lab.gpuops = SimpleNamespace(restart=lambda gpu: (_ for _ in ()).throw(LabError("no", "fix it")))
    lab.state.gpus["gpu0"] = Child("gpu", "gpu0", None)
    assert run(lab, "restart", gpu="gpu0") == protocol.error("no", "fix it")
