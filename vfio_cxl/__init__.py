"""vfio-cxl: a CXL + VFIO lab.

Rooms on floors, imports only to the same floor or down (``tests/fast/test_package_imports.py``
checks it, and that no import circle exists):

* commands: ``cli`` (``vfio-cxl``, ``__main__``), ``demos``, ``bench``, ``pytest_plugin`` on the
  host; ``guest.cmd`` in the guest.  Host commands run guest commands by name over SSH
  (``python3 -m vfio_cxl.guest.cmd.X``), never by importing them.
* libraries: ``lab`` (host lab: topology -> QEMU argv -> running VMs; QMP, console, SSH;
  the fabric manager, whose command line is ``lab.fm.commands``) and ``matrix`` above it;
  ``devices`` (device models served to QEMU over vfio-user: ``vfio_user``, ``gpu``, ``smc``)
  below the lab; ``guest`` (the library that runs inside the VM: VFIO, CXL/devdax, the GPU,
  SMC and NVMe drivers, storage, the record channel and its cache maintenance, ``cacheline``).
* shared by both sides: ``vfio_abi`` (the kernel's VFIO ABI), the register maps
  ``devices.gpu.regs`` and ``devices.smc.regs``, ``errors`` (``LabError``) and ``paths``.

The guest library and the guest's commands import only the standard library, cffi, pyudev,
pyroute2, themselves and the shared modules above, so the guest can run this package straight
from a read-only share of the checkout (or of a copy of the installed package); native helpers
the guest loads (``guest/cacheline.c``) are built on the host into ``vfio_cxl/_native/``.
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
