"""The demos' payload: a message, then the GPU's PRNG fill, so every side can check the bytes.

The guest's ``demo_dma`` has the GPU write it into CXL devdax; the host's demos read the
same bytes back from the memory backend file and compare them with ``expected_payload``.
"""

from __future__ import annotations

from ..devices.gpu import regs

__all__ = ["MESSAGE", "SEED", "expected_payload"]

MESSAGE = b"DMA FROM GPU TO CXL MEMORY"
SEED = 0x5EED_C0DE


def expected_payload(size: int) -> bytes:
    """The ``size`` bytes the GPU writes: ``MESSAGE``, then ``FILL_PRNG`` from ``SEED``."""
    return (MESSAGE + regs.prng_bytes(SEED, size - len(MESSAGE)))[:size]
