"""scripts/bench nic without a VM: the cells made of the two guests' reports, the target
against the bounce, the table, the sizes option.  The run itself is the lead's (it boots nic2)."""

import pytest

from vfio_cxl.bench import nic
from vfio_cxl.bench.__main__ import SUBCOMMANDS


def reports(path: str, mb_s: float, rx_cpu: float, copied: int, size: int = 1 << 20, verified: bool = True):
    seconds = size / mb_s / 1e6
    sent = {"writes": [{"size": size, "status": "OK", "error": None, "mb_s": mb_s, "seconds": seconds,
                        "frames": None if path == "tcp" else size // 1024, "cpu_seconds": 0.5 * rx_cpu * size / 1e9,
                        "payload_bytes_copied": copied}]}
    got = {"writes": [{"status": "OK", "error": None, "cpu_seconds": rx_cpu * size / 1e9, "verified": verified,
                       "payload_bytes_copied": copied}]}
    return nic.cells_of(path, sent, got)


def test_cells_carry_the_issue_s_fields_per_write():
    (cell,) = reports("zero-copy", 20.0, 10.0, 0)
    assert cell["path"] == "zero-copy" and cell["size"] == 1 << 20 and cell["mb_s"] == 20.0
    assert cell["frames_s"] == pytest.approx(1024 / ((1 << 20) / 20e6))
    assert cell["receiver_guest_cpu_s_per_gb"] == pytest.approx(10.0)
    assert cell["sender_guest_cpu_s_per_gb"] == pytest.approx(5.0)
    assert cell["verified"] and cell["receiver_payload_bytes_copied"] == 0
    (tcp,) = reports("tcp", 50.0, 30.0, 1 << 20)
    assert tcp["frames_s"] is None


def test_a_refused_or_unverified_write_has_no_figures():
    sent = {"writes": [{"size": 4096, "status": "REFUSED", "error": "the key is stale", "seconds": 1}]}
    got = {"writes": [{"status": "STALE_KEY", "error": "stale", "cpu_seconds": 0.1, "verified": False}]}
    (cell,) = nic.cells_of("zero-copy", sent, got)
    assert cell["mb_s"] is None and not cell["verified"] and "stale" in cell["error"]


def test_the_target_compares_zero_copy_with_the_bounce_at_the_largest_size():
    cells = reports("zero-copy", 30.0, 4.0, 0) + reports("bounce", 20.0, 10.0, 2 << 20)
    cells += reports("zero-copy", 5.0, 40.0, 0, size=4096) + reports("bounce", 10.0, 10.0, 8192, size=4096)
    t = nic.targets(cells)
    assert t["target_size"] == 1 << 20 and t["target_met"]
    assert t["per_size"][1 << 20] == {"mb_s_vs_bounce": 1.5, "receiver_cpu_vs_bounce": pytest.approx(0.4)}
    assert t["per_size"][4096]["mb_s_vs_bounce"] == 0.5
    slow = reports("zero-copy", 10.0, 4.0, 0) + reports("bounce", 20.0, 10.0, 2 << 20)
    assert not nic.targets(slow)["target_met"]
    assert nic.targets(reports("tcp", 10.0, 4.0, 0)) == {"per_size": {}}


def test_the_table_prints_each_figure_beside_the_bounce_s(capsys):
    cells = reports("zero-copy", 30.0, 4.0, 0) + reports("bounce", 20.0, 10.0, 2 << 20) + reports("tcp", 40.0, 8.0, 1 << 20)
    nic.print_table({"qemu": "lab", "kernel": "distro", "backend": "type1", "load_average_1min": 0.5, "sizes": [1 << 20],
                     "cells": cells, "targets": nic.targets(cells)})
    out = capsys.readouterr().out
    zc = next(line for line in out.splitlines() if " zero-copy " in line)
    assert "1.50x" in zc and "0.40x" in zc and zc.rstrip().endswith("yes")
    assert "1.50x the bounce's MB/s" in out and "40 % of its receiver CPU" in out and ": met" in out


def test_sizes_are_checked_and_the_bench_is_registered():
    assert nic._sizes("4K,1M") == [4096, 1 << 20]
    for bad in ("0", "32M", "x", ""):
        with pytest.raises(Exception, match="sizes from 1 byte to 16M"):
            nic._sizes(bad)
    assert SUBCOMMANDS["nic"] == "vfio_cxl.bench.nic"


def test_qemu_names_the_build_the_lab_boots(monkeypatch, tmp_path):
    import argparse
    from vfio_cxl.bench.options import use_qemu_build
    from vfio_cxl.lab.qemu_runtime import QEMU_ENV
    # set, then deleted: monkeypatch then restores "unset" after the test, though use_qemu_build
    # sets the variable itself (a bare delenv of an unset name records nothing to restore, and
    # the path leaked into every later test's `vfio-cxl`: CI's VM tests all failed so)
    monkeypatch.setenv(QEMU_ENV, "")
    monkeypatch.delenv(QEMU_ENV)
    assert use_qemu_build(argparse.Namespace(qemu=None)) == "stock" and QEMU_ENV not in __import__("os").environ
    path = str(tmp_path / "qemu-system-x86_64")
    assert use_qemu_build(argparse.Namespace(qemu=path)) == path
    assert __import__("os").environ[QEMU_ENV] == path
