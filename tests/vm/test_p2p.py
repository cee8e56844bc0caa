"""Peer-to-peer DMA on the p2p topology: two GPUs behind one PCIe switch, one VFIO
container; each GPU's engine writes into the other's VRAM through the IOMMU."""

import json

import pytest

from tests.vm.conftest import guest_json

SIZES = [4 << 10, 1 << 20, 16 << 20]


@pytest.mark.parametrize("size", SIZES, ids=["4KiB", "1MiB", "16MiB"])
def test_p2p_both_ways_every_byte(p2p_lab, size):
    vm = p2p_lab["host0"]
    result = guest_json(vm, f"python3 -m vfio_cxl.guest.p2p --size {size} --json")
    groups = result["groups"]
    assert len(set(groups.values())) == 2, f"both GPUs in one IOMMU group: {groups}"
    assert len(result["copies"]) == 2
    a_to_b, b_to_a = result["copies"]
    assert (a_to_b["from"], a_to_b["to"]) == (b_to_a["to"], b_to_a["from"])
    for copy in result["copies"]:
        assert copy["bytes"] == size
        assert copy["match"], copy             # sha256 through both BAR mmaps
        assert copy["path"] == "peer fast path", copy


def test_p2p_message_path_is_still_correct(p2p_lab):
    vm = p2p_lab["host0"]
    result = guest_json(vm, "python3 -m vfio_cxl.guest.p2p --size 1M --path message --one-way --json")
    (copy,) = result["copies"]
    assert copy["match"] and copy["path"] == "message path" and copy["peer_kib"] == 0, copy


def test_p2p_pull_over_the_message_path_reads_every_byte_through_qemu(p2p_lab):
    """HOST_TO_VRAM from the peer's BAR IOVA with the fast path off: 64 DMA_READ
    messages of 64 KiB that QEMU 11.1 answers, at most two outstanding (QEMU drops
    what does not fit its socket buffer); every byte lands in the initiator's VRAM."""
    vm = p2p_lab["host0"]
    result = guest_json(vm, "python3 -m vfio_cxl.guest.p2p --size 4M --path message --pull "
                            "--one-way --json")
    (copy,) = result["copies"]
    assert copy["match"] and copy["bytes"] == 4 << 20, copy
    assert copy["path"] == "message path" and copy["peer_kib"] == 0, copy
    assert copy["initiator"] == copy["to"], copy


def test_p2p_isolation_unmapped_and_after_unmap(p2p_lab):
    vm = p2p_lab["host0"]
    result = guest_json(vm, "python3 -m vfio_cxl.guest.p2p --check isolation")
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
    result = guest_json(vm, "python3 -m vfio_cxl.guest.p2p --check bad-input")
    for case, words in (("bar_not_mmappable", "not mmappable"), ("size_beyond_bar", "beyond"),
                        ("peer_in_other_container", "same VFIO container")):
        assert result[case]["error"] and words in result[case]["error"], (case, result[case])
        assert result[case]["mappings_left"] == 0, (case, result[case])
    assert result["peer_in_other_container"]["peer_mappings_left"] == 0


def test_p2p_cli_reports_groups_and_kernel(p2p_lab):
    vm = p2p_lab["host0"]
    out = vm.run("python3 -m vfio_cxl.guest.p2p --size 64K").stdout
    assert out.count("IOMMU group") == 2 and "VFIO_IOMMU_MAP_DMA accepted" in out, out
    assert out.count("checksum MATCH") == 2, out
    err = vm.run("python3 -m vfio_cxl.guest.p2p --size 1G", check=False)
    assert err.exited == 1 and "beyond" in err.stderr and "Traceback" not in err.stderr, err.stderr
