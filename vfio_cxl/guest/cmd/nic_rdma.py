"""In the guest: ``vfio-cxl nic rdma-recv|rdma-write``, RDMA-shaped writes from one host's
VRAM into another's (vfio_cxl.guest.nic.rdma; docs/nic.md).

    vfio-cxl nic rdma-recv [--path zero-copy|bounce|tcp] [--vram-offset OFF] [--length LEN] [--writes N]
                           [--seed S] [--free-after K [--reregister]] [--ready-file PATH] [--json]
    vfio-cxl nic rdma-write --to MAC --key KEY --sizes 16M[,4K...] [--offset OFF] [--seed S] [--imm N]
                            [--path zero-copy|bounce|tcp] [--peer IP] [--json]

``rdma-recv`` registers VRAM [--vram-offset, + --length) of its GPU for remote writes, writes
``--ready-file`` (JSON: the key, the NIC's MAC) and serves ``--writes`` writes; each landed
range is read back through BAR2 (sha256) and, with ``--seed``, checked against the seeded
pattern at the same offset (``verified``).  ``rdma-write`` fills its own region with that
pattern and writes ``--offset``.. of it, one write per ``--sizes`` entry, to the same offset
of the peer's region ``--key``.  Paths: ``zero-copy`` (NIC DMA from and into VRAM), ``bounce``
(through guest RAM, the CPU copying through BAR2), ``tcp`` (the kernel's TCP over the
virtio-net link, ``--peer``).  Each side counts the payload bytes its CPU copied.
"""

from __future__ import annotations

import hashlib
import json

from ..vfio.errors import VfioError

PATHS = ("zero-copy", "bounce", "tcp")


class RdmaSide:
    """One end over the userspace igb: a NicSession (NIC and GPU in one context) and an endpoint."""

    def __init__(self, args):
        from ..nic.session import NicSession
        from ..vfio.backend import choose_backend
        from ..vfio.bind import bind_vfio_pci
        from .nic_cli import _pick, _pick_gpu
        gpu, nic = _pick_gpu(args.gpu), _pick(args.nic)
        bind_vfio_pci(gpu)
        bind_vfio_pci(nic)
        self.session = NicSession.open(nic, gpu, backend=choose_backend(nic, args.backend), queues=2)
        self.gpu, self.kernel = self.session.gpu, self.session.kernel
        try:
            self.ep = self.session.endpoint(placement=args.path)
        except BaseException:
            self.session.close()
            raise

    def register(self, offset: int, length: int, remote: bool):
        from ..nic.rdma import Access
        return self.ep.reg_mr(self.gpu, offset, length, Access.REMOTE_WRITE if remote else Access(0),
                              notes=self.kernel)

    def free(self, region) -> None:
        self.ep.dereg_mr(region)

    def serve(self, timeout: float, region) -> dict:
        c = self.ep.serve(timeout)
        return {"write_id": c.write_id, "key": c.key, "offset": c.offset, "length": c.length, "imm": c.imm,
                "frames": c.frames, "status": c.status.name, "error": c.error, "seconds": c.seconds,
                "cpu_seconds": c.cpu_seconds}

    def write(self, region, offset: int, length: int, key: int, imm: int, args) -> dict:
        r = self.ep.write(region, offset, length, key, offset, to=args.to, imm=imm, timeout=args.timeout)
        return {"frames": r.frames, "imm": r.imm, "seconds": r.seconds, "cpu_seconds": r.cpu_seconds}

    def copied(self) -> dict:
        return {k: self.ep.counts[k] for k in ("payload_bytes_copied", "header_bytes_copied")}

    def describe(self) -> dict:
        from ..drivers.igb import format_mac
        nic = self.session.nic
        return {"bdf": nic.bdf, "gpu": self.gpu.device.bdf, "mac": format_mac(nic.mac),
                "data_mac": format_mac(self.ep.data_mac),
                "link": nic.link, "vfio_backend": self.session.backend, "kernel": self.kernel}

    def close(self) -> dict:
        """Close everything; -> what was still mapped in a registration window after the endpoint closed."""
        from ..nic.rdma import MR_IOVA
        try:
            self.ep.close()
            left = [hex(m.iova) for m in self.session.nic.device.mappings if m.iova >= MR_IOVA]
        finally:
            self.session.close()
        return {"mapped_after_close": left}


