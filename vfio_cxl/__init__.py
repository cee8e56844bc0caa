"""vfio-cxl: a CXL + VFIO lab.

Three rooms, arrows one way:

* ``vfio_cxl.lab``   -- host lab: topology -> QEMU argv -> running VMs (QMP, console, SSH)
* ``vfio_cxl.devices`` -- device models served to QEMU over vfio-user (``vfio_user``, ``gpu``)
* ``vfio_cxl.guest`` -- runs inside the VM: a library (VFIO, CXL/devdax, the GPU, SMC and NVMe
  drivers, storage, the record channel) and, apart from it, the guest's commands (``guest.cmd``)

The guest room imports only the standard library, cffi, pyudev, pyroute2 and
``vfio_cxl.devices.gpu.regs`` (the register map the device and its driver share), so
the guest can run this package straight from a read-only share of the checkout (or of a
copy of the installed package).
"""

__version__ = "0.1.0"

BYTECODE_ENV = "VFIO_CXL_PYC"   # set by the guest's init: the lab's shared bytecode cache


def _setup() -> None:
    """In the guest, this package's bytecode lives in the lab's shared cache (vfio_cxl.guest.bytecode).
    The modules that install that finder are cached there too: ``sys.pycache_prefix`` points at
    the cache while they load (this file itself is compiled at every start: keep it short)."""
    import os

    cache = os.environ.get(BYTECODE_ENV)
    if not cache:
        return
    import sys

    saved, sys.pycache_prefix = sys.pycache_prefix, cache
    try:
        from .guest.bytecode import install
    finally:
        sys.pycache_prefix = saved
    install(cache, __path__[0])


_setup()
