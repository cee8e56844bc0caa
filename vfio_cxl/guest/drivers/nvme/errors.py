"""What can go wrong driving an NVMe controller, each with its cause and its fix."""

from __future__ import annotations

from ...vfio.errors import VfioError


class NvmeError(VfioError):
    """An NVMe operation failed; the message says why and what to do."""


class NvmeTimeout(NvmeError):
    """A command did not complete in time (the controller is still alive)."""


class NvmeFatalError(NvmeError):
    """The controller reports Controller Fatal Status (CSTS.CFS), is gone, or was reset under
    the request: every outstanding request fails with it; ``reset()`` brings it back."""


class NvmeRemovedError(NvmeFatalError):
    """The kernel asked for the device back (vfio-pci's release request: it is being
    hot-removed); the driver tore its queues down and the owner must close it."""


class NvmeCommandError(NvmeError):
    """A command completed with an error status."""

    def __init__(self, what: str, status: int, fix: str):
        self.status = status
        super().__init__(what, fix)
