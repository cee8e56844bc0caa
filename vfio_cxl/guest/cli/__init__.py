"""The name the guest image's ``vfio-cxl`` wrapper runs (``python3 -m vfio_cxl.guest.cli``): see ``__main__``.

Not part of the library: the command is ``vfio_cxl.guest.cmd.cli``.
"""
