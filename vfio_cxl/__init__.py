"""vfio-cxl: a CXL + VFIO lab.

Rooms on floors, imports only to the same floor or down (``tests/fast/test_package_imports.py``
checks it, and that no import circle exists):

* commands: ``cli`` (``vfio-cxl``, ``__main__``), ``demos``, ``bench``, ``pytest_plugin`` on the
  host; ``guest.cmd`` in the guest.  Host commands run guest commands by name over SSH
  (``python3 -m vfio_cxl.guest.cmd.X``), never by importing them.
* libraries: ``lab`` (host lab: topology -> QEMU argv -> running VMs; QMP, console, SSH;
  the fabric manager, whose command line is ``lab.fm.cli``) and ``matrix`` above it;
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


def _bytecode_in(cache: str) -> None:
    """This package's modules keep their bytecode under ``cache`` (the guest: the source share is
    read-only, so no ``__pycache__`` can be written beside it); every other module, the standard
    library first, keeps its own ``__pycache__`` (on the guest's disk, read without a round trip
    to the host).  ``PYTHONPYCACHEPREFIX`` would move all of them into ``cache``.

    A finder for the package's directories whose source loader compiles with
    ``sys.pycache_prefix`` set to ``cache`` for that one module; Python still checks each
    ``.pyc`` against its source and its own magic number before it uses it."""
    import sys
    from importlib import machinery

    class SharedCacheLoader(machinery.SourceFileLoader):
        def get_code(self, fullname):
            saved, sys.pycache_prefix = sys.pycache_prefix, cache
            try:
                return super().get_code(fullname)
            finally:
                sys.pycache_prefix = saved

    finder = machinery.FileFinder.path_hook(
        (machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
        (SharedCacheLoader, machinery.SOURCE_SUFFIXES),
        (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES))
    root = __path__[0]

    def hook(path: str):
        if path != root and not path.startswith(root + "/"):
            raise ImportError("not this package's directory")
        return finder(path)

    sys.path_hooks.insert(0, hook)


def _setup() -> None:
    import os

    cache = os.environ.get(BYTECODE_ENV)
    if cache:
        _bytecode_in(cache)


_setup()