class TcpSide:
    """One end over the kernel's TCP on the lab link: the GPU alone through VFIO."""

    def __init__(self, args):
        from ..drivers.gpu import GpuDriver
        from ..vfio.bind import bind_vfio_pci
        from .nic_cli import _pick_gpu
        bdf = _pick_gpu(args.gpu)
        bind_vfio_pci(bdf)
        self.gpu = GpuDriver.open(bdf)
        self.peer, self.timeout = None, args.timeout

    def register(self, offset: int, length: int, remote: bool):
        """The range (no registration on TCP); the responder listens from here on."""
        from ..nic.tcp import TcpResponder
        if offset < 0 or length <= 0 or offset + length > self.gpu.vram_size:
            raise VfioError(f"VRAM [{offset:#x}, {offset + length:#x})", "a range inside VRAM")
        if remote and self.peer is None:
            self.peer = TcpResponder(timeout=self.timeout)
        return (offset, length)

    def serve(self, timeout: float, region) -> dict:
        before = self.peer.payload_bytes_copied
        r = self.peer.serve(self.gpu, *region)
        return {"write_id": None, "key": None, "offset": r["offset"], "length": r["length"], "imm": r["imm"],
                "frames": None, "status": r["status"].name, "error": None if r["status"] == 0 else r["status"].name,
                "seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"],
                "payload_bytes_copied": self.peer.payload_bytes_copied - before}

    def write(self, region, offset: int, length: int, key: int, imm: int, args) -> dict:
        from ..nic.tcp import TcpRequester
        if self.peer is None:
            self.peer = TcpRequester(args.peer, timeout=args.timeout)
        if offset + length > region[1]:
            raise VfioError(f"a write of {length} bytes from offset {offset:#x} of a {region[1]:#x}-byte region",
                            "write from inside the local region")
        r = self.peer.write(self.gpu, region[0] + offset, length, offset, imm)
        return {"frames": None, **r}

    def copied(self) -> dict:
        return {"payload_bytes_copied": self.peer.payload_bytes_copied if self.peer else 0}

    def describe(self) -> dict:
        return {"gpu": self.gpu.device.bdf}

    def close(self) -> dict:
        try:
            if self.peer is not None:
                self.peer.close()
        finally:
            self.gpu.close()
        return {}


def _side(args):
    return TcpSide(args) if args.path == "tcp" else RdmaSide(args)


def _ready(path: str | None, info: dict) -> None:
    """``info`` as JSON at ``path``, whole: written aside, then renamed into place."""
    if path:
        import os
        with open(f"{path}.part", "w") as f:
            f.write(json.dumps(info) + "\n")
        os.replace(f"{path}.part", path)


def _check_recv_args(args) -> None:
    if args.writes < 1 or args.timeout <= 0:
        raise VfioError(f"--writes {args.writes} --timeout {args.timeout}", "pass a positive count and timeout")
    if args.free_after is not None and not 1 <= args.free_after <= args.writes:
        raise VfioError(f"--free-after {args.free_after} with --writes {args.writes}",
                        "free the region after 1 to --writes writes")
    if args.path == "tcp" and args.free_after is not None:
        raise VfioError("--free-after with --path tcp: the TCP reference has no registrations", "drop --free-after")
    if args.reregister and args.free_after is None:
        raise VfioError("--reregister without --free-after", "pass --free-after K: the region is registered "
                                                            "again after it is freed")


def _landed(gpu, region_offset: int, write: dict, seed: int | None) -> dict:
    """The landed range read back through BAR2: its sha256 and, with ``seed``, whether it is the pattern."""
    from ..nic.rdma import pattern
    if write["status"] != "OK":
        return {"sha256": None, "verified": False}
    data = gpu.vram.read(region_offset + write["offset"], write["length"])
    return {"sha256": hashlib.sha256(data).hexdigest(),
            "verified": seed is not None and data == pattern(seed, write["offset"], write["length"])}


