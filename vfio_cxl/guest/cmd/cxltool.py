"""Guest-side CXL/devdax tool, driven by the lab over SSH (JSON out, base64 data).

    python3 -m vfio_cxl.guest.cmd.cxltool list             discovery (pyudev) + cxl list
    python3 -m vfio_cxl.guest.cmd.cxltool up [MEMDEV]      RAM region as devdax (idempotent)
    python3 -m vfio_cxl.guest.cmd.cxltool regions < plan   the topology's regions (JSON plan from the lab)
    python3 -m vfio_cxl.guest.cmd.cxltool down REGION      destroy a region
    python3 -m vfio_cxl.guest.cmd.cxltool write DAX OFFSET < base64
    python3 -m vfio_cxl.guest.cmd.cxltool read DAX OFFSET LENGTH > base64
    python3 -m vfio_cxl.guest.cmd.cxltool digest DAX OFFSET LENGTH   sha256 + leading text (JSON)
"""

from __future__ import annotations

import json
import sys

from .. import cxl

# `regions` runs at every lab's boot, in every VM: it imports only what it uses (hashlib loads
# libcrypto, base64 and the dax mapping are for the data commands).


def _json(obj) -> str:
    import dataclasses

    def default(o):
        return str(o) if not dataclasses.is_dataclass(o) else dataclasses.asdict(o)
    return json.dumps(obj, default=default)


def _printable_prefix(data: bytes) -> str:
    """The leading run of printable ASCII (the payload's text header)."""
    end = next((i for i, byte in enumerate(data) if not 32 <= byte < 127), len(data))
    return data[:end].decode("ascii")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    try:
        if command == "list":
            print(_json({"memdevs": cxl.memdevs(), "switches": cxl.switches(),
                         "root_decoders": cxl.root_decoders(), "regions": cxl.regions(),
                         "cxl_list": cxl.cxl_list()}))
        elif command == "up":
            print(_json(cxl.ensure_ram_devdax(args[0] if args else None)))
        elif command == "regions":
            print(json.dumps(cxl.bring_up(json.loads(sys.stdin.read()))))
        elif command == "down":
            cxl.destroy_region(args[0])
        elif command == "write":
            import base64
            from ..dax import open_dax
            data = base64.b64decode(sys.stdin.read())
            with open_dax(args[0]) as dax:
                dax.write(int(args[1], 0), data)
            print(len(data))
        elif command == "read":
            import base64
            from ..dax import open_dax
            with open_dax(args[0]) as dax:
                print(base64.b64encode(dax.read(int(args[1], 0), int(args[2], 0))).decode())
        elif command == "digest":
            import hashlib
            from ..dax import open_dax
            offset, length = int(args[1], 0), int(args[2], 0)
            with open_dax(args[0]) as dax:
                data = dax.view[offset:offset + length]
                print(json.dumps({"sha256": hashlib.sha256(data).hexdigest(),
                                  "head": _printable_prefix(bytes(data[:64]))}))
                data.release()
        else:
            print(f"unknown command {command!r}\n{__doc__}", file=sys.stderr)
            return 2
    except cxl.CxlError as err:
        print(f"cxltool: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
