"""``vfio-cxl gpu serve``: run the GPU as a vfio-user server for QEMU.

    vfio-cxl gpu serve --socket PATH [--vram-mib N] [--vendor-id 0x0601]
                       [--device-id 0x1991] [--irq-mode msix|msi] [--message-timeout S]
                       [--share-vram PATH] [--peer PATH ...] [--local-dma-faults] [-v]

Prints exactly one line, ``READY <socket path>``, on stdout once the socket
listens (the lab starts QEMU only after it).  SIGTERM or SIGINT stop it
cleanly and remove the socket file.  Logs go to stderr; -v logs every
message.
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import regs
from .device import GpuDevice
from ..serve_loop import serve_until_signalled
from ..vfio_user.server import VfioUserServer


def _int(text: str) -> int:
    return int(text, 0)


def _id16(text: str) -> int:
    value = int(text, 0)
    if not 0 <= value <= 0xFFFF:
        raise argparse.ArgumentTypeError(f"{text} is not a 16-bit PCI ID")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vfio-cxl gpu",
                                     description="The vfio-cxl GPU, a vfio-user device server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the GPU on a UNIX socket until SIGTERM")
    serve.add_argument("--socket", required=True, metavar="PATH",
                       help="UNIX socket QEMU's vfio-user-pci connects to")
    serve.add_argument("--vram-mib", type=_int, default=regs.DEFAULT_VRAM_SIZE // regs.MIB,
                       metavar="N", help="VRAM size in MiB, a power of two (default 64)")
    serve.add_argument("--vendor-id", type=_id16, default=regs.PCI_VENDOR_ID,
                       help="PCI vendor ID (default 0x0601)")
    serve.add_argument("--device-id", type=_id16, default=regs.PCI_DEVICE_ID,
                       help="PCI device ID (default 0x1991)")
    serve.add_argument("--irq-mode", choices=("msix", "msi"), default="msix",
                       help="interrupt capability: MSI-X (default, 4 vectors, BAR4) or MSI "
                            "(4 vectors, no BAR4; QEMU 11.1 can hot-remove it)")
    serve.add_argument("--message-timeout", type=float, default=2.0, metavar="S",
                       help="give up on a message that stops arriving midway (default 2 s)")
    serve.add_argument("--share-vram", metavar="PATH",
                       help="UNIX socket on which peer GPU servers fetch this GPU's VRAM fd (P2P)")
    serve.add_argument("--peer", action="append", default=[], metavar="PATH",
                       help="a peer GPU's --share-vram socket (repeatable): enables the proven "
                            "P2P fast path into its VRAM (docs/gpu-device.md, P2P)")
    serve.add_argument("--local-dma-faults", action="store_true",
                       help="fault a DMA to an IOVA without a DMA_MAP inside the device only; "
                            "by default it also goes to QEMU (rate limited), whose vIOMMU "
                            "records the fault the guest logs (docs/gpu-device.md, Faults)")
    serve.add_argument("-v", "--verbose", action="store_true",
                       help="log every vfio-user message (debug level)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s gpu %(levelname)s %(name)s: %(message)s")
    try:
        device = GpuDevice(args.vram_mib * regs.MIB, args.vendor_id, args.device_id,
                           irq_mode=args.irq_mode, share_vram=args.share_vram, peers=args.peer,
                           local_dma_faults=args.local_dma_faults)
    except ValueError as exc:
        print(f"vfio-cxl gpu: {exc}", file=sys.stderr)
        return 2
    server = VfioUserServer(args.socket, device, partial_timeout=args.message_timeout)
    try:
        return serve_until_signalled("vfio-cxl gpu", [args.socket], listen=server.listen,
                                     run=server.serve_forever, stop=server.stop, wakeup_fd=server.wakeup_fd)
    finally:
        server.close()
        device.close()


if __name__ == "__main__":
    sys.exit(main())
