"""The devices room: device models served to QEMU over vfio-user.

* ``vfio_user`` -- the protocol: wire format, transport, connection, server
  loop, DMA mappings, IRQs, PCI config space.  It knows no particular device.
* ``gpu``       -- the programmable GPU (0601:1991); ``gpu.regs`` is its register map.
* ``smc``       -- the shared-memory controller (0601:5c01); ``smc.regs`` is its register map.
* ``serve_loop`` -- listen, READY, serve until SIGTERM: the devices' ``serve`` commands.

The register maps are the only modules a guest driver imports (the SMC's takes the
MSI-X BAR layout from the GPU's).
Devices never import the lab or the guest stack.
"""
