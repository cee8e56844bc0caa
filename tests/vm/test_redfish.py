"""The fabric as a Redfish service, driven by DMTF's own client library (``redfish``): a real
`fabric` lab (the plugin's ``lab`` fixture: a detached lab and its fabric manager), real
hot-plug.  The service is started as a user would (``vfio-cxl fm redfish``), its events go
to a small HTTP listener on 127.0.0.1.  Figures are printed (pytest -s or -rA)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redfish

from tests.redfish_listener import Listener
from vfio_cxl.paths import REPO_ROOT

pytestmark = pytest.mark.lab("fabric")

FABRIC = "/redfish/v1/Fabrics/CXL"
CONN = f"{FABRIC}/Connections"
SUBS = "/redfish/v1/EventService/Subscriptions"


def move(gpu: str, host: str) -> dict:
    return {"Links": {"InitiatorEndpoints": [{"@odata.id": f"{FABRIC}/Endpoints/host-{host}"}],
                      "TargetEndpoints": [{"@odata.id": f"{FABRIC}/Endpoints/gpu-{gpu}"}]}}


@pytest.fixture
def service(lab):
    result = subprocess.run([sys.executable, "-m", "vfio_cxl", "fm", "redfish", "--lab", lab.name],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    url = result.stdout.strip()
    client = redfish.redfish_client(base_url=url.removesuffix("/redfish/v1/"), timeout=300, max_retry=1)
    yield url, client
    # --stop (the lab's own stop would end it too; the next test gets a lab without it)
    subprocess.run([sys.executable, "-m", "vfio_cxl", "fm", "redfish", "--lab", lab.name, "--stop"],
                   capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)


def gpu_dma_everywhere(lab, vm: str) -> list[str]:
    """`vfio-cxl gpu dma` on every GPU of ``vm``: the BDFs it checked (each must match)."""
    gpus = json.loads(lab.ssh(vm, "vfio-cxl gpu ls --json"))["gpus"]
    for gpu in gpus:
        answer = json.loads(lab.ssh(vm, f"vfio-cxl gpu dma --gpu {gpu['bdf']} --json"))
        assert answer["match"] and answer["sha256_read"] == answer["sha256_expected"], answer
    return [gpu["bdf"] for gpu in gpus]


def test_a_redfish_client_sees_the_fabric_moves_gpu0_and_hears_it_die(lab, service):
    url, rf = service
    root = rf.get("/redfish/v1/")
    assert root.status == 200 and root.dict["Fabrics"]["@odata.id"] == "/redfish/v1/Fabrics"
    fabric = rf.get(FABRIC).dict
    assert fabric["FabricType"] == "CXL" and fabric["Oem"]["VfioCxl"]["Lab"] == lab.name
    endpoints = {m["@odata.id"].rsplit("/", 1)[1] for m in rf.get(f"{FABRIC}/Endpoints").dict["Members"]}
    assert {"host-a", "host-b", "gpu-gpu0", "gpu-gpu1", "mem-a-mem0", "mem-b-mem0"} <= endpoints
    connections = {m["@odata.id"].rsplit("/", 1)[1] for m in rf.get(CONN).dict["Members"]}
    assert {"gpu0-a", "gpu1-b", "mem0-a", "mem0-b"} <= connections
    switch_ports = rf.get(f"{FABRIC}/Switches/a-sw0/Ports").dict["Members@odata.count"]
    assert switch_ports == 2   # up, ds0

    listener = Listener()
    try:
        created = rf.post(SUBS, body={"Destination": listener.url, "Context": "vm-test"})
        assert created.status == 201, created.text
        t0 = time.monotonic()
        moved = rf.post(CONN, body=move("gpu0", "b"))
        move_s = time.monotonic() - t0
        assert moved.status == 201, moved.text
        assert moved.getheader("Location") == f"{CONN}/gpu0-b"
        status = lab.fm.status()
        assert status["gpus"]["gpu0"]["owner"] == "b" and status["gpus"]["gpu0"]["state"] == "attached"
        _, attached = listener.until("gpu-attached")
        assert attached["OriginOfCondition"]["@odata.id"] == f"{FABRIC}/Endpoints/gpu-gpu0"
        bdfs = gpu_dma_everywhere(lab, "b")
        assert len(bdfs) == 2, bdfs   # gpu1 and the moved gpu0
        print(f"\nPOST Connection gpu0 -> b: {move_s:.2f} s (fm assign behind it); gpu dma in b on {bdfs}")

        t0 = time.monotonic()
        assert rf.delete(f"{CONN}/gpu0-b").status == 204
        print(f"DELETE Connection gpu0-b: {time.monotonic() - t0:.2f} s")
        assert lab.fm.status()["gpus"]["gpu0"]["state"] == "free"
        assert rf.get(f"{CONN}/gpu0-b").status == 404
        assert rf.post(CONN, body=move("gpu0", "a")).status == 201   # back where the lab had it

        pid = lab.fm.status()["gpus"]["gpu0"]["server_pid"]
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        seen, died = listener.until("gpu-server-died")
        assert died["MessageId"].endswith(".ResourceStatusChangedCritical")
        assert died["OriginOfCondition"]["@odata.id"] == f"{FABRIC}/Endpoints/gpu-gpu0"
        print(f"GPU server killed -> Redfish event at the listener: {(seen - killed) * 1e3:.0f} ms")
        assert rf.get(f"{FABRIC}/Endpoints/gpu-gpu0").dict["Status"]["Health"] == "Critical"
        lab.fm.restart("gpu0")   # leave the lab healthy
    finally:
        listener.close()


def test_bad_requests_get_redfish_errors_and_the_fm_stays_up(lab, service):
    url, rf = service

    def error(response, status: int, message_id: str) -> dict:
        assert response.status == status, response.text
        (info,) = response.dict["error"]["@Message.ExtendedInfo"]
        assert info["MessageId"] == f"Base.1.16.0.{message_id}", info
        return info

    info = error(rf.post(CONN, body=move("gpu7", "b")), 400, "ResourceNotFound")
    assert "gpu-gpu0" in info["Resolution"]
    error(rf.post(CONN, body=b'{"Links": {'), 400, "MalformedJSON")   # bytes: sent as they are
    info = error(rf.patch(f"{FABRIC}/Endpoints/gpu-gpu0", body={"Name": "mine"}), 400, "PropertyNotWritable")
    assert info["MessageArgs"] == ["Name"]
    error(rf.get(f"{FABRIC}/Endpoints/nothing"), 404, "ResourceNotFound")
    # the FM is up and nothing moved ("degraded" if an earlier test of this lab killed a server)
    assert lab.alive() and lab.fm.status()["gpus"]["gpu0"]["owner"] == "a"

    # A connection to a dead VM: b's QEMU is killed; the FM refuses the move, says why.
    qemu = lab.fm.status()["vms"]["b"]["qemu_pid"]
    os.kill(qemu, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while lab.fm.status()["vms"]["b"]["state"] != "dead":
        assert time.monotonic() < deadline, "the FM did not see b die"
        time.sleep(0.1)   # the FM's pidfd reports it; polling its status here
    info = error(rf.post(CONN, body=move("gpu0", "b")), 409, "GeneralError")
    assert "VM b is dead" in info["Resolution"] and "running VM" in info["Resolution"]
    status = lab.fm.status()
    assert status["gpus"]["gpu0"]["owner"] == "a" and status["state"] == "degraded"
    assert rf.get(f"{FABRIC}/Endpoints/host-b").dict["Status"]["State"] == "UnavailableOffline"
