"""cffi declarations parsed once, not at every start of a guest command.

In cffi's in-line ABI mode (``FFI().cdef(...)``) every program start imports pycparser and
parses the C declarations again: a few hundred ms under TCG, for the VFIO and iommufd
structs.  cffi's out-of-line ABI mode (``set_source(NAME, None)`` + ``emit_python_code``)
turns that parse into a small generated Python module that builds the same FFI from compact
type tables with ``_cffi_backend`` alone: no compiler, no pycparser.

``ffi_for(NAME, CDEF, ...)`` keeps one such module per set of declarations beside the guest's
bytecode (``$VFIO_CXL_PYC/vfio-cxl-cffi/``), named by the hash of the declarations and
of cffi's version, so another cffi or an edited declaration never loads a stale one: it writes
the module the first time (to a temporary name, then renamed) and loads it after.  Without a
bytecode cache directory (a host, the tests), or when it cannot be written or read, it parses
in-line as before.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

SUBDIR = "vfio-cxl-cffi"


def _parsed(cdefs: tuple[str, ...]):
    import cffi
    ffi = cffi.FFI()
    for cdef in cdefs:
        ffi.cdef(cdef)
    return ffi


def module_path(name: str, cdefs: tuple[str, ...], cache: str, backend_version: str) -> str:
    key = hashlib.sha256("\0".join((backend_version, *cdefs)).encode()).hexdigest()[:16]
    return os.path.join(cache, SUBDIR, f"_vfio_cxl_{name}_{key}.py")


def _emit(path: str, cdefs: tuple[str, ...]) -> None:
    ffi = _parsed(cdefs)
    # None: ABI mode, nothing to compile; not verbose: cffi would print "generating ..." on the
    # command's stdout, which the lab parses
    ffi.set_source(os.path.basename(path)[:-3], None, compiler_verbose=False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        ffi.emit_python_code(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffi


def ffi_for(name: str, *cdefs: str, cache: str | None = None):
    """An FFI with these declarations: from the cached out-of-line module, else parsed."""
    cache = cache if cache is not None else os.environ.get("VFIO_CXL_PYC")
    if not cache:
        return _parsed(cdefs)
    try:
        import _cffi_backend
        path = module_path(name, cdefs, cache, _cffi_backend.__version__)
        if os.path.exists(path):
            try:
                return _load(path)
            except Exception:   # noqa: BLE001 -- damaged or foreign: written anew below
                pass
        _emit(path, cdefs)
        return _load(path)
    except Exception:   # noqa: BLE001 -- a cache it cannot write or read: parse, as without one
        return _parsed(cdefs)
