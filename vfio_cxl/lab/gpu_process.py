"""The GPU device server as a child process of the lab (one per VM with a GPU).

A ``DeviceServerProcess`` (see device_process.py) running
``python -m vfio_cxl.devices.gpu serve --socket PATH ...``: its own Python
process, so its DMA engine never competes with the lab for the GIL; the lab
starts QEMU only after the server has printed ``READY <socket>``.
"""

from __future__ import annotations

from pathlib import Path

from .device_process import DeviceServerProcess


class GpuServerProcess(DeviceServerProcess):
    def __init__(self, socket: Path, log: Path, extra_args: list[str] = (), append: bool = False):
        self.socket = socket
        self.extra_args = list(extra_args)
        super().__init__("GPU server", "vfio_cxl.devices.gpu",
                         ["--socket", str(socket), *self.extra_args], [socket], log,
                         append=append)   # append: one log across a GPU's successive servers
