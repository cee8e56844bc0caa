"""Issue 35 steps 2-4: the guest's userspace igb driver, devmem-shaped receive into VRAM, and
RDMA-shaped writes from host0's VRAM into host1's.

On the ``nic2`` topology (host0 and host1, each a GPU and an igb behind one PCIe switch, the
two igbs on one point-to-point link): both links come up; host0 sends frames to a MAC host1
steers to queue 1, and host1 receives every one with the bytes sent and statistics that
agree; with ``--gpu`` host1's queue 1 is bound to gpu1's VRAM: the headers land in guest RAM,
the payloads in VRAM at the offsets recv reports (read back through BAR2), nothing stays
mapped after unbind; a queue without buffers drops what is steered there and recv returns
nothing by its timeout.  ``nic rdma-write`` of 16 MiB from gpu0's VRAM lands in gpu1's
registered VRAM byte for byte with no payload byte copied by host1's CPU; the bounce and the
TCP reference land the same bytes; a write beyond the region, with a freed region's key, a
stale key or an unknown one is refused by name and writes nothing.  Type1 on the image's
Debian kernel, iommufd on the lab kernel.  Last, two tests that break their lab: gpu1 hot-
removed (QMP device_del) while rdma-recv holds its VRAM, and host1's QEMU killed mid-write.

The receiver runs first, in the background (``start_command``), and writes ``--ready-file``
once its buffers are posted; the sender starts when that file exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

import documented_commands as docs
from vfio_cxl.guest.drivers.igb.spec import parse_mac
from vfio_cxl.guest.nic import frames
from vfio_cxl.guest.nic.rdma import HEADER, MTU, pattern

from .conftest import pci_ids

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


def header_split_into_vram(lab, backend: str) -> dict:
    """host1's queue 1 bound to 1 MiB of gpu1's VRAM at 1 MiB, COUNT frames from host0; checked
    (check_devmem); -> the receiver's report."""
    sent, got = transfer(lab, f"--queue 1 --steer {FLOW} --gpu --vram-offset 0x100000 --vram-length 1M "
                              f"--count {COUNT} --seed {SEED} --timeout 120",
                         f"--to {FLOW} --count {COUNT} --size {SIZE} --seed {SEED}", backend)
    check_devmem(sent, got, (0x100000, 1 << 20))
    return got


