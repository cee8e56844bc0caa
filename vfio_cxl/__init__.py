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
