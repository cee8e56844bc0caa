"""Fuzzing the message parser: arbitrary bytes and mutated valid messages
never crash the server, never hang it, and never stop it serving."""

import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from vfio_user_client import ServerThread, VfioUserClient, no_leaks

from vfio_cxl.devices.gpu import regs
from vfio_cxl.devices.vfio_user import wire

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    with no_leaks():
        srv = ServerThread(tmp_path_factory.mktemp("fuzz"), partial_timeout=0.2, dma_timeout=0.5)
        try:
            yield srv
        finally:
            srv.stop()
        assert srv.server.internal_errors == 0, "a handler raised: see the log"


def hdr(command, payload, msg_id=1, flags=0):
    return struct.pack("<HHIII", msg_id, command, 16 + len(payload), flags, 0) + payload


VERSION_MSG = hdr(wire.VERSION, wire.version_payload(0, 0, {"max_data_xfer_size": 65536}))
TEMPLATES = [
    hdr(wire.DEVICE_GET_INFO, struct.pack("<IIII", 16, 0, 0, 0)),
    hdr(wire.DEVICE_GET_REGION_INFO, struct.pack("<IIIIQQ", 64, 0, 2, 0, 0, 0)),
    hdr(wire.DEVICE_GET_IRQ_INFO, struct.pack("<IIII", 16, 0, 2, 0)),
    hdr(wire.DEVICE_SET_IRQS, struct.pack("<IIIII", 24, 0x22, 2, 0, 4) + b"\1\0\1\0"),
    hdr(wire.REGION_READ, struct.pack("<QII", 0, 7, 64)),
    hdr(wire.REGION_READ, struct.pack("<QII", 0, 0, 4)),
    hdr(wire.REGION_WRITE, struct.pack("<QII", 0x50, 0, 4) + b"\1\0\0\0"),
    hdr(wire.REGION_WRITE, struct.pack("<QII", 0x20, 0, 4) + b"\1\0\0\0"),
    hdr(wire.REGION_WRITE, struct.pack("<QII", 0x10, 7, 4) + b"\xff\xff\xff\xff"),
    hdr(wire.REGION_WRITE, struct.pack("<QII", 0, 2, 8) + b"fuzzfuzz"),
    hdr(wire.DMA_MAP, struct.pack("<IIQQQ", 32, 3, 0, 0x10000, 0x10000)),
    hdr(wire.DMA_UNMAP, struct.pack("<IIQQ", 24, 0, 0x10000, 0x10000)),
    hdr(wire.DEVICE_RESET, b""),
    hdr(wire.DMA_READ, struct.pack("<QQ", 0, 8), flags=1),
]


def exchange(srv, data: bytes, negotiate: bool) -> None:
    """Send ``data``, close our write side, and require the server to hang up in time."""
    c = VfioUserClient(srv.path, timeout=5)
    try:
        if negotiate:
            c.send_raw(VERSION_MSG)
        c.send_raw(data)
        c.transport.sock.shutdown(1)  # SHUT_WR: EOF after our bytes
        assert c.closed.wait(5), "server did not finish with the connection (hang?)"
    finally:
        c.close()
    srv.wait_idle()
    assert srv.server.internal_errors == 0, "a handler raised on this input (see the log)"


def assert_alive(srv) -> None:
    with VfioUserClient(srv.path, timeout=5) as c:
        c.negotiate()
        assert c.reg_read(regs.REG_ID) == regs.ID_MAGIC
        assert c.config_read(0, 4) == bytes.fromhex("01069119")
    srv.wait_idle()


@FUZZ
@given(data=st.binary(max_size=600), negotiate=st.booleans())
def test_arbitrary_bytes(fuzz_server, data, negotiate):
    exchange(fuzz_server, data, negotiate)
    assert_alive(fuzz_server)


@FUZZ
@given(template=st.sampled_from(TEMPLATES),
       edits=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 255)), max_size=6),
       cut=st.integers(0, 100), repeat=st.integers(1, 3))
def test_mutated_valid_messages(fuzz_server, template, edits, cut, repeat):
    msg = bytearray(template)
    for pos, value in edits:
        if pos < len(msg):
            msg[pos] = value
    msg = bytes(msg[:max(len(msg) - cut, 0)] if cut < 40 else msg)
    exchange(fuzz_server, msg * repeat, negotiate=True)
    assert_alive(fuzz_server)


@FUZZ
@given(size=st.integers(0, 2**32 - 1), command=st.integers(0, 0xFFFF),
       flags=st.integers(0, 2**32 - 1), tail=st.binary(max_size=64))
def test_arbitrary_headers(fuzz_server, size, command, flags, tail):
    raw = struct.pack("<HHIII", 9, command, size, flags, 0) + tail
    exchange(fuzz_server, raw, negotiate=True)
    assert_alive(fuzz_server)


# Field-aware messages: every known command with its payload struct filled from
# boundary values and arbitrary integers -- reaches the handlers' semantic checks
# (misaligned offsets, huge counts, odd flags), which byte noise rarely does.
LAYOUTS = {
    wire.DMA_MAP: "<IIQQQ", wire.DMA_UNMAP: "<IIQQ", wire.DEVICE_GET_INFO: "<IIII",
    wire.DEVICE_GET_REGION_INFO: "<IIIIQQ", wire.DEVICE_GET_IRQ_INFO: "<IIII",
    wire.DEVICE_SET_IRQS: "<IIIII", wire.REGION_READ: "<QII", wire.REGION_WRITE: "<QII",
    wire.DEVICE_RESET: "<", wire.VERSION: "<HH", wire.DEVICE_GET_REGION_IO_FDS: "<IIII",
}
SMALL = st.sampled_from([0, 1, 2, 3, 4, 7, 8, 9, 12, 16, 20, 24, 32, 64, 0x50, 0x800, 0xFFC,
                         0x1000, 0xFFFFF])


def field(code: str):
    top = {"H": 2**16, "I": 2**32, "Q": 2**64}[code] - 1
    small = SMALL.map(lambda v: min(v, top))
    return st.one_of(small, small, st.sampled_from([top, top - 3, top // 2 + 1]),
                     st.integers(0, top))


@st.composite
def structured_message(draw):
    command = draw(st.sampled_from(sorted(LAYOUTS)))
    layout = LAYOUTS[command]
    values = [draw(field(code)) for code in layout[1:]]
    data = draw(st.one_of(st.just(b""), st.binary(max_size=48)))
    if command in (wire.REGION_READ, wire.REGION_WRITE) and draw(st.integers(0, 3)):
        # mostly plausible accesses, so they get past the checks into the device model
        values = [draw(st.one_of(st.integers(0, 0x1100), field("Q"))),
                  draw(st.one_of(st.sampled_from([0, 2, 4, 7]), st.integers(0, 9))),
                  draw(st.integers(0, 16))]
        data = draw(st.binary(min_size=values[2], max_size=values[2])) \
            if command == wire.REGION_WRITE else b""
    elif command == wire.DEVICE_GET_REGION_INFO:
        values[2] = draw(st.one_of(st.integers(0, 9), field("I")))
    payload = struct.pack(layout, *values) + data
    flags = draw(st.sampled_from([0, 0, wire.FLAG_NO_REPLY]))
    return struct.pack("<HHIII", draw(st.integers(0, 0xFFFF)), command, 16 + len(payload),
                       flags, 0) + payload


@FUZZ
@given(messages=st.lists(structured_message(), min_size=1, max_size=12))
def test_structured_messages(fuzz_server, messages):
    exchange(fuzz_server, b"".join(messages), negotiate=True)
    assert_alive(fuzz_server)
