"""vfio-cxl: a CXL + VFIO lab.

Three rooms, arrows one way:

* ``vfio_cxl.lab``   -- host lab: topology -> QEMU argv -> running VMs (QMP, console, SSH)
* ``vfio_cxl.devices`` -- device models served to QEMU over vfio-user (``vfio_user``, ``gpu``)
* ``vfio_cxl.guest`` -- runs inside the VM: a library (VFIO, CXL/devdax, the GPU, SMC and NVMe
  drivers, storage, the record channel) and, apart from it, the guest's commands (``guest.cmd``)

The guest room imports only the standard library, cffi, pyudev, pyroute2 and
``vfio_cxl.devices.gpu.regs`` (the register map the device and its driver share), so
the guest can run this package straight from a read-only share of the checkout (or of a
copy of the installed package).
"""

__version__ = "0.1.0"
