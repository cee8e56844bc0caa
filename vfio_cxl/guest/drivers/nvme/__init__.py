"""A userspace NVMe driver for the guest, over the VFIO library (type1 or iommufd).

Modules, one job each: spec (NVMe 1.4 numbers and entry layouts), prp (PRP lists and SGLs),
tracker (requests in flight, each owning its page), queue (a submission/completion queue
pair and its doorbells), rq (a command on a queue: data pointer, entry, completion), iova (IOVA
space for data buffers), controller (bring-up as one verb per step, admin commands, waiting with
timeouts, fatal status, reset), errors.  Design: docs/storage.md.
"""

from . import rq
from .controller import DmaBuffer, NvmeController, find_controllers
from .errors import NvmeCommandError, NvmeError, NvmeFatalError, NvmeRemovedError, NvmeTimeout
from .queue import QueuePair
from .spec import Completion, ControllerInfo, IoOp, NamespaceInfo
from .tracker import Request, RequestTracker

__all__ = ["DmaBuffer", "NvmeController", "find_controllers", "NvmeCommandError", "NvmeError", "NvmeFatalError",
           "NvmeRemovedError", "NvmeTimeout", "QueuePair", "Completion", "ControllerInfo", "IoOp", "NamespaceInfo", "Request",
           "RequestTracker", "rq"]
