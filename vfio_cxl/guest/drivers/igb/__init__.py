"""A userspace igb (82576) driver for the guest, over the VFIO library (type1 or iommufd).

Modules, one job each: spec (registers, bits, the advanced descriptors packed and unpacked),
ring (which descriptors are posted and what each carries), device (bring-up as one verb per
step, VMDq steering, send, receive, statistics), errors.  Design: docs/nic.md.
"""

from .device import IgbDevice, find_nics
from .errors import IgbError, IgbTimeout
from .spec import RxCompletion, format_mac, parse_mac

__all__ = ["IgbDevice", "find_nics", "IgbError", "IgbTimeout", "RxCompletion", "format_mac", "parse_mac"]
