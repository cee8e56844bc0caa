"""The devices room: device models served to QEMU over vfio-user.

* ``vfio_user`` -- the protocol: wire format, transport, connection, server
  loop, DMA mappings, IRQs, PCI config space.  It knows no particular device.
* ``gpu``       -- the programmable GPU (0601:1991); ``gpu.regs`` is its
  register map, the only module a guest driver imports.

Devices never import the lab or the guest stack.
"""
