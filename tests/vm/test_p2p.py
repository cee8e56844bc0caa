"""Peer-to-peer DMA on the p2p topology: gpu0 and gpu1 behind one PCIe switch, gpu2 on a
root port of its own, all in one VFIO container; each GPU's engine writes into the
others' VRAM through the IOMMU -- behind the switch (A<->B) and through the root
complex (A<->C) in the same boot.  The last case runs on the lab kernel (IOMMUFD;
``lab_kernel_lab`` boots p2p for every lab-kernel test) when it is built."""

import json

import pytest

from tests.vm.conftest import guest_json

SIZES = [4 << 10, 1 << 20, 16 << 20]


def check_routes(result):
    """A -> B behind the switch, A -> C through the root complex, both ways, each GPU its group."""
    groups = result["groups"]
    assert len(groups) == 3 and len(set(groups.values())) == 3, f"GPUs share an IOMMU group: {groups}"
    kinds = [c["route"]["kind"] for c in result["copies"]]
    assert kinds == ["switch", "switch", "root complex", "root complex"], kinds
    a_to_b, b_to_a, a_to_c, c_to_a = result["copies"]
    assert (a_to_b["from"], a_to_b["to"]) == (b_to_a["to"], b_to_a["from"])
    assert (a_to_c["from"], a_to_c["to"]) == (c_to_a["to"], c_to_a["from"])
    assert a_to_b["from"] == a_to_c["from"] and a_to_b["to"] != a_to_c["to"]


@pytest.mark.parametrize("size", SIZES, ids=["4KiB", "1MiB", "16MiB"])
def test_p2p_both_ways_every_byte(p2p_lab, size):
    vm = p2p_lab["host0"]
    result = guest_json(vm, f"vfio-cxl-m vfio_cxl.guest.cmd.p2p --size {size} --json")
    check_routes(result)
    for copy in result["copies"]:
        assert copy["bytes"] == size
        assert copy["match"], copy             # sha256 through both BAR mmaps
        assert copy["path"] == "peer fast path", copy


STREAM = ("import json; from vfio_cxl.guest.p2p import PeerPair, pick_bdfs\n"
          "with PeerPair(pick_bdfs(None, None)) as pair:\n"
          "    print(json.dumps(pair.stream(0, 1, 1 << 20, 4, seed=7)))\n")


def test_p2p_streamed_copies_fill_every_slot(p2p_lab):
    """The bench's streamed row: four descriptors queued at once, one interrupt; each lands
    in its own MiB of the peer's VRAM (zeroed first), all through the fast path."""
    result = guest_json(p2p_lab["host0"], f"python3 -c '{STREAM}'")
    assert result["count"] == 4 and result["match"], result
    assert result["path"] == "peer fast path" and result["route"]["kind"] == "switch", result


def test_p2p_message_path_is_still_correct(p2p_lab):
    vm = p2p_lab["host0"]
    result = guest_json(vm, "vfio-cxl-m vfio_cxl.guest.cmd.p2p --size 1M --path message --one-way --json")
    assert [c["route"]["kind"] for c in result["copies"]] == ["switch", "root complex"]
    for copy in result["copies"]:
        assert copy["match"] and copy["path"] == "message path" and copy["peer_kib"] == 0, copy


def test_p2p_pull_over_the_message_path_reads_every_byte_through_qemu(p2p_lab):
    """HOST_TO_VRAM from the peer's BAR IOVA with the fast path off: 64 DMA_READ
    messages of 64 KiB that QEMU 11.1 answers, at most two outstanding (QEMU drops
    what does not fit its socket buffer); every byte lands in the initiator's VRAM."""
    vm = p2p_lab["host0"]
    result = guest_json(vm, "vfio-cxl-m vfio_cxl.guest.cmd.p2p --size 4M --path message --pull "
                            "--one-way --json")
    assert [c["route"]["kind"] for c in result["copies"]] == ["switch", "root complex"]
    for copy in result["copies"]:
        assert copy["match"] and copy["bytes"] == 4 << 20, copy
        assert copy["path"] == "message path" and copy["peer_kib"] == 0, copy
        assert copy["initiator"] == copy["to"], copy


