"""The Redfish service: the app's own logic against a FAKE fabric manager client (model, links,
writes, errors), event delivery to a real HTTP listener, and the whole path -- `fm redfish`
starting the real service process, which talks to a real fabric manager over its socket --
over the fake lab of test_lab_fm.py (sleeping processes for VMs and GPU servers)."""

from __future__ import annotations

import copy
import json
import re
import xml.etree.ElementTree as ET
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import topology
from vfio_cxl.lab.fm import protocol
from vfio_cxl.lab.fm.procs import ProcessId
from vfio_cxl.lab.fm.protocol import RemoteError
from vfio_cxl.lab.fm.redfish.app import MAX_SUBSCRIPTIONS, Subscriptions, create_app
from vfio_cxl.lab.fm.redfish.csdl import EDM, EDMX
from vfio_cxl.lab.fm.redfish.events import Deliverer, redfish_event
from vfio_cxl.lab.fm.redfish.model import FABRIC, ROOT
from vfio_cxl.lab.fm.redfish.process import RedfishService
from vfio_cxl.paths import REPO_ROOT

from test_lab_fm import FakeFm, env  # noqa: F401 (fixture)
from tests.redfish_listener import Listener

CONN = f"{FABRIC}/Connections"
STATUS = {
    "name": "fabric-1", "topology": "fabric", "state": "running", "fm_pid": 1, "created": 1.0,
    "vms": {"a": {"state": "running", "ssh_port": 40001}, "b": {"state": "running", "ssh_port": 40002}},
    "gpus": {"gpu0": {"owner": "a", "state": "attached", "server_pid": 10, "vram_mib": 64, "irq": "msi",
                      "scrubbed": True, "port": None},
             "gpu1": {"owner": "b", "state": "attached", "server_pid": 11, "vram_mib": 64, "irq": "msi",
                      "scrubbed": True, "port": None}},
    "smcs": {}, "free_hotplug_ports": {"a": ["hp0"], "b": ["hp0"]},
}


class FakeClient:
    """FAKE FM client: the status of a `fabric` lab; assign/release move gpus like the FM would
    (the real FM's moves are tested in test_lab_fm.py and the VM tests)."""

    def __init__(self):
        self.state = copy.deepcopy(STATUS)
        self.calls = []

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def status(self):
        return copy.deepcopy(self.state)

    def assign(self, gpu, vm, keep_vram=False):
        self.calls.append(("assign", gpu, vm, keep_vram))
        if self.state["vms"][vm]["state"] != "running":   # what the real FM answers (op_assign)
            raise RemoteError(f"VM {vm} is {self.state['vms'][vm]['state']}", f"assign {gpu} to a running VM")
        self.state["gpus"][gpu].update(owner=vm, state="attached", port="hp0")
        return {"gpu": gpu, "vm": vm}

    def release(self, gpu):
        self.calls.append(("release", gpu))
        self.state["gpus"][gpu].update(owner=None, state="free", port=None)
        return {"gpu": gpu}


@pytest.fixture
def fake():
    fm = FakeClient()
    app = create_app(fm, topology.load("fabric"))
    return fm, app.test_client()


def check_error(response, status: int, message_id: str, *words: str) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    (info,) = error["@Message.ExtendedInfo"]
    assert info["MessageId"] == f"Base.1.16.0.{message_id}" == error["code"], info
    assert info["Resolution"], info
    for word in words:
        assert word in json.dumps(info), (word, info)
    return info


def move_body(gpu="gpu0", host="b", **extra) -> dict:
    return {"Links": {"InitiatorEndpoints": [{"@odata.id": f"{FABRIC}/Endpoints/host-{host}"}],
                      "TargetEndpoints": [{"@odata.id": f"{FABRIC}/Endpoints/gpu-{gpu}"}]}, **extra}


