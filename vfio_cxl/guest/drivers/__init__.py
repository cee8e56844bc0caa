"""Userspace drivers, in the guest, for devices the lab does not serve itself (QEMU's NVMe).

Each sits on the VFIO library (``vfio_cxl.guest.vfio``) like the GPU's driver does."""
