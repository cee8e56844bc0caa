"""Issue 35 steps 2-3, the guest's userspace igb driver and devmem-shaped receive into VRAM.

On the ``nic2`` topology (host0 and host1, each a GPU and an igb behind one PCIe switch, the
two igbs on one point-to-point link): both links come up; host0 sends frames to a MAC host1
steers to queue 1, and host1 receives every one with the bytes sent and statistics that
agree; with ``--gpu`` host1's queue 1 is bound to gpu1's VRAM: the headers land in guest RAM,
the payloads in VRAM at the offsets recv reports (read back through BAR2), nothing stays
mapped after unbind; a queue without buffers drops what is steered there and recv returns
nothing by its timeout.  Type1 on the image's Debian kernel, iommufd on the lab kernel.

The receiver runs first, in the background (``start_command``), and writes ``--ready-file``
once its buffers are posted; the sender starts when that file exists.
"""

from __future__ import annotations

import hashlib
import json

import documented_commands as docs
from vfio_cxl.guest.drivers.igb.spec import parse_mac
from vfio_cxl.guest.nic import frames

FLOW = "02:00:00:00:01:01"          # the MAC host1 steers to queue 1
READY = "/tmp/nic-ready"
COUNT, SIZE, SEED = 32, 1024, 11


def guest_json(vm, command: str) -> dict:
    return json.loads(vm.run(command, timeout=600).stdout)


def wait_ready(vm, timeout: float = 300) -> None:
    """Until the receiver wrote its ready file: one guest command that looks every 20 ms (one
    SSH command per look cost hundreds of commands a test)."""
    done = vm.run(f"timeout {timeout:g} sh -c 'until [ -e {READY} ]; do sleep 0.02; done'",
                  check=False, timeout=timeout + 60)
    assert done.exited == 0, f"the receiver did not post its buffers within {timeout} s"


def transfer(lab, recv_args: str, send_args: str, backend: str) -> tuple[dict, dict]:
    """``nic recv`` on host1 (started first, in the background), ``nic send`` on host0 once
    host1 is ready; (sender's report, receiver's report)."""
    rx, tx = lab["host1"], lab["host0"]
    rx.run(f"rm -f {READY}")
    with rx.start_command(f"vfio-cxl nic recv {recv_args} --backend {backend} --ready-file {READY} --json",
                          timeout=900) as receiving:
        wait_ready(rx)
        sent = guest_json(tx, f"vfio-cxl nic send {send_args} --backend {backend} --json")
        got = json.loads(receiving.join().stdout)
    return sent, got


def expected(sender_mac: str, count: int = COUNT, size: int = SIZE, seed: int = SEED) -> dict:
    """What the receiver must report for frames 0..count-1 of ``nic send``."""
    run = [frames.frame(parse_mac(FLOW), parse_mac(sender_mac), seed, k, size) for k in range(count)]
    return {"sha256": hashlib.sha256(b"".join(f[frames.HEADERS:] for f in run)).hexdigest(),
            "headers_sha256": hashlib.sha256(b"".join(f[:frames.HEADERS] for f in run)).hexdigest(),
            "frame_bytes": sum(map(len, run))}


def check_delivery(sent: dict, got: dict, count: int = COUNT, size: int = SIZE) -> None:
    want = expected(sent["mac"], count, size)
    assert sent["link"] and got["link"]
    assert sent["frames"] == count and got["frames"] == count, (sent, got)
    assert got["verified"] and got["seqs"] == list(range(count))         # in order, each payload intact
    assert got["sha256"] == want["sha256"] and got["headers_sha256"] == want["headers_sha256"]
    assert sent["frame_bytes"] == want["frame_bytes"]
    # The counters agree: everything host0 sent, host1 received, on a link nothing else uses.
    assert sent["stats"]["gptc"] == count and got["stats"]["gprc"] == count, (sent["stats"], got["stats"])
    assert sent["stats"]["gotc"] >= want["frame_bytes"] and got["stats"]["gorc"] >= want["frame_bytes"]
    assert got["stats"]["rx_overrun_events"] == 0


def test_both_nics_are_listed_with_their_mac(nic2_lab):
    for name in ("host0", "host1"):
        (nic,) = guest_json(nic2_lab[name], "vfio-cxl nic ls --json")["nics"]
        assert nic["ids"] == "8086:10c9" and parse_mac(nic["mac"])


def test_frames_cross_the_link_into_guest_ram_type1(nic2_lab):
    sent, got = transfer(nic2_lab, f"--queue 1 --steer {FLOW} --count {COUNT} --seed {SEED} --timeout 120",
                         f"--to {FLOW} --count {COUNT} --size {SIZE} --seed {SEED}", "type1")
    assert got["mode"] == "ram" and got["vfio_backend"] == "type1"
    check_delivery(sent, got)