def test_header_split_into_vram_type1(nic2_lab):
    got = header_split_into_vram(nic2_lab, "type1")
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
    host1 with send on host0, rdma-recv on host1 with rdma-write on host0, stats on both."""
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
    (rdma_recv,) = [c for c in shown if c.startswith("vfio-cxl nic rdma-recv")]
    (rdma_write,) = [c for c in shown if c.startswith("vfio-cxl nic rdma-write")]
    rx.run(f"rm -f {READY}")
    with rx.start_command(rdma_recv, timeout=1800) as receiving:
        wait_ready(rx)
        wrote = tx.run(rdma_write, timeout=1800).stdout
        placed = receiving.join().stdout
    assert f"{16 << 20} bytes at 0x0 in" in wrote and "payload bytes copied by this CPU 0" in wrote, wrote
    assert ": OK" in placed and "verified True" in placed and "payload bytes copied by this CPU 0" in placed, placed
    for vm in (rx, tx):
        out = vm.run("vfio-cxl nic stats", timeout=600).stdout
        assert "link " in out and "gprc " in out and "gptc " in out, out


# -- RDMA-shaped writes (step 4) ---------------------------------------------------------------

RSEED = 5


def rdma_serve(lab, recv_args: str, writes: list[str], backend: str) -> tuple[list[dict], dict]:
    """``nic rdma-recv`` on host1 (in the background, until its ready file holds the key), then
    each of ``writes`` (``nic rdma-write`` arguments; ``{key}`` and ``{mac}`` filled in from
    the ready file) on host0 in turn; (the writers' reports, the receiver's)."""
    rx, tx = lab["host1"], lab["host0"]
    rx.run(f"rm -f {READY}")
    with rx.start_command(f"vfio-cxl nic rdma-recv {recv_args} --backend {backend} --ready-file {READY} --json",
                          timeout=1800) as receiving:
        wait_ready(rx)
        ready = json.loads(rx.run(f"cat {READY}").stdout)
        sent = [json.loads(tx.run(f"vfio-cxl nic rdma-write {w.format(**ready)} --backend {backend} --json",
                                  timeout=1800, check=False).stdout) for w in writes]
        got = json.loads(receiving.join(check=False).stdout)
    return sent, got


def check_placed(sent: dict, got: dict, size: int, offset: int = 0) -> None:
    """One write of ``size`` bytes at ``offset``: placed whole, the bytes read back through
    host1's BAR2 the seeded pattern (sha256 computed here too), the payload copied by neither CPU."""
    (w,) = sent["writes"]
    assert w["status"] == "OK" and w["payload_bytes_copied"] == 0, w
    frames_ = -(-size // MTU)
    assert w["frames"] == frames_ and w["mb_s"] > 0
    r = got["writes"][-1]
    assert r["status"] == "OK" and r["verified"] and (r["offset"], r["length"]) == (offset, size), r
    assert r["sha256"] == hashlib.sha256(pattern(RSEED, offset, size)).hexdigest()
    assert r["frames"] == frames_ and r["imm"] == w["imm"]
    assert r["payload_bytes_copied"] == 0 and r["header_bytes_copied"] == frames_ * HEADER
    assert got["mapped_after_close"] == []


def test_rdma_write_of_16m_lands_in_remote_vram_with_no_cpu_copy_type1(nic2_lab):
    sent, got = rdma_serve(nic2_lab, f"--length 16M --seed {RSEED}",
                           [f"--to {{mac}} --key {{key}} --length 16M --sizes 16M --seed {RSEED} --imm 7"], "type1")
    check_placed(sent[0], got, 16 << 20)
    assert sent[0]["writes"][0]["imm"] == 7 and got["vfio_backend"] == "type1"
    assert got["stats"]["gprc"] >= 16 << 10 and got["stats"]["rx_overrun_events"] == 0, got["stats"]


@pytest.mark.parametrize("path", ["bounce", "tcp"])
def test_rdma_bounce_and_tcp_land_the_same_bytes_through_the_cpus(nic2_lab, path):
    peer = "" if path == "tcp" else "--to {mac} --key {key}"      # tcp: the link address, no key
    sent, got = rdma_serve(nic2_lab, f"--path {path} --length 1M --seed {RSEED}",
                           [f"--path {path} {peer} --length 1M --sizes 1M --seed {RSEED}"], "type1")
    (w,), r = sent[0]["writes"], got["writes"][0]
    assert w["status"] == "OK" and r["status"] == "OK" and r["verified"], (w, r)
    assert r["sha256"] == hashlib.sha256(pattern(RSEED, 0, 1 << 20)).hexdigest()
    assert r["payload_bytes_copied"] >= 1 << 20 and w["payload_bytes_copied"] >= 1 << 20


def test_rdma_refuses_a_range_beyond_the_region_and_a_freed_region(nic2_lab):
    write = f"--to {{mac}} --key {{key}} --length 128K --seed {RSEED}"      # the source: inside its own region
    sent, got = rdma_serve(nic2_lab, f"--length 64K --seed {RSEED} --writes 3 --free-after 2",
                           [f"{write} --offset 0xF000 --sizes 8K", f"{write} --sizes 4K", f"{write} --sizes 4K"],
                           "type1")
    beyond, ok, freed = (s["writes"][0] for s in sent)
    assert beyond["status"] == "REFUSED" and "beyond the registered region" in beyond["error"], beyond
    assert ok["status"] == "OK"
    assert freed["status"] == "REFUSED" and "was freed" in freed["error"], freed
    assert [w["status"] for w in got["writes"]] == ["OUT_OF_RANGE", "OK", "FREED"], got["writes"]
    assert got["writes"][1]["verified"] and got["mapped_after_close"] == []


def test_rdma_refuses_a_stale_key_and_one_never_handed_out(nic2_lab):
    write = f"--to {{mac}} --length 64K --seed {RSEED} --sizes 4K"
    sent, got = rdma_serve(nic2_lab, f"--length 64K --seed {RSEED} --writes 3 --free-after 1 --reregister",
                           [f"{write} --key {{key}}", f"{write} --key {{key}}", f"{write} --key 0x7f05"], "type1")
    ok, stale, unknown = (s["writes"][0] for s in sent)
    assert ok["status"] == "OK" and len(set(got["keys"])) == 2, got["keys"]
    assert stale["status"] == "REFUSED" and "earlier registration" in stale["error"], stale
    assert unknown["status"] == "REFUSED" and "names no registration" in unknown["error"], unknown
    assert [w["status"] for w in got["writes"]] == ["OK", "STALE_KEY", "UNKNOWN_KEY"], got["writes"]


# -- the peer's lab gone: it breaks the lab (run last of the Debian kernel's nic2, then closed) --

def vram(lab, gpu: str, offset: int, length: int) -> bytes:
    """Bytes of ``gpu``'s VRAM, read on the host from the memfd its server holds (QEMU maps it)."""
    pid = lab.gpu_servers[gpu].process.pid
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        if "vfio-cxl-gpu-vram" in os.readlink(fd):
            with open(fd, "rb") as f:
                f.seek(offset)
                return f.read(length)
    raise AssertionError(f"{gpu}'s server (pid {pid}) holds no VRAM memfd")


LOST_SEED = 23                      # a pattern no earlier write left in gpu1's VRAM


def test_the_peer_lab_dying_mid_write_ends_the_writer_naming_it_with_nothing_mapped(nic2_lab, labs):
    """rdma-recv on host1, a 16 MiB rdma-write from host0 (--timeout 10: the seconds the peer
    may stay silent); once the write's first 4 KiB are in gpu1's VRAM (read on the host),
    host1's QEMU is killed.  The writer ends within its timeout (and some slack), exit status 1,
    its write PEER_LOST naming host1's MAC and what it last acknowledged, nothing left mapped."""
    rx, tx = nic2_lab["host1"], nic2_lab["host0"]
    try:
        rx.run(f"rm -f {READY}")
        receiving = rx.start_command(f"vfio-cxl nic rdma-recv --length 16M --seed {LOST_SEED} --timeout 600 "
                                     f"--backend type1 --ready-file {READY} --json", timeout=1800)
        wait_ready(rx)
        ready = json.loads(rx.run(f"cat {READY}").stdout)
        with tx.start_command(f"vfio-cxl nic rdma-write --to {ready['mac']} --key {ready['key']} --length 16M "
                              f"--sizes 16M --seed {LOST_SEED} --timeout 10 --backend type1 --json",
                              timeout=1800) as writing:
            first = pattern(LOST_SEED, 0, 4096)
            deadline = time.monotonic() + 600
            while vram(nic2_lab, "gpu1", 0, 4096) != first:
                assert time.monotonic() < deadline, "the write's first frames never landed in gpu1's VRAM"
                time.sleep(0.02)      # the host watching VRAM, not synchronising the guests
            os.killpg(rx.process.pid, signal.SIGKILL)                # host1's lab goes down mid-write
            rx.process.wait()
            killed = time.monotonic()
            done = writing.join(check=False)
        ended_after = time.monotonic() - killed
        receiving.cancel()            # its SSH connection died with the VM
    finally:
        labs.close()                  # the lab lost a VM: never reuse it
    out = json.loads(done.stdout)
    (w,) = out["writes"]
    assert done.exited == 1 and w["status"] == "PEER_LOST", (done.exited, w)
    assert f"to {ready['mac']}: the peer went silent mid-transfer" in w["error"], w["error"]
    assert "it last acknowledged" in w["error"] and "frames placed" in w["error"], w["error"]
    assert ended_after < 10 + 30, f"the writer took {ended_after:.0f} s after the peer died"
    assert out["mapped_after_close"] == [] and w["payload_bytes_copied"] == 0, out


# -- iommufd: the lab kernel -------------------------------------------------------------------

def test_iommufd_frames_and_header_split_into_vram(nic2_lab_kernel_lab):
    lab = nic2_lab_kernel_lab
    sent, got = transfer(lab, f"--queue 1 --steer {FLOW} --count {COUNT} --seed {SEED} --timeout 120",
                         f"--to {FLOW} --count {COUNT} --size {SIZE} --seed {SEED}", "iommufd")
    assert got["vfio_backend"] == "iommufd"
    check_delivery(sent, got)
    got = header_split_into_vram(lab, "iommufd")
    # iommufd cannot pin a BAR mmap: the range went in as a VFIO dma-buf
    assert any("IOMMU_IOAS_MAP_FILE accepted" in note for note in got["kernel"].values()), got["kernel"]


def test_iommufd_rdma_write_of_16m_and_a_range_beyond_the_region(nic2_lab_kernel_lab):
    write = f"--to {{mac}} --key {{key}} --length 17M --seed {RSEED}"       # the source: inside its own region
    sent, got = rdma_serve(nic2_lab_kernel_lab, f"--length 16M --seed {RSEED} --writes 2",
                           [f"{write} --sizes 16M", f"{write} --offset 0xFFF000 --sizes 8K"], "iommufd")
    assert got["vfio_backend"] == "iommufd"
    check_placed({"writes": sent[0]["writes"]}, {**got, "writes": got["writes"][:1]}, 16 << 20)
    assert sent[1]["writes"][0]["status"] == "REFUSED" and got["writes"][1]["status"] == "OUT_OF_RANGE"
    assert any("IOMMU_IOAS_MAP_FILE accepted" in note for note in got["kernel"].values()), got["kernel"]


# -- the GPU moved away: it breaks the lab (run last of the lab kernel's nic2, then closed) -----

def test_the_gpu_moved_away_while_registered_ends_the_responder_naming_it(nic2_lab_kernel_lab, labs):
    """gpu1 is hot-removed from host1 (QMP device_del, what the fabric manager sends to move it)
    while rdma-recv holds 1 MiB of its VRAM registered and waits for a write: vfio-pci's release
    request wakes the wait, the responder tears the registration down and closes the GPU --
    the removal completes in the guest and in QEMU -- and ends naming the GPU's BDF, nothing
    left mapped; the NIC still works for guest-RAM traffic.  On the lab kernel's nic2, last of
    its tests (type1 all the same): the lab it leaves cannot be reused, and the Debian kernel's
    nic2 is closed by the killed-peer test, so neither needs a second boot."""
    rx = nic2_lab_kernel_lab["host1"]
    try:
        rx.run(f"rm -f {READY}")
        with rx.start_command(f"vfio-cxl nic rdma-recv --length 1M --timeout 600 --backend type1 "
                              f"--ready-file {READY} --json", timeout=900) as receiving:
            wait_ready(rx)
            answer = rx.connect_qmp().cmd_obj({"execute": "device_del", "arguments": {"id": "gpu1"}})
            assert "error" not in answer, answer
            t0 = time.monotonic()
            done = receiving.join(check=False)
        ended_after = time.monotonic() - t0
        assert done.stdout.strip(), f"rdma-recv printed no report (exit {done.exited}): {done.stderr[-3000:]}"
        out = json.loads(done.stdout)
        assert done.exited == 1 and out["writes"] == [], (done.exited, out)
        assert f"the GPU {out['gpu']} was released by the host" in out["released"], out["released"]
        assert "bind again once a GPU is there" in out["released"] and out["mapped_after_close"] == []
        assert ended_after < 60, f"the responder took {ended_after:.0f} s to let the GPU go"
        deadline = time.monotonic() + 60
        while "gpu1" in pci_ids(rx):                                   # QEMU finishes the unplug
            assert time.monotonic() < deadline, "QEMU still lists gpu1 60 s after the guest released it"
        assert rx.run(f"test -e /sys/bus/pci/devices/{out['gpu']}", check=False).exited != 0
        stats = guest_json(rx, "vfio-cxl nic stats --seconds 0 --json")    # the NIC outlives the GPU
        assert stats["bdf"] == out["bdf"], stats
    finally:
        labs.close()                  # host1 has no GPU now: the next test gets a fresh lab
