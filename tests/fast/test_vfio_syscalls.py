"""The libc ioctl wrapper, against the host's real kernel (no VFIO needed).

FIONREAD on a pipe exercises the pointer path and the result, and an ioctl
a pipe does not know exercises errno.
"""

import errno
import os
import termios

import pytest

from vfio_cxl.guest.vfio.syscalls import ioctl
from vfio_cxl.guest.vfio.uapi import ffi


@pytest.fixture
def pipe():
    read_end, write_end = os.pipe()
    yield read_end, write_end
    os.close(read_end)
    os.close(write_end)


def test_pointer_argument_is_filled_by_the_kernel(pipe):
    read_end, write_end = pipe
    os.write(write_end, b"x" * 37)
    count = ffi.new("int *")
    assert ioctl(read_end, termios.FIONREAD, count) == 0
    assert count[0] == 37


def test_failure_raises_oserror_with_errno(pipe):
    with pytest.raises(OSError) as raised:
        ioctl(pipe[0], termios.TIOCGWINSZ, ffi.new("char[8]"))
    assert raised.value.errno == errno.ENOTTY


def test_bad_fd_is_ebadf():
    with pytest.raises(OSError) as raised:
        ioctl(-1, termios.FIONREAD, ffi.new("int *"))
    assert raised.value.errno == errno.EBADF
