"""Which device a guest command drives: the one named, or the only one of its kind."""

from __future__ import annotations

from ..vfio.errors import VfioError


def pick(found: list[str], bdf: str | None, kind: str, option: str, listing: str) -> str:
    """``bdf`` (``BB:DD.F``, or with its domain) if it is among ``found``; with no ``bdf``, the
    only one found.  Otherwise a VfioError naming the ``kind`` of device (singular: "GPU"),
    what there is, and the ``option`` and ``listing`` command that would help."""
    if bdf is None:
        if len(found) != 1:
            raise VfioError(f"{len(found)} {kind}s here: {', '.join(found) or 'none'}",
                            f"pick one with {option} BDF ({listing})")
        return found[0]
    full = bdf if bdf.count(":") == 2 else f"0000:{bdf}"
    if full not in found:
        raise VfioError(f"no {kind} at {bdf}", f"{kind}s here: {', '.join(found) or 'none'} ({listing})")
    return full
