"""Seeded fuzzer for the fabric manager's control protocol: a hostile client, many requests.

    python -m vfio_cxl.bench fm-fuzz [--requests 10000] [--seed S] [--lab [NAME]] [--json]

Without ``--lab``, starts a fabric manager over the FAKE lab of tests/fast/fm_fake_lab.py (``--fabric
--auto-release``: sleeping processes for VMs and servers, the FM's real guest scripts on a
fake sysfs), in a private cache and run directory, and sends it ``--requests`` lines drawn
from ``random.Random(seed)``: well-formed requests of every op (GPU moves included), the same
with a field of the wrong type, unknown fields and ops, other versions, nesting past the
parser's depth, invalid UTF-8, random bytes, long strings, lines split across writes and
several lines in one write.  Now and then a connection is dropped mid-line or mid-op, or a
line over the 1 MiB limit is sent (the FM answers and closes that connection).

With ``--lab NAME`` (or ``--lab``: the only lab running) it fuzzes the FM of that running lab instead (``vfio-cxl vm up T
--detach``; it neither starts nor stops it), with that lab's VM and GPU names: the GPU ops
it sends act on the real lab (a move it asks for happens).  When the requests are sent, every
VM must still be running and answer ``vfio-cxl vm ssh --lab NAME VM -- true``.

Invariants, checked as it goes:

* the FM process never dies;
* every line that is a line (ends in ``\\n``, at most 1 MiB) gets exactly one answer, in
  order, each a protocol message (``ok`` true or false; a refusal has a ``what`` and a ``fix``);
  a well-formed request of a fast op is answered ``ok``;
* the FM's resident memory stays within ``--rss-limit-mib`` of what it was after start.

The exit status is 1 if one broke, and the command that replays the run is printed (the same
sequence of requests; the fake lab's timing may still differ).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..lab.fm import protocol
from ..paths import REPO_ROOT

FAKE_LAB = REPO_ROOT / "tests" / "fast" / "fm_fake_lab.py"
MAX_LINE = 1 << 20
FAKE_VMS, FAKE_GPUS = ("a", "b"), ("gpu0", "gpu1")
FAST_OPS = ("hello", "status", "events", "ssh_info")
REAL_LAB_ANSWER_S = 2 * protocol.op_timeout("assign", {}) + 60   # longest wait for one answer (--lab)


class Violation(Exception):
    pass


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise Violation(f"no VmRSS for pid {pid}")


class Fuzzer:
    def __init__(self, seed: int, requests: int, rss_limit_mib: int, workdir: Path, lab: str | None = None):
        self.rng = random.Random(seed)
        self.lab = lab   # a running lab's name, or None: the fake lab, started here
        self.record = None
        self.vms, self.gpus = FAKE_VMS, FAKE_GPUS
        self.ssh_checked: dict[str, float] = {}   # VM -> seconds its `vm ssh -- true` took after the run
        self.requests, self.rss_limit = requests, rss_limit_mib << 10
        self.workdir = workdir
        self.sent = self.answered = self.refused = self.reconnects = self.slow_ops = 0
        self.kinds: dict[str, int] = {}
        self.rss_start = self.rss_max = 0
        self.fm: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.reader = None

    # -- the FM ----------------------------------------------------------------------------
    @property
    def fm_pid(self) -> int:
        return self.record.fm_id().pid if self.record else self.fm.pid

    def start(self) -> None:
        if self.lab is not None:
            self.attach_to_lab()
            return
        env = {**os.environ, "VFIO_CXL_CACHE": str(self.workdir / "cache"),
               "VFIO_CXL_RUNDIR": str(self.workdir / "run")}
        (self.workdir / "run").mkdir()
        logdir = self.workdir / "cache" / "logs" / "fuzz-1"
        logdir.mkdir(parents=True)
        self.fm_log = open(logdir / "fm.log", "ab")
        self.fm = subprocess.Popen([sys.executable, str(FAKE_LAB), "fuzz-1", str(logdir), "--fabric",
                                    "--auto-release"], stdout=subprocess.PIPE, stderr=self.fm_log, text=True,
                                   cwd=REPO_ROOT, env=env, start_new_session=True)
        for line in self.fm.stdout:
            if line.startswith("ready: "):
                self.socket_path = json.loads(line[len("ready: "):])["socket"]
                break
        else:
            raise Violation(f"the fake FM did not start; see {logdir / 'fm.log'}")
        self.rss_start = self.rss_max = rss_kib(self.fm.pid)

    def attach_to_lab(self) -> None:
        from ..errors import LabError
        from ..lab.fm import registry

        try:
            self.record = registry.find(self.lab or None)
        except LabError as err:
            raise Violation(f"{err} ({err.fix})") from None
        self.lab = self.record.name
        if not self.record.fm_alive():
            raise Violation(f"lab {self.lab}'s fabric manager is not running (see vfio-cxl vm ls)")
        self.socket_path = str(self.record.socket)
        self.rss_start = self.rss_max = rss_kib(self.fm_pid)
        status = self.lab_status()
        self.vms, self.gpus = tuple(status["vms"]) or FAKE_VMS, tuple(status["gpus"]) or FAKE_GPUS

    def lab_status(self) -> dict:
        self.connect()
        try:
            self.sock.sendall(b'{"version": 1, "op": "status"}\n')
            status = self.answer("status")
        finally:
            self.disconnect()
        if not status["ok"]:
            raise Violation(f"status refused: {status['error']}")
        return status["result"]

    def check_ssh(self) -> None:
        """Every VM of the lab runs and answers SSH as a user reaches it: ``vm ssh -- true``."""
        status = self.lab_status()
        for vm in self.vms:
            if status["vms"][vm]["state"] != "running":
                raise Violation(f"VM {vm} is {status['vms'][vm]['state']} after the fuzz")
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "vfio_cxl", "vm", "ssh", "--lab", self.lab, vm, "--", "true"],
                                  capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
            if done.returncode != 0:
                raise Violation(f"VM {vm} does not answer SSH after the fuzz (vm ssh exited {done.returncode}: "
                                f"{done.stderr.strip()[-300:]})")
            self.ssh_checked[vm] = round(time.monotonic() - started, 2)

    def stop(self) -> None:
        self.disconnect()
        if self.lab is not None:
            return   # not ours to stop
        if self.fm is not None and self.fm.poll() is None:
            os.killpg(self.fm.pid, signal.SIGTERM)
            try:
                self.fm.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.fm.pid, signal.SIGKILL)
                self.fm.wait()
        if self.fm is not None:
            self.fm.stdout.close()
            self.fm_log.close()

    def check_alive(self) -> None:
        if self.record is not None:
            if not self.record.fm_alive():
                raise Violation(f"lab {self.lab}'s FM died after {self.sent} requests")
            return
        if self.fm.poll() is not None:
            raise Violation(f"the FM died ({self.fm.returncode}) after {self.sent} requests")

    # -- the connection ----------------------------------------------------------------------
    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # A real lab's GPU op may take minutes (protocol.op_timeout: a guest that does not let go
        # or bind), and an answer may queue behind one: slow is not wrong, silence past that is.
        self.sock.settimeout(60 if self.lab is None else REAL_LAB_ANSWER_S)
        self.sock.connect(self.socket_path)
        self.reader = self.sock.makefile("rb")

    def disconnect(self) -> None:
        if self.reader:
            self.reader.close()
        if self.sock:
            self.sock.close()
        self.sock = self.reader = None

    def answer(self, what: str) -> dict:
        line = self.reader.readline(MAX_LINE + 1)
        if not line.endswith(b"\n"):
            self.check_alive()
            raise Violation(f"no answer (got {line[:80]!r}) to {what}")
        message = json.loads(line)
        if "event" in message:
            return self.answer(what)
        if message.get("version") != 1 or not isinstance(message.get("ok"), bool):
            raise Violation(f"answer not in the protocol: {line[:200]!r} to {what}")
        if not message["ok"]:
            error = message.get("error") or {}
            if not error.get("what") or not error.get("fix"):
                raise Violation(f"a refusal without what/fix: {line[:200]!r} to {what}")
        return message

    # -- requests ----------------------------------------------------------------------------
    def valid(self) -> dict:
        r = self.rng
        op = r.choice(FAST_OPS * 12 + ("assign", "release", "restart"))
        fields = {"version": 1, "op": op}
        if op == "events":
            if r.random() < 0.7:
                fields["since"] = r.randrange(-5, 5000)
            if r.random() < 0.5:
                fields["limit"] = r.randrange(1, 1001)
        elif op == "ssh_info":
            fields["vm"] = r.choice(self.vms)
        elif op == "assign":
            fields.update(gpu=r.choice(self.gpus), vm=r.choice(self.vms), keep_vram=r.random() < 0.8)
        elif op == "release":
            fields.update(gpu=r.choice(self.gpus), keep_vram=r.random() < 0.8, timeout=r.choice([0.05, 0.2, 1]))
        elif op == "restart":
            fields["gpu"] = r.choice(self.gpus)
        return fields

    def junk_value(self):
        r = self.rng
        return r.choice([None, True, False, 0, -1, 2 ** 80, 1.5, float("inf") if r.random() < 0.1 else 3.0, "",
                         "x" * r.randrange(1, 5000), "\u0000\ud7ff", [], {}, [[[1]]], {"a": {"b": [1]}},
                         "gpu0", "a", "..", "\n"])

    def line(self) -> tuple[str, bytes, bool]:
        """(kind, bytes without the newline, whether a fast op must be answered ok)."""
        r = self.rng
        kind = r.choices(["valid", "wrong-type", "unknown-field", "unknown-op", "version", "nested",
                          "not-utf8", "random-bytes", "not-object", "long-string", "empty"],
                         weights=[40, 12, 6, 5, 4, 4, 4, 6, 4, 3, 2])[0]
        request = self.valid()
        must_ok = kind == "valid" and request["op"] in FAST_OPS and request.get("since", 0) >= 0
        if kind == "wrong-type":
            field = r.choice([k for k in request if k != "version"] + ["version"])
            request[field] = self.junk_value()
        elif kind == "unknown-field":
            request[r.choice(["verbose", "gpus", "vm ", "", "\u00e9"])] = self.junk_value()
        elif kind == "unknown-op":
            request["op"] = r.choice(["teleport", "", "STATUS", "status\u0000", "op_status", "_shutdown"])
        elif kind == "version":
            request["version"] = r.choice([0, 2, "1", 1.0000001, None])
        if kind in ("valid", "wrong-type", "unknown-field", "unknown-op", "version"):
            try:
                data = json.dumps(request, allow_nan=True).encode()
            except ValueError:
                data = b'{"version": 1, "op": "hello", "x": 1e999}'
        elif kind == "nested":
            depth = r.choice([900, 5000, 100_000])
            data = r.choice([b"[", b'{"a":']) * depth
        elif kind == "not-utf8":
            data = json.dumps(request).encode()[:-1] + b', "x": "\xff\xfe\xc3"}'
        elif kind == "random-bytes":
            data = bytes(r.randrange(256) for _ in range(r.randrange(1, 200))).replace(b"\n", b" ")
        elif kind == "not-object":
            data = r.choice([b"[]", b"1", b'"status"', b"null", b"true", b"1e999"])
        elif kind == "long-string":
            data = json.dumps({"version": 1, "op": "ssh_info", "vm": "v" * r.randrange(10_000, 200_000)}).encode()
        else:
            data = b""
        return kind, data, must_ok

    def send(self, data: bytes) -> None:
        """In one write, or in random pieces."""
        if self.rng.random() < 0.2 and len(data) > 1:
            cuts = sorted(self.rng.sample(range(1, len(data)), min(3, len(data) - 1)))
            for a, b in zip([0, *cuts], [*cuts, len(data)]):
                self.sock.sendall(data[a:b])
        else:
            self.sock.sendall(data)

    def step(self) -> None:
        r = self.rng
        if self.sock is None:
            self.connect()
            self.reconnects += 1
        roll = r.random()
        if roll < 0.01:   # leave mid-line, or mid-op
            if r.random() < 0.5:
                self.sock.sendall(b'{"version": 1, "op": "sta')
            else:
                self.sock.sendall(json.dumps({"version": 1, "op": "restart", "gpu": r.choice(self.gpus)}).encode() + b"\n")
            self.kinds["disconnect"] = self.kinds.get("disconnect", 0) + 1
            self.sent += 1
            self.disconnect()
            return
        if roll < 0.012:   # over the limit: one refusal, then the FM closes the connection
            self.sock.sendall(b"x" * (MAX_LINE + 10) + b"\n")
            answer = self.answer("an over-long line")
            if answer["ok"] or "without a newline" not in answer["error"]["what"]:
                raise Violation(f"over-long line answered {answer}")
            self.kinds["over-long"] = self.kinds.get("over-long", 0) + 1
            self.sent += 1
            self.answered += 1
            self.disconnect()
            return
        batch = [self.line() for _ in range(r.choice([1, 1, 1, 2, 5]))]   # pipelined
        self.send(b"".join(data + b"\n" for _, data, _ in batch))
        for kind, data, must_ok in batch:
            self.sent += 1
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            answer = self.answer(f"{kind} request {data[:120]!r}")
            self.answered += 1
            self.refused += not answer["ok"]
            if must_ok and not answer["ok"]:
                raise Violation(f"a well-formed {kind} request {data[:200]!r} was refused: {answer['error']}")
            if kind == "valid" and json.loads(data)["op"] in ("assign", "release", "restart"):
                self.slow_ops += 1

    def run(self) -> None:
        self.start()
        while self.sent < self.requests:
            self.step()
            if self.sent % 250 < 5:
                self.check_alive()
                self.rss_max = max(self.rss_max, rss_kib(self.fm_pid))
                if self.rss_max - self.rss_start > self.rss_limit:
                    raise Violation(f"the FM's RSS grew from {self.rss_start >> 10} to {self.rss_max >> 10} MiB")
        self.disconnect()
        self.connect()   # the FM still answers, and its lab is as it was
        self.sock.sendall(b'{"version": 1, "op": "status"}\n')
        status = self.answer("the last status")
        if not status["ok"] or status["result"]["state"] != "running":
            raise Violation(f"the lab is not running after the fuzz: {status}")
        self.disconnect()
        if self.lab is not None:
            self.check_ssh()
        self.rss_max = max(self.rss_max, rss_kib(self.fm_pid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench fm-fuzz",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="how many request lines (default 10000)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--rss-limit-mib", type=int, default=64,
                        help="how much the FM's RSS may grow over the run (default 64 MiB)")
    parser.add_argument("--lab", nargs="?", const="", metavar="NAME",
                        help="fuzz this running lab's FM (vfio-cxl vm up T --detach; no NAME: the only one "
                             "running), then check that its VMs answer SSH; default: a fake lab of its own")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    replay = f"scripts/bench fm-fuzz --requests {args.requests} --seed {seed}" + (f" --lab {args.lab}".rstrip() if args.lab is not None else "")
    if not args.json:
        print(f"fm-fuzz: seed {seed}, {args.requests} requests, "
              + (f"lab {args.lab or '(the only one running)'}" if args.lab is not None else "fake lab"), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="fmf-", dir="/tmp"))   # short: socket paths
    fuzzer = Fuzzer(seed, args.requests, args.rss_limit_mib, workdir, lab=args.lab)
    started = time.monotonic()
    violation = None
    try:
        fuzzer.run()
    except (Violation, OSError, ValueError) as err:
        violation = f"{type(err).__name__}: {err}" if not isinstance(err, Violation) else str(err)
    finally:
        fuzzer.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.monotonic() - started
    result = {"seed": seed, "requests": fuzzer.sent, "answered": fuzzer.answered, "refused": fuzzer.refused,
              "slow_ops": fuzzer.slow_ops, "connections": fuzzer.reconnects, "kinds": fuzzer.kinds,
              "seconds": round(elapsed, 1), "requests_per_second": round(fuzzer.sent / elapsed) if elapsed else 0,
              "rss_start_mib": round(fuzzer.rss_start / 1024, 1), "rss_max_mib": round(fuzzer.rss_max / 1024, 1),
              "rss_limit_mib": args.rss_limit_mib, "lab": fuzzer.lab, "ssh_after_s": fuzzer.ssh_checked,
              "violation": violation, "replay": replay}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"  {fuzzer.sent} requests ({result['requests_per_second']}/s) on {fuzzer.reconnects} connections: "
              f"{fuzzer.answered} answered, {fuzzer.refused} refused, {fuzzer.slow_ops} GPU ops")
        print("  kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(fuzzer.kinds.items())))
        print(f"  FM RSS {result['rss_start_mib']} MiB at start, at most {result['rss_max_mib']} MiB "
              f"(limit: start + {args.rss_limit_mib} MiB)")
        if fuzzer.ssh_checked:
            print("  after the fuzz, vm ssh -- true: " + ", ".join(f"{vm} {s} s" for vm, s in fuzzer.ssh_checked.items()))
    if violation:
        print(f"fm-fuzz: FAILED: {violation}\nreplay with: {replay}", file=sys.stderr)
        return 1
    if not args.json:
        print("fm-fuzz: the FM stayed up and answered every line"
              + (f", and every VM of lab {fuzzer.lab} answers SSH" if args.lab is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
