"""Pictures of a topology: a text tree, and graphviz drawings (SVG, PNG).

    vfio-cxl vm topology fabric               the tree as text
    vfio-cxl vm topology fabric --svg f.svg   drawn with graphviz's dot

Both come from one walk over the validated :class:`~vfio_cxl.lab.topology.Topology`:
hosts, host bridges (with the bus numbers the lab assigns), root ports,
switches, Type3 devices with their backends (shared ones marked), windows,
regions, GPUs (owned or free), NVMe controllers, NICs (and the link each is wired to), hot-plug
ports, links and shared-memory controllers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LabError
from .topology import Topology, Vm, format_size

HOST_PACKAGES = ["graphviz"]   # Debian's graphviz: the dot the Python package runs


@dataclass
class Node:
    id: str
    label: str
    kind: str                   # vm, pcie, port, hb, switch, type3, gpu, nvme, nic, window, region, hotplug
    children: list["Node"] = field(default_factory=list)


def _type3_label(topo: Topology, vm: Vm, name: str) -> str:
    t3 = vm.type3_named(name)
    parts = []
    for kind, backend in (("volatile", t3.volatile), ("persistent", t3.persistent)):
        if backend:
            users = {v for v, _ in topo.backend_users(backend)}
            shared = f", shared with {', '.join(sorted(users - {vm.name}))}" if len(users) > 1 else ""
            parts.append(f"{kind} {backend} {format_size(topo.backends[backend].size)}{shared}")
    if t3.persistent:
        parts.append(f"LSA {format_size(t3.lsa_size)}")
    return f"{name}: Type3 ({'; '.join(parts)})"


def _region_label(topo: Topology, vm: Vm, region) -> str:
    window = vm.windows[region.window]
    gran = region.granularity or window.granularity
    use = {"devdax": "devdax" if region.type == "ram" else "devdax namespace",
           "fsdax": "fsdax namespace", "none": "left for the user"}[region.use]
    return (f"region {region.name}: {region.type}, {region.ways}-way x {format_size(gran)}, "
            f"{format_size(vm.region_size(region, topo.backends))} [{', '.join(vm.region_order(region))}] -> {use}")


def _nvme_node(vm: Vm, nvme) -> Node:
    spaces = ", ".join(format_size(size) for size in nvme.namespaces)
    extras = f", CMB {format_size(nvme.cmb)}" if nvme.cmb else ""
    return Node(f"{vm.name}/{nvme.name}", f"{nvme.name}: NVMe (namespaces {spaces}; {nvme.queue_pairs} queue pairs"
                f"{extras})", "nvme")


def _nic_node(topo: Topology, vm: Vm, nic) -> Node:
    if nic.link is None:
        behind = "user network, reaches nothing"
    else:
        peer = next(v for v in topo.links[nic.link].vms if v != vm.name)
        behind = f"link {nic.link} to {peer}"
    return Node(f"{vm.name}/{nic.name}", f"{nic.name}: NIC ({nic.model}, {nic.pci_id}; {behind})", "nic")


def link_nics(topo: Topology, index: int) -> list[tuple[str, str]]:
    """(VM, NIC) of the NICs wired to link ``index``, in the link's VM order (none or two)."""
    on_link = {nic.owner: nic.name for nic in topo.nics.values() if nic.link == index}
    return [(vm, on_link[vm]) for vm in topo.links[index].vms if vm in on_link]


