"""In the guest: ``vfio-cxl nic ls|stats|send|recv|rdma-recv|rdma-write`` over the userspace igb driver.

    vfio-cxl nic ls [--json]                                   igb functions: BDF, driver, MAC
    vfio-cxl nic stats [--nic BDF] [--seconds S] [--json]      bring up, count for S seconds, print the counters
    vfio-cxl nic send [--nic BDF] --to MAC [--count N] [--size BYTES] [--seed S] [--json]
    vfio-cxl nic recv [--nic BDF] [--count N] [--timeout S] [--queue Q --steer MAC] [--buffers K]
                      [--gpu [BDF] [--vram-offset OFF] [--vram-length LEN]] [--seed S] [--json]
    vfio-cxl nic rdma-recv|rdma-write ...                       RDMA-shaped writes, VRAM to VRAM (nic_rdma.py)

``send`` sends IPv4/UDP frames whose payloads are ``frames.payload(seed, k, size)``; ``recv``
checks each payload it gets against the seed (``verified``) and prints the sha256 of the
payloads in arrival order.  With ``--gpu``, ``recv`` binds VRAM to the queue (devmem):
headers land in guest RAM, payloads in the GPU's VRAM, read back through its BAR2 to check.
``--ready-file`` is written once the receiver's buffers are posted (for a sender elsewhere).
"""

from __future__ import annotations

import json
import time

from ..vfio.bind import Sysfs
from ..vfio.errors import VfioError

PCI_VENDOR_INTEL, PCI_DEVICE_82576 = 0x8086, 0x10C9     # spec's, without importing the driver for `ls`


def find_nics() -> list[str]:
    from ..vfio.bind import find_pci_devices
    return find_pci_devices(PCI_VENDOR_INTEL, PCI_DEVICE_82576)


def _pick(bdf: str | None) -> str:
    from .pick import pick
    return pick(find_nics(), bdf, "igb function", "--nic", "vfio-cxl nic ls")


def _mac(sysfs: Sysfs, bdf: str, driver: str | None) -> str | None:
    """The kernel netdev's address; else RA[0] read through VFIO: of a function bound to vfio-pci
    and free, or of one with no driver, bound to vfio-pci for the read and left as it was."""
    net = sysfs.device_dir(bdf) / "net"
    for dev in sorted(net.iterdir()) if net.is_dir() else []:
        return (dev / "address").read_text().strip()
    if driver not in ("vfio-pci", None):
        return None
    from ..drivers.igb import spec
    from ..vfio import VfioPciDevice
    try:
        with VfioPciDevice.open(bdf, bind=driver is None) as device:
            bar0 = device.bar(0)
            return spec.format_mac(spec.mac_from_receive_address(bar0.read32(spec.RAL0), bar0.read32(spec.RAL0 + 4)))
    except VfioError:
        return None                              # held by another process: its MAC is its business


def cmd_ls(args) -> int:
    sysfs = Sysfs()
    rows = []
    for bdf in find_nics():
        driver = sysfs.driver(bdf)
        rows.append({"bdf": bdf, "ids": f"{PCI_VENDOR_INTEL:04x}:{PCI_DEVICE_82576:04x}", "driver": driver,
                     "iommu_group": sysfs.iommu_group(bdf), "mac": _mac(sysfs, bdf, driver)})
    if args.json:
        print(json.dumps({"nics": rows}))
        return 0
    if not rows:
        print("no igb function in this VM")
    for r in rows:
        print(f"{r['bdf']}  [{r['ids']}]  driver {r['driver'] or '-'}  iommu group {r['iommu_group']}  "
              f"mac {r['mac'] or '-'}")
    return 0


def _open(args, **kwargs):
    from ..drivers.igb import IgbDevice
    return IgbDevice.open(_pick(args.nic), backend=args.backend, **kwargs)


def cmd_stats(args) -> int:
    """Bring the NIC up, receive on queue 0 for ``--seconds`` (frames counted, not kept), print
    the link and the counters.  Counters from before this command are gone: opening a VFIO
    device resets it (FLR), and a reset clears them."""
    if args.seconds < 0:
        raise VfioError(f"--seconds {args.seconds}", "pass 0 or more")
    with _open(args, queues=1) as nic:
        frames = len(nic.recv(0, 1 << 31, args.seconds)) if args.seconds else 0
        out = {"bdf": nic.bdf, "link": nic.link, "seconds": args.seconds, "frames": frames,
               "vfio_backend": nic.device.backend, "stats": nic.stats()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['bdf']}: link {'up' if out['link'] else 'down'}, {out['frames']} frames in {args.seconds:g} s")
        print("  " + ", ".join(f"{k} {v}" for k, v in out["stats"].items()))
    return 0


