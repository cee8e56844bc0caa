"""``python -m vfio_cxl.bench NAME [args...]``: run one benchmark's main(argv)."""

import importlib
import sys

# subcommand -> module with a main(argv) -> int
SUBCOMMANDS = {
    "gpu-server": "vfio_cxl.bench.gpu_server",
    "boot": "vfio_cxl.bench.boot",
    "guest-start": "vfio_cxl.bench.guest_start",
    "routes": "vfio_cxl.bench.routes",
    "share": "vfio_cxl.bench.share",
    "chaos": "vfio_cxl.bench.chaos",
    "fm-fuzz": "vfio_cxl.bench.fm_fuzz",
    "supervision": "vfio_cxl.bench.supervision",
    "channel": "vfio_cxl.bench.channel",
    "p2p": "vfio_cxl.bench.p2p",
    "fabric": "vfio_cxl.bench.fabric",
    "storage": "vfio_cxl.bench.storage",
    "nic": "vfio_cxl.bench.nic",
    "gpumem": "vfio_cxl.bench.gpumem",
    "matrix-node": "vfio_cxl.bench.matrix_node",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        print("usage: python -m vfio_cxl.bench {" + ",".join(SUBCOMMANDS) + "} [args...]",
              file=sys.stderr)
        return 2
    from vfio_cxl.errors import LabError

    try:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    except LabError as err:   # a problem the user can fix: one line, as the vfio-cxl CLI prints it
        print(f"scripts/bench {argv[0]}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
