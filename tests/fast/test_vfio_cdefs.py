"""The cffi declarations' cache (vfio_cxl.guest.vfio.cdefs): the FFI it loads is the parsed one,
the second start parses nothing, and a damaged or unwritable cache falls back to parsing."""

import os
import subprocess
import sys

from vfio_cxl.guest.vfio import uapi, uapi_iommufd
from vfio_cxl.guest.vfio.cdefs import SUBDIR, ffi_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def layout(ffi, structs):
    return {s: (ffi.sizeof(s), [(f, ffi.offsetof(s, f)) for f, _ in ffi.typeof(s).fields])
            for s in structs}


def test_the_cached_ffi_has_every_struct_as_parsed(tmp_path):
    for cdefs, structs in (((uapi.CDEF,), uapi.STRUCTS),
                           ((uapi_iommufd.CDEF, uapi_iommufd.CDEF_NEWER),
                            uapi_iommufd.STRUCTS + uapi_iommufd.NEWER_STRUCTS)):
        parsed = ffi_for("t", *cdefs, cache="")
        written = ffi_for("t", *cdefs, cache=str(tmp_path))    # parses, writes the module
        loaded = ffi_for("t", *cdefs, cache=str(tmp_path))     # loads the module
        assert layout(written, structs) == layout(loaded, structs) == layout(parsed, structs)
    assert len(list((tmp_path / SUBDIR).glob("_vfio_cxl_t_*.py"))) == 2   # one per set of declarations


def start(cache):
    probe = ("import sys; from vfio_cxl.guest.vfio import uapi, uapi_iommufd, syscalls; "
             "print(uapi.ffi.sizeof('struct vfio_iommu_type1_dma_map'), 'pycparser' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "VFIO_CXL_PYC": str(cache), "PYTHONPATH": ROOT})
    return out.stdout.split()


def test_a_second_start_parses_nothing(tmp_path):
    assert start(tmp_path) == ["32", "True"]    # the first start parses and writes
    assert start(tmp_path) == ["32", "False"]   # the next one loads: pycparser never imported


def test_a_damaged_module_is_written_anew_and_an_unwritable_cache_parses(tmp_path):
    ffi_for("t", uapi.CDEF, cache=str(tmp_path))
    (module,) = (tmp_path / SUBDIR).glob("*.py")
    module.write_text("raise ImportError('damaged')\n")
    assert ffi_for("t", uapi.CDEF, cache=str(tmp_path)).sizeof("struct vfio_iommu_type1_dma_map") == 32
    assert "damaged" not in module.read_text()
    blocked = tmp_path / "file"
    blocked.write_text("")   # a cache "directory" that is a file: nothing can be written below it
    assert ffi_for("t", uapi.CDEF, cache=str(blocked)).sizeof("struct vfio_iommu_type1_dma_map") == 32
