"""The VFIO user API (include/uapi/linux/vfio.h) as cffi declarations and ints.

The container/group type1 path; the iommufd backend's structs are in
``uapi_iommufd``.  Struct layouts, ioctl numbers and flags are facts of the kernel ABI;
``tests/fast/test_vfio_uapi_layout.py`` checks every struct size, field offset
and constant here against the guest kernel's own headers.

The declarations and constants are defined once, in ``vfio_cxl.vfio_abi``
(standard library only; the vfio-user wire code uses them too); this module
gives them to cffi.  Imports only the standard library, cffi and that module (through ``cdefs``).
"""

from __future__ import annotations

from ...vfio_abi import *  # noqa: F401,F403  (the VFIO_* constants, by their kernel names)
from ...vfio_abi import CDEF, CONSTANTS  # noqa: F401
from .cdefs import ffi_for

ffi = ffi_for("vfio", CDEF)   # parsed once per guest, not at every start (cdefs.py)

#: Every struct declared in CDEF, for the layout test and for readers.
STRUCTS = tuple(f"struct {name}" for name in ffi.list_types()[1])
