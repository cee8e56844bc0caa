"""The GPU engine: one state machine that owns everything the device does.

States (docs/gpu-device.md, "Engine states"): IDLE, RUNNING, HALTED, and
DETACHED while no client is connected.  Every register write and every
client event is an ``Input`` given to ``Engine.input``; ``_step`` is the one
place where the state changes.  The engine thread executes descriptors and
reports what happened as inputs too (``RETIRED``, ``FAILED``).

Quiescing: every piece of work the thread starts carries the ``epoch`` it
started in.  An input that drops work (ENABLE cleared, BAD_TAIL, reset, Bus
Master Enable cleared, disconnect) bumps the epoch while holding ``gate``,
the lock around every memory access of the thread (a direct-path chunk, a
VRAM fill chunk).  So once the input returns -- before the device answers
the client's next message -- no access of the dropped work is in progress
and none will follow: direct accesses re-check the epoch under the gate, DMA
messages re-check it under the transport's send lock, replies to messages
already sent are thrown away, and the thread's waits are cut short.

Lock order: ``lock`` -> ``gate`` -> DMA table lock -> transport send lock.
The engine thread never takes ``lock`` while it holds ``gate``.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from enum import Enum
from typing import Callable

from ..vfio_user import wire
from ..vfio_user.dma import DmaAborted, DmaFault, DmaPort, FaultKind
from . import regs
from . import nvme_io
from .farmem import FarMemory
from .register_file import MSG_WINDOW, RING_CONFIG, RegisterFile
from .regs import Op, Status
from .faults import FAULT_STATUS

log = logging.getLogger(__name__)

FETCH_BATCH = 64  # descriptors fetched per ring read
FILL_CHUNK = 1 << 20  # VRAM bytes filled per gate hold



class State(Enum):
    IDLE = "idle"
    RUNNING = "running"
    HALTED = "halted"
    DETACHED = "detached"


class Input(Enum):
    REG_WRITE = "reg_write"  # (reg, value, byte mask)
    RESET = "reset"  # (function_level,): CONTROL.RESET, DEVICE_RESET, FLR
    BUS_MASTER = "bus_master"  # (enabled,): PCI command register bit 2
    CONNECT = "connect"  # (DmaPort,)
    DISCONNECT = "disconnect"  # ()
    DMA_MAP = "dma_map"  # (iova, size, flags, fd, offset)
    DMA_UNMAP = "dma_unmap"  # (iova, size, all)
    RETIRED = "retired"  # (epoch, index, flags): a descriptor completed OK
    FAILED = "failed"  # (epoch, status, index or None for HEAD, addr, errno): the ring must halt
    STOP = "stop"  # (): the server shuts down


class Engine:
    def __init__(self, vram: memoryview, raise_vector: Callable[[int], object]):
        self.vram = vram
        self.vram_size = len(vram)
        self.raise_vector = raise_vector  # MSI-X or MSI, the device decides
        self.regs = RegisterFile(self.vram_size)
        self.lock = threading.Condition()
        self.gate = threading.Lock()
        self.state = State.DETACHED
        self.resume = State.IDLE  # the state to enter when a client connects
        self.epoch = 0
        self.bus_master = False
        self.port: DmaPort | None = None
        self.job_epoch: int | None = None  # epoch of the batch the thread is running
        self.stopping = False
        self.resets = 0
        self.transitions = 0
        self._thread: threading.Thread | None = None
        self.farmem = FarMemory(self, FAULT_STATUS)  # interface 1.1: far memory and compute

    # ================================================================ lifetime
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gpu-engine", daemon=True)
        self._thread.start()
        self.farmem.start()

    def stop(self) -> None:
        self.input(Input.STOP)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.farmem.join()

    # ================================================================ inputs
    def input(self, kind: Input, *args):
        """Apply one input; returns when it has taken effect (see the module doc)."""
        with self.lock:
            result = self._step(kind, *args)
            self.transitions += 1
            self.lock.notify_all()
        return result

    def _step(self, kind: Input, *args):
        """Every state transition of the device.  Caller holds ``lock``."""
        r, state = self.regs, self.state
        if kind is Input.REG_WRITE:
            reg, value, mask = args
            if reg == regs.REG_CONTROL:
                bits = value & mask
                if bits & regs.CONTROL_RESET:
                    return self._reset("CONTROL.RESET")
                if not mask & 0xFF:
                    return None
                if bits & regs.CONTROL_ENABLE:
                    if state is State.IDLE:
                        if r.ring_config_valid():
                            self._enter(State.RUNNING)
                        else:
                            self._halt(Status.BAD_RING_CONFIG, r.head, r.ring_base, 0)
                elif state is State.RUNNING:
                    self._drop()
                    self._enter(State.IDLE)
            elif reg == regs.REG_RING_TAIL:
                if state is State.HALTED:
                    return None  # doorbells do nothing until reset
                tail = (r.tail & ~mask) | (value & mask)
                if tail >= r.ring_size:
                    self._halt(Status.BAD_TAIL, r.head, tail, 0)
                else:
                    r.tail = tail
            elif reg == regs.REG_INTR_STATUS:
                r.intr_status &= ~(value & mask)
            elif reg == regs.REG_SCRATCH:
                r.scratch = (r.scratch & ~mask) | (value & mask)
            elif reg == regs.REG_P2P_CONTROL:
                r.p2p_control = ((r.p2p_control & ~mask) | (value & mask)) & regs.P2P_FAST_DISABLE
            elif reg in RING_CONFIG:
                if state is State.IDLE:
                    r.set_ring_config(reg, value, mask)
            elif reg in MSG_WINDOW:   # any state: transfers started after the write use it
                r.set_msg_window(reg, value, mask)
            elif regs.FARMEM_FIRST <= reg <= regs.FARMEM_LAST:
                self.farmem.reg_write(reg, value, mask)
            # everything else is read-only: ignored
            return None
        if kind is Input.RESET:
            (function_level,) = args
            if function_level:
                self.bus_master = False  # config space is back at its reset value
            return self._reset("function level reset" if function_level else "reset")
        if kind is Input.BUS_MASTER:
            (on,) = args
            if self.bus_master and not on:
                self._drop()  # the descriptor in flight runs again once BME is back
            self.bus_master = on
            return None
        if kind is Input.CONNECT:
            (port,) = args
            self.port = port
            self._enter(self.resume if state is State.DETACHED else state)
            return None
        if kind is Input.DISCONNECT:
            if state is State.DETACHED:
                return None
            self._drop()
            if state is State.RUNNING and r.head != r.tail:
                self._latch_halt(Status.DMA_ABORTED, r.head, 0, errno.ECONNRESET)
                state = State.HALTED
            self.resume = state
            self.port = None
            self._enter(State.DETACHED)
            return None
        if kind is Input.DMA_MAP:
            iova, size, flags, fd, offset = args
            return self.port.table.map(iova, size, flags, fd, offset)
        if kind is Input.DMA_UNMAP:
            iova, size, everything = args
            table = self.port.table
            with self.gate:  # a direct copy finishes its chunk first; later ones fault
                return table.unmap_all() if everything else table.unmap(iova, size)
        if kind is Input.RETIRED:
            epoch, index, flags = args
            if epoch != self.epoch or state is not State.RUNNING:
                return False
            r.head = (index + 1) % r.ring_size
            r.completed = (r.completed + 1) & 0xFFFFFFFF
            if flags & regs.DESC_FLAG_INTERRUPT:
                self._raise(regs.VEC_DMA_DONE, regs.INTR_DMA_DONE)
            return True
        if kind is Input.FAILED:
            epoch, status, index, addr, err = args
            if epoch != self.epoch or state is not State.RUNNING:
                return False
            self._halt(status, r.head if index is None else index, addr, err)
            return True
        if kind is Input.STOP:
            self.stopping = True
            self._drop()
            return None
        raise AssertionError(f"unknown input {kind}")

    # ---------------------------------------------------------------- helpers (lock held)
    def _enter(self, state: State) -> None:
        if state is not self.state:
            log.debug("engine %s -> %s", self.state.value, state.value)
        self.state = state

    def _drop(self) -> None:
        """Stop all work in flight: after this no access of it happens (see module doc)."""
        with self.gate:
            self.epoch += 1
        if self.port is not None:
            self.port.abort_transfers()
        self.farmem.drop_migration()  # the copy engine's work is dropped too

    def _latch_halt(self, status: Status, index: int, addr: int, err: int) -> None:
        self.regs.latch_error(status, index, addr, err)
        log.warning("ring halted: %s at index %d addr %#x errno %d",
                    Status(status).name, index, addr, err)
        self._enter(State.HALTED)

    def _halt(self, status: Status, index: int, addr: int, err: int) -> None:
        self._drop()
        self._latch_halt(status, index, addr, err)
        self._raise(regs.VEC_ERROR, regs.INTR_ERROR)

    def _reset(self, why: str) -> None:
        self._drop()
        self.regs.reset()
        self.farmem.reset()
        self.resets += 1
        self._enter(State.IDLE)
        log.info("device reset (%s)", why)

    def raise_fault(self) -> None:
        """VEC_FAULT (farmem's replayable fault); caller holds ``lock``."""
        self._raise(regs.VEC_FAULT, regs.INTR_FAULT)

    def _raise(self, vector: int, bit: int) -> None:
        self.regs.intr_status |= bit
        if self.bus_master:  # an MSI(-X) message is a memory write: it needs BME
            self.raise_vector(vector)

    # ================================================================ reads
    def status(self) -> int:
        # executing: a batch of this epoch is out and the ring is not drained yet
        busy = (self.job_epoch is not None and self.job_epoch == self.epoch
                and self.regs.head != self.regs.tail)
        return ((regs.STATUS_ENABLED if self.state is State.RUNNING else 0)
                | (regs.STATUS_BUSY if busy else 0)
                | (regs.STATUS_HALTED if self.state is State.HALTED else 0))

    def reg_value(self, reg: int) -> int:
        """Caller holds ``lock``."""
        control = regs.CONTROL_ENABLE if self.state is State.RUNNING else 0
        if reg == regs.REG_P2P_PEER_KIB:
            return (self.port.peer_bytes >> 10) & 0xFFFFFFFF if self.port else 0
        if reg == regs.REG_P2P_PROOFS:
            return self.port.proofs & 0xFFFFFFFF if self.port else 0
        if reg == regs.REG_MSGWIN_WRITES:
            return self.port.window_writes & 0xFFFFFFFF if self.port else 0
        if reg == regs.REG_MSGWIN_READS:
            return self.port.window_reads & 0xFFFFFFFF if self.port else 0
        if regs.FARMEM_FIRST <= reg <= regs.FARMEM_LAST or regs.FARMEM2_FIRST <= reg <= regs.FARMEM2_LAST:
            return self.farmem.reg_value(reg)
        return self.regs.value(reg, self.status(), control)

    def message_window(self) -> tuple[int, int]:
        """(base, size) of the message window (read without the lock: two ints, one tuple)."""
        r = self.regs
        return r.msgwin_base, r.msgwin_size

    def peer_fast_enabled(self) -> bool:
        """REG_P2P_CONTROL allows the peer fast path (read without the lock: one int)."""
        return not self.regs.p2p_control & regs.P2P_FAST_DISABLE

    # ================================================================ the engine thread
    def _runnable(self) -> bool:
        r = self.regs
        return (self.state is State.RUNNING and self.bus_master and self.port is not None
                and not self.port.closed and r.head != r.tail)

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self._runnable():
                    self.lock.wait()
                if self.stopping:
                    return
                r = self.regs
                job = (self.epoch, self.port, r.ring_base, r.ring_size, r.compl_base,
                       r.head, r.tail)
                self.job_epoch = self.epoch
            try:
                self._run_batch(*job)
            except Exception:  # a bug here must not silently kill the device
                log.exception("engine failure")
                self.input(Input.FAILED, job[0], Status.DMA_ABORTED, None, 0, errno.EIO)
            finally:
                with self.lock:
                    self.job_epoch = None

    def _run_batch(self, epoch, port, ring_base, size, compl_base, head, tail) -> None:
        def stale() -> bool:
            return self.epoch != epoch

        count = min((tail - head) % size, size - head, FETCH_BATCH)
        ring = bytearray(count * regs.DESC_SIZE)
        try:
            port.read(ring_base + head * regs.DESC_SIZE, memoryview(ring), stale)
        except DmaAborted:
            return
        except DmaFault as fault:
            if fault.kind != FaultKind.CLOSED:  # client gone: DISCONNECT decides
                self.input(Input.FAILED, epoch, Status.RING_FETCH, head, fault.addr, fault.errno)
            return
        for i in range(count):
            if stale():
                return
            index = head + i
            desc = regs.DESC.unpack_from(ring, i * regs.DESC_SIZE)
            started = time.monotonic_ns()
            try:
                status, done, addr, err = self._execute(desc, port, stale)
            except DmaAborted:
                return
            if not self._complete(epoch, port, compl_base, index, desc, status, done, addr,
                                  err, time.monotonic_ns() - started, stale):
                return

    def _execute(self, desc, port: DmaPort, stale):
        """Run one descriptor -> (status, bytes_done, fault_addr, errno)."""
        src, dst, length, op, flags, reserved, _cookie = desc
        if flags & ~regs.DESC_FLAGS_VALID or reserved:
            return Status.BAD_FLAGS, 0, 0, 0
        if op == Op.NOP:
            return Status.OK, 0, 0, 0
        if op in (Op.COMPUTE, Op.FLUSH):
            return self.farmem.execute(op, src, dst, length, port, stale)
        if op not in (Op.VRAM_TO_HOST, Op.HOST_TO_VRAM, Op.FILL_PATTERN, Op.FILL_PRNG, Op.HOST_TO_HOST,
                      Op.NVME_IO):
            return Status.BAD_OPCODE, 0, 0, 0
        if op == Op.HOST_TO_HOST:
            return self._host_copy(src, dst, length, port, stale)
        if op == Op.NVME_IO:
            return nvme_io.NvmeBatch(self.vram, self.gate, port, stale).run(src, dst, length)
        vram_off = src if op == Op.VRAM_TO_HOST else dst
        if vram_off + length > self.vram_size:
            return Status.VRAM_RANGE, 0, vram_off, 0
        window = self.vram[vram_off:vram_off + length]
        try:
            if op == Op.VRAM_TO_HOST:
                port.write(dst, window, stale)
            elif op == Op.HOST_TO_VRAM:
                port.read(src, window, stale)
            elif op == Op.FILL_PATTERN:
                self._fill(window, stale, pattern=src)
            else:
                self._fill(window, stale, seed=src)
        except DmaFault as fault:
            if fault.kind == FaultKind.CLOSED:  # client gone: the DISCONNECT input decides
                raise DmaAborted() from None
            return FAULT_STATUS[fault.kind], fault.done, fault.addr, fault.errno
        finally:
            window.release()
        return Status.OK, length, 0, 0

    def _host_copy(self, src: int, dst: int, length: int, port: DmaPort, stale):
        """HOST_TO_HOST: both ranges are checked before a byte moves (like an IOMMU), then
        copied front to back through a bounce buffer, HOST_COPY_CHUNK at a time."""
        try:
            port.table.check(src, length, wire.DMA_MAP_FLAG_READ)
            port.table.check(dst, length, wire.DMA_MAP_FLAG_WRITE)
        except DmaFault as fault:
            return FAULT_STATUS[fault.kind], 0, fault.addr, fault.errno
        bounce = bytearray(min(length, regs.HOST_COPY_CHUNK))
        done = 0
        while done < length:
            n = min(len(bounce), length - done)
            piece = memoryview(bounce)[:n]
            writing = False
            try:
                port.read(src + done, piece, stale)
                writing = True
                port.write(dst + done, piece, stale)
            except DmaFault as fault:
                if fault.kind == FaultKind.CLOSED:
                    raise DmaAborted() from None
                # bytes_done counts what reached the destination
                return FAULT_STATUS[fault.kind], done + (fault.done if writing else 0), fault.addr, fault.errno
            finally:
                piece.release()
            done += n
        return Status.OK, length, 0, 0

    def _fill(self, window: memoryview, stale, *, pattern: int | None = None,
              seed: int | None = None) -> None:
        """FILL_PATTERN / FILL_PRNG into VRAM, one gated chunk at a time."""
        unit = regs.pattern_bytes(pattern, FILL_CHUNK) if pattern is not None else b""
        pos = 0
        while pos < len(window):
            if seed is not None:  # computed outside the gate
                n = min(regs.PRNG_BLOCK - pos % regs.PRNG_BLOCK, len(window) - pos)
                data = regs.prng_bytes(seed, n, pos)
            else:
                n = min(FILL_CHUNK, len(window) - pos)
                data = unit[:n]  # FILL_CHUNK is a multiple of 8: the pattern stays in phase
            with self.gate:
                if stale():
                    raise DmaAborted()
                window[pos:pos + n] = data
            pos += n

    def _complete(self, epoch, port, compl_base, index, desc, status, done, addr, err,
                  duration, stale) -> bool:
        """Write the completion record, then retire or halt.  False: stop the batch."""
        cookie, flags = desc[6], desc[4]
        with self.lock:
            if self.epoch != epoch:
                return False
            seq = (self.regs.completed + 1) & 0xFFFFFFFF
        record = regs.COMPL.pack(cookie, int(status), done, index, seq, duration)
        try:
            port.write(compl_base + index * regs.COMPL_SIZE, record, stale)
        except DmaAborted:
            return False
        except DmaFault as fault:
            if fault.kind == FaultKind.CLOSED:
                return False
            if status == Status.OK:
                status, addr, err = Status.COMPLETION_WRITE, fault.addr, fault.errno
            self.input(Input.FAILED, epoch, status, index, addr, err)
            return False
        if status != Status.OK:
            self.input(Input.FAILED, epoch, status, index, addr, err)
            return False
        return self.input(Input.RETIRED, epoch, index, flags)