def check_devmem(sent: dict, got: dict, vram: tuple[int, int]) -> None:
    check_delivery(sent, got)
    assert got["mode"] == "devmem" and got["vram_range"] == list(vram)
    # split at the UDP payload: 42 header bytes in guest RAM, the payload alone in VRAM
    assert got["split"] == COUNT and got["linear"] == 0 and got["header_bytes"] == [frames.HEADERS] * COUNT
    frags = [f for frame in got["fragments"] for f in frame]
    assert [len(frame) for frame in got["fragments"]] == [1] * COUNT          # 1 KiB payloads, 4 KiB chunks
    assert all(vram[0] <= off and off + size <= vram[0] + vram[1] and size == SIZE for off, size, _ in frags)
    assert len({off for off, _, _ in frags}) == COUNT and len({t for _, _, t in frags}) == COUNT
    assert got["returned"] == COUNT and got["mapped_after_unbind"] == []


def test_header_split_into_vram_type1(nic2_lab):
    sent, got = transfer(nic2_lab, f"--queue 1 --steer {FLOW} --gpu --vram-offset 0x100000 --vram-length 1M "
                                   f"--count {COUNT} --seed {SEED} --timeout 120",
                         f"--to {FLOW} --count {COUNT} --size {SIZE} --seed {SEED}", "type1")
    check_devmem(sent, got, (0x100000, 1 << 20))
    assert any("VFIO_IOMMU_MAP_DMA" in note for note in got["kernel"].values()), got["kernel"]


def test_a_queue_without_buffers_drops_and_recv_returns_nothing(nic2_lab):
    sent, got = transfer(nic2_lab, f"--queue 1 --steer {FLOW} --buffers 0 --count 4 --seed {SEED} --timeout 20",
                         f"--to {FLOW} --count 4 --size {SIZE} --seed {SEED}", "type1")
    assert sent["frames"] == 4 and sent["stats"]["gptc"] == 4
    assert got["frames"] == 0 and got["seqs"] == []
    # QEMU's igb: ICR.RXO, and no counter moves for the dropped frames (docs/nic.md)
    assert got["stats"]["rx_overrun_events"] >= 1 and got["stats"]["gprc"] == 0, got["stats"]


def test_bad_input_is_refused_with_a_clear_error(nic2_lab):
    vm = nic2_lab["host0"]
    r = vm.run("vfio-cxl nic recv --queue 1", check=False)
    assert r.exited == 1 and "without --steer" in r.stderr, r.stderr
    r = vm.run(f"vfio-cxl nic send --to {FLOW} --size 1500", check=False)
    assert r.exited == 1 and "8 to 1472" in r.stderr, r.stderr
    r = vm.run("vfio-cxl nic send --to 02:00:00:00:01", check=False)
    assert r.exited == 2 and "not a MAC address" in r.stderr, r.stderr
    r = vm.run(f"vfio-cxl nic recv --queue 1 --steer {FLOW} --gpu --vram-offset 0x123 --timeout 1", check=False)
    assert r.exited == 1 and "multiple of 4096" in r.stderr, r.stderr


def test_documented_commands_as_typed(nic2_lab):
    """docs/nic.md's commands (CASES group "nic"), as typed: ls on both hosts, each recv on
    host1 with send on host0, stats on both."""
    shown = [c for c, case in docs.CASES.items() if case.group == "nic" and not case.skip and not case.same]
    recvs = [c for c in shown if c.startswith("vfio-cxl nic recv")]
    (send,) = [c for c in shown if c.startswith("vfio-cxl nic send")]
    rx, tx = nic2_lab["host1"], nic2_lab["host0"]
    for vm in (rx, tx):
        assert "8086:10c9" in vm.run("vfio-cxl nic ls", timeout=600).stdout
    for recv in recvs:
        rx.run(f"rm -f {READY}")
        with rx.start_command(recv, timeout=900) as receiving:
            wait_ready(rx)
            tx.run(send, timeout=600)
            out = receiving.join().stdout
        assert "8 frames" in out and "verified True" in out, out
    for vm in (rx, tx):
        out = vm.run("vfio-cxl nic stats", timeout=600).stdout
        assert "link " in out and "gprc " in out and "gptc " in out, out


# -- iommufd: the lab kernel -------------------------------------------------------------------

def test_iommufd_frames_and_header_split_into_vram(nic2_lab_kernel_lab):
    lab = nic2_lab_kernel_lab
    sent, got = transfer(lab, f"--queue 1 --steer {FLOW} --count {COUNT} --seed {SEED} --timeout 120",
                         f"--to {FLOW} --count {COUNT} --size {SIZE} --seed {SEED}", "iommufd")
    assert got["vfio_backend"] == "iommufd"
    check_delivery(sent, got)
    sent, got = transfer(lab, f"--queue 1 --steer {FLOW} --gpu --vram-offset 0x100000 --vram-length 1M "
                              f"--count {COUNT} --seed {SEED} --timeout 120",
                         f"--to {FLOW} --count {COUNT} --size {SIZE} --seed {SEED}", "iommufd")
    check_devmem(sent, got, (0x100000, 1 << 20))
    # iommufd cannot pin a BAR mmap: the range went in as a VFIO dma-buf
    assert any("IOMMU_IOAS_MAP_FILE accepted" in note for note in got["kernel"].values()), got["kernel"]