def _mac_arg(text: str) -> bytes:
    import argparse
    from ..drivers.igb.spec import parse_mac
    try:
        return parse_mac(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def cmd_send(args) -> int:
    from ..drivers.igb import format_mac
    from ..nic import frames
    if not frames.SEQ.size <= args.size <= frames.MAX_PAYLOAD:
        raise VfioError(f"--size {args.size}: a payload of {frames.SEQ.size} to {frames.MAX_PAYLOAD} bytes "
                        "(a standard frame, headers included)", "pass a smaller --size")
    with _open(args, queues=1, interrupts=False) as nic:
        run = [frames.frame(args.to, nic.mac, args.seed, k, args.size) for k in range(args.count)]
        t0 = time.perf_counter()
        sent = nic.send(run)
        seconds = time.perf_counter() - t0
        out = {"bdf": nic.bdf, "mac": format_mac(nic.mac), "link": nic.link, "to": format_mac(args.to), "frames": sent,
               "bytes": sent * args.size, "frame_bytes": sum(map(len, run)), "seconds": seconds,
               "vfio_backend": nic.device.backend, "stats": nic.stats()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['bdf']} ({out['mac']}): {sent} frames of {args.size} payload bytes to {out['to']} "
              f"in {seconds:.3f} s; gptc {out['stats']['gptc']}")
    return 0


def _check_recv_args(args) -> None:
    if args.queue and args.steer is None:
        raise VfioError(f"--queue {args.queue} without --steer: only frames to a steered MAC reach a queue "
                        "other than 0", "pass --steer MAC (the MAC the sender sends to)")
    if args.gpu and not args.queue:
        raise VfioError("--gpu binds VRAM to queue 0, which takes the NIC's own and broadcast traffic",
                        "pass --queue 1 --steer MAC")
    if args.gpu and args.buffers is not None:
        raise VfioError("--buffers with --gpu: a VRAM binding posts its chunks", "drop --buffers")
    if args.timeout <= 0 or args.count < 1:
        raise VfioError(f"--count {args.count} --timeout {args.timeout}", "pass a positive count and timeout")


def _ready(path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write("ready\n")


def _payload_report(seed: int | None, payloads: list[bytes]) -> dict:
    import hashlib
    from ..nic import frames
    seqs = [frames.check_payload(seed, p) for p in payloads] if seed is not None else []
    return {"frames": len(payloads), "bytes": sum(map(len, payloads)),
            "sha256": hashlib.sha256(b"".join(payloads)).hexdigest(),
            "seqs": seqs, "verified": seed is not None and None not in seqs}


def cmd_recv(args) -> int:
    _check_recv_args(args)
    out = _recv_devmem(args) if args.gpu else _recv_ram(args)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['bdf']} queue {out['queue']} ({out['mode']}): {out['frames']} frames, {out['bytes']} payload "
              f"bytes" + (f", verified {out['verified']}" if args.seed is not None else "")
              + f"; gprc {out['stats']['gprc']}, rx overruns {out['stats']['rx_overrun_events']}")
    return 0 if args.seed is None or out["verified"] or not out["frames"] else 1


def _recv_ram(args) -> dict:
    import hashlib
    from ..drivers.igb import format_mac
    from ..nic import frames
    queues = max(args.queue + 1, 1)
    with _open(args, queues=queues, bring_up=False) as nic:
        nic.bring_up({args.steer: args.queue} if args.steer is not None else None)
        if args.buffers is not None:             # the other queues keep theirs: the device drops, not defers
            nic.configure_rx(args.queue, buffers=args.buffers)
        _ready(args.ready_file)
        got = nic.recv(args.queue, args.count, args.timeout)
        headers = [f[:frames.HEADERS] for f in got]
        out = {"bdf": nic.bdf, "mac": format_mac(nic.mac), "link": nic.link, "queue": args.queue, "mode": "ram",
               "vfio_backend": nic.device.backend,
               **_payload_report(args.seed, [f[frames.HEADERS:] for f in got]),
               "headers_sha256": hashlib.sha256(b"".join(headers)).hexdigest(), "stats": nic.stats()}
    return out


