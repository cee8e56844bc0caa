"""uapi.py against the guest kernel's own headers.

The guest runs Debian trixie; its ``linux-libc-dev`` carries the uapi headers
of that kernel.  We fetch it with the project's private apt (never the host's
apt sources), compile a small C probe with the host's gcc against those
headers, and compare every struct size, field offset, field size and constant
it prints with what cffi computes from ``uapi.py`` (type1) and
``uapi_iommufd.py`` (iommufd and the VFIO device cdev ioctls).

No apt or no gcc is a failure, not a skip: a layout nobody checked is exactly
the bug this test exists for.  ``VFIO_CXL_OFFLINE=1`` skips it on purpose.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from vfio_cxl import vfio_abi
from vfio_cxl.guest.vfio import uapi, uapi_iommufd
from vfio_cxl.paths import cache_root

# What to fetch; its hash names the cache directory, so a changed recipe fetches anew.
HEADERS_RECIPE = {"suite": "trixie", "package": "linux-libc-dev", "triplet": "x86_64-linux-gnu", "layout": 1}
GUEST_KERNEL = (6, 12)  # Debian trixie's kernel series
STAMP = ".vfio-cxl-complete"

# Both backends' ABI modules: type1 (vfio.h) and iommufd (iommufd.h + vfio.h's cdev ioctls).
MODULES = (uapi, uapi_iommufd)
STRUCTS = {struct: module.ffi for module in MODULES for struct in module.STRUCTS}
CONSTANTS = {name: value for module in MODULES for name, value in module.CONSTANTS.items()}


def _recipe_hash() -> str:
    return hashlib.sha256(json.dumps(HEADERS_RECIPE, sort_keys=True).encode()).hexdigest()[:16]


def _fetch_headers(dest: Path) -> None:
    """Download and unpack linux-libc-dev into ``dest`` (atomically: a half-done one never counts)."""
    from vfio_cxl.errors import LabError
    from vfio_cxl.lab.apt import PrivateApt, extract_deb

    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: the layout test needs apt to fetch the guest's kernel headers "
                        "(set VFIO_CXL_OFFLINE=1 to skip it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent))
    try:
        apt = PrivateApt(work / "apt", [HEADERS_RECIPE["suite"]])
        debs = apt.download([HEADERS_RECIPE["package"]], work / "debs")
        if len(debs) != 1:
            pytest.fail(f"expected one {HEADERS_RECIPE['package']} .deb, apt gave {debs}")
        tree = work / "tree"
        extract_deb(debs[0], tree)
        if not (tree / "usr/include/linux/vfio.h").is_file():
            pytest.fail(f"{debs[0].name} has no usr/include/linux/vfio.h")
        (tree / STAMP).write_text(debs[0].name + "\n")
        try:
            tree.rename(dest)
        except OSError:
            if not (dest / STAMP).is_file():  # not a concurrent run that won the race
                raise
    except LabError as error:
        pytest.fail(f"cannot fetch the guest's kernel headers with the private apt: {error} "
                    "(set VFIO_CXL_OFFLINE=1 to skip this test)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def guest_headers() -> Path:
    """The extracted linux-libc-dev tree, cached under cache_root()/headers/<recipe hash>."""
    if os.environ.get("VFIO_CXL_OFFLINE") == "1":
        pytest.skip("VFIO_CXL_OFFLINE=1: not fetching the guest's kernel headers")
    dest = cache_root() / "headers" / _recipe_hash()
    if not (dest / STAMP).is_file():
        shutil.rmtree(dest, ignore_errors=True)
        _fetch_headers(dest)
    return dest


def _probe_source() -> str:
    """C that prints one 'key value' line per fact the test compares."""
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        "#include <linux/version.h>",
        "#include <linux/vfio.h>",
        "#include <linux/iommufd.h>",
        "#define SHOW(key, expr) printf(\"%s %llu\\n\", key, (unsigned long long)(expr))",
        "int main(void) {",
        '  SHOW("LINUX_VERSION_CODE", LINUX_VERSION_CODE);',
    ]
    for struct, ffi in STRUCTS.items():
        lines.append(f'  SHOW("sizeof {struct}", sizeof({struct}));')
        for name, field in ffi.typeof(struct).fields:
            lines.append(f'  SHOW("offsetof {struct}.{name}", offsetof({struct}, {name}));')
            if not _is_flexible_array(field):
                lines.append(f'  SHOW("fieldsize {struct}.{name}", sizeof((({struct} *)0)->{name}));')
    for name in CONSTANTS:
        lines.append(f'  SHOW("const {name}", {name});')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _is_flexible_array(field) -> bool:
    return field.type.kind == "array" and field.type.length is None


@pytest.fixture(scope="module")
def kernel_facts(guest_headers: Path, tmp_path_factory) -> dict[str, int]:
    """Compile and run the probe against the guest headers; returns its 'key value' lines."""
    if platform.machine() != "x86_64":
        pytest.fail(f"the guest is x86_64; a layout probe compiled on {platform.machine()} proves nothing")
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc not found: the layout test compiles a C probe against the guest's headers "
                    "(install gcc on the host, or set VFIO_CXL_OFFLINE=1 to skip)")
    include = guest_headers / "usr" / "include"
    work = tmp_path_factory.mktemp("vfio-probe")
    (work / "probe.c").write_text(_probe_source())
    # The guest's uapi headers come first; linux/types.h needs asm/ from the multiarch dir.
    compile_cmd = [gcc, "-std=gnu11", "-Werror", "-I", str(include),
                   "-I", str(include / HEADERS_RECIPE["triplet"]), "probe.c", "-o", "probe"]
    built = subprocess.run(compile_cmd, cwd=work, capture_output=True, text=True)
    if built.returncode != 0:
        pytest.fail("the C probe does not compile against the guest's vfio.h "
                    f"(a name in uapi.py the kernel does not have?):\n{built.stderr[-3000:]}")
    ran = subprocess.run([str(work / "probe")], capture_output=True, text=True, check=True)
    facts = {}
    for line in ran.stdout.splitlines():
        key, _, value = line.rpartition(" ")
        facts[key] = int(value)
    return facts


def test_probe_used_the_guest_kernels_headers(kernel_facts, guest_headers):
    # The host's own /usr/include is older: prove the probe saw the trixie headers.
    code = kernel_facts["LINUX_VERSION_CODE"]
    assert (code >> 16, (code >> 8) & 0xFF) == GUEST_KERNEL
    deb = (guest_headers / STAMP).read_text()
    assert re.search(rf"_{GUEST_KERNEL[0]}\.{GUEST_KERNEL[1]}\.", deb), deb


def test_every_struct_and_constant_was_probed(kernel_facts):
    # Guards against a probe that silently printed less than the test compares.
    structs = [k for k in kernel_facts if k.startswith("sizeof ")]
    consts = [k for k in kernel_facts if k.startswith("const ")]
    assert len(structs) == len(STRUCTS) >= 24
    assert len(consts) == len(CONSTANTS)
    for ioctl in ("GET_API_VERSION", "CHECK_EXTENSION", "SET_IOMMU", "GROUP_GET_STATUS",
                  "GROUP_SET_CONTAINER", "GROUP_UNSET_CONTAINER", "GROUP_GET_DEVICE_FD",
                  "DEVICE_GET_INFO", "DEVICE_GET_REGION_INFO", "DEVICE_GET_IRQ_INFO",
                  "DEVICE_SET_IRQS", "DEVICE_RESET", "IOMMU_GET_INFO", "IOMMU_MAP_DMA",
                  "IOMMU_UNMAP_DMA", "DEVICE_BIND_IOMMUFD", "DEVICE_ATTACH_IOMMUFD_PT",
                  "DEVICE_DETACH_IOMMUFD_PT"):
        assert f"const VFIO_{ioctl}" in kernel_facts
    for ioctl in ("DESTROY", "IOAS_ALLOC", "IOAS_IOVA_RANGES", "IOAS_MAP", "IOAS_UNMAP"):
        assert f"const IOMMU_{ioctl}" in kernel_facts


@pytest.mark.parametrize("struct", sorted(STRUCTS))
def test_struct_layout_matches_kernel(struct, kernel_facts):
    ffi = STRUCTS[struct]
    ctype = ffi.typeof(struct)
    ours = {f"sizeof {struct}": ffi.sizeof(ctype)}
    for name, field in ctype.fields:
        ours[f"offsetof {struct}.{name}"] = field.offset
        if not _is_flexible_array(field):
            ours[f"fieldsize {struct}.{name}"] = ffi.sizeof(field.type)
    kernels = {key: kernel_facts.get(key) for key in ours}
    assert ours == kernels


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_constant_matches_kernel(name, kernel_facts):
    assert CONSTANTS[name] == kernel_facts[f"const {name}"]


@pytest.mark.parametrize("layout", vfio_abi.LAYOUTS, ids=lambda layout: layout.c_name)
def test_wire_layouts_match_the_checked_structs(layout):
    """vfio_abi.LAYOUTS (what the vfio-user wire code packs) against the cffi structs
    that the C probe above checks against the kernel: every field at the same offset,
    and the head no longer than the struct."""
    ffi = STRUCTS[layout.c_name]
    assert layout.size <= ffi.sizeof(layout.c_name)
    for field, offset in layout.offsets().items():
        assert ffi.offsetof(layout.c_name, field) == offset, (layout.c_name, field)
