"""The gpu-server benchmark's bare socket copy reference (bench/gpu_server.py):
it really moves the bytes through a socket from another process, and leaves
neither that process nor an fd behind."""

import os

from vfio_cxl.bench.gpu_server import socket_copy_bandwidth

MIB = 1 << 20


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def children() -> set[str]:
    """Pids of this process's children, reaped or not (a zombie is still listed)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            found.update(f.read().split())
    return found


def test_socket_copy_reference_measures_every_run_and_cleans_up():
    fds, kids = open_fds(), children()
    figure = socket_copy_bandwidth(4 * MIB, 3)
    assert figure.low > 0 and figure.low <= figure.median <= figure.high
    assert figure.cpu_client > 0 and figure.cpu_server == 0
    assert open_fds() <= fds  # (listing /proc/self/fd opens one fd of its own)
    assert children() <= kids, "the sender process was left behind"