def tree(topo: Topology) -> list[Node]:
    """One node per VM, holding its PCIe side, CXL side, windows and regions."""
    vms = []
    reserve = format_size(topo.hotplug_reserve())
    for vm in topo.vms:
        root = Node(vm.name, f"vm {vm.name} ({vm.cpus} cpus, {format_size(vm.memory)} RAM)", "vm")
        pcie = Node(f"{vm.name}/pcie.0", "pcie.0 (intel-iommu)", "pcie")
        for gpu in topo.gpus_of(vm.name):
            if gpu.at is None:
                port = Node(f"{vm.name}/{gpu.root_port}", f"{gpu.root_port}: root port", "port")
                port.children.append(Node(f"{vm.name}/{gpu.name}",
                                          f"{gpu.name}: GPU ({format_size(gpu.vram)} VRAM, {gpu.irq})", "gpu"))
                pcie.children.append(port)
        for ps in vm.pcie_switches:
            sw = Node(f"{vm.name}/{ps.name}", f"{ps.name}: PCIe switch (x3130)", "switch")
            for ds in ps.downstream_ports:
                port = Node(f"{vm.name}/{ds}", f"{ds}: downstream port", "port")
                for gpu in topo.gpus_of(vm.name):
                    if gpu.at == ds:
                        port.children.append(Node(f"{vm.name}/{gpu.name}",
                                                  f"{gpu.name}: GPU ({format_size(gpu.vram)} VRAM, {gpu.irq})", "gpu"))
                for nvme in vm.nvmes:
                    if nvme.at == ds:
                        port.children.append(_nvme_node(vm, nvme))
                for nic in topo.nics_of(vm.name):
                    if nic.at == ds:
                        port.children.append(_nic_node(topo, vm, nic))
                sw.children.append(port)
            rp = Node(f"{vm.name}/{ps.name}-port", f"{ps.name}-port: root port", "port", [sw])
            pcie.children.append(rp)
        for nvme in vm.nvmes:   # on root ports of their own, after the switches as in the lab's argv
            if nvme.at is None:
                pcie.children.append(Node(f"{vm.name}/{nvme.root_port}", f"{nvme.root_port}: root port", "port",
                                          [_nvme_node(vm, nvme)]))
        for hp in vm.hotplug_port_ids():
            pcie.children.append(Node(f"{vm.name}/{hp}", f"{hp}: hot-plug root port (pref64 {reserve}, free)",
                                      "hotplug"))
        found = topo.smc_of(vm.name)
        if found:   # the shared-memory controller's function in this host (the lab's argv adds it last)
            smc, host = found
            pcie.children.append(Node(f"{vm.name}/smc_port", "smc_port: root port", "port", [
                Node(f"{vm.name}/smc/{smc.name}", f"{smc.name}: shared-memory controller (host {host})", "smc")]))
        for nic in topo.nics_of(vm.name):   # after the controller, as in the lab's argv
            if nic.at is None:
                pcie.children.append(Node(f"{vm.name}/{nic.root_port}", f"{nic.root_port}: root port", "port",
                                          [_nic_node(topo, vm, nic)]))
        root.children.append(pcie)
        buses = vm.bus_numbers()
        for hb in vm.host_bridges:
            hbn = Node(f"{vm.name}/{hb.name}", f"{hb.name}: CXL host bridge (pxb-cxl, bus {buses[hb.name]})", "hb")
            for rp in hb.root_ports:
                rpn = Node(f"{vm.name}/{rp}", f"{rp}: CXL root port", "port")
                sw = vm.switch_at(rp)
                ports = [rpn]
                if sw:
                    swn = Node(f"{vm.name}/{sw.name}", f"{sw.name}: CXL switch", "switch")
                    rpn.children.append(swn)
                    ports = []
                    for ds in sw.downstream_ports:
                        dsn = Node(f"{vm.name}/{ds}", f"{ds}: downstream port", "port")
                        swn.children.append(dsn)
                        ports.append(dsn)
                for port in ports:
                    pname = port.id.split("/", 1)[1]
                    for t3 in vm.type3:
                        if t3.at == pname:
                            port.children.append(Node(f"{vm.name}/{t3.name}", _type3_label(topo, vm, t3.name),
                                                      "type3"))
                hbn.children.append(rpn)
            root.children.append(hbn)
        for w, window in enumerate(vm.windows):
            wn = Node(f"{vm.name}/window{w}", f"window {w}: {format_size(window.size)} over "
                      f"{', '.join(window.targets)} ({window.ways}-way x {format_size(window.granularity)})",
                      "window")
            for region in vm.regions:
                if region.window == w:
                    wn.children.append(Node(f"{vm.name}/{region.name}", _region_label(topo, vm, region), "region"))
            root.children.append(wn)
        vms.append(root)
    return vms


def text(topo: Topology) -> str:
    lines = [f"topology {topo.name}: {' '.join(topo.description.split())}"]

    def walk(node: Node, prefix: str, last: bool, top: bool) -> None:
        lines.append(node.label if top else f"{prefix}{'└─ ' if last else '├─ '}{node.label}")
        child_prefix = "" if top else prefix + ("   " if last else "│  ")
        for i, child in enumerate(node.children):
            walk(child, child_prefix, i == len(node.children) - 1, False)

    for vm in tree(topo):
        walk(vm, "", True, True)
    if topo.unowned_gpus():
        lines.append("unowned GPUs (for hot-plug): " + ", ".join(
            f"{g.name} ({format_size(g.vram)} VRAM, {g.irq})" for g in topo.unowned_gpus()))
    for name, backend in topo.backends.items():
        users = topo.backend_users(name)
        kind = "shared" if len({v for v, _ in users}) > 1 else "private"
        lines.append(f"backend {name}: {format_size(backend.size)} file, {kind}: "
                     + ", ".join(f"{v}/{t}" for v, t in users))
    for i, link in enumerate(topo.links):
        wire = " <-> ".join(f"{vm}/{nic}" for vm, nic in link_nics(topo, i))
        lines.append(f"link {i}: {link.vms[0]} <-> {link.vms[1]} (private point-to-point network"
                     + (f"; NICs {wire})" if wire else ")"))
    for name, smc in topo.smcs.items():
        lines.append(f"smc {name}: shared-memory controller (one server), hosts "
                     + ", ".join(f"{h}={vm}" for h, vm in enumerate(smc.hosts)))
    return "\n".join(lines) + "\n"


