"""The lab as Redfish resources: a pure function of the topology and one ``fm status``.

Nothing here holds state: every request builds the resources again from the fabric
manager's answer, so the Redfish view can never disagree with the FM (its one owner).

Property names, enumerations and ``@odata.type`` versions follow DMTF's published schemas
(DSP8010: ServiceRoot, Fabric, Switch, Port, Endpoint, Zone, Connection, EventService,
EventDestination, Event, Message; DSP0268 for the collections).  Identifiers:

    Fabrics/CXL                                   the lab's one fabric (FabricType CXL)
    Fabrics/CXL/Switches/{vm}-{switch}            a CXL switch in a host, Ports: up, {downstream}
    Fabrics/CXL/Endpoints/host-{vm}               a host (its root complex): the initiator
    Fabrics/CXL/Endpoints/gpu-{gpu}               a GPU (Processor, target), wherever it sits
    Fabrics/CXL/Endpoints/mem-{vm}-{type3}        a Type3 memory device (MediaController)
    Fabrics/CXL/Endpoints/smc-{smc}               a shared-memory controller
    Fabrics/CXL/Zones/{vm}                        what host {vm} sees
    Fabrics/CXL/Connections/{gpu}-{vm}            GPU {gpu} attached to host {vm} (POST / DELETE)
    Fabrics/CXL/Connections/{type3}-{vm}          Type3 memory of host {vm} (ConnectionType Memory)
    Fabrics/CXL/Connections/{smc}-{vm}            a shared-memory controller's function in {vm}
"""

from __future__ import annotations

ROOT = "/redfish/v1"
FABRIC_ID = "CXL"
FABRIC = f"{ROOT}/Fabrics/{FABRIC_ID}"
REDFISH_VERSION = "1.20.0"
BASE_REGISTRY = "Base.1.16.0"
EVENT_REGISTRY = "ResourceEvent.1.3.0"

TYPES = {
    "ServiceRoot": "#ServiceRoot.v1_16_0.ServiceRoot",
    "Fabric": "#Fabric.v1_3_2.Fabric",
    "Switch": "#Switch.v1_9_2.Switch",
    "Port": "#Port.v1_11_0.Port",
    "Endpoint": "#Endpoint.v1_8_1.Endpoint",
    "Zone": "#Zone.v1_6_2.Zone",
    "Connection": "#Connection.v1_3_0.Connection",
    "EventService": "#EventService.v1_10_2.EventService",
    "EventDestination": "#EventDestination.v1_14_0.EventDestination",
    "Event": "#Event.v1_10_0.Event",
    "Message": "#Message.v1_2_0.Message",
    "SessionService": "#SessionService.v1_1_9.SessionService",
}


def ref(path: str) -> dict:
    return {"@odata.id": path}


def collection(path: str, kind: str, name: str, members: list[str]) -> dict:
    return {"@odata.id": path, "@odata.type": f"#{kind}Collection.{kind}Collection", "Name": name,
            "Members": [ref(m) for m in members], "Members@odata.count": len(members)}


def resource(path: str, kind: str, ident: str, name: str, **props) -> dict:
    return {"@odata.id": path, "@odata.type": TYPES[kind], "Id": ident, "Name": name, **props}


def status_of(state: str, health: str = "OK") -> dict:
    return {"State": state, "Health": health}


GPU_STATUS = {   # FM GPU state -> Redfish Status
    "attached": status_of("Enabled"),
    "free": status_of("StandbyOffline"),
    "moving": status_of("Updating"),
    "failed": status_of("UnavailableOffline", "Critical"),
    "stopped": status_of("Disabled"),
}
VM_STATUS = {
    "running": status_of("Enabled"),
    "dead": status_of("UnavailableOffline", "Critical"),
    "stopped": status_of("Disabled"),
}


def host_endpoint(vm: str) -> str:
    return f"{FABRIC}/Endpoints/host-{vm}"


def gpu_endpoint(gpu: str) -> str:
    return f"{FABRIC}/Endpoints/gpu-{gpu}"