def _failure(err) -> str:
    """A write's status word for ``err``: the GPU released by the host, the peer gone, or refused."""
    from ..nic.rdma import PeerLost
    from ..nic.release import GpuReleased
    return "GPU_RELEASED" if isinstance(err, GpuReleased) else "PEER_LOST" if isinstance(err, PeerLost) else "REFUSED"


def cmd_rdma_recv(args) -> int:
    from ..nic.release import GpuReleased
    _check_recv_args(args)
    side = _side(args)
    out = {"path": args.path, **side.describe(), "region": [args.vram_offset, args.length], "keys": [],
           "writes": [], "released": None}
    try:
        region = side.register(args.vram_offset, args.length, remote=True)
        out["keys"].append(getattr(region, "key", None))
        _ready(args.ready_file, {"key": out["keys"][0], **{k: out.get(k) for k in ("mac", "data_mac")}})
        try:
            _serve_writes(side, region, args, out)
        except GpuReleased as err:          # the host moved the GPU away: nothing to place into
            out["released"] = str(err)
        out["stats"] = side.session.nic.stats() if args.path != "tcp" else {}
    finally:
        out.update(side.close())
    _print_recv(args, out)
    return 0 if out["released"] is None and all(
        w["status"] == "OK" and (args.seed is None or w["verified"]) for w in out["writes"]) else 1


def _serve_writes(side, region, args, out: dict) -> None:
    """Serve ``--writes`` writes into ``region``, each checked and appended to ``out["writes"]``."""
    for n in range(1, args.writes + 1):
        before = side.copied()
        w = side.serve(args.timeout, region)
        w.update({k: v - before[k] for k, v in side.copied().items()})
        w.update(_landed(side.gpu, args.vram_offset, w, args.seed))
        out["writes"].append(w)
        if n == args.free_after:
            side.free(region)
            if args.reregister:
                region = side.register(args.vram_offset, args.length, remote=True)
                out["keys"].append(region.key)


def _print_recv(args, out: dict) -> None:
    if args.json:
        print(json.dumps(out))
        return
    for w in out["writes"]:
        print(f"{args.path}: write {w['write_id']} of {w['length']} bytes at {w['offset']:#x}: {w['status']}"
              + (f" ({w['error']})" if w["error"] else "")
              + f", imm {w['imm']}, payload bytes copied by this CPU {w['payload_bytes_copied']}"
              + (f", verified {w['verified']}" if args.seed is not None else ""))
    if out["released"]:
        print(f"{args.path}: stopped: {out['released']}")


def _parse_sizes(text: str, parse_size) -> list[int]:
    """``4K,64K,16M`` -> bytes each (``parse_size`` is the command line's, which raises
    argparse.ArgumentTypeError on a bad one)."""
    import argparse
    try:
        sizes = [parse_size(s) for s in text.split(",") if s]
    except (ValueError, argparse.ArgumentTypeError) as err:
        raise VfioError(f"--sizes {text!r}: {err}", "pass sizes like 4K,64K,16M") from None
    if not sizes:
        raise VfioError(f"--sizes {text!r}", "pass sizes like 4K,64K,16M")
    return sizes


