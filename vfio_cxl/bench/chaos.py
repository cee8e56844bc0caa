"""Chaos harness for the GPU's vfio-user socket: a misbehaving client, for a while.

    python -m vfio_cxl.bench chaos [--seconds 60] [--seed S] [--json]

Starts the server the way the lab does (``vfio-cxl gpu serve --socket PATH``,
a child process, with ``--local-dma-faults``: the harness holds it to the
spec's rule that DMA names only live DMA_MAP windows) and plays a client that does everything a buggy, hostile or
crashing QEMU could: random valid and invalid message sequences, messages
sent in random pieces (short writes) and replies read a few bytes at a time
(short reads), disconnects in the middle of a message or of a DMA transfer,
memfds truncated after DMA_MAP, device resets and halts in the middle of
transfers, doorbells over descriptors that DMA to mapped, unmapped and
half-mapped IOVAs.  Random choices come from ``random.Random(seed)``; the seed
is printed, and a failing run prints the command that replays it (the same
sequence of actions; outcomes that hinge on thread timing in the server may
still differ from run to run).

Invariants, checked after every action:

* the server process never dies, and every session starts with a fresh
  client whose VERSION handshake succeeds;
* the server never writes outside a live DMA mapping: the guard pages of every
  client memfd stay intact, a direct window does not change after its
  DMA_UNMAP reply (or, once the next client is being served, after its
  client left), and no DMA_READ / DMA_WRITE names an IOVA that is not mapped
  or exceeds the client's max_data_xfer_size;
* no descriptor completes after a reset was acknowledged (the completion
  area and every data window stay as they were, no DMA request arrives) and
  at most the one in flight completes after a halt was acknowledged;
* replies match their requests and No_reply commands get none.

Throughput (messages/s) is printed so a long run can be sized.  The exit
status is 1 if any invariant broke.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time

from . import gpu_doc as gpu
from . import vfio_user_spec as vu

RING_IOVA = 0x1000_0000
COMPL_IOVA = 0x1010_0000
RING_ENTRIES = 128
SLOT_BASE = 0x2000_0000
SLOT_STRIDE = 0x100_0000
SLOTS = 12
VRAM_MIB = 16
VRAM = VRAM_MIB << 20
REPLY_TIMEOUT = 5.0


class Violation(Exception):
    pass


class Stats:
    def __init__(self):
        self.sessions = 0
        self.messages = 0
        self.dma_requests = 0
        self.disconnects = 0  # abrupt ones (mid-message, mid-transfer)
        self.resets = 0
        self.halts = 0
        self.truncations = 0
        self.descriptors = 0
        self.server_restarts = 0
        self.unsealed_refused = 0
        self.violations: list[str] = []


class Session:
    """One client connection and everything it mapped."""

    def __init__(self, h: "Harness"):
        self.h = h
        self.rng = h.rng
        self.peer = vu.Peer(h.server.socket_path, timeout=REPLY_TIMEOUT)
        self.live: dict[int, vu.Window] = {}  # slot iova -> mapped window
        self.retired: list[tuple[vu.Window, bytes]] = []  # unmapped direct windows + snapshot
        self.all_windows: list[vu.Window] = []
        self.ring: vu.Window | None = None
        self.compl: vu.Window | None = None
        self.efds: list[int] = []
        self.tail = 0
        self.frozen: tuple[bytes, int, str] | None = None  # compl snapshot, changes allowed, why
        self.frozen_data: list[tuple[vu.Window, bytes]] = []

    # ------------------------------------------------------------ helpers
    def request(self, command, payload=b"", **kw) -> vu.Msg:
        return self.peer.request(command, payload, **kw)

    def window(self, iova, size, direct, sealed=True) -> vu.Window:
        w = vu.Window(iova, size, direct=direct, name="chaos", sealed=sealed)
        w.write(iova, bytes([vu.FILL]) * size)
        self.all_windows.append(w)
        return w

    def start(self) -> None:
        caps = {"max_msg_fds": self.rng.choice([1, 4, 8, 16])}
        xfer = self.rng.choice([None, 1024, 4096, 65536, 1 << 20, 4 << 20])
        if xfer is not None:
            caps["max_data_xfer_size"] = xfer
        if self.rng.random() < 0.2:
            self.peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            self.peer.read_chunk = self.rng.choice([7, 100, 4096])
        reply = self.peer.handshake(caps)
        if reply.is_error:
            raise Violation(f"a fresh client's VERSION was refused: {reply!r}")
        if xfer is None:
            self.peer.max_data_xfer = vu.DEFAULT_MAX_DATA_XFER

    # ------------------------------------------------------------ invariants
    def check(self) -> None:
        h = self.h
        if not h.server.alive():
            raise Violation(f"the server died (exit status {h.server.exit_status()}): "
                            f"{h.server.stderr_tail(800)}")
        for w in self.all_windows + [w for w, _ in h.orphans]:
            if not w.truncated and not w.canaries_intact():
                h.violation(f"guard page of window {w.iova:#x} written")
                w.truncated = True  # report once
        for w, snap in self.retired + h.orphans:
            if not w.truncated and w.body() != snap:
                h.violation(f"window {w.iova:#x} written after it was unmapped")
                w.truncated = True
        if self.frozen and self.compl is not None:
            snap, allowed, why = self.frozen
            now = self.compl.body()
            changed = sum(1 for i in range(0, len(snap), gpu.COMPL_SIZE)
                          if now[i:i + gpu.COMPL_SIZE] != snap[i:i + gpu.COMPL_SIZE])
            if changed > allowed:
                h.violation(f"{changed} completion records written after {why} was "
                            f"acknowledged (allowed {allowed})")
                self.frozen = (now, allowed, why)
        for w, snap in self.frozen_data:
            if not w.truncated and w.body() != snap:
                h.violation(f"window {w.iova:#x} written after a reset was acknowledged")
                w.truncated = True
        if self.peer.violations:
            for v in self.peer.violations:
                h.violation(v)
            self.peer.violations.clear()

    def freeze(self, why: str, allowed: int) -> None:
        if self.compl is not None:
            self.frozen = (self.compl.body(), allowed, why)
        if allowed == 0:  # reset: nothing at all may move any more
            self.frozen_data = [(w, w.body()) for w in self.live.values()
                                if not w.truncated and w not in (self.ring, self.compl)]
            self.peer.dma_forbidden = f"after {why} was acknowledged"

    def thaw(self) -> None:
        self.check()
        self.frozen = None
        self.frozen_data = []
        self.peer.dma_forbidden = None

    # ------------------------------------------------------------ actions
    def act(self) -> None:
        actions = [
            (8, self.a_registers), (6, self.a_map), (4, self.a_unmap), (2, self.a_unmap_bad),
            (6, self.a_ring), (14, self.a_submit), (8, self.a_serve), (3, self.a_reset),
            (3, self.a_halt), (2, self.a_set_irqs), (5, self.a_invalid), (2, self.a_short_write),
            (1, self.a_truncate), (1, self.a_info),
        ]
        weights = [w for w, _ in actions]
        self.rng.choices([a for _, a in actions], weights)[0]()
        self.check()

    def a_registers(self) -> None:
        p = self.peer
        off = self.rng.choice([gpu.SCRATCH, gpu.ID, gpu.STATUS, gpu.RING_HEAD, gpu.COMPLETED,
                               gpu.ERR_STATUS, gpu.INTR_STATUS, self.rng.randrange(0, 4096, 4)])
        if self.rng.random() < 0.5:
            p.read32(off)
        elif off in (gpu.SCRATCH, gpu.INTR_STATUS):
            p.write32(off, self.rng.getrandbits(32), posted=self.rng.random() < 0.5)
        else:
            p.region_read(gpu.BAR_VRAM, self.rng.randrange(0, VRAM - 4096), self.rng.choice([4, 4096]))

    def a_info(self) -> None:
        self.request(vu.DEVICE_GET_INFO, vu.DEVICE_INFO.pack(16, 0, 0, 0))
        r = self.request(vu.DEVICE_GET_REGION_INFO,
                         vu.REGION_INFO.pack(256, 0, self.rng.randrange(10), 0, 0, 0))
        r.close_fds()
        self.request(vu.DEVICE_GET_IRQ_INFO, vu.IRQ_INFO.pack(16, 0, self.rng.randrange(6), 0))

    def a_map(self) -> None:
        slot = SLOT_BASE + self.rng.randrange(SLOTS) * SLOT_STRIDE
        if slot in self.live and self.rng.random() < 0.7:
            return
        size = self.rng.choice([1, 2, 16, 64, 256]) * vu.PAGE
        direct = self.rng.random() < 0.5
        sealed = not direct or self.rng.random() < 0.6
        w = self.window(slot, size, direct, sealed)
        reply = self.peer.dma_map(w)
        if reply.is_error:
            if slot not in self.live and sealed:
                self.h.violation(f"DMA_MAP of free window {slot:#x}+{size:#x} refused: {reply!r}")
            elif not sealed:
                self.h.stats.unsealed_refused += 1  # a server may insist on F_SEAL_SHRINK
        else:
            if slot in self.live:
                self.h.violation(f"DMA_MAP over the live window {slot:#x} accepted (no EEXIST)")
                self.retire(self.live.pop(slot))
            self.live[slot] = w

    def retire(self, w: vu.Window) -> None:
        w.mapped = False
        if w.direct and not w.truncated:
            self.retired.append((w, w.body()))

    def a_unmap(self) -> None:
        if not self.live:
            return
        if self.rng.random() < 0.1:
            reply = self.peer.dma_unmap(0, 0, flags=vu.DMA_UNMAP_FLAG_ALL)
            if reply.is_error:
                self.h.violation(f"DMA_UNMAP FLAG_ALL refused: {reply!r}")
            for w in self.live.values():
                self.retire(w)
            self.live.clear()
            self.ring = self.compl = None
            return
        slot = self.rng.choice(list(self.live))
        w = self.live[slot]
        reply = self.peer.dma_unmap(w.iova, w.size)
        if reply.is_error:
            self.h.violation(f"exact DMA_UNMAP of {w.iova:#x}+{w.size:#x} refused: {reply!r}")
            return
        self.retire(self.live.pop(slot))
        if w is self.ring:
            self.ring = None
        if w is self.compl:
            self.compl = None
            self.frozen = None

    def a_unmap_bad(self) -> None:
        """Unmaps the spec refuses: half a window, FLAG_ALL with an address."""
        if not self.live:
            return
        w = self.rng.choice(list(self.live.values()))
        if self.rng.random() < 0.5 and w.size > vu.PAGE:
            reply = self.peer.dma_unmap(w.iova, w.size // 2, keep_exported=True)
        else:
            reply = self.peer.dma_unmap(w.iova, w.size, flags=vu.DMA_UNMAP_FLAG_ALL,
                                        keep_exported=True)
        if not reply.is_error:
            self.h.violation(f"malformed DMA_UNMAP of {w.iova:#x} accepted")
            # what the server kept is unknown now: start over from "nothing mapped"
            self.peer.dma_unmap(0, 0, flags=vu.DMA_UNMAP_FLAG_ALL)
            for x in list(self.live.values()):
                self.retire(x)
            self.live.clear()
            self.ring = self.compl = None
            self.frozen = None

    def a_ring(self) -> None:
        """(Re)program and enable the ring, mapping its areas if needed."""
        p = self.peer
        for attr, iova in (("ring", RING_IOVA), ("compl", COMPL_IOVA)):
            if getattr(self, attr) is None:
                if iova in self.live:
                    return
                w = self.window(iova, RING_ENTRIES * 32, direct=self.rng.random() < 0.7)
                reply = p.dma_map(w)
                if reply.is_error:
                    return
                self.live[iova] = w
                setattr(self, attr, w)
        self.compl.write(COMPL_IOVA, bytes(self.compl.size))
        if not self.efds:
            self.efds = [vu.new_eventfd() for _ in range(gpu.MSIX_VECTORS)]
            p.set_irqs(vu.PCI_MSIX_IRQ, 0, gpu.MSIX_VECTORS,
                       vu.IRQ_SET_DATA_EVENTFD | vu.IRQ_SET_ACTION_TRIGGER, fds=self.efds)
        # a known starting point: reset (HEAD 0), then memory space + bus master on
        p.write32(gpu.CONTROL, gpu.CONTROL_RESET)
        self.h.stats.resets += 1
        self.freeze("CONTROL.RESET", 0)
        p.region_write(vu.PCI_CONFIG_REGION, 4, (0x0006).to_bytes(2, "little"))
        self.thaw()
        p.write32(gpu.RING_BASE_LO, RING_IOVA)
        p.write32(gpu.RING_BASE_HI, 0)
        p.write32(gpu.RING_SIZE, RING_ENTRIES)
        p.write32(gpu.COMPL_BASE_LO, COMPL_IOVA)
        p.write32(gpu.COMPL_BASE_HI, 0)
        self.tail = 0
        p.write32(gpu.CONTROL, gpu.CONTROL_ENABLE)

    def target(self, length: int) -> int:
        """An IOVA for a descriptor: mostly inside a live window, sometimes not."""
        r = self.rng.random()
        data = [w for w in self.live.values() if w not in (self.ring, self.compl)]
        if data and r < 0.75:
            w = self.rng.choice(data)
            return w.iova + self.rng.randrange(0, max(1, w.size - length + 1))
        if data and r < 0.85:
            w = self.rng.choice(data)
            return w.end - self.rng.randrange(1, max(2, min(length, w.size) + 1))  # runs off the end
        if self.retired and r < 0.93:
            return self.rng.choice(self.retired)[0].iova
        return self.rng.choice([0x5000_0000, 0, 2 ** 64 - vu.PAGE, SLOT_BASE - vu.PAGE])

    def a_submit(self) -> None:
        if self.ring is None or self.compl is None or self.frozen:
            return
        descs = []
        for _ in range(self.rng.randrange(1, 12)):
            op = self.rng.choices([gpu.OP_NOP, gpu.OP_FILL_PATTERN, gpu.OP_VRAM_TO_HOST,
                                   gpu.OP_HOST_TO_VRAM, gpu.OP_FILL_PRNG, 0x42],
                                  [2, 2, 6, 5, 1, 0.3])[0]
            length = self.rng.choice([0, 1, 64, 4096, 65536, 300_000, 1 << 20])
            vram = self.rng.randrange(0, VRAM - length + 1) if self.rng.random() < 0.97 else VRAM
            flags = gpu.DESC_FLAG_INTERRUPT if self.rng.random() < 0.5 else 0
            if op == gpu.OP_VRAM_TO_HOST:
                src, dst = vram, self.target(length)
            elif op == gpu.OP_HOST_TO_VRAM:
                src, dst = self.target(length), vram
            else:
                src, dst = self.rng.getrandbits(64), vram
            descs.append(gpu.descriptor(op, src, dst, length, flags, self.rng.getrandbits(64)))
        for d in descs[:RING_ENTRIES - 1]:
            self.ring.write(RING_IOVA + self.tail * gpu.DESC_SIZE, d)
            self.tail = (self.tail + 1) % RING_ENTRIES
        self.h.stats.descriptors += len(descs)
        self.peer.write32(gpu.RING_TAIL, self.tail, posted=self.rng.random() < 0.8)

    def a_serve(self) -> None:
        """Answer the server's DMA requests for a moment (transfers need it)."""
        fds = self.efds
        try:
            self.peer.pump(lambda: False, self.rng.choice([0.002, 0.01, 0.05]), poll_fds=fds)
        except vu.PeerTimeout:
            pass
        for fd in fds:
            vu.eventfd_take(fd)

    def a_reset(self) -> None:
        """CONTROL.RESET or DEVICE_RESET, often while a transfer is in flight."""
        if self.rng.random() < 0.5:
            self.a_submit()
        held = None
        if self.rng.random() < 0.5:  # catch the engine inside a DMA request first
            try:
                msg = self.peer.recv(0.05)
                if msg.type == vu.TYPE_COMMAND and msg.command in (vu.DMA_READ, vu.DMA_WRITE):
                    held = msg
                else:
                    self.peer.unsolicited.append(msg)
                    self.h.violation(f"unexpected message from the server: {msg!r}")
            except vu.PeerTimeout:
                pass
        how = self.rng.choice(["CONTROL.RESET", "DEVICE_RESET"])
        if how == "CONTROL.RESET":
            msg_id = self.peer.send(vu.REGION_WRITE, vu.REGION_RW.pack(gpu.CONTROL, 0, 4)
                                    + gpu.CONTROL_RESET.to_bytes(4, "little"))
        else:
            msg_id = self.peer.send(vu.DEVICE_RESET)
        if held is not None:
            self.h.stats.dma_requests += 1
            self.peer.serve_dma(held)  # answered after the reset request, before its reply
        reply = self.peer.next_reply()
        if reply.msg_id != msg_id or reply.is_error:
            self.h.violation(f"{how} not acknowledged properly: {reply!r}")
        self.h.stats.resets += 1
        self.freeze(how, 0)

    def a_halt(self) -> None:
        """Clear ENABLE or write a bad doorbell, mid-batch."""
        if self.ring is None or self.frozen:
            return
        self.a_submit()
        if self.rng.random() < 0.5:
            self.peer.write32(gpu.CONTROL, 0)
            why = "clearing ENABLE"
        else:
            self.peer.write32(gpu.RING_TAIL, RING_ENTRIES + self.rng.randrange(1000))
            why = "a BAD_TAIL halt"
        self.h.stats.halts += 1
        self.freeze(why, 1)

    def a_set_irqs(self) -> None:
        flags = self.rng.choice([
            vu.IRQ_SET_DATA_NONE | vu.IRQ_SET_ACTION_TRIGGER,
            vu.IRQ_SET_DATA_BOOL | vu.IRQ_SET_ACTION_TRIGGER,
            vu.IRQ_SET_DATA_EVENTFD | vu.IRQ_SET_ACTION_TRIGGER,
            vu.IRQ_SET_DATA_NONE | vu.IRQ_SET_DATA_BOOL | vu.IRQ_SET_ACTION_MASK,
            self.rng.getrandbits(32)])
        start, count = self.rng.randrange(6), self.rng.randrange(6)
        data = bytes(self.rng.getrandbits(1) for _ in range(count)) \
            if flags & vu.IRQ_SET_DATA_BOOL else b""
        fds = []
        if flags & vu.IRQ_SET_DATA_EVENTFD and self.rng.random() < 0.5:
            fds = [vu.new_eventfd() for _ in range(self.rng.randrange(1, 5))]
        try:
            self.peer.set_irqs(self.rng.randrange(6), start, count, flags, data, fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        if flags & vu.IRQ_SET_DATA_EVENTFD:
            for fd in self.efds:
                os.close(fd)
            self.efds = []  # possibly replaced; the next a_ring sets them again

    def a_invalid(self) -> None:
        """A malformed or unsupported command; the connection must stay in step."""
        r = self.rng.random()
        command = self.rng.choice(list(vu.CLIENT_COMMANDS) + [0, 11, 12, 14, 77, 0xFFFF])
        if command == vu.VERSION:  # a second VERSION may legitimately end the connection
            command = vu.DEVICE_GET_INFO
        payload = bytes(self.rng.getrandbits(8) for _ in range(self.rng.choice([0, 3, 8, 24, 40])))
        flags = vu.FLAG_NO_REPLY if r < 0.2 else 0
        if command in (vu.DMA_MAP, vu.DMA_UNMAP, vu.DEVICE_RESET):
            command = vu.DEVICE_FEATURE  # random maps/unmaps/resets would blur the invariants
        if command == vu.REGION_WRITE:
            # a region write with random bytes may hit CONTROL etc.: aim it at SCRATCH
            payload = vu.REGION_RW.pack(gpu.SCRATCH, 0, 4) + payload[:4].ljust(4, b"\0")
        self.peer.send(command, payload, flags=flags)
        if flags & vu.FLAG_NO_REPLY:
            self.peer.read32(gpu.ID)  # the next reply must be this one's
            return
        reply = self.peer.next_reply()
        if reply.is_error and reply.size != vu.HEADER_SIZE:
            self.h.violation(f"error reply with a payload: {reply!r}")
        reply.close_fds()

    def a_short_write(self) -> None:
        body = vu.REGION_RW.pack(gpu.SCRATCH, 0, 4) + self.rng.getrandbits(32).to_bytes(4, "little")
        raw = vu.header(self.peer.next_id(), vu.REGION_WRITE, len(body)) + body
        cuts = [self.rng.randrange(1, 8) for _ in range(6)]
        self.peer.send_bytes(raw, pieces=cuts)
        self.peer.next_reply()

    def a_truncate(self) -> None:
        direct = [w for w in self.live.values() if w.direct and not w.truncated
                  and not w.sealed and w not in (self.ring, self.compl)]
        if not direct:
            return
        w = self.rng.choice(direct)
        w.truncated = True
        os.ftruncate(w.fd, self.rng.choice([0, vu.PAGE]))
        self.h.stats.truncations += 1

    # ------------------------------------------------------------ endings
    def end(self) -> None:
        """Leave: politely, mid-message, or with DMA requests unanswered."""
        r = self.rng.random()
        if r < 0.3:
            body = vu.REGION_RW.pack(gpu.SCRATCH, 0, 4) + b"\1\2\3\4"
            raw = vu.header(1, vu.REGION_WRITE, len(body)) + body
            try:
                self.peer.send_bytes(raw[:self.rng.randrange(1, len(raw))])
            except vu.PeerClosed:
                pass
            self.h.stats.disconnects += 1
        elif r < 0.5:
            self.a_submit()
            self.h.stats.disconnects += 1
        self.close()

    def close(self) -> None:
        self.h.stats.messages += self.peer.sent
        self.h.stats.dma_requests += len(self.peer.dma_log)
        for v in self.peer.violations:
            self.h.violation(v)
        self.peer.violations.clear()
        self.peer.close(keep_windows=True)
        for fd in self.efds:
            os.close(fd)
        self.efds = []


class Harness:
    def __init__(self, seed: int, seconds: float, workdir: str):
        self.seed = seed
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.stats = Stats()
        # spec-strict: no DMA message outside a live DMA_MAP, so no unmapped-DMA fault reports
        self.server = vu.ServerProcess(os.path.join(workdir, "gpu.sock"), vram_mib=VRAM_MIB,
                                       extra=("--local-dma-faults",))
        self.orphans: list[tuple[vu.Window, bytes]] = []  # the last client's windows, frozen
        self.carry: list[vu.Window] = []  # windows of the session that just ended

    def violation(self, what: str) -> None:
        if len(self.stats.violations) < 1000:
            self.stats.violations.append(what)

    def run(self) -> Stats:
        self.server.start()
        deadline = time.monotonic() + self.seconds
        try:
            while time.monotonic() < deadline:
                self.session(deadline)
        finally:
            for w in self.carry:
                w.close()
            self.server.stop()
        return self.stats

    def session(self, deadline: float) -> None:
        self.stats.sessions += 1
        previous, self.carry = self.carry, []
        s = None
        try:
            s = Session(self)
            s.start()
            # the previous client is gone and this one is served: its windows are frozen now
            self.orphans = [(w, w.body()) for w in previous if not w.truncated]
            for _ in range(self.rng.randrange(5, 120)):
                if time.monotonic() > deadline:
                    break
                s.act()
            s.check()
            s.end()
        except Violation as v:
            self.violation(str(v))
        except (AssertionError, ValueError) as exc:
            self.violation(f"a valid request failed: {exc}")
        except vu.PeerClosed as exc:
            if not self.dying():
                self.violation(f"the server closed a connection that did nothing wrong: {exc}")
        except vu.PeerTimeout as exc:
            if not self.dying():
                self.violation(f"the server stopped answering: {exc}")
        except OSError as exc:
            if not self.dying():
                self.violation(f"the server is running but a fresh client cannot connect: {exc}")
                self.server.stop()
        finally:
            if s is not None:
                s.close()
                self.carry = s.all_windows
            for w in previous:
                w.close()
            self.orphans = []
            self.restart()

    def dying(self, grace: float = 5.0) -> bool:
        """Whether the server is exiting: a lost connection is often the first sign
        of its death, and the process may take a moment to go."""
        try:
            self.server.proc.wait(grace)
        except subprocess.TimeoutExpired:
            return False
        return True

    def restart(self) -> None:
        """After a violation that killed the server, go on with a new one (counted)."""
        if not self.server.alive():
            self.violation(f"the server died (exit status {self.server.exit_status()})")
            self.server.stop()
            self.server.start()
            self.stats.server_restarts += 1


def group(violations: list[str]) -> dict[str, tuple[int, str]]:
    """Violations by kind (numbers and addresses blanked): kind -> (count, an example)."""
    kinds: dict[str, tuple[int, str]] = {}
    for v in violations:
        kind = re.sub(r"<Msg[^>]*>", "<reply>", v)
        kind = re.sub(r"0x[0-9a-f]+|\b\d+\b", "N", kind)
        n, example = kinds.get(kind, (0, v))
        kinds[kind] = (n + 1, example)
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vfio_cxl.bench chaos",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    replay = f"scripts/bench chaos --seconds {args.seconds:g} --seed {seed}"
    if not args.json:
        print(f"chaos: seed {seed}, {args.seconds:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="vfio-cxl-chaos-") as tmp:
        started = time.monotonic()
        stats = Harness(seed, args.seconds, tmp).run()
        elapsed = time.monotonic() - started
    rate = stats.messages / elapsed if elapsed else 0.0
    result = {
        "seed": seed, "seconds": round(elapsed, 1), "sessions": stats.sessions,
        "messages_sent": stats.messages, "messages_per_second": round(rate),
        "dma_requests_served": stats.dma_requests, "descriptors": stats.descriptors,
        "disconnects": stats.disconnects, "resets": stats.resets, "halts": stats.halts,
        "truncations": stats.truncations, "unsealed_maps_refused": stats.unsealed_refused,
        "server_restarts": stats.server_restarts,
        "violations": stats.violations,
        "violation_kinds": {k: n for k, (n, _) in group(stats.violations).items()},
        "replay": replay,
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"  sessions {stats.sessions}, messages sent {stats.messages} "
              f"({rate:.0f}/s), DMA requests served {stats.dma_requests}, "
              f"descriptors {stats.descriptors}")
        print(f"  disconnects mid-message/transfer {stats.disconnects}, resets {stats.resets}, "
              f"halts {stats.halts}, fds truncated {stats.truncations} "
              f"(unsealed maps refused {stats.unsealed_refused}), "
              f"server restarts {stats.server_restarts}")
        kinds = group(stats.violations)
        print(f"  invariant violations: {len(stats.violations)} ({len(kinds)} kinds)")
        for kind, (n, example) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
            print(f"    {n:5d} x {kind}\n            e.g. {example}")
    if stats.violations:
        print(f"chaos: FAILED; replay with: {replay}", file=sys.stderr)
        return 1
    if not args.json:
        print("chaos: no invariant broken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