def build(topology, status: dict) -> dict[str, dict]:
    """Every resource of the service, by path (without a trailing slash, but for the root)."""
    out: dict[str, dict] = {}
    vms = {vm.name: vm for vm in topology.vms}
    lab_health = "OK" if status["state"] == "running" else "Warning"

    endpoints: dict[str, dict] = {}
    zones: dict[str, list[str]] = {name: [host_endpoint(name)] for name in vms}
    connections: dict[str, dict] = {}

    for name, spec in vms.items():
        vm = status["vms"].get(name, {"state": "stopped"})
        endpoints[host_endpoint(name)] = resource(
            host_endpoint(name), "Endpoint", f"host-{name}", f"Host {name} (root complex)",
            Description=f"VM {name} of lab {status['name']}: its root complex and hot-plug root ports",
            EndpointProtocol="PCIe",
            ConnectedEntities=[{"EntityType": "RootComplex", "EntityRole": "Initiator"}],
            Status=VM_STATUS.get(vm["state"], status_of("Absent")),
            Oem=oem({"VM": name, "SSHPort": vm.get("ssh_port"),
                             "HotplugPorts": [f"hp{i}" for i in range(spec.hotplug_ports)],
                             "FreeHotplugPorts": status.get("free_hotplug_ports", {}).get(name, [])}))

    for gname, gpu in status["gpus"].items():
        path = gpu_endpoint(gname)
        endpoints[path] = resource(
            path, "Endpoint", f"gpu-{gname}", f"GPU {gname}",
            Description="vfio-user GPU 0601:1991 served by the lab (docs/gpu-device.md)",
            EndpointProtocol="PCIe",
            ConnectedEntities=[{"EntityType": "Processor", "EntityRole": "Target"}],
            Status=GPU_STATUS.get(gpu["state"], status_of("Absent")),
            Oem=oem({"State": gpu["state"], "Owner": gpu["owner"], "Port": gpu.get("port"),
                             "VRAMMiB": gpu.get("vram_mib"), "IRQ": gpu.get("irq"),
                             "Scrubbed": gpu.get("scrubbed"), "ServerPid": gpu.get("server_pid")}))
        if gpu["owner"] is not None and gpu["state"] != "free":
            cid = f"{gname}-{gpu['owner']}"
            connections[cid] = connection(cid, f"GPU {gname} in host {gpu['owner']}",
                                          [host_endpoint(gpu["owner"])], [path],
                                          GPU_STATUS.get(gpu["state"], status_of("Absent")), gpu=True)
            if gpu["owner"] in zones:
                zones[gpu["owner"]].append(path)

    switches: dict[str, dict] = {}
    for name, spec in vms.items():
        for t3 in spec.type3:
            path = f"{FABRIC}/Endpoints/mem-{name}-{t3.name}"
            backend = t3.volatile or t3.persistent
            endpoints[path] = resource(
                path, "Endpoint", f"mem-{name}-{t3.name}", f"Type3 {t3.name} of host {name}",
                Description=f"CXL Type3 memory device at {t3.at}, backed by {backend}",
                EndpointProtocol="CXL",
                ConnectedEntities=[{"EntityType": "MediaController", "EntityRole": "Target"}],
                Status=status_of("Enabled"),
                Oem=oem({"Backend": backend, "At": t3.at,
                                 "Volatile": t3.volatile is not None}))
            zones[name].append(path)
            cid = f"{t3.name}-{name}"
            connections[cid] = connection(cid, f"Type3 {t3.name} memory of host {name}",
                                          [host_endpoint(name)], [path], status_of("Enabled"),
                                          ConnectionType="Memory")
        for sw in spec.switches:
            sid = f"{name}-{sw.name}"
            ports = {"up": {"PortType": "UpstreamPort", "at": sw.at, "endpoint": host_endpoint(name)}}
            for ds in sw.downstream_ports:
                below = [t3 for t3 in spec.type3 if t3.at == ds]
                ports[ds] = {"PortType": "DownstreamPort", "at": ds,
                             "endpoint": f"{FABRIC}/Endpoints/mem-{name}-{below[0].name}" if below else None}
            switches[sid] = {"vm": name, "switch": sw, "ports": ports}

    for sname, smc in status.get("smcs", {}).items():
        path = f"{FABRIC}/Endpoints/smc-{sname}"
        ok = smc["state"] in ("running", "attached", "")
        endpoints[path] = resource(
            path, "Endpoint", f"smc-{sname}", f"Shared-memory controller {sname}",
            Description="vfio-user shared-memory controller: semaphores and doorbells (docs/smc-device.md)",
            EndpointProtocol="PCIe",
            ConnectedEntities=[{"EntityType": "Bridge", "EntityRole": "Target"}],
            Status=status_of("Enabled") if ok else status_of("UnavailableOffline", "Critical"),
            Oem=oem({"State": smc["state"], "Hosts": smc["hosts"], "ServerPid": smc.get("server_pid")}))
        for host in smc["hosts"]:
            if host in zones:
                zones[host].append(path)
            cid = f"{sname}-{host}"
            connections[cid] = connection(cid, f"Controller {sname} in host {host}", [host_endpoint(host)],
                                          [path], endpoints[path]["Status"])

    # -- the tree ------------------------------------------------------------------------
    out[ROOT + "/"] = resource(ROOT + "/", "ServiceRoot", "RootService", f"vfio-cxl lab {status['name']}",
                               RedfishVersion=REDFISH_VERSION, UUID=lab_uuid(status),
                               Fabrics=ref(f"{ROOT}/Fabrics"), EventService=ref(f"{ROOT}/EventService"),
                               SessionService=ref(f"{ROOT}/SessionService"),
                               Links={"Sessions": ref(f"{ROOT}/SessionService/Sessions")})
    # No authentication (a lab service on 127.0.0.1): a SessionService that says so, since the
    # ServiceRoot schema requires its Links.Sessions.
    out[f"{ROOT}/SessionService"] = resource(f"{ROOT}/SessionService", "SessionService", "SessionService",
                                             "Session Service", ServiceEnabled=False,
                                             Description="no authentication: the service listens on 127.0.0.1 only",
                                             Sessions=ref(f"{ROOT}/SessionService/Sessions"))
    out[f"{ROOT}/SessionService/Sessions"] = collection(f"{ROOT}/SessionService/Sessions", "Session",
                                                        "Sessions", [])
    out[f"{ROOT}/Fabrics"] = collection(f"{ROOT}/Fabrics", "Fabric", "Fabrics", [FABRIC])
    out[FABRIC] = resource(FABRIC, "Fabric", FABRIC_ID, f"CXL fabric of lab {status['name']}",
                           Description=f"topology {status['topology']}: {len(vms)} hosts, "
                                       f"{len(status['gpus'])} GPUs; fabric manager pid {status['fm_pid']}",
                           FabricType="CXL", Status=status_of("Enabled", lab_health),
                           Switches=ref(f"{FABRIC}/Switches"), Endpoints=ref(f"{FABRIC}/Endpoints"),
                           Zones=ref(f"{FABRIC}/Zones"), Connections=ref(f"{FABRIC}/Connections"),
                           Oem=oem({"Lab": status["name"], "State": status["state"]}))
    out[f"{FABRIC}/Endpoints"] = collection(f"{FABRIC}/Endpoints", "Endpoint", "Endpoints", list(endpoints))
    out.update(endpoints)
    out[f"{FABRIC}/Switches"] = collection(f"{FABRIC}/Switches", "Switch", "Switches",
                                           [f"{FABRIC}/Switches/{s}" for s in switches])
    for sid, sw in switches.items():
        path = f"{FABRIC}/Switches/{sid}"
        out[path] = resource(path, "Switch", sid, f"CXL switch {sw['switch'].name} of host {sw['vm']}",
                             SwitchType="CXL", Status=status_of("Enabled"), Ports=ref(f"{path}/Ports"),
                             Oem=oem({"VM": sw["vm"], "At": sw["switch"].at}))
        out[f"{path}/Ports"] = collection(f"{path}/Ports", "Port", f"Ports of {sid}",
                                          [f"{path}/Ports/{p}" for p in sw["ports"]])
        for pid, port in sw["ports"].items():
            ppath = f"{path}/Ports/{pid}"
            links = {"AssociatedEndpoints": [ref(port["endpoint"])] if port["endpoint"] else []}
            out[ppath] = resource(ppath, "Port", pid, f"{sid} {pid}", PortId=pid, PortProtocol="CXL",
                                  PortType=port["PortType"], Status=status_of("Enabled"), Links=links,
                                  Oem=oem({"At": port["at"]}))
    out[f"{FABRIC}/Zones"] = collection(f"{FABRIC}/Zones", "Zone", "Zones",
                                        [f"{FABRIC}/Zones/{z}" for z in zones])
    for zid, members in zones.items():
        path = f"{FABRIC}/Zones/{zid}"
        out[path] = resource(path, "Zone", zid, f"What host {zid} sees", ZoneType="ZoneOfEndpoints",
                             Status=status_of("Enabled"), Links={"Endpoints": [ref(m) for m in members]})
    out[f"{FABRIC}/Connections"] = collection(f"{FABRIC}/Connections", "Connection", "Connections",
                                              [f"{FABRIC}/Connections/{c}" for c in connections])
    for cid, body in connections.items():
        out[body["@odata.id"]] = body
    return out


def connection(cid: str, name: str, initiators: list[str], targets: list[str], status: dict,
               gpu: bool = False, **props) -> dict:
    path = f"{FABRIC}/Connections/{cid}"
    body = resource(path, "Connection", cid, name, Status=status,
                    Links={"InitiatorEndpoints": [ref(i) for i in initiators],
                           "TargetEndpoints": [ref(t) for t in targets]}, **props)
    body["Oem"] = oem({"Deletable": gpu})
    return body


def oem(fields: dict) -> dict:
    """Our own properties, under Oem.VfioCxl (Redfish wants an @odata.type on an OEM object;
    the lab publishes no CSDL for it, so a validator reports it as unknown, not as wrong)."""
    return {"VfioCxl": {"@odata.type": "#VfioCxl.v1_0_0.VfioCxl", **fields}}


def lab_uuid(status: dict) -> str:
    """A stable UUID per lab (name + creation time), as ServiceRoot wants one."""
    import uuid

    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"vfio-cxl:{status['name']}:{status['created']}"))
