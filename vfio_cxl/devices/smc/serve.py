"""``vfio-cxl smc serve``: run one shared-memory controller for N hosts.

    vfio-cxl smc serve --sockets DIR --hosts N [--message-timeout S] [-v]
    vfio-cxl smc serve --socket PATH --socket PATH ... [--message-timeout S] [-v]

Host h's QEMU connects its vfio-user-pci device to socket h
(``DIR/host<h>.sock`` with --sockets).  Once every socket listens, prints one
line per host, ``READY <socket path>``, in host order, on stdout.  SIGTERM or
SIGINT stop it cleanly and remove the socket files.  Logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

from . import regs
from .device import SmcController
from ..serve_loop import serve_until_signalled


def socket_paths(directory: str, hosts: int) -> list[str]:
    return [str(Path(directory) / f"host{h}.sock") for h in range(hosts)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vfio-cxl smc",
                                     description="The vfio-cxl shared-memory controller, a vfio-user "
                                                 "device server with one socket per host.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the controller until SIGTERM")
    where = serve.add_mutually_exclusive_group(required=True)
    where.add_argument("--sockets", metavar="DIR",
                       help="directory for the sockets host0.sock .. host<N-1>.sock (with --hosts; "
                            "created if missing)")
    where.add_argument("--socket", action="append", metavar="PATH",
                       help="socket of the next host (repeat once per host, host 0 first)")
    serve.add_argument("--hosts", type=int, metavar="N", help=f"hosts (1..{regs.MAX_HOSTS}) with --sockets")
    serve.add_argument("--message-timeout", type=float, default=2.0, metavar="S",
                       help="give up on a message that stops arriving midway (default 2 s)")
    serve.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sockets is not None:
        if args.hosts is None:
            parser.error("--sockets needs --hosts N")
        sockets = socket_paths(args.sockets, args.hosts) if args.hosts > 0 else []
    else:
        if args.hosts is not None and args.hosts != len(args.socket):
            parser.error(f"--hosts {args.hosts} disagrees with {len(args.socket)} --socket options")
        sockets = args.socket
    if not 1 <= len(sockets) <= regs.MAX_HOSTS:
        print(f"vfio-cxl smc: {len(sockets)} hosts; an SMC serves 1 to {regs.MAX_HOSTS} "
              "(give --hosts N or one --socket per host)", file=sys.stderr)
        return 2
    if len(set(sockets)) != len(sockets):
        print("vfio-cxl smc: the same socket is named twice; give each host its own", file=sys.stderr)
        return 2
    if args.sockets is not None:
        try:
            Path(args.sockets).mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            print(f"vfio-cxl smc: cannot create the sockets directory {args.sockets}: {exc.strerror} "
                  "(give --sockets a directory you can write)", file=sys.stderr)
            return 1
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s smc %(levelname)s %(name)s: %(message)s")
    controller = SmcController(sockets, partial_timeout=args.message_timeout)
    stopped = threading.Event()

    def listen() -> None:
        controller.listen()
        controller.start()

    def run() -> None:
        while not stopped.wait(0.5):   # a timeout, so the signal handler runs between waits
            pass

    try:
        return serve_until_signalled("vfio-cxl smc", sockets, listen=listen, run=run, stop=stopped.set)
    finally:
        controller.close()


if __name__ == "__main__":
    sys.exit(main())