def test_p2p_isolation_unmapped_and_after_unmap(p2p_lab):
    vm = p2p_lab["host0"]
    result = guest_json(vm, "vfio-cxl-m vfio_cxl.guest.cmd.p2p --check isolation")
    assert result["mapped_copy"]["match"] and result["mapped_copy"]["peer_kib"] == 1024, result
    for case in ("never_mapped", "after_unmap"):
        fault = result[case]["fault"]
        assert fault is not None, f"{case}: A's DMA into B's BAR IOVA succeeded"
        assert fault["status"] == "DMA_UNMAPPED" and fault["cookie"] == 0xBAD, fault
        assert fault["address"] == 0x11_0000_0000, fault
        assert result[case]["b_unchanged"], f"{case}: B's VRAM changed"
    assert result["recovered"]


def test_p2p_bad_input_is_refused_and_leaves_nothing_mapped(p2p_lab):
    vm = p2p_lab["host0"]
    result = guest_json(vm, "vfio-cxl-m vfio_cxl.guest.cmd.p2p --check bad-input")
    for case, words in (("bar_not_mmappable", "not mmappable"), ("size_beyond_bar", "beyond"),
                        ("peer_in_other_container", "same VFIO container")):
        assert result[case]["error"] and words in result[case]["error"], (case, result[case])
        assert result[case]["mappings_left"] == 0, (case, result[case])
    assert result["peer_in_other_container"]["peer_mappings_left"] == 0


def test_p2p_cli_reports_groups_and_kernel(p2p_lab):
    vm = p2p_lab["host0"]
    out = vm.run("vfio-cxl-m vfio_cxl.guest.cmd.p2p --size 64K").stdout
    assert out.count("IOMMU group") == 3, out
    assert out.count("VFIO_IOMMU_MAP_DMA of the BAR mmap accepted") == 3, out
    assert out.count("checksum MATCH") == 4, out
    assert out.count("behind the PCIe switch") == 2 and out.count("through the root complex (") == 2, out
    err = vm.run("vfio-cxl-m vfio_cxl.guest.cmd.p2p --size 1G", check=False)
    assert err.exited == 1 and "beyond" in err.stderr and "Traceback" not in err.stderr, err.stderr


def test_p2p_on_iommufd_lab_kernel(lab_kernel_lab):
    """The lab kernel (7.3, IOMMUFD): one iommufd IOAS for the three GPUs.  IOMMU_IOAS_MAP of a
    BAR mmap is refused (iommufd pins pages; the BAR is VM_PFNMAP); the BAR goes in as a VFIO
    dma-buf with IOMMU_IOAS_MAP_FILE when the kernel has CONFIG_VFIO_PCI_DMABUF, and the copies
    then take both routes like type1; without it every refusal is reported, naming the option,
    and nothing stays open (type1 P2P works right after)."""
    vm = lab_kernel_lab["host0"]
    result = guest_json(vm, "vfio-cxl-m vfio_cxl.guest.cmd.p2p --check iommufd --size 1M")
    assert result["config"]["CONFIG_IOMMUFD"] == "y" and result["config"]["CONFIG_VFIO_DEVICE_CDEV"] == "y", result
    notes = list(result["kernel"].values())
    assert notes and all("IOMMU_IOAS_MAP of the BAR mmap refused" in n and "EFAULT" in n for n in notes), notes
    if result["config"]["CONFIG_VFIO_PCI_DMABUF"] == "y":
        assert result["refused"] is None, result["refused"]
        assert all("IOMMU_IOAS_MAP_FILE accepted" in n for n in notes) and len(notes) == 3, notes
        assert [c["route"]["kind"] for c in result["copies"]] == ["switch", "root complex"]
        for copy in result["copies"]:
            assert copy["match"] and copy["backend"] == "iommufd" and copy["path"] == "peer fast path", copy
    else:
        assert "VFIO_DEVICE_FEATURE_DMA_BUF refused" in result["refused"] and "ENOTTY" in result["refused"]
        assert "CONFIG_VFIO_PCI_DMABUF" in result["refused"] and "--backend type1" in result["refused"]
        assert len(set(result["groups"].values())) == 3, result["groups"]
    assert result["type1_after"] == {"match": True, "copies": 2}
