"""The server as a process-level citizen: IRQ set-up, bad input, reconnects,
stalled messages, and the CLI."""

import errno
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from vfio_user_client import (DATA_IOVA, Rig, ServerThread, VfioUserClient, gpu_server,  # noqa: F401
                              no_leaks, wait_eventfd)

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.vfio_user import wire
from vfio_cxl.devices.gpu.regs import DESC_FLAG_INTERRUPT as IRQ, Op, pack_descriptor

EVENTFD_TRIGGER = wire.IRQ_SET_DATA_EVENTFD | wire.IRQ_SET_ACTION_TRIGGER
NONE_TRIGGER = wire.IRQ_SET_DATA_NONE | wire.IRQ_SET_ACTION_TRIGGER
MSIX = wire.PCI_MSIX_IRQ


def eventfds(n):
    return [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in range(n)]


# ------------------------------------------------------------------ SET_IRQS
def test_qemu_msix_enable_sequence_then_interrupts_fire(gpu_server):
    c = gpu_server.client()
    irqs = gpu_server.device.irqs
    efds = eventfds(4)
    try:
        # what QEMU 11.1 sends when the guest enables MSI-X (lab notes)
        assert c.set_irqs(MSIX, 0, 1, EVENTFD_TRIGGER).ok  # count 1, no fd: "unset"
        assert c.set_irqs(MSIX, 0, 0, NONE_TRIGGER).ok  # disable all
        assert c.set_irqs(MSIX, 0, 4, EVENTFD_TRIGGER, efds).ok
        assert all(irqs.has_eventfd(MSIX, v) for v in range(4))
        # loopback triggers, as VFIO allows
        assert c.set_irqs(MSIX, 1, 1, NONE_TRIGGER).ok
        assert wait_eventfd(efds[1], 2) == 1
        assert c.set_irqs(MSIX, 0, 4, wire.IRQ_SET_DATA_BOOL | wire.IRQ_SET_ACTION_TRIGGER,
                          data=bytes([1, 0, 1, 0])).ok
        assert [wait_eventfd(fd, 0) for fd in efds] == [1, 0, 1, 0]
        # de-assign one vector: its raise is dropped, the others still work
        assert c.set_irqs(MSIX, 2, 1, EVENTFD_TRIGGER).ok
        assert not irqs.has_eventfd(MSIX, 2) and irqs.has_eventfd(MSIX, 3)
        err = eventfds(1)
        assert c.set_irqs(wire.PCI_ERR_IRQ, 0, 1, EVENTFD_TRIGGER, err).ok
        os.close(err[0])
    finally:
        for fd in efds:
            os.close(fd)


@pytest.mark.parametrize("args,nfds", [
    ((MSIX, 0, 3, EVENTFD_TRIGGER), 2),  # fd count differs from count
    ((MSIX, 3, 2, EVENTFD_TRIGGER), 2),  # beyond the 4 vectors
    ((5, 0, 1, EVENTFD_TRIGGER), 1),  # no such IRQ index
    ((wire.PCI_INTX_IRQ, 0, 1, EVENTFD_TRIGGER), 1),  # INTx has no vectors
    ((MSIX, 0, 1, wire.IRQ_SET_DATA_EVENTFD | wire.IRQ_SET_ACTION_MASK), 1),  # not maskable
    ((MSIX, 0, 1, wire.IRQ_SET_DATA_NONE | wire.IRQ_SET_DATA_EVENTFD
      | wire.IRQ_SET_ACTION_TRIGGER), 1),  # two data kinds
    ((MSIX, 0, 1, NONE_TRIGGER), 1),  # fds without DATA_EVENTFD
])
def test_bad_set_irqs_are_refused_and_their_fds_closed(gpu_server, args, nfds):
    c = gpu_server.client()
    efds = eventfds(nfds)
    try:
        assert c.set_irqs(*args, fds=efds).errno == errno.EINVAL
        assert not any(gpu_server.device.irqs.has_eventfd(MSIX, v) for v in range(4))
    finally:
        for fd in efds:
            os.close(fd)
    # no_leaks (in the fixture) proves the server closed its copies


