"""What a user runs in the guest, apart from the library it is built on.

``vfio-cxl gpu|nvme ...`` (``cli``), the demos' guest halves (``demo_dma``,
``stream``, ``cxltool``), the checks' and benchmarks' guest halves
(``gpu_checks``, ``smc_checks``, ``storage_checks``, ``p2p``, ``bench_routes``,
``share_bench``, ``storage_bench``, ``gpumem``, ``selftest``) and the boot-time
network setup (``netconfig``).  Each runs as ``python3 -m vfio_cxl.guest.cmd.NAME``.
The library (``vfio_cxl.guest``: ``vfio``, ``cxl``, ``dax``, ``drivers``,
``storage``, ``channel``, ...) never imports from here (docs/guest-library.md).
"""
