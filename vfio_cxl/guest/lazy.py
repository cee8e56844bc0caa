"""Package names that load their module on first use (PEP 562), for ``vfio_cxl.guest`` and
``vfio_cxl.guest.vfio``: importing the package costs nothing, and a program pays only for
the modules whose names it uses (a guest command starts in a few hundred ms under TCG)."""

from __future__ import annotations

import importlib
import sys


def lazy_names(package: str, homes: dict[str, tuple[str, ...]]):
    """``(__getattr__, __dir__, __all__)`` for ``package``: each name of ``homes[module]`` comes
    from ``package.module`` the first time it is asked for, then stays in the package."""
    home = {name: module for module, names in homes.items() for name in names}
    public = sorted(home)

    def __getattr__(name: str):
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{home[name]}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__, public
