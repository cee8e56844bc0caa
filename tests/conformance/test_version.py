"""VFIO_USER_VERSION negotiation (spec section "VFIO_USER_VERSION")."""

from __future__ import annotations

import pytest

from vfio_cxl.bench import gpu_doc as gpu
from vfio_cxl.bench import vfio_user_spec as vu

from .conftest import assert_error_reply, assert_ok_reply, expect_closed, fresh_client_works

KNOWN_CAPS = {"max_msg_fds", "max_data_xfer_size", "max_dma_maps", "pgsizes", "twin_socket",
              "write_multiple", "migration"}


def test_reply_keeps_the_major_and_a_minor_not_above_the_proposed(raw):
    """VERSION: "The major version in the reply must be the same as proposed." and
    "The minor version in the reply must be equal to or less than the minor
    version proposed." (QEMU 11.1 proposes 0.0.)"""
    reply = raw.request(vu.VERSION, vu.version_body(0, 0, {"max_msg_fds": 8}))
    assert_ok_reply(reply, vu.VERSION)
    major, minor, _caps = vu.parse_version(reply.payload)
    assert (major, minor) == (0, 0)


def test_higher_minor_is_answered_with_a_minor_not_above_it(raw):
    """VERSION: "The minor version in the reply must be equal to or less than the
    minor version proposed." and "Both the client and server must support all
    minor versions less than the maximum minor version it supports"."""
    reply = raw.request(vu.VERSION, vu.version_body(0, 7, {"max_msg_fds": 8}))
    assert_ok_reply(reply, vu.VERSION)
    major, minor, _ = vu.parse_version(reply.payload)
    assert major == 0 and minor <= 7


def test_reply_json_is_nul_terminated_utf8_with_a_capabilities_object(raw):
    """VERSION: "version data ... variable (including terminating NUL)" and "The
    version data is an optional UTF-8 encoded JSON byte array"; capability values
    have the types of the table (numbers, objects, booleans)."""
    reply = raw.request(vu.VERSION, vu.version_body(0, 0, {
        "max_msg_fds": 16, "max_data_xfer_size": 1 << 20, "pgsizes": 4096,
        "max_dma_maps": 65535, "write_multiple": True}))
    assert_ok_reply(reply, vu.VERSION)
    text = reply.payload[vu.VERSION_HEAD.size:]
    if text:
        assert text.endswith(b"\0") and text.count(b"\0") == 1, "JSON not NUL-terminated once"
    _, _, caps = vu.parse_version(reply.payload)
    for name in ("max_msg_fds", "max_data_xfer_size", "max_dma_maps", "pgsizes"):
        if name in caps:
            assert isinstance(caps[name], int) and not isinstance(caps[name], bool) \
                and caps[name] >= 0, f"{name} is {caps[name]!r}"
    if "write_multiple" in caps:
        assert isinstance(caps["write_multiple"], bool)


def test_reply_capabilities_are_a_subset_of_the_proposed(raw):
    """VERSION: "The capability list must be a subset of those proposed."  A client
    that proposes only max_msg_fds gets no other capability back."""
    reply = raw.request(vu.VERSION, vu.version_body(0, 0, {"max_msg_fds": 4}))
    assert_ok_reply(reply, vu.VERSION)
    _, _, caps = vu.parse_version(reply.payload)
    assert set(caps) <= {"max_msg_fds"}, f"capabilities not proposed: {set(caps) - {'max_msg_fds'}}"


def test_version_without_json_is_accepted_with_defaults(raw):
    """VERSION: "version data ... Optional." and every capability is optional, with
    defaults (max_msg_fds 1, max_data_xfer_size 1048576)."""
    reply = raw.request(vu.VERSION, vu.version_body(0, 0, None))
    assert_ok_reply(reply, vu.VERSION)
    major, minor, _ = vu.parse_version(reply.payload)
    assert major == 0 and minor == 0
    assert raw.read32(gpu.ID) == gpu.ID_VALUE


def test_unsupported_major_closes_the_connection(raw, gpu_server):
    """Connection Initiation: "The server replies with a compatible version and set
    of capabilities it supports, or closes the connection if it cannot support the
    advertised version."  No successful reply to major 0x7777, and the connection
    ends."""
    raw.send(vu.VERSION, vu.version_body(0x7777, 0, {}))
    seen = expect_closed(raw)
    assert all(m.is_error for m in seen), f"success reply to an unsupported major: {seen}"
    raw.close()
    fresh_client_works(gpu_server)


@pytest.mark.parametrize("body", [
    b"\x00\x00",  # shorter than major + minor
    vu.version_body(0, 0, raw_json=b"{not json\0"),
    vu.version_body(0, 0, raw_json=b"[1, 2]\0"),
    vu.version_body(0, 0, raw_json=b'{"capabilities": 5}\0'),
], ids=["short", "bad-json", "json-array", "caps-not-object"])
def test_malformed_version_never_succeeds(raw, gpu_server, body):
    """VERSION request layout (major u16, minor u16, JSON object with an optional
    "capabilities" object): a malformed proposal gets an error reply (header only)
    or the connection closed, never a negotiated session."""
    raw.send(vu.VERSION, body)
    try:
        reply = raw.next_reply()
    except vu.PeerClosed:
        raw.close()
        fresh_client_works(gpu_server)
        return
    assert_error_reply(reply, vu.VERSION)


def test_client_max_msg_fds_zero_means_no_fds_in_replies(raw):
    """VERSION capabilities: max_msg_fds is the "Maximum number of file descriptors
    that can be received by the sender in one message."  A client that can take
    none gets BAR2's region info without an fd, and then without the MMAP flag
    (GET_REGION_INFO: "When this flag is set, the reply will include a file
    descriptor in its meta-data")."""
    assert_ok_reply(raw.handshake({"max_msg_fds": 0, "max_data_xfer_size": 1 << 20}),
                    vu.VERSION)
    reply = raw.request(vu.DEVICE_GET_REGION_INFO,
                        vu.REGION_INFO.pack(256, 0, gpu.BAR_VRAM, 0, 0, 0))
    try:
        assert_ok_reply(reply, vu.DEVICE_GET_REGION_INFO)
        assert len(reply.fds) == 0, f"{len(reply.fds)} fds sent to a client with max_msg_fds 0"
        flags = vu.REGION_INFO.unpack_from(reply.payload)[1]
        assert not flags & vu.REGION_INFO_FLAG_MMAP, "MMAP flag without an fd"
    finally:
        reply.close_fds()


def test_region_info_fds_respect_the_default_max_msg_fds_of_one(raw):
    """VERSION capabilities: max_msg_fds "If not specified then the receiver must
    assume a value of 1."  No reply ever carries more than one fd."""
    assert_ok_reply(raw.handshake({"max_data_xfer_size": 1 << 20}), vu.VERSION)
    for index in range(vu.PCI_NUM_REGIONS):
        reply = raw.request(vu.DEVICE_GET_REGION_INFO,
                            vu.REGION_INFO.pack(256, 0, index, 0, 0, 0))
        assert len(reply.fds) <= 1
        reply.close_fds()
