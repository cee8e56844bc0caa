"""ioctl(2) through libc, in cffi ABI mode (the guest has no C compiler).

``fcntl.ioctl`` copies small buffers into a scratch area and cannot carry a
pointer we already own, so VFIO's structs go through libc's ioctl directly.
"""

from __future__ import annotations

import os
from typing import Callable, Union

from .cdefs import ffi_for

_ffi = ffi_for("ioctl", "int ioctl(int fd, unsigned long request, ...);")
try:
    _libc = _ffi.dlopen(None)  # the running process already has libc loaded
    _libc.ioctl
except (OSError, AttributeError):
    _libc = _ffi.dlopen("libc.so.6")

# An ioctl argument: nothing, a plain integer, a C pointer (cffi cdata) or bytes.
IoctlArg = Union[None, int, bytes, "_ffi.CData"]
IoctlFn = Callable[[int, int, IoctlArg], int]


def ioctl(fd: int, request: int, arg: IoctlArg = None) -> int:
    """Call ioctl(fd, request, arg); returns its non-negative result or raises OSError."""
    if arg is None:
        c_arg = _ffi.cast("unsigned long", 0)
    elif isinstance(arg, int):
        c_arg = _ffi.cast("unsigned long", arg)
    elif isinstance(arg, bytes):
        keep = _ffi.new("char[]", arg)  # NUL-terminated copy, alive until we return
        c_arg = _ffi.cast("char *", keep)
    else:
        c_arg = _ffi.cast("void *", arg)
    result = _libc.ioctl(fd, request, c_arg)
    if result < 0:
        err = _ffi.errno
        raise OSError(err, os.strerror(err))
    return result