def test_set_irqs_refuses_fds_that_are_not_eventfds(gpu_server):
    c = gpu_server.client()
    r, w = os.pipe()
    try:
        assert c.set_irqs(MSIX, 0, 1, EVENTFD_TRIGGER, [w]).errno == errno.EINVAL
    finally:
        os.close(r)
        os.close(w)


# ------------------------------------------------------------------ bad input
def raw_request(command, payload=b"", msg_id=7, flags=0, size=None):
    size = 16 + len(payload) if size is None else size
    return struct.pack("<HHIII", msg_id, command, size, flags, 0) + payload


def region_access(offset, region, count, data=b""):
    return struct.pack("<QII", offset, region, count) + data


@pytest.mark.parametrize("command,payload,err", [
    (99, b"", errno.ENOSYS),
    (0, b"", errno.ENOSYS),
    (wire.DMA_READ, b"\0" * 16, errno.ENOSYS),  # a server->client command
    (wire.DEVICE_GET_REGION_IO_FDS, b"\0" * 16, errno.ENOSYS),
    (wire.REGION_READ, region_access(0, 0, 4)[:15], errno.EINVAL),  # truncated
    (wire.REGION_READ, region_access(0, 0, 4) + b"x", errno.EINVAL),  # too long
    (wire.REGION_READ, region_access(0, 0, (1 << 20) + 1), errno.E2BIG),
    (wire.REGION_READ, region_access(4094, 0, 4), errno.EINVAL),  # past BAR0
    (wire.REGION_READ, region_access(2**64 - 2, 7, 4), errno.EINVAL),  # offset overflow
    (wire.REGION_READ, region_access(0, 1, 4), errno.EINVAL),  # BAR1 absent
    (wire.REGION_READ, region_access(0, 42, 4), errno.EINVAL),
    (wire.REGION_WRITE, region_access(0, 0, 8, b"1234"), errno.EINVAL),  # count != data
    (wire.REGION_WRITE, region_access(16 * regs.MIB - 2, 2, 4, b"abcd"), errno.EINVAL),
    (wire.DMA_MAP, b"\0" * 31, errno.EINVAL),
    (wire.DMA_UNMAP, struct.pack("<IIQQ", 24, 1, 0, 4096), errno.ENOTSUP),  # dirty bitmap
    (wire.DMA_UNMAP, struct.pack("<IIQQ", 24, 0, 0, 0), errno.EINVAL),
    (wire.DEVICE_GET_INFO, struct.pack("<IIII", 8, 0, 0, 0), errno.EINVAL),  # argsz too small
    (wire.DEVICE_SET_IRQS, b"\0" * 19, errno.EINVAL),
    (wire.VERSION, b"\0\0\0\0", errno.EINVAL),  # again
])
def test_malformed_requests_get_error_replies(gpu_server, command, payload, err):
    c = gpu_server.client()
    reply = c.request(command, payload)
    assert reply.errno == err
    assert reply.header.size == 16 and reply.payload == b""
    assert c.reg_read(regs.REG_ID) == regs.ID_MAGIC  # the connection carries on


def test_out_of_range_write_changes_nothing(gpu_server):
    c = gpu_server.client()
    vram = gpu_server.device.vram
    vram[-4:] = b"keep"
    assert c.region_write(regs.BAR_VRAM, 16 * regs.MIB - 2, b"XXXX").errno == errno.EINVAL
    assert bytes(vram[-4:]) == b"keep"


def test_unexpected_fds_are_refused_and_closed(gpu_server):
    c = gpu_server.client()
    fd = os.memfd_create("stray")
    try:
        reply = c.request(wire.REGION_READ, region_access(0, 0, 4), [fd])
        assert reply.errno == errno.EINVAL
        fd2 = os.memfd_create("stray2")
        reply = c.request(wire.DMA_MAP, struct.pack("<IIQQQ", 32, 3, 0, 0x100000, 4096), [fd, fd2])
        assert reply.errno == errno.EINVAL
        os.close(fd2)
    finally:
        os.close(fd)


