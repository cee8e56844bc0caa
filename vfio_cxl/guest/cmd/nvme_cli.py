"""In the guest: ``vfio-cxl nvme ls|identify|read|write`` over the userspace NVMe driver.

    vfio-cxl nvme ls [--json]                                  controllers: BDF, driver, IOMMU group, where
    vfio-cxl nvme identify [--nvme BDF] [--json]                Identify Controller + namespaces
    vfio-cxl nvme write --nvme BDF [--nsid N] --offset OFF (--pattern SEED --length LEN | --in FILE) [--json]
    vfio-cxl nvme read  --nvme BDF [--nsid N] --offset OFF --length LEN [--out FILE] [--sgl] [--json]

Data goes through guest RAM the driver maps for the controller; ``read`` and ``write`` print the
sha256 of the bytes moved.  ``--pattern SEED`` writes ``pattern(SEED, LEN)`` (Python's
``random.Random(SEED).randbytes``), so the host can check the backing file without a copy.
"""

from __future__ import annotations

import json
import time

from ..vfio.bind import Sysfs
from ..vfio.errors import VfioError


def pattern(seed: int, length: int) -> bytes:
    import random   # here: `vfio-cxl gpu ...` builds this parser too, and never needs it
    return random.Random(seed).randbytes(length)


def _sha256(data: bytes) -> str:
    import hashlib   # here: `vfio-cxl gpu ...` builds this parser too, and never needs it
    return hashlib.sha256(data).hexdigest()


def find_controllers() -> list[str]:
    from ..drivers.nvme import find_controllers   # the driver loads only when a command drives it
    return find_controllers()


def _open(bdf: str, **kwargs):
    from ..drivers.nvme import NvmeController
    return NvmeController.open(bdf, **kwargs)


def _pick(bdf: str | None) -> str:
    from .pick import pick
    return pick(find_controllers(), bdf, "NVMe controller", "--nvme", "vfio-cxl nvme ls")


def cmd_ls(args) -> int:
    sysfs = Sysfs()
    rows = []
    for bdf in find_controllers():
        parent = sysfs.device_dir(bdf).resolve().parent.name
        rows.append({"bdf": bdf, "driver": sysfs.driver(bdf), "iommu_group": sysfs.iommu_group(bdf),
                     "upstream": parent})
    if args.json:
        print(json.dumps({"controllers": rows}))
    else:
        if not rows:
            print("no NVMe controller in this VM")
        for r in rows:
            print(f"{r['bdf']}  driver {r['driver'] or '-'}  iommu group {r['iommu_group']}  "
                  f"below {r['upstream']}")
    return 0


def cmd_identify(args) -> int:
    with _open(_pick(args.nvme), backend=args.backend) as nvme:
        info = nvme.describe()
    if args.json:
        print(json.dumps(info))
    else:
        print(f"{info['bdf']}: {info['model']} serial {info['serial']} firmware {info['firmware']} "
              f"NVMe {info['version']}, MDTS {info['mdts']} bytes, SGLs {'yes' if info['sgl'] else 'no'}, "
              f"up to {info['max_queue_entries']} entries per queue, {info['io_queues']} I/O queue(s), "
              f"VFIO {info['vfio_backend']}")
        for ns in info["namespaces"]:
            print(f"  namespace {ns['nsid']}: {ns['blocks']} blocks of {ns['block_size']} bytes ({ns['size']} bytes)")
    return 0


def cmd_rw(args) -> int:
    bdf = _pick(args.nvme)
    with _open(bdf, backend=args.backend, interrupts=args.msix) as nvme:
        if args.op == "write":
            if args.input:
                with open(args.input, "rb") as f:
                    data = f.read()
            elif args.length is None:
                raise VfioError("write --pattern SEED needs --length LEN", "add e.g. --length 1M")
            else:
                data = pattern(args.pattern, args.length)
            length = len(data)
        else:
            length = args.length
        nvme.check_range(args.nsid, args.offset, length)
        buf = nvme.dma_buffer(length)
        if args.op == "write":
            buf.mem[:length] = data
        start = time.monotonic()
        commands = nvme.io(nvme_op(args.op), args.nsid, args.offset, buf.iova, length, sgl=args.sgl)
        if args.op == "write" and args.flush:
            nvme.flush(args.nsid)
        seconds = time.monotonic() - start
        data = bytes(buf.mem[:length])
        backend = nvme.device.backend
    if args.op == "read" and args.out:
        with open(args.out, "wb") as f:
            f.write(data)
    result = {"bdf": bdf, "op": args.op, "nsid": args.nsid, "offset": args.offset, "bytes": length,
              "commands": commands, "sha256": _sha256(data), "seconds": seconds,
              "vfio_backend": backend, "sgl": args.sgl}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{bdf}: {args.op} {length} bytes at {args.offset:#x} of namespace {args.nsid} in {commands} "
              f"command(s), {seconds * 1e3:.1f} ms (VFIO {backend}); sha256 {result['sha256']}")
    return 0


def nvme_op(name: str):
    from ..drivers.nvme import IoOp
    return IoOp.WRITE if name == "write" else IoOp.READ


def add_parser(sub, parse_size) -> None:
    nvme = sub.add_parser("nvme", help="NVMe controllers through the userspace driver").add_subparsers(
        dest="command", required=True)
    p = nvme.add_parser("ls", help="NVMe controllers: BDF, driver, IOMMU group")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)
    p = nvme.add_parser("identify", help="Identify Controller and its namespaces")
    p.add_argument("--nvme", metavar="BDF")
    p.add_argument("--backend", choices=("type1", "iommufd"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_identify)
    for op in ("read", "write"):
        p = nvme.add_parser(op, help=f"{op} bytes of a namespace through guest RAM")
        p.add_argument("--nvme", metavar="BDF")
        p.add_argument("--nsid", type=int, default=1)
        p.add_argument("--offset", type=parse_size_or_zero(parse_size), default=0)
        p.add_argument("--backend", choices=("type1", "iommufd"))
        p.add_argument("--sgl", action="store_true", help="SGLs instead of PRPs")
        p.add_argument("--msix", action="store_true", help="MSI-X completions instead of polling")
        p.add_argument("--json", action="store_true")
        if op == "read":
            p.add_argument("--length", type=parse_size, required=True)
            p.add_argument("--out", metavar="FILE")
        else:
            src = p.add_mutually_exclusive_group(required=True)
            src.add_argument("--pattern", type=int, metavar="SEED")
            src.add_argument("--in", dest="input", metavar="FILE")
            p.add_argument("--length", type=parse_size, help="with --pattern")
            p.add_argument("--no-flush", dest="flush", action="store_false")
        p.set_defaults(func=cmd_rw, op=op)


def parse_size_or_zero(parse_size):
    def parse(text: str) -> int:
        return 0 if text.strip() in ("0", "0x0") else parse_size(text)
    return parse
