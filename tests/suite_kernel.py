"""The kernel the VM tests boot when a test is not about a kernel.

The lab kernel when it is cached -- SSH-ready in under 2 s against Debian's 5 s under TCG, with
type1 and iommufd both -- else the image's Debian kernel.  Debian's kernel keeps groups of its
own: the in-process ``single`` and ``selftest`` labs (DEBIAN_GROUPS), the documented commands that
boot a lab as a user types them, and the matrix's Debian cells.  ``VFIO_CXL_TEST_KERNEL=debian``
runs every group on Debian's kernel.  tests/conftest.py gives the plugin's ``lab`` fixture the same
kernel (its --lab-kernel, unless one is given) and names the choice in the session's header."""

from __future__ import annotations

import functools
import os

from vfio_cxl.errors import LabError

ENV = "VFIO_CXL_TEST_KERNEL"
CHOICES = ("lab", "debian")
# the topologies whose in-process lab boots the image's Debian kernel whatever the suite's kernel
DEBIAN_GROUPS = frozenset({"single", "selftest"})


class BadChoice(ValueError):
    pass


def wanted() -> str:
    value = os.environ.get(ENV, "lab")
    if value not in CHOICES:
        raise BadChoice(f"{ENV}={value!r}: write 'lab' (the lab kernel when it is built; the default) "
                        "or 'debian' (the image's kernel for every group)")
    return value


@functools.cache
def suite_kernel():
    """The lab kernel (a GuestKernel) when it is cached and wanted, else None: the image's kernel."""
    if wanted() == "debian":
        return None
    from vfio_cxl.lab.kernel import lab_kernel

    try:
        return lab_kernel(provision=False)
    except LabError:
        return None


def suite_kernel_name() -> str | None:
    """suite_kernel() as ``--kernel`` takes it: 'lab', or None for the image's kernel."""
    return "lab" if suite_kernel() is not None else None


def describe() -> str:
    """One line for the session's header."""
    kernel = suite_kernel()
    if kernel is not None:
        return (f"VM tests' kernel: the lab kernel ({kernel.image}); Debian's for the in-process "
                f"{' and '.join(sorted(DEBIAN_GROUPS))} labs and for the labs documented commands boot as typed "
                f"({ENV}=debian: Debian's for all)")
    why = f"{ENV}=debian" if wanted() == "debian" else "the lab kernel is not built: vfio-cxl provision --kernel lab"
    return f"VM tests' kernel: the image's Debian kernel for every lab ({why})"
