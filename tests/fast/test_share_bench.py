"""The CXL-vs-TCP benchmark's own logic: its plan and how figures come out of both sides' timestamps."""

import pytest

from vfio_cxl.bench.share import TRANSPORTS, goal, phases
from vfio_cxl.guest.cxl import CxlError
from vfio_cxl.guest.record_plan import DEFAULT_PLAN, parse_plan
from vfio_cxl.guest.cmd.share_bench import TRANSPORTS as GUEST_TRANSPORTS


def test_default_plan_covers_the_four_sizes_paced_and_streamed():
    plan = parse_plan(DEFAULT_PLAN)
    assert sorted({s for s, _, _ in plan}) == [64, 4096, 65536, 1 << 20]
    assert {(s, m) for s, _, m in plan} == {(s, m) for s in (64, 4096, 65536, 1 << 20) for m in ("paced", "stream")}


@pytest.mark.parametrize("bad", ["64:10", "64:10:fast", "0:10:paced", "64:1:stream", "x:1:paced"])
def test_bad_plan_items_are_named(bad):
    with pytest.raises(CxlError, match=f"bad plan item '{bad}'"):
        parse_plan(bad)


def test_phases_latency_round_trip_and_throughput():
    plan = parse_plan("64:3:paced,1000:3:stream")
    sent = {"transport": "tcp", "clock": {"offset": 100.0},          # b's clock runs 100 s ahead of a's
            "sent_at": [0.0, 1.0, 2.0, 10.0, 10.1, 10.2], "acked_at": [0.004, 1.006, 2.008, None, None, None]}
    got = {"bad": 0, "seen_at": [100.001, 101.003, 102.002, 110.5, 110.6, 110.7]}
    table = phases(plan, sent, got)
    assert table[64]["latency_ms_median"] == pytest.approx(2.0)
    assert table[64]["rtt_ms_median"] == pytest.approx(6.0)
    assert table[1000]["mb_s"] == pytest.approx(2 * 1000 / 0.2 / 1e6)
    with pytest.raises(RuntimeError, match="1 bad payloads, 6 of 6 records checked"):
        phases(plan, sent, dict(got, bad=1))


def test_goal_says_where_it_is_not_met():
    table = {"doorbell": {64: {"latency_ms_median": 0.5}, 1 << 20: {"latency_ms_median": 9.0, "mb_s": 600.0}},
             "tcp": {64: {"latency_ms_median": 0.8}, 1 << 20: {"latency_ms_median": 8.0, "mb_s": 100.0}}}
    g = goal(table, [64, 1 << 20], 1 << 20)
    assert g["throughput_ratio_1mib"] == pytest.approx(6.0) and g["throughput_5x"]
    assert not g["doorbell_latency_lower_everywhere"] and g["doorbell_latency_not_lower_at"] == [1 << 20]


def test_every_transport_is_a_choice_of_the_guest_program():
    assert set(TRANSPORTS.values()) == set(GUEST_TRANSPORTS)
