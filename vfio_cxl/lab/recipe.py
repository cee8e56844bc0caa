"""Recipes: the inputs that define a cached artefact, and the hash that names it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def recipe_hash(*parts: object) -> str:
    """A short stable hash of JSON-able recipe parts and file contents."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            digest.update(part.name.encode() + b"\0" + part.read_bytes())
        else:
            digest.update(json.dumps(part, sort_keys=True).encode())
        digest.update(b"\1")
    return digest.hexdigest()[:16]


@contextmanager
def building(final: Path) -> Iterator[Path]:
    """Build into a scratch directory next to ``final`` and move it in place on success.

    A build that fails or is interrupted leaves nothing at ``final``, so a
    half-built artefact is never mistaken for a cached one.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = final.with_name(f".{final.name}.build-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        yield scratch
        scratch.rename(final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class Progress:
    """Step-by-step progress lines with elapsed time, for builds that take a while."""

    def __init__(self, what: str, log=print):
        self.what = what
        self.log = log
        self.start = time.monotonic()

    def step(self, message: str) -> None:
        self.log(f"[{self.what} {time.monotonic() - self.start:6.1f}s] {message}")