def test_header_smaller_than_itself_bad_type_and_no_reply_errors(gpu_server):
    c = gpu_server.client()
    c.send_raw(raw_request(wire.DEVICE_GET_INFO, size=8, msg_id=0x501))
    assert c.closed.wait(5), "a header with size < 16 cannot be framed: the server hangs up"
    gpu_server.wait_idle()
    c = gpu_server.client()
    c.send_raw(raw_request(wire.DEVICE_GET_INFO, struct.pack("<IIII", 16, 0, 0, 0),
                           msg_id=0x502, flags=0x2))
    c.send_raw(raw_request(99, msg_id=0x503, flags=wire.FLAG_NO_REPLY))  # refused silently
    assert c.reg_read(regs.REG_ID) == regs.ID_MAGIC  # still in sync afterwards
    # a reply to something the server never asked is dropped
    c.send_raw(struct.pack("<HHIII", 0x4444, wire.DMA_READ, 40, 1, 0) + b"\0" * 24)
    assert c.reg_read(regs.REG_ID) == regs.ID_MAGIC


def test_oversized_message_is_skipped_with_e2big(gpu_server):
    c = gpu_server.client()
    body = region_access(0, regs.BAR_VRAM, 2 << 20) + b"\xEE" * (2 << 20)
    slot_reply = c.request(wire.REGION_WRITE, body)
    assert slot_reply.errno == errno.E2BIG
    assert bytes(gpu_server.device.vram[:4]) != b"\xEE" * 4
    assert c.reg_read(regs.REG_ID) == regs.ID_MAGIC


def test_absurd_size_hangs_up_and_the_server_accepts_again(gpu_server):
    c = gpu_server.client()
    c.send_raw(raw_request(wire.REGION_WRITE, size=0xFFFFFFF0))
    assert c.closed.wait(5), "server kept a connection with a 4 GiB message"
    gpu_server.wait_idle()
    assert gpu_server.client().reg_read(regs.REG_ID) == regs.ID_MAGIC


@pytest.mark.parametrize("cut", ["header", "body"])
def test_message_cut_off_midway_times_out(gpu_server, cut):
    c = gpu_server.client()
    msg = raw_request(wire.REGION_WRITE, region_access(0, 0, 4, b"abcd"))
    started = time.monotonic()
    c.send_raw(msg[:10] if cut == "header" else msg[:24])
    assert c.closed.wait(5), "server waited forever for the rest of a message"
    assert time.monotonic() - started < 3  # partial_timeout is 0.3 s here
    gpu_server.wait_idle()
    assert gpu_server.client().reg_read(regs.REG_ID) == regs.ID_MAGIC


# ------------------------------------------------------------------ reconnects
def test_client_leaves_and_the_next_one_finds_the_device_as_it_was(gpu_server):
    rig = Rig(gpu_server, direct=True)
    rig.client.reg_write(regs.REG_SCRATCH, 0xCAFE)
    rig.submit([pack_descriptor(Op.FILL_PRNG, 123, 4096, 4096, IRQ)])
    rig.wait_vector(regs.VEC_DMA_DONE)
    rig.close()
    gpu_server.wait_idle()
    # the old client's mappings and eventfds are gone with it (no_leaks checks fds too)
    assert not any(gpu_server.device.irqs.has_eventfd(MSIX, v) for v in range(4))
    c = gpu_server.client()
    assert c.reg_read(regs.REG_SCRATCH) == 0xCAFE  # device state is kept
    assert c.read(regs.BAR_VRAM, 4096, 4096) == regs.prng_bytes(123, 4096)
    # and a new VM resets and drives it
    c.reset()
    c.close()
    gpu_server.wait_idle()
    rig2 = Rig(gpu_server, direct=False)
    rig2.submit([pack_descriptor(Op.VRAM_TO_HOST, 4096, DATA_IOVA, 4096, IRQ)])
    rig2.wait_vector(regs.VEC_DMA_DONE)
    assert rig2.host(DATA_IOVA, 4096) == regs.prng_bytes(123, 4096)
    rig2.close()


