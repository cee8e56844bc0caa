"""Issue: every shipped topology boots, and what each guest sees agrees with the declaration.

One test per topology (each boots once; single, shared, p2p, smc and pool are shared
with the other VM tests, and run before the tests that kill one of their VMs).  In every guest it compares ``cxl list -vv`` (host bridges,
switches, memdevs by serial, root decoders = windows with their ways,
granularity and size, regions with ways, granularity, size and memdevs in
position order), ``daxctl list`` (enabled devdax devices), ``ndctl list``
(namespaces) and ``lspci`` (GPUs, shared-memory controllers, NICs, NVMe controllers, PCIe switch, root
ports) with the topology; in an
interleaved region it writes one chunk per position and finds each in the backend file
of the memdev the topology puts at that position.
"""

from __future__ import annotations

import base64
import json
import os

import pytest

from vfio_cxl.lab import topology

from .conftest import kernel_of

GPU_ID = "0601:1991"
SMC_ID = "0601:5c01"
X3130_UP, XIO3130_DOWN = "104c:8232", "104c:8233"
PCIE_ROOT_PORT = "1b36:000c"
NVME_ID = topology.NVME_PCI_ID


def walk(node, found: dict) -> None:
    """Flatten cxl-cli's nested JSON into memdevs, ports, decoders and regions."""
    if isinstance(node, list):
        for item in node:
            walk(item, found)
        return
    if not isinstance(node, dict):
        return
    if "memdev" in node and "serial" in node:
        found["memdevs"][node["memdev"]] = node
    elif "port" in node and "depth" in node:
        found["ports"].append(node)
    elif "decoder" in node:
        found["decoders"][node["decoder"]] = node
    elif "region" in node and "decode_state" in node:
        found["regions"][node["region"]] = node
    for value in node.values():
        if isinstance(value, (list, dict)):
            walk(value, found)


# Everything cxl-cli lists -- buses, ports, endpoints, decoders with targets, memdevs, regions,
# idle ones too -- without -vvv's health, alert and partition queries: those go to every
# memdev's mailbox (tens of seconds per VM under TCG) and nothing here checks them.
# -vv nests regions under their root decoder without mappings; -R -T adds them.
LISTINGS = {"cxl": "cxl list -vv", "regions": "cxl list -R -T", "dax": "daxctl list",
            "namespaces": "ndctl list -N", "pci": "lspci -n | awk '{print $3}'"}
SEP = "----vfio-cxl-listing----"


def start_listings(vm):
    """Every listing the checks compare, in one guest command (each SSH exec and each tool start
    costs under TCG); ``.join()`` waits for it."""
    return vm.start_command("set -e; " + " ".join(f"{cmd}; echo {SEP};" for cmd in LISTINGS.values()),
                            timeout=600)


def listings_of(running) -> dict:
    parts = running.join().stdout.split(SEP + "\n")
    assert len(parts) == len(LISTINGS) + 1 and parts[-1] == "", parts
    return dict(zip(LISTINGS, parts))


def cxl_view(out: dict) -> dict:
    found = {"memdevs": {}, "ports": [], "decoders": {}, "regions": {}}
    walk(json.loads(out["cxl"] or "[]"), found)
    for region in json.loads(out["regions"] or "[]"):
        found["regions"][region["region"]] = region
    return found


def check_cxl(topo, spec, vm, out) -> None:
    seen = cxl_view(out)
    by_serial = {m["serial"]: m for m in seen["memdevs"].values()}
    # Memdevs: one per Type3, found by its serial, with the declared capacities.
    assert sorted(by_serial) == sorted(spec.serial(t.name) for t in spec.type3)
    for t3 in spec.type3:
        m = by_serial[spec.serial(t3.name)]
        assert m.get("ram_size", 0) == (topo.backends[t3.volatile].size if t3.volatile else 0), t3.name
        assert m.get("pmem_size", 0) == (topo.backends[t3.persistent].size if t3.persistent else 0), t3.name
    # Host bridges are the ports at depth 1, switches those at depth 2 with dports.
    depth1 = [p for p in seen["ports"] if p["depth"] == 1]
    depth2 = [p for p in seen["ports"] if p["depth"] == 2]
    assert len(depth1) == len(spec.host_bridges)
    assert sorted(p["nr_dports"] for p in depth1) == sorted(len(hb.root_ports) for hb in spec.host_bridges)
    assert sorted(p["nr_dports"] for p in depth2) == sorted(len(s.downstream_ports) for s in spec.switches)
    # Root decoders are the windows, in order.
    roots = sorted((d for name, d in seen["decoders"].items() if name.startswith("decoder0.")),
                   key=lambda d: int(d["decoder"].split(".")[1]))
    assert len(roots) == len(spec.windows)
    for root, window in zip(roots, spec.windows):
        assert root["size"] == window.size and root["interleave_ways"] == window.ways
        assert root.get("nr_targets") == window.ways
        if window.ways > 1:
            assert root["interleave_granularity"] == window.granularity
    # Regions: by memdevs in position order.
    name_of = {spec.serial(t.name): m["memdev"] for t in spec.type3 for m in [by_serial[spec.serial(t.name)]]}
    assert len(seen["regions"]) == len(spec.regions)
    for region in spec.regions:
        mems = [name_of[spec.serial(m)] for m in spec.region_order(region)]
        match = [r for r in seen["regions"].values()
                 if [x["memdev"] for x in sorted(r["mappings"], key=lambda x: x["position"])] == mems
                 and r["type"] == region.type]
        assert len(match) == 1, f"region {region.name}: no {region.type} region over {mems}: {seen['regions']}"
        r = match[0]
        assert r["decode_state"] == "commit"
        assert r["interleave_ways"] == region.ways
        assert r["interleave_granularity"] == (region.granularity or spec.windows[region.window].granularity)
        assert r["size"] == spec.region_size(region, topo.backends)
        made = vm.regions[region.name]
        assert made["region"] == r["region"]


