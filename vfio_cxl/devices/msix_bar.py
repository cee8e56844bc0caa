"""The MSI-X BAR every lab device has: BAR4, 4 KiB, the table at 0 and the PBA at 0x800.

Standard library only (nothing at all): the register maps (``gpu.regs``, ``smc.regs``)
take these names from here, and guest drivers import those maps.  Each entry of the
table is 16 bytes (PCI Local Bus 3.0, 6.8.2).
"""

BAR_MSIX = 4
MSIX_BAR_SIZE = 0x1000
MSIX_TABLE_OFFSET = 0x000
MSIX_PBA_OFFSET = 0x800
MSIX_ENTRY_SIZE = 16