def test_every_link_resolves_and_the_fabric_is_modelled(fake):
    fm, client = fake
    seen, todo = {}, [f"{ROOT}/"]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        response = client.get(path)
        assert response.status_code == 200, path
        assert response.headers["OData-Version"] == "4.0"
        body = seen[path] = response.get_json()
        assert body["@odata.id"] == path and body["@odata.type"].startswith("#")

        def refs(node):
            if isinstance(node, dict):
                if set(node) == {"@odata.id"}:
                    yield node["@odata.id"]
                for value in node.values():
                    yield from refs(value)
            elif isinstance(node, list):
                for value in node:
                    yield from refs(value)
        todo.extend(refs(body))
    fabric = seen[FABRIC]
    assert fabric["FabricType"] == "CXL" and fabric["@odata.type"] == "#Fabric.v1_3_2.Fabric"
    endpoints = {p.rsplit("/", 1)[1] for p in seen if p.startswith(f"{FABRIC}/Endpoints/")}
    assert endpoints == {"host-a", "host-b", "gpu-gpu0", "gpu-gpu1", "mem-a-mem0", "mem-b-mem0"}
    connections = {p.rsplit("/", 1)[1] for p in seen if p.startswith(f"{CONN}/")}
    assert connections == {"gpu0-a", "gpu1-b", "mem0-a", "mem0-b"}
    assert seen[f"{CONN}/mem0-a"]["ConnectionType"] == "Memory"
    zone_a = {m["@odata.id"].rsplit("/", 1)[1] for m in seen[f"{FABRIC}/Zones/a"]["Links"]["Endpoints"]}
    assert zone_a == {"host-a", "gpu-gpu0", "mem-a-mem0"}
    ports = seen[f"{FABRIC}/Switches/a-sw0/Ports/ds0"]
    assert ports["PortType"] == "DownstreamPort" and ports["Links"]["AssociatedEndpoints"] == [
        {"@odata.id": f"{FABRIC}/Endpoints/mem-a-mem0"}]
    assert seen[f"{ROOT}/"]["Links"]["Sessions"]["@odata.id"] in seen


def walk(client) -> dict[str, dict]:
    """Every resource reachable from the service root, by path."""
    seen, todo = {}, [f"{ROOT}/"]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen[path] = client.get(path).get_json()
            todo += [v for v in re.findall(r'"@odata.id": "([^"]+)"', json.dumps(seen[path]))]
    return seen


def test_metadata_declares_every_type_the_service_returns(fake):
    fm, client = fake
    response = client.get(f"{ROOT}/$metadata")
    assert response.status_code == 200 and response.mimetype == "application/xml"
    assert response.headers["OData-Version"] == "4.0"
    edmx = ET.fromstring(response.get_data())
    included = {}
    for reference in edmx.iter(f"{{{EDMX}}}Reference"):
        for include in reference.iter(f"{{{EDMX}}}Include"):
            included[include.get("Namespace")] = reference.get("Uri")
    client.post(f"{ROOT}/EventService/Subscriptions", json={"Destination": "http://127.0.0.1:9/x"})
    resources = walk(client)
    types = set(re.findall(r'"@odata.type": "#([^"]+)"', json.dumps(list(resources.values()))))
    assert {"Fabric.v1_3_2.Fabric", "EndpointCollection.EndpointCollection", "VfioCxl.v1_0_0.VfioCxl",
            "EventDestination.v1_14_0.EventDestination"} <= types
    for odata_type in types:
        namespace, _, name = odata_type.rpartition(".")
        unversioned = namespace.split(".")[0]
        assert namespace in included and unversioned in included, odata_type
        uri = included[namespace]
        assert uri.endswith(f"/{unversioned}_v1.xml"), (odata_type, uri)
    container = edmx.find(f".//{{{EDM}}}EntityContainer")
    assert container.get("Extends") == "ServiceRoot.v1_16_0.ServiceContainer"
    # the lab's OEM schema is served where $metadata says, and defines the type the resources name
    oem = client.get(included["VfioCxl.v1_0_0"])
    assert oem.status_code == 200 and oem.mimetype == "application/xml"
    schema = ET.fromstring(oem.get_data()).find(f".//{{{EDM}}}Schema[@Namespace='VfioCxl.v1_0_0']")
    (oem_type,) = schema.iter(f"{{{EDM}}}ComplexType")
    assert oem_type.get("Name") == "VfioCxl" and oem_type.get("BaseType") == "Resource.OemObject"