def cmd_rdma_write(args) -> int:
    from ..nic.rdma import RdmaError, pattern
    from ..nic.release import GpuReleased
    sizes = _parse_sizes(args.sizes, args.parse_size)
    if args.path != "tcp" and (args.to is None or args.key is None):
        raise VfioError(f"--path {args.path} without --to and --key", "pass the peer NIC's MAC (--to, from "
                        "rdma-recv's ready file) and its region's key (--key)")
    side = _side(args)
    out = {"path": args.path, **side.describe(), "region": [args.vram_offset, args.length], "writes": []}
    try:
        region = side.register(args.vram_offset, args.length, remote=False)
        side.gpu.vram.write(args.vram_offset, pattern(args.seed, 0, args.length))   # set-up: not timed
        for i, size in enumerate(sizes):
            before = side.copied()
            entry = {"size": size, "offset": args.offset}
            try:
                entry.update(side.write(region, args.offset, size, args.key, args.imm + i, args))
                entry.update({"status": "OK", "error": None, "mb_s": size / entry["seconds"] / 1e6,
                              "frames_s": (entry["frames"] or 0) / entry["seconds"],
                              "cpu_s_per_gb": entry["cpu_seconds"] / (size / 1e9)})
            except (RdmaError, GpuReleased) as err:
                entry.update({"status": _failure(err), "error": str(err)})
            entry.update({k: v - before[k] for k, v in side.copied().items()})
            out["writes"].append(entry)
            if entry["status"] in ("GPU_RELEASED", "PEER_LOST"):
                break                   # no later write can go: the GPU or the peer is gone
        out["stats"] = side.session.nic.stats() if args.path != "tcp" else {}
    finally:
        out.update(side.close())
    _print_write(args, out)
    return 0 if all(w["status"] == "OK" for w in out["writes"]) else 1


def _print_write(args, out: dict) -> None:
    if args.json:
        print(json.dumps(out))
        return
    for w in out["writes"]:
        if w["error"]:
            how = "refused" if w["status"] == "REFUSED" else f"failed ({w['status']})"
            print(f"{args.path}: write of {w['size']} bytes at {w['offset']:#x} {how}: {w['error']}")
        else:
            print(f"{args.path}: {w['size']} bytes at {w['offset']:#x} in {w['seconds']:.3f} s, "
                  f"{w['mb_s']:.1f} MB/s, imm {w['imm']}, payload bytes copied by this CPU {w['payload_bytes_copied']}")


def add_parsers(nic, parse_size, common, mac_arg) -> None:
    p = nic.add_parser("rdma-recv", help="register VRAM and place the peer's RDMA-shaped writes there")
    common(p)
    _path_and_region(p, parse_size)
    p.add_argument("--writes", type=int, default=1, help="writes to serve")
    p.add_argument("--seed", type=int, help="check each landed range against the seeded pattern")
    p.add_argument("--free-after", type=int, metavar="K", help="free the region after K writes")
    p.add_argument("--reregister", action="store_true", help="with --free-after: register the range again")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S", help="seconds to wait for each write")
    p.add_argument("--ready-file", metavar="PATH", help="written (JSON: key, mac) once the region is registered")
    p.set_defaults(func=cmd_rdma_recv)
    p = nic.add_parser("rdma-write", help="write ranges of this host's VRAM into the peer's registered VRAM")
    common(p)
    _path_and_region(p, parse_size)
    p.add_argument("--to", type=mac_arg, metavar="MAC", help="the peer NIC's MAC (rdma-recv's ready file)")
    p.add_argument("--key", type=integer, help="the peer region's key (rdma-recv's ready file)")
    p.add_argument("--peer", default="169.254.0.2", help="--path tcp: the peer's link address")
    p.add_argument("--sizes", default="16M", help="one write per size, in order (4K,64K,16M)")
    p.add_argument("--offset", type=integer, default=0, help="the offset in both regions")
    p.add_argument("--seed", type=int, default=1, help="the pattern this side's region is filled with")
    p.add_argument("--imm", type=integer, default=0, help="the first write's immediate (then +1 each)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds the peer may stay silent")
    p.set_defaults(func=cmd_rdma_write, parse_size=parse_size)


def _path_and_region(p, parse_size) -> None:
    p.add_argument("--path", choices=PATHS, default="zero-copy")
    p.add_argument("--gpu", metavar="BDF", default="only", help="the GPU (default: the VM's only one)")
    p.add_argument("--vram-offset", type=integer, default=0)
    p.add_argument("--length", type=parse_size, default=16 << 20, help="the region's bytes (whole pages)")



def integer(text: str) -> int:
    """``--key 0x100``, ``--offset 4096``: decimal or 0x hex."""
    return int(text, 0)
