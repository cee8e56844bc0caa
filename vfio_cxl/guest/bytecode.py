"""The guest's bytecode cache (``$VFIO_CXL_PYC``, set by the guest's init): the package's modules
keep their ``.pyc`` there, since the share the guest reads the source from is read-only and no
``__pycache__`` can be written beside it; every other module, the standard library first, keeps
its own ``__pycache__`` on the guest's disk, read without a round trip to the host
(``PYTHONPYCACHEPREFIX`` would move all of them into the cache).  The package's ``__init__``
installs it (docs/guest-library.md, "Bytecode")."""

import sys
from importlib import machinery


def install(cache: str, root: str) -> None:
    """A finder for the package's directories (``root`` and below) whose source loader compiles
    with ``sys.pycache_prefix`` set to ``cache`` for that one module.  Python still checks each
    ``.pyc`` against its source (mtime, size) and its own magic number before it uses one, and a
    cache it cannot write to costs a compile, never an error."""

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

    def ours(path: str) -> bool:
        return path == root or path.startswith(root + "/")

    def hook(path: str):
        if not ours(path):
            raise ImportError("not this package's directory")
        return finder(path)

    sys.path_hooks.insert(0, hook)
    # the directories read before this (the package's own, guest/, to import this module) have
    # the standard finder cached: found again through the hook at their next import
    for path in [p for p in sys.path_importer_cache if ours(p)]:
        del sys.path_importer_cache[path]