def test_the_odata_service_document_lists_resources_that_resolve(fake):
    fm, client = fake
    document = client.get(f"{ROOT}/odata").get_json()
    assert document["@odata.context"] == f"{ROOT}/$metadata"
    assert {entry["name"] for entry in document["value"]} >= {"Service", "Fabrics", "EventService"}
    for entry in document["value"]:
        assert client.get(entry["url"]).status_code == 200, entry


def test_post_a_connection_assigns_and_delete_releases(fake):
    fm, client = fake
    response = client.post(CONN, json=move_body())
    assert response.status_code == 201, response.get_json()
    assert response.headers["Location"] == f"{CONN}/gpu0-b" == response.get_json()["@odata.id"]
    assert fm.calls == [("assign", "gpu0", "b", False)]
    assert client.get(f"{CONN}/gpu0-a").status_code == 404
    zone_b = client.get(f"{FABRIC}/Zones/b").get_json()["Links"]["Endpoints"]
    assert {"@odata.id": f"{FABRIC}/Endpoints/gpu-gpu0"} in zone_b
    client.post(CONN, json=move_body("gpu1", "a", Oem={"VfioCxl": {"KeepVRAM": True}}))
    assert fm.calls[-1] == ("assign", "gpu1", "a", True)
    assert client.delete(f"{CONN}/gpu0-b").status_code == 204
    assert fm.calls[-1] == ("release", "gpu0")
    gpu0 = client.get(f"{FABRIC}/Endpoints/gpu-gpu0").get_json()
    assert gpu0["Status"]["State"] == "StandbyOffline" and gpu0["Oem"]["VfioCxl"]["Owner"] is None


@pytest.mark.parametrize("body, status, message_id, words", [
    (move_body("gpu9"), 400, "ResourceNotFound", ["gpu-gpu9", "gpu-gpu0"]),
    (move_body(host="c"), 400, "ResourceNotFound", ["host-c", "host-b"]),
    ({"Links": {"InitiatorEndpoints": [{"@odata.id": f"{FABRIC}/Endpoints/gpu-gpu1"}],
                "TargetEndpoints": [{"@odata.id": f"{FABRIC}/Endpoints/gpu-gpu0"}]}},
     400, "PropertyValueNotInList", ["Links/InitiatorEndpoints", "host-a"]),
    ({"Name": "x"}, 400, "PropertyMissing", ["Links", "InitiatorEndpoints"]),
    ({"Links": {"TargetEndpoints": "gpu0"}}, 400, "PropertyValueTypeError", ["Links/TargetEndpoints"]),
    ({**move_body(), "Id": "mine"}, 400, "PropertyNotWritable", ["Id"]),
    ({**move_body(), "Colour": 1}, 400, "PropertyUnknown", ["Colour"]),
])
def test_bad_connections_are_refused_saying_what_would_be_right(fake, body, status, message_id, words):
    fm, client = fake
    check_error(client.post(CONN, json=body), status, message_id, *words)
    assert fm.calls == []   # nothing reached the FM


def test_a_connection_to_a_dead_vm_is_the_fms_refusal_and_changes_nothing(fake):
    fm, client = fake
    fm.state["vms"]["b"]["state"] = "dead"
    assert client.get(f"{FABRIC}/Endpoints/host-b").get_json()["Status"] == {
        "State": "UnavailableOffline", "Health": "Critical"}
    response = client.post(CONN, json=move_body())
    info = check_error(response, 409, "GeneralError", "VM b is dead", "running VM")
    assert info["MessageSeverity"] == "Critical" and info["Message"].startswith("A general error has occurred.")
    assert response.get_json()["error"]["message"] == "The fabric manager refused: VM b is dead"
    assert fm.state["gpus"]["gpu0"]["owner"] == "a"


