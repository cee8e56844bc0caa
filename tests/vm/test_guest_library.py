"""docs/guest-library.md's complete program, run in a guest as the page shows it: the library
alone (no command module) drives the GPU's DMA into CXL memory, and prints the line the page shows."""

import json
import shlex

import pytest

import documented_commands as docs

pytestmark = pytest.mark.lab("single")


def test_the_documented_program_runs_on_the_library_alone(lab):
    program, shown = docs.program_and_output("docs/guest-library.md")
    assert "vfio_cxl.guest.cmd" not in program
    check = "\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith('vfio_cxl.guest.cmd')))\n"
    out = lab.ssh("host0", f"python3 -c {shlex.quote(program + check)}").splitlines()
    assert out[-1] == "[]", out                  # no command module was loaded
    # the page shows Debian's kernel's type1 and says: iommufd on a kernel with the VFIO cdev
    backend = lab.ssh("host0", "if [ -e /dev/iommu ]; then echo iommufd; else echo type1; fi").strip()
    assert out[0] == shown.replace("(VFIO backend type1)", f"(VFIO backend {backend})"), (out, shown)


def test_the_image_s_vfio_cxl_command_runs_the_guest_commands(lab):
    """/usr/local/bin/vfio-cxl (the image's wrapper) runs python3 -m vfio_cxl.guest.cmd.cli."""
    listed = json.loads(lab.ssh("host0", "vfio-cxl gpu ls --json"))
    assert [gpu["bdf"] for gpu in listed["gpus"]] == ["0000:01:00.0"], listed
    dma = json.loads(lab.ssh("host0", "vfio-cxl gpu dma --json"))
    assert dma["match"] and dma["sha256_read"] == dma["sha256_expected"], dma