def check_dax_and_namespaces(topo, spec, vm, out) -> None:
    dax = {d["chardev"]: d for d in json.loads(out["dax"] or "[]")}
    namespaces = json.loads(out["namespaces"] or "[]")
    namespaces = namespaces if isinstance(namespaces, list) else [namespaces]
    want_dax = [r.name for r in spec.regions if r.use == "devdax"]
    want_ns = [r.name for r in spec.regions if r.type == "pmem" and r.use != "none"]
    for name in want_dax:
        device = vm.regions[name]["dax"]
        assert dax[device]["mode"] == "devdax" and "state" not in dax[device], dax[device]   # enabled
        assert vm.run(f"test -c /dev/{device}", check=False).exited == 0
    assert len(dax) == len(want_dax)
    assert len(namespaces) == len(want_ns)
    for name in want_ns:
        ns = next(n for n in namespaces if n["dev"] == vm.regions[name]["namespace"])
        region = next(r for r in spec.regions if r.name == name)
        assert ns["mode"] == region.use
        if region.use == "fsdax":
            assert vm.run(f"test -b /dev/{ns['blockdev']}", check=False).exited == 0


def check_pci(topo, spec, vm, out) -> None:
    ids = out["pci"].split()
    gpus = topo.gpus_of(spec.name)
    assert ids.count(GPU_ID) == len(gpus)
    assert ids.count(X3130_UP) == len(spec.pcie_switches)
    assert ids.count(XIO3130_DOWN) == sum(len(p.downstream_ports) for p in spec.pcie_switches)
    smc = topo.smc_of(spec.name)
    assert ids.count(SMC_ID) == (1 if smc else 0)   # a host's function of its shared-memory controller
    nics = topo.nics_of(spec.name)
    for model_id in {n.pci_id for n in nics}:   # emulated NICs, on root ports of their own or switch ports
        assert ids.count(model_id) == len([n for n in nics if n.pci_id == model_id]), model_id
    assert ids.count(NVME_ID) == len(spec.nvmes)
    pcie_ports = (len([g for g in gpus if g.at is None]) + spec.hotplug_ports + len(spec.pcie_switches)
                  + (1 if smc else 0) + len([n for n in nics if n.at is None])
                  + len([n for n in spec.nvmes if n.at is None]))
    assert ids.count(PCIE_ROOT_PORT) == pcie_ports
    if len(gpus) > 1:   # each GPU in an IOMMU group of its own
        groups = vm.run(f"for d in $(lspci -D -n -d {GPU_ID} | cut -d' ' -f1); do "
                        "readlink /sys/bus/pci/devices/$d/iommu_group; done").stdout.split()
        assert len(groups) == len(gpus) == len(set(groups))


def check_interleave(lab, topo, spec, vm) -> None:
    """In a multi-way RAM region, chunk i of the dax device lands at offset 0 of the
    backend of the memdev at position i: the position order the lab computed is the
    one the decoders use."""
    for region in spec.regions:
        if region.type != "ram" or region.use != "devdax" or region.ways == 1:
            continue
        granularity = region.granularity or spec.windows[region.window].granularity
        chunks = [bytes([0x41 + i]) * 64 + os.urandom(64) for i in range(region.ways)]
        device = f"/dev/{vm.regions[region.name]['dax']}"
        for i, chunk in enumerate(chunks):
            vm.run(f"vfio-cxl-m vfio_cxl.guest.cmd.cxltool write {device} {i * granularity}",
                   stdin=base64.b64encode(chunk).decode())
        for i, memdev in enumerate(spec.region_order(region)):
            backend = spec.type3_named(memdev).volatile
            assert lab.read_backend(backend, 0, len(chunks[i])) == chunks[i], \
                f"{region.name}: chunk {i} is not at the start of {memdev}'s backend {backend}"


@pytest.mark.parametrize("topology_name", topology.available())
def test_guest_agrees_with_the_topology(labs, topology_name):
    lab = labs.get(topology_name, kernel_of(topology_name))   # the same boot as its fixture's tests
    topo = lab.topology
    # The listings in every guest at once: each guest works on its own vCPUs.
    running = {spec.name: start_listings(lab[spec.name]) for spec in topo.vms}
    for spec in topo.vms:
        vm = lab[spec.name]
        out = listings_of(running[spec.name])
        check_cxl(topo, spec, vm, out)
        check_dax_and_namespaces(topo, spec, vm, out)
        check_pci(topo, spec, vm, out)
        check_interleave(lab, topo, spec, vm)