def test_malformed_json_patch_and_other_bad_requests(fake):
    fm, client = fake
    check_error(client.post(CONN, data=b'{"Links": ', content_type="application/json"), 400, "MalformedJSON")
    check_error(client.post(CONN, data=b"[1, 2]", content_type="application/json"), 400, "MalformedJSON", "list")
    check_error(client.patch(f"{FABRIC}/Endpoints/gpu-gpu0", json={"Name": "mine"}), 400,
                "PropertyNotWritable", "Name")
    check_error(client.patch(FABRIC, json={"FabricType": "PCIe"}), 400, "PropertyNotWritable", "FabricType")
    check_error(client.patch(f"{FABRIC}/Endpoints/gpu-gpu9", json={"Name": "x"}), 404, "ResourceNotFound",
                "gpu-gpu9")
    check_error(client.get(f"{FABRIC}/Nowhere"), 404, "ResourceNotFound")
    response = client.put(FABRIC, json={})
    check_error(response, 405, "OperationNotAllowed")
    assert "PATCH" in response.headers["Allow"]
    check_error(client.delete(f"{CONN}/mem0-a"), 405, "ResourceCannotBeDeleted")
    check_error(client.delete(f"{CONN}/gpu0-b"), 404, "ResourceNotFound", "gpu0-b")
    check_error(client.post(CONN, data=b"x" * (65 << 10), content_type="application/json"), 413, "GeneralError")
    assert fm.calls == []


def test_subscriptions_are_bounded_and_checked(fake):
    fm, client = fake
    subs = f"{ROOT}/EventService/Subscriptions"
    check_error(client.post(subs, json={"Destination": "http://10.0.0.1:80/x"}), 400, "PropertyValueFormatError",
                "127.0.0.1")
    check_error(client.post(subs, json={"Destination": "http://127.0.0.1:9/", "Protocol": "SNMPv3"}), 400,
                "PropertyValueNotInList", "Redfish")
    check_error(client.post(subs, json={"Destination": "http://127.0.0.1:9/", "Context": "x" * 300}), 400,
                "StringValueTooLong")
    check_error(client.post(subs, json={}), 400, "PropertyMissing", "Destination")
    for i in range(MAX_SUBSCRIPTIONS):
        response = client.post(subs, json={"Destination": f"http://127.0.0.1:9/{i}", "Context": str(i)})
        assert response.status_code == 201
    check_error(client.post(subs, json={"Destination": "http://127.0.0.1:9/"}), 503,
                "EventSubscriptionLimitExceeded")
    assert client.get(subs).get_json()["Members@odata.count"] == MAX_SUBSCRIPTIONS
    assert client.delete(f"{subs}/1").status_code == 204
    check_error(client.delete(f"{subs}/1"), 404, "ResourceNotFound")


def test_events_are_delivered_to_a_listener_as_redfish_events():
    subs, listener = Subscriptions(), Listener()
    try:
        subs.create({"Destination": listener.url, "Context": "mine"})
        deliverer = Deliverer(subs, log=lambda text: None)
        deliverer.offer({"seq": 7, "time": 1795430000.25, "monotonic": 1.0, "kind": "lab-ready", "message": "x"})
        deliverer.offer({"seq": 8, "time": 1795430000.5, "monotonic": 2.0, "kind": "gpu-server-died",
                         "message": "GPU gpu0's server died", "gpu": "gpu0", "owner": "a", "pid": 5,
                         "returncode": -9})
        event = listener.next(timeout=10)   # lab-ready is not delivered: the first is seq 8
        (record,) = event["Events"]
        assert event["Context"] == "mine" and event["@odata.type"].startswith("#Event.")
        assert record["MessageId"] == "ResourceEvent.1.3.0.ResourceStatusChangedCritical"
        assert record["OriginOfCondition"] == {"@odata.id": f"{FABRIC}/Endpoints/gpu-gpu0"}
        assert record["EventId"] == "8" and record["Oem"]["VfioCxl"]["kind"] == "gpu-server-died"
        assert record["EventTimestamp"] == "2026-11-23T10:33:20.500+00:00"   # date -u -d @1795430000.5
    finally:
        listener.close()
    assert redfish_event({"seq": 1, "time": 0, "kind": "vm-died", "message": "m", "vm": "b"}, "")[
        "Events"][0]["OriginOfCondition"] == {"@odata.id": f"{FABRIC}/Endpoints/host-b"}


