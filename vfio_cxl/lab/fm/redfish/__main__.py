"""``python -m vfio_cxl.lab.fm.redfish``: the Redfish service process (the FM starts it on
``vfio-cxl fm redfish``; see docs/redfish.md).  Serves on the listening socket it inherits
(``--fd``) until the FM ends the event stream (the lab stops) or sends SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from werkzeug.serving import make_server

from ....errors import LabError
from ... import topology
from ..client import FmClient
from .app import Subscriptions, create_app
from .events import Deliverer, follow


def log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.lab.fm.redfish")
    parser.add_argument("--socket", required=True, type=Path, help="the FM's control socket")
    parser.add_argument("--lab", required=True)
    topology.add_handoff_options(parser)
    parser.add_argument("--fd", required=True, type=int, help="a listening TCP socket on 127.0.0.1")
    args = parser.parse_args(argv)

    try:
        topo = topology.load_handed(args.topology, args.topology_sha256)
    except LabError as err:
        log(f"error: {err.what} ({err.fix})")
        return 1

    def fm() -> FmClient:
        return FmClient(args.socket, lab=args.lab, timeout=300)

    subscriptions = Subscriptions()
    app = create_app(fm, topo, subscriptions)
    server = make_server("127.0.0.1", 0, app, threaded=True, fd=args.fd)
    deliverer = Deliverer(subscriptions, log=log)
    with fm() as client:
        since = max((ev["seq"] for ev in client.events()), default=0)

    def follower():
        try:
            with fm() as client:
                follow(client, deliverer, since)
            log("the fabric manager ended the event stream (the lab stops); stopping")
        except LabError as err:
            log(f"lost the fabric manager: {err}; stopping")
        server.shutdown()

    threading.Thread(target=follower, name="fm-events", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda signum, frame: threading.Thread(target=server.shutdown).start())
    log(f"Redfish service of lab {args.lab} on http://127.0.0.1:{server.port}/redfish/v1/")
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
