"""The GPU's release request, watched by the NIC's loops: a GPU the host moves away gives up
its VRAM bindings and is closed, and every later call says so.

    watch = ReleaseWatch(gpu, on_release=lambda: (rx.drop_gpu(gpu), ep.drop_gpu(gpu)))
    nic.wake_fds = watch.fds          # a wait on the NIC's rings also ends when the request fires
    watch.check()                     # in every call and after every wait: GpuReleased once fired

When the fabric manager moves a GPU to another host it asks the guest kernel to remove it
(QMP device_del); vfio-pci then signals the holder on the device's release request eventfd
(VFIO_PCI_REQ_IRQ_INDEX, ``VfioDevice.release_request``) and waits for the device to be
closed.  ``check`` reads that eventfd (one non-blocking read); the first time it finds it
signalled it runs ``on_release`` -- the holders stop their RX queues that point into VRAM,
take back the posted descriptors and remove the NIC's mappings of the BAR --, then drops the
GPU's BAR mmaps and closes it, which lets the kernel finish the removal.  No thread: the NIC
waits on its queue's vector and on ``fds`` together, so a blocked call wakes and checks.
"""

from __future__ import annotations

from ..drivers.igb import IgbError


class GpuReleased(IgbError):
    """The GPU a NIC binding or registration used was released by the host (moved away)."""


class ReleaseWatch:
    """``gpu``'s release request (a GpuDriver, whose ``request`` is the eventfd or None).
    ``on_release`` runs once, before the GPU is closed: it must leave nothing of the GPU's
    VRAM posted to or mapped for the NIC."""

    def __init__(self, gpu, on_release):
        self.gpu, self.bdf = gpu, gpu.device.bdf
        self._on_release = on_release
        self.released = False

    @property
    def fds(self) -> tuple[int, ...]:
        """The eventfd(s) to wait on beside a queue's vector (none where vfio-pci has no request)."""
        request = self.gpu.request
        return tuple(request.eventfds) if request is not None and not self.released else ()

    def check(self) -> None:
        """GpuReleased if the host released the GPU (now or before); the first time, the
        bindings are torn down and the GPU is closed first."""
        if not self.released and self.gpu.release_requested():
            self.give_up()
        if self.released:
            raise self.error()

    def give_up(self) -> None:
        """Tear down in order: the holders (queues stopped, descriptors taken back, the NIC's
        mappings of the BAR removed), the GPU's BAR mmaps, the GPU itself.  Each step runs;
        the GPU is closed even if a holder failed (the kernel waits for that)."""
        self.released = True
        try:
            self._on_release()
        finally:
            self.gpu.close()        # unmaps its BARs (VfioDevice.close), then closes the fd

    def error(self) -> GpuReleased:
        return GpuReleased(f"the GPU {self.bdf} was released by the host (moved to another host: vfio-pci's "
                           "release request); its VRAM bindings and registrations were torn down, the NIC's "
                           "mappings of its BAR removed and the GPU closed",
                           "bind again once a GPU is there: open a new session with a GPU of this VM "
                           "(vfio-cxl gpu ls); the NIC still carries guest-RAM traffic")