def test_the_redfish_op_is_checked_like_every_other():
    protocol.parse_request(b'{"version": 1, "op": "redfish", "port": 8000, "stop": false}')
    with pytest.raises(protocol.ProtocolError, match="'port' must be int"):
        protocol.parse_request(b'{"version": 1, "op": "redfish", "port": "8000"}')


def test_a_port_in_use_is_refused_at_once(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LabError, match=f"cannot listen on 127.0.0.1:{port}"):
            RedfishService.start(fm_socket=tmp_path / "fm.sock", lab="x", topology=topology.load("fabric"), port=port,
                                 log=tmp_path / "redfish.log")


# -- the real service process and a real fabric manager (over the fake lab) ---------------------

def http(method: str, url: str, body=None) -> tuple[int, dict | None]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_fm_redfish_serves_moves_delivers_and_stops_with_the_lab(env):
    fm = FakeFm("--fabric")
    rundir = Path(fm.record.rundir)
    result = subprocess.run([sys.executable, "-m", "vfio_cxl", "fm", "redfish", "--lab", fm.name],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    url = result.stdout.strip()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/redfish/v1/")
    base = url.removesuffix("/redfish/v1/")
    with fm.client() as client:
        info = client.status()["redfish"]
        assert info["url"] == url and info["state"] == "running"
        assert client.redfish()["already"]   # asking again reports the running one
    pid = info["pid"]
    assert str(rundir) in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    status, root = http("GET", url)   # answers at once: the FM handed it a listening socket
    assert status == 200 and root["Fabrics"] == {"@odata.id": f"{ROOT}/Fabrics"}

    listener = Listener()
    try:
        status, sub = http("POST", f"{base}{ROOT}/EventService/Subscriptions",
                           {"Destination": listener.url, "Context": "fast"})
        assert status == 201
        (rundir / "deleted-gpu0").touch()   # the fake's DEVICE_DELETED for gpu0's boot device
        status, created = http("POST", f"{base}{CONN}", move_body())
        assert status == 201 and created["Id"] == "gpu0-b", created
        with fm.client() as client:
            gpu0 = client.status()["gpus"]["gpu0"]
        assert gpu0["owner"] == "b" and gpu0["state"] == "attached"
        kinds = [listener.next(timeout=10)["Events"][0]["Oem"]["VfioCxl"]["kind"] for _ in range(2)]
        assert kinds == ["gpu-released", "gpu-attached"]

        (rundir / f"deleted-{gpu0['dev_id']}").touch()
        status, _ = http("DELETE", f"{base}{CONN}/gpu0-b")
        assert status == 204
        with fm.client() as client:
            assert client.status()["gpus"]["gpu0"]["state"] == "free"
        assert listener.next(timeout=10)["Events"][0]["Oem"]["VfioCxl"]["kind"] == "gpu-released"

        status, error = http("POST", f"{base}{CONN}", move_body("gpu9"))
        assert status == 400 and "gpu-gpu9" in error["error"]["message"]
        with fm.client() as client:   # the FM is up and unchanged
            assert client.status()["gpus"]["gpu0"]["state"] == "free"

        with fm.client() as client:
            server_pid = client.status()["gpus"]["gpu1"]["server_pid"]
        os.kill(server_pid, signal.SIGKILL)
        event = listener.next(timeout=10)["Events"][0]
        assert event["MessageId"].endswith("ResourceStatusChangedCritical")
        assert event["OriginOfCondition"] == {"@odata.id": f"{FABRIC}/Endpoints/gpu-gpu1"}
    finally:
        listener.close()

    result = subprocess.run([sys.executable, "-m", "vfio_cxl", "fm", "redfish", "--lab", fm.name, "--stop"],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0 and f"(pid {pid}) stopped" in result.stdout, result.stderr
    assert ProcessId.of(pid) is None or not Path(f"/proc/{pid}").exists()
    # Started again, it goes with the lab.
    with fm.client() as client:
        pid = client.redfish()["pid"]
        client.stop()
    assert fm.wait() == 0
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)   # a reaped child: /proc entry gone (the FM waited for it)
    assert not Path(f"/proc/{pid}").exists()
