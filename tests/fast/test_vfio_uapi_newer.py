"""The iommufd/VFIO ABI newer than the guest's 6.12 headers, against the lab kernel's source.

``uapi_iommufd.NEWER_STRUCTS``/``NEWER_CONSTANTS`` (IOMMU_IOAS_MAP_FILE and
VFIO_DEVICE_FEATURE_DMA_BUF: peer-to-peer DMA on iommufd) are compiled into a
C probe against ``include/uapi`` of the lab kernel's unpacked source tree
(``vfio-cxl provision --kernel lab`` puts it under the kernels cache; the
architecture's asm/ headers come from the host, they do not change), and
every size, offset and constant is compared with what cffi computes.  Without
that source tree the test skips, saying so: the trixie layout test
(test_vfio_uapi_layout.py) cannot check these, its headers do not have them.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from vfio_cxl.guest.vfio import uapi_iommufd as u
from vfio_cxl.lab.kernel import kernels_root


def lab_source():
    found = sorted(p for p in kernels_root().glob("src-*") if (p / "include/uapi/linux/iommufd.h").is_file())
    if not found:
        pytest.skip("no lab kernel source tree (vfio-cxl provision --kernel lab unpacks it)")
    return found[-1]


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict[str, int]:
    src = lab_source()
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc not found: this test compiles a C probe against the lab kernel's uapi headers")
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <linux/vfio.h>",
             "#include <linux/iommufd.h>",
             '#define SHOW(k, e) printf("%s %llu\\n", k, (unsigned long long)(e))', "int main(void) {"]
    for struct in u.NEWER_STRUCTS:
        lines.append(f'  SHOW("sizeof {struct}", sizeof({struct}));')
        for name, _ in u.ffi.typeof(struct).fields:
            lines.append(f'  SHOW("offsetof {struct}.{name}", offsetof({struct}, {name}));')
    for name in u.NEWER_CONSTANTS:
        lines.append(f'  SHOW("const {name}", {name});')
    lines += ["  return 0;", "}"]
    work = tmp_path_factory.mktemp("uapi-newer")
    (work / "probe.c").write_text("\n".join(lines) + "\n")
    # raw uapi headers, as headers_install would clean them: no __user, no "kernel headers" warning
    built = subprocess.run([gcc, "-std=gnu11", "-Werror", "-D__EXPORTED_HEADERS__", "-D__user=", "-I", str(src / "include/uapi"),
                            "-I", str(src / "arch/x86/include/uapi"), "probe.c", "-o", "probe"],
                           cwd=work, capture_output=True, text=True)
    assert built.returncode == 0, f"the probe does not compile against {src}/include/uapi:\n{built.stderr[-3000:]}"
    out = subprocess.run([str(work / "probe")], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, _, v in (line.rpartition(" ") for line in out.splitlines())}


def test_every_newer_struct_and_constant_was_probed(facts):
    assert len([k for k in facts if k.startswith("sizeof ")]) == len(u.NEWER_STRUCTS) >= 4
    assert len([k for k in facts if k.startswith("const ")]) == len(u.NEWER_CONSTANTS) >= 7


@pytest.mark.parametrize("struct", sorted(u.NEWER_STRUCTS))
def test_newer_struct_layout(struct, facts):
    ctype = u.ffi.typeof(struct)
    ours = {f"sizeof {struct}": u.ffi.sizeof(ctype),
            **{f"offsetof {struct}.{name}": field.offset for name, field in ctype.fields}}
    assert ours == {key: facts.get(key) for key in ours}


@pytest.mark.parametrize("name", sorted(u.NEWER_CONSTANTS))
def test_newer_constant(name, facts):
    assert u.NEWER_CONSTANTS[name] == facts[f"const {name}"]