_STYLE = {
    "vm": {"shape": "box", "style": "rounded,bold"},
    "pcie": {"shape": "box", "style": "rounded"},
    "port": {"shape": "box", "fontsize": "10"},
    "hotplug": {"shape": "box", "style": "dashed", "fontsize": "10"},
    "hb": {"shape": "box", "style": "filled", "fillcolor": "#dbe9f6"},
    "switch": {"shape": "box", "style": "filled", "fillcolor": "#e8e8e8"},
    "type3": {"shape": "box3d", "style": "filled", "fillcolor": "#fde9c8"},
    "gpu": {"shape": "component", "style": "filled", "fillcolor": "#d6f0d6"},
    "nvme": {"shape": "cylinder", "style": "filled", "fillcolor": "#f0e0c0"},
    "nic": {"shape": "tab", "style": "filled", "fillcolor": "#d6e4f6"},
    "smc": {"shape": "component", "style": "filled", "fillcolor": "#f6d6d6"},
    "window": {"shape": "note", "style": "filled", "fillcolor": "#f3e6f7"},
    "region": {"shape": "note", "fontsize": "10"},
}


def graph(topo: Topology):
    """A graphviz.Digraph: a cluster per VM, backends and unowned GPUs outside them."""
    import graphviz

    g = graphviz.Digraph(topo.name, graph_attr={"rankdir": "TB", "fontname": "Helvetica", "fontsize": "11",
                                               "label": f"{topo.name}", "labelloc": "t"},
                         node_attr={"fontname": "Helvetica", "fontsize": "11"},
                         edge_attr={"fontname": "Helvetica", "fontsize": "10"})
    for vm_node in tree(topo):
        with g.subgraph(name=f"cluster_{vm_node.id}") as c:
            c.attr(label=vm_node.label, style="rounded", color="#777777")

            def add(node: Node) -> None:
                c.node(node.id, node.label.replace(": ", "\n", 1), **_STYLE[node.kind])
                for child in node.children:
                    add(child)
                    c.edge(node.id, child.id)

            for top in vm_node.children:
                add(top)
    vm = {v.name: v for v in topo.vms}
    for name, backend in topo.backends.items():
        users = topo.backend_users(name)
        shared = len({v for v, _ in users}) > 1
        g.node(f"backend/{name}", f"{name}\n{format_size(backend.size)} file{' (shared)' if shared else ''}",
               shape="cylinder", style="filled", fillcolor="#ffd27f" if shared else "#fff3d6")
        for v, t in users:
            g.edge(f"{v}/{t}", f"backend/{name}", style="dashed", arrowhead="none")
    for vname, v in vm.items():
        for w, window in enumerate(v.windows):
            for target in window.targets:
                g.edge(f"{vname}/window{w}", f"{vname}/{target}", style="dotted", arrowhead="none",
                       color="#9966aa")
        for region in v.regions:
            for m in region.memdevs:
                g.edge(f"{vname}/{region.name}", f"{vname}/{m}", style="dotted", arrowhead="none",
                       constraint="false")
    for gpu in topo.unowned_gpus():
        g.node(f"gpu/{gpu.name}", f"{gpu.name}\nGPU, unowned\n({format_size(gpu.vram)} VRAM)",
               shape="component", style="dashed,filled", fillcolor="#eef7ee")
    for name, smc in topo.smcs.items():
        g.node(f"smc/{name}", f"{name}\nSMC server\n({len(smc.hosts)} hosts)", shape="component",
               style="filled", fillcolor="#f0a8a8")
        for h, v in enumerate(smc.hosts):
            g.edge(f"{v}/smc/{name}", f"smc/{name}", label=f"host {h}", style="dashed", arrowhead="none")
    for i, link in enumerate(topo.links):
        a, b = link.vms
        ends = link_nics(topo, i)
        g.edge(f"{a}/pcie.0", f"{b}/pcie.0", label=f"link {i} (virtio-net)" if ends else "link", dir="both",
               style="bold", color="#4477aa", constraint="false")
        if ends:   # the NICs' own wire on the same link
            (va, na), (vb, nb) = ends
            g.edge(f"{va}/{na}", f"{vb}/{nb}", label=f"link {i} ({topo.nics[na].model})", dir="both",
                   style="bold", color="#4477aa", constraint="false")
    return g


def render(topo: Topology, path: Path, fmt: str, log=print) -> None:
    """Draw ``topo`` to ``path`` (fmt svg or png) with dot; installs Debian's graphviz if missing."""
    import shutil

    if not shutil.which("dot"):
        from .apt import ensure_host_packages
        ensure_host_packages(HOST_PACKAGES, log)
    try:
        data = graph(topo).pipe(format=fmt)
    except Exception as err:   # graphviz.ExecutableNotFound, CalledProcessError
        raise LabError(f"graphviz could not draw {topo.name}: {err}", "is Debian's graphviz (dot) installed?") from None
    path.write_bytes(data)


def draw_all(directory: Path, log=print) -> list[Path]:
    """docs pictures: NAME.gv (graphviz source) and NAME.svg for every shipped topology."""
    from . import topology

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in topology.available():
        topo = topology.load(name)
        (directory / f"{name}.gv").write_text(graph(topo).source)
        render(topo, directory / f"{name}.svg", "svg", log)
        written += [directory / f"{name}.gv", directory / f"{name}.svg"]
    return written


if __name__ == "__main__":
    import sys

    for path in draw_all(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/topologies")):
        print(path)
