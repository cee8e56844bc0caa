"""The SMC's one shared state and its owner: every input from every host goes
through ``SmcState.input`` under one lock, so semaphores, mailboxes,
doorbells and host liveness change in one place, one input at a time -- that
is what makes ACQUIRE atomic across hosts.

Inputs (``Input``): a host connected or disconnected, a host reset (CONTROL
or DEVICE_RESET / FLR), a BAR0 register read (reads may have side effects:
ACQUIRE, DB_POP, LOST_POP) and a BAR0 register write.  Interrupts are raised
through ``raise_vector(host, vector)``, an eventfd write that never blocks.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from threading import Lock

from . import regs
from .regs import Error

log = logging.getLogger(__name__)


class Input(Enum):
    CONNECT = "connect"        # (host)
    DISCONNECT = "disconnect"  # (host): the host is lost
    RESET = "reset"            # (host)
    READ = "read"              # (host, reg) -> value
    WRITE = "write"            # (host, reg, value, byte mask)


@dataclass
class Semaphore:
    owner: int = regs.NO_HOST
    epoch: int = 0
    released: dict = field(default_factory=dict)   # host -> epoch of its last normal release
    waiters: set = field(default_factory=set)   # hosts refused (BUSY) since the last grant


@dataclass
class Message:
    src: int
    seq: int
    data: bytes


@dataclass
class HostState:
    """What belongs to one host (its 'per host' registers and queues)."""
    alive: bool = False
    intr_status: int = 0
    last_error: int = 0
    error_reg: int = 0
    scratch: int = 0
    tx_data: bytearray = field(default_factory=lambda: bytearray(regs.MAILBOX_MSG_SIZE))
    tx_fence: int = 0
    tx_ctrl: int = 0
    tx_status: int = 0
    db_staged: dict = field(default_factory=dict)   # target host -> staged payload
    rx: deque = field(default_factory=deque)
    rx_seq: int = 0
    doorbells: deque = field(default_factory=deque)
    db_payload: int = 0
    db_dropped: int = 0
    lost: deque = field(default_factory=deque)


def _epoch_next(epoch: int) -> int:
    nxt = (epoch + 1) & regs.EPOCH_MASK
    return nxt or 1


class SmcState:
    def __init__(self, hosts: int, raise_vector=lambda host, vector: None):
        if not 1 <= hosts <= regs.MAX_HOSTS:
            raise ValueError(f"{hosts} hosts: an SMC serves 1 to {regs.MAX_HOSTS}")
        self.num_hosts = hosts
        self.raise_vector = raise_vector
        self.lock = Lock()
        self.hosts = [HostState() for _ in range(hosts)]
        self.sems = [Semaphore() for _ in range(regs.NUM_SEMAPHORES)]
        self.grants = 0
        self.forced_releases = 0

    # ================================================================ the one entry point
    def input(self, kind: Input, host: int, *args):
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"host {host} is not one of 0..{self.num_hosts - 1}")
        with self.lock:
            if kind is Input.READ:
                return self._read(host, *args)
            if kind is Input.WRITE:
                return self._write(host, *args)
            if kind is Input.CONNECT:
                self._reset_host(host)
                self.hosts[host].alive = True
                log.info("host %d connected", host)
                return None
            if kind is Input.DISCONNECT:
                return self._lose(host)
            if kind is Input.RESET:
                log.info("host %d reset", host)
                return self._reset_host(host)
            raise AssertionError(kind)

    # ================================================================ transitions
    def _signal(self, host: int, vector: int) -> None:
        h = self.hosts[host]
        if not h.alive:
            return
        h.intr_status |= 1 << vector
        self.raise_vector(host, vector)

    def _error(self, host: int, err: Error, reg: int) -> None:
        h = self.hosts[host]
        h.last_error, h.error_reg = int(err), reg
        log.debug("host %d: %s at %#x", host, err.name, reg)

    def _free(self, index: int, *, forced: bool) -> None:
        """Release semaphore ``index``; a forced release bumps the epoch, so a token
        the lost holder handed out can never match again."""
        sem = self.sems[index]
        sem.owner = regs.NO_HOST
        if forced:
            sem.epoch = _epoch_next(sem.epoch)
            self.forced_releases += 1
        waiters, sem.waiters = sem.waiters, set()
        for w in sorted(waiters):
            self._signal(w, regs.VEC_SEM_FREE)

    def _release_all(self, host: int) -> list[int]:
        held = [i for i, s in enumerate(self.sems) if s.owner == host]
        for i in held:
            self._free(i, forced=True)
        for s in self.sems:
            s.waiters.discard(host)
        return held

    def _reset_host(self, host: int) -> None:
        self._release_all(host)
        alive = self.hosts[host].alive
        self.hosts[host] = HostState(alive=alive)

    def _lose(self, host: int) -> None:
        if not self.hosts[host].alive:
            return
        held = self._release_all(host)
        self.hosts[host] = HostState(alive=False)
        log.info("host %d lost; semaphores %s released with new epochs", host, held)
        for other, h in enumerate(self.hosts):
            if other != host and h.alive:
                if len(h.lost) < regs.LOST_FIFO_DEPTH:
                    h.lost.append(host)
                self._signal(other, regs.VEC_PEER_LOST)

    # ================================================================ reads
    def _read(self, host: int, reg: int) -> int:
        h = self.hosts[host]
        if regs.SEM_BASE <= reg < regs.SEM_BASE + regs.SEM_STRIDE * regs.NUM_SEMAPHORES:
            return self._sem_read(host, (reg - regs.SEM_BASE) // regs.SEM_STRIDE,
                                  (reg - regs.SEM_BASE) % regs.SEM_STRIDE)
        if regs.REG_RX_DATA <= reg < regs.REG_RX_DATA + regs.MAILBOX_MSG_SIZE:
            if not h.rx:
                return 0
            data = h.rx[0].data.ljust(regs.MAILBOX_MSG_SIZE, b"\0")
            off = reg - regs.REG_RX_DATA
            return int.from_bytes(data[off:off + 4], "little")
        if regs.REG_TX_DATA <= reg < regs.REG_TX_DATA + regs.MAILBOX_MSG_SIZE:
            off = reg - regs.REG_TX_DATA
            return int.from_bytes(h.tx_data[off:off + 4], "little")
        if reg == regs.REG_DB_POP:
            if not h.doorbells:
                return 0
            src, payload = h.doorbells.popleft()
            h.db_payload = payload
            return regs.POP_VALID | src
        if reg == regs.REG_TX_SEND:
            return self._send(host, h.tx_ctrl)
        if reg == regs.REG_RX_POP:
            if h.rx:
                h.rx.popleft()
            return len(h.rx)
        if regs.REG_DOORBELL_BASE <= reg < regs.REG_DOORBELL_BASE + 4 * regs.MAX_HOSTS:
            target = (reg - regs.REG_DOORBELL_BASE) // 4
            return self._ring(host, target, h.db_staged.get(target, 0), reg)
        if reg == regs.REG_LOST_POP:
            if not h.lost:
                return 0
            return regs.POP_VALID | h.lost.popleft()
        head = h.rx[0] if h.rx else None
        values = {
            regs.REG_ID: regs.ID_MAGIC,
            regs.REG_VERSION: regs.DEVICE_VERSION,
            regs.REG_HOST_ID: host,
            regs.REG_NUM_HOSTS: self.num_hosts,
            regs.REG_NUM_SEMS: regs.NUM_SEMAPHORES,
            regs.REG_HOSTS_ALIVE: sum(1 << i for i, o in enumerate(self.hosts) if o.alive),
            regs.REG_INTR_STATUS: h.intr_status,
            regs.REG_LAST_ERROR: h.last_error,
            regs.REG_ERROR_REG: h.error_reg,
            regs.REG_SCRATCH: h.scratch,
            regs.REG_TX_FENCE: h.tx_fence,
            regs.REG_TX_CTRL: h.tx_ctrl,
            regs.REG_TX_STATUS: h.tx_status,
            regs.REG_RX_COUNT: len(h.rx),
            regs.REG_RX_SRC: head.src if head else regs.NO_HOST,
            regs.REG_RX_SEQ: head.seq if head else 0,
            regs.REG_RX_LEN: len(head.data) if head else 0,
            regs.REG_DB_PAYLOAD: h.db_payload,
            regs.REG_DB_COUNT: len(h.doorbells),
            regs.REG_DB_DROPPED: h.db_dropped,
            regs.REG_LOST_COUNT: len(h.lost),
        }
        return values.get(reg, 0)

    def _sem_read(self, host: int, index: int, fld: int) -> int:
        sem = self.sems[index]
        if fld == regs.SEM_ACQUIRE:
            if sem.owner == host:   # already ours: the same grant again, no new epoch
                return regs.ACQ_GRANTED | sem.epoch
            if sem.owner != regs.NO_HOST:
                sem.waiters.add(host)
                return regs.ACQ_BUSY | sem.owner
            sem.owner = host
            sem.epoch = _epoch_next(sem.epoch)
            sem.waiters.discard(host)
            self.grants += 1
            return regs.ACQ_GRANTED | sem.epoch
        if fld == regs.SEM_STATE:
            return (regs.STATE_HELD if sem.owner != regs.NO_HOST else 0) | sem.owner
        if fld == regs.SEM_EPOCH:
            return sem.epoch
        return 0   # RELEASE reads 0

    # ================================================================ writes
    def _write(self, host: int, reg: int, value: int, mask: int) -> None:
        h = self.hosts[host]
        if regs.REG_TX_DATA <= reg < regs.REG_TX_DATA + regs.MAILBOX_MSG_SIZE:
            off = reg - regs.REG_TX_DATA
            old = int.from_bytes(h.tx_data[off:off + 4], "little")
            h.tx_data[off:off + 4] = ((old & ~mask) | (value & mask)).to_bytes(4, "little")
            return
        if regs.SEM_BASE <= reg < regs.SEM_BASE + regs.SEM_STRIDE * regs.NUM_SEMAPHORES:
            index, fld = divmod(reg - regs.SEM_BASE, regs.SEM_STRIDE)
            if fld != regs.SEM_RELEASE:
                return self._error(host, Error.BAD_REGISTER, reg)
            return self._release(host, index, value & mask, reg)
        if regs.REG_DOORBELL_BASE <= reg < regs.REG_DOORBELL_BASE + 4 * regs.MAX_HOSTS:
            target = (reg - regs.REG_DOORBELL_BASE) // 4
            old = h.db_staged.get(target, 0)
            h.db_staged[target] = (old & ~mask) | (value & mask)
            return None
        if reg == regs.REG_INTR_STATUS:
            h.intr_status &= ~(value & mask)
        elif reg == regs.REG_CONTROL:
            if value & mask & regs.CONTROL_RESET:
                self._reset_host(host)
        elif reg == regs.REG_LAST_ERROR:
            h.last_error = h.error_reg = 0
        elif reg == regs.REG_SCRATCH:
            h.scratch = (h.scratch & ~mask) | (value & mask)
        elif reg == regs.REG_TX_FENCE:
            h.tx_fence = (h.tx_fence & ~mask) | (value & mask)
        elif reg == regs.REG_TX_CTRL:
            h.tx_ctrl = (h.tx_ctrl & ~mask) | (value & mask)
        else:
            self._error(host, Error.BAD_REGISTER, reg)

    def _release(self, host: int, index: int, epoch: int, reg: int) -> None:
        sem = self.sems[index]
        if sem.released.get(host) == epoch and not (sem.owner == host and sem.epoch == epoch):
            # The same release again (a repeated write), maybe after other hosts have taken and
            # released the semaphore since: already done.
            return None
        if sem.owner != host:
            return self._error(host, Error.NOT_OWNER, reg)
        if epoch != sem.epoch:
            return self._error(host, Error.STALE_EPOCH, reg)
        sem.released[host] = epoch
        self._free(index, forced=False)

    def _ring(self, host: int, target: int, payload: int, reg: int) -> int:
        if target >= self.num_hosts:
            return self._fail(host, Error.BAD_INDEX, reg)
        t = self.hosts[target]
        if not t.alive:
            return self._fail(host, Error.HOST_ABSENT, reg)
        if len(t.doorbells) >= regs.DOORBELL_FIFO_DEPTH:
            t.db_dropped += 1
            return self._fail(host, Error.DB_FULL, reg)
        t.doorbells.append((host, payload))
        self._signal(target, regs.VEC_DOORBELL)
        return Error.OK

    def _fail(self, host: int, err: Error, reg: int) -> int:
        self._error(host, err, reg)
        return int(err)

    def _send(self, host: int, word: int) -> int:
        h = self.hosts[host]
        target = word & regs.TX_TARGET_MASK
        length = (word >> regs.TX_LEN_SHIFT) & 0x7F
        status = Error.OK
        if target >= self.num_hosts:
            status = Error.BAD_INDEX
        elif not 1 <= length <= regs.MAILBOX_MSG_SIZE:
            status = Error.BAD_LENGTH
        elif word & regs.TX_FENCED:
            index = (word >> regs.TX_SEM_SHIFT) & 0xFF
            if index >= regs.NUM_SEMAPHORES:
                status = Error.BAD_INDEX
            elif self.sems[index].epoch != h.tx_fence:
                status = Error.STALE_EPOCH
            elif self.sems[index].owner != host:
                status = Error.NOT_OWNER
        if status is Error.OK:
            t = self.hosts[target]
            if not t.alive:
                status = Error.HOST_ABSENT
            elif len(t.rx) >= regs.MAILBOX_SLOTS:
                status = Error.MBOX_FULL
        h.tx_status = int(status)
        if status is not Error.OK:
            return self._fail(host, status, regs.REG_TX_SEND)
        t.rx_seq = (t.rx_seq + 1) & 0xFFFFFFFF or 1
        t.rx.append(Message(host, t.rx_seq, bytes(h.tx_data[:length])))
        self._signal(target, regs.VEC_MAILBOX)
        return int(Error.OK)