def _pick_gpu(bdf: str) -> str:
    """``--gpu``'s GPU: the BDF given, or ("only") the VM's only GPU."""
    from ...devices.gpu import regs
    from ..vfio.bind import find_pci_devices
    from .pick import pick
    found = find_pci_devices(regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID)
    return pick(found, None if bdf == "only" else bdf, "GPU", "--gpu", "vfio-cxl gpu ls")


def _recv_devmem(args) -> dict:
    import hashlib
    from ..drivers.igb import format_mac
    from ..nic.session import NicSession
    from ..vfio.bind import bind_vfio_pci
    from ..vfio.backend import choose_backend
    gpu, nic = _pick_gpu(args.gpu), _pick(args.nic)
    bind_vfio_pci(gpu)
    bind_vfio_pci(nic)                 # bound first: which backend can drive it depends on its cdev
    backend = choose_backend(nic, args.backend)
    with NicSession.open(nic, gpu, backend=backend, queues=args.queue + 1) as s:
        b = s.rx.bind_rx(args.queue, s.gpu, args.vram_offset, args.vram_length, notes=s.kernel)
        s.nic.steer(args.steer, args.queue)
        _ready(args.ready_file)
        got = s.rx.recv(b, args.count, args.timeout)
        payloads = [b"".join(s.rx.read(f) for f in frame.fragments) for frame in got]
        fragments = [[[f.vram_offset, f.size, f.token] for f in frame.fragments] for frame in got]
        returned = s.rx.dontneed([f.token for frame in got for f in frame.fragments])
        out = {"bdf": s.nic.bdf, "mac": format_mac(s.nic.mac), "link": s.nic.link, "queue": args.queue,
               "mode": "devmem",
               "gpu": gpu, "vfio_backend": s.backend, **_payload_report(args.seed, payloads),
               "headers_sha256": hashlib.sha256(b"".join(frame.header for frame in got)).hexdigest(),
               "header_bytes": [len(frame.header) for frame in got],
               "split": sum(frame.split for frame in got), "linear": sum(not frame.split for frame in got),
               "fragments": fragments, "returned": returned,
               "vram_range": [args.vram_offset, args.vram_length], "kernel": s.kernel, "stats": s.nic.stats()}
        header_iova = b.header_mapping.iova
        s.rx.unbind(b)
        out["mapped_after_unbind"] = [hex(m.iova) for m in s.nic.device.mappings
                                      if m.overlaps(b.iova, b.length) or m.overlaps(header_iova, 1)]
    return out


def add_parser(sub, parse_size) -> None:
    nic = sub.add_parser("nic", help="igb NICs through the userspace driver").add_subparsers(
        dest="command", required=True)
    p = nic.add_parser("ls", help="igb functions: BDF, driver, MAC")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)
    p = nic.add_parser("stats", help="bring the NIC up, count for --seconds, print the counters")
    _common(p)
    p.add_argument("--seconds", type=float, default=1.0, metavar="S")
    p.set_defaults(func=cmd_stats)
    p = nic.add_parser("send", help="IPv4/UDP frames of a seeded payload to a MAC")
    _common(p)
    p.add_argument("--to", type=_mac_arg, required=True, metavar="MAC")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--size", type=int, default=1024, help="payload bytes per frame (8 to 1472)")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=cmd_send)
    p = nic.add_parser("recv", help="receive frames (into guest RAM, or with --gpu into VRAM)")
    _common(p)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--timeout", type=float, default=5.0, metavar="S")
    p.add_argument("--queue", type=int, default=0)
    p.add_argument("--steer", type=_mac_arg, metavar="MAC", help="frames to this MAC go to --queue only")
    p.add_argument("--buffers", type=int, help="RX buffers to post (0: none, what is steered there is dropped)")
    p.add_argument("--seed", type=int, help="check each payload against this seed")
    p.add_argument("--gpu", metavar="BDF", nargs="?", const="only",
                   help="devmem: payloads into this GPU's VRAM (no BDF: the VM's only GPU)")
    p.add_argument("--vram-offset", type=lambda s: int(s, 0), default=0)
    p.add_argument("--vram-length", type=parse_size, default=1 << 20)
    p.add_argument("--ready-file", metavar="PATH", help="written once the buffers are posted")
    p.set_defaults(func=cmd_recv)
    from .nic_rdma import add_parsers
    add_parsers(nic, parse_size, _common, _mac_arg)


def _common(p) -> None:
    p.add_argument("--nic", metavar="BDF")
    p.add_argument("--backend", choices=("type1", "iommufd"))
    p.add_argument("--json", action="store_true")
