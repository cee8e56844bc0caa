"""Topology pictures: the text tree, the graphviz drawing, and the docs' copies being current."""

import re
import shutil

import pytest

from vfio_cxl.lab import picture, topology
from vfio_cxl.paths import REPO_ROOT

DOCS = REPO_ROOT / "docs" / "topologies"


@pytest.mark.parametrize("name", topology.available())
def test_docs_pictures_are_current(name):
    """docs/topologies/NAME.gv is what the code draws now (redraw: scripts/draw-topologies),
    and NAME.svg was drawn from it."""
    topo = topology.load(name)
    assert (DOCS / f"{name}.gv").read_text() == picture.graph(topo).source, \
        f"docs/topologies/{name}.gv is stale: run scripts/draw-topologies"
    svg = (DOCS / f"{name}.svg").read_text()
    assert svg.startswith("<?xml") and f"<title>{name}</title>" in svg
    # Every component the tree names appears in the drawing.
    for vm in topo.vms:
        for t3 in vm.type3:
            assert f">{t3.name.replace('-', '&#45;')}</text>" in svg
        for nvme in vm.nvmes:
            assert f">{nvme.name}<" in svg
        for nic in topo.nics_of(vm.name):
            assert f">{nic.name}<" in svg


def test_every_part_is_in_the_text_tree():
    topo = topology.load("p2p")
    out = picture.text(topo)
    for part in ("psw0: PCIe switch (x3130)", "dp0: downstream port", "gpu0: GPU (64M VRAM, msix)",
                 "gpu1: GPU (64M VRAM, msix)", "hb0: CXL host bridge (pxb-cxl, bus 12)",
                 "mem0: Type3 (volatile cxl0 256M)", "window 0: 4G over hb0 (1-way x 8K)",
                 "region r0: ram, 1-way x 8K, 256M [mem0] -> devdax", "backend cxl0: 256M file, private: host0/mem0"):
        assert part in out, part


def test_nvme_controllers_are_in_the_text_tree_where_they_sit():
    out = picture.text(topology.load("storage"))
    assert ("   │     └─ dp1: downstream port\n"
            "   │        └─ nvme0: NVMe (namespaces 256M; 16 queue pairs, CMB 4M)\n") in out
    assert ("   └─ nvme1-port: root port\n"
            "      └─ nvme1: NVMe (namespaces 64M, 16M; 8 queue pairs, CMB 4M)\n") in out


def test_nics_are_in_the_text_tree_where_they_sit_with_the_link_they_join():
    out = picture.text(topology.load("nic2"))
    assert ("         └─ dp1: downstream port\n"
            "            └─ nic0: NIC (igb, 8086:10c9; link 0 to host1)\n") in out
    assert "nic1: NIC (igb, 8086:10c9; link 0 to host0)" in out
    assert "link 0: host0 <-> host1 (private point-to-point network; NICs host0/nic0 <-> host1/nic1)" in out
    selftest = picture.text(topology.load("selftest"))
    assert ("   └─ igb-port: root port\n"
            "      └─ igb: NIC (igb, 8086:10c9; user network, reaches nothing)\n") in selftest


def test_the_drawing_wires_the_nics_of_a_link_to_each_other():
    source = picture.graph(topology.load("nic2")).source
    assert '"host0/nic0" -> "host1/nic1" [label="link 0 (igb)"' in source
    assert '"host0/pcie.0" -> "host1/pcie.0" [label="link 0 (virtio-net)"' in source
    assert '"host0/dp1" -> "host0/nic0"' in source


def test_interleaved_region_lists_memdevs_in_position_order():
    out = picture.text(topology.load("hb2"))
    assert "region r0: ram, 4-way x 8K, 1G [mem0, mem2, mem1, mem3] -> devdax" in out


@pytest.mark.skipif(not shutil.which("dot"), reason="Debian's graphviz (dot) is not installed; "
                    "vfio-cxl vm topology --svg installs it")
def test_svg_and_png_render(tmp_path):
    topo = topology.load("fabric")
    picture.render(topo, tmp_path / "f.svg", "svg")
    picture.render(topo, tmp_path / "f.png", "png")
    assert re.search(r"<svg width=\"\d+pt\"", (tmp_path / "f.svg").read_text())
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_docs_complete_example_is_valid():
    text = (REPO_ROOT / "docs" / "topologies.md").read_text()
    example = text.split("## A complete example\n\n```toml\n", 1)[1].split("```", 1)[0]
    topo = topology.parse(example, "example", "docs/topologies.md")
    assert [vm.name for vm in topo.vms] == ["a", "b"] and topo.unowned_gpus()[0].name == "gpu1"