def test_second_client_waits_for_the_first(gpu_server):
    first = gpu_server.client()
    second = VfioUserClient(gpu_server.path, timeout=5)
    gpu_server.clients.append(second)
    done = threading.Event()
    result = {}

    def negotiate():
        result["caps"] = second.negotiate()
        done.set()

    t = threading.Thread(target=negotiate)
    t.start()
    assert not done.wait(0.2), "a second client was served while the first was connected"
    first.close()
    assert done.wait(5), "the waiting client was never served"
    t.join()
    assert result["caps"]["max_msg_fds"] == 8


def test_disconnect_in_the_middle_of_a_message_path_transfer(tmp_path):
    with no_leaks():
        srv = ServerThread(tmp_path, dma_timeout=5)
        try:
            rig = Rig(srv, direct=False)
            got_request = threading.Event()

            def swallow(header, body, fds):
                rig.client.transport.discard(body, fds)
                got_request.set()  # and never answer

            rig.client._serve_dma = swallow
            rig.submit([pack_descriptor(Op.NOP, 0, 0, 0)])
            assert got_request.wait(5)
            rig.close()  # the server must not wait for the reply that never comes
            srv.wait_idle()
            c = srv.client()
            # the spec ("Clients"): a RUNNING ring with work becomes HALTED, DMA_ABORTED
            assert c.reg_read(regs.REG_ERR_STATUS) == regs.Status.DMA_ABORTED
            assert c.reg_read(regs.REG_ERR_ERRNO) == errno.ECONNRESET
            assert c.reg_read(regs.REG_ERR_ADDR_LO) == 0
        finally:
            srv.stop()


# ------------------------------------------------------------------ CLI
def start_cli(sock, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "vfio_cxl.devices.gpu", "serve", "--socket", str(sock), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_line(stream, timeout=10):
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, "no line from the server in time"
    return stream.readline()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_prints_ready_serves_and_exits_cleanly(tmp_path, sig):
    sock = tmp_path / "gpu.sock"
    proc = start_cli(sock, "--vram-mib", "4", "--device-id", "0x1992", "-v")
    try:
        assert read_line(proc.stdout) == f"READY {sock}\n"
        assert sock.exists()
        with VfioUserClient(str(sock)) as c:
            c.negotiate()
            assert c.config_read(0, 4) == bytes.fromhex("01069219")
            assert c.reg_read(regs.REG_VRAM_SIZE_LO) == 4 * regs.MIB
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out == ""  # READY was the only line
    assert not sock.exists(), "socket file left behind"
    assert "VERSION" in err and "REGION_READ" in err  # -v logs every message


def test_cli_replaces_a_stale_socket_but_not_other_files(tmp_path):
    sock = tmp_path / "gpu.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))
    stale.close()  # file stays, nobody listens
    proc = start_cli(sock)
    try:
        assert read_line(proc.stdout) == f"READY {sock}\n"
        proc.terminate()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    regular = tmp_path / "not-a-socket"
    regular.write_text("precious")
    proc = start_cli(regular)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 1 and "not a socket" in err
    assert regular.read_text() == "precious"


def test_cli_rejects_bad_arguments(tmp_path):
    proc = start_cli(tmp_path / "s", "--vram-mib", "3")
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "power of two" in err
    proc = start_cli(tmp_path / "s", "--vendor-id", "0x10000")
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "16-bit" in err


def test_top_level_cli_forwards_to_the_gpu_server(tmp_path):
    sock = tmp_path / "gpu.sock"
    proc = subprocess.Popen([sys.executable, "-m", "vfio_cxl", "gpu", "serve", "--socket", str(sock)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert read_line(proc.stdout) == f"READY {sock}\n"
        proc.terminate()
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and not sock.exists()
