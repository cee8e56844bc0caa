"""What can go wrong driving an igb, each with its cause and its fix."""

from __future__ import annotations

from ...vfio.errors import VfioError


class IgbError(VfioError):
    """An igb operation failed or was given something it cannot do; the message says which."""


class IgbTimeout(IgbError):
    """The device did not do something (reset, link up, a transmit) within its bound."""
