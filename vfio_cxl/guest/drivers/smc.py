"""The shared-memory controller's userspace driver: VFIO (vfio_cxl.guest.vfio) +
the register map (vfio_cxl.devices.smc.regs); docs/smc-device.md is the contract.

    with SmcDriver.open() as smc:
        with smc.semaphore(0, timeout=5) as epoch:     # epoch = the fencing token
            ... write shared memory, stamped with epoch ...
        smc.send(1, b"hello")                          # host 1's mailbox
        smc.ring(1, 0x1234)                            # host 1's doorbell vector fires
        src, payload = smc.wait_doorbell(timeout=5)
        lost = smc.wait_peer_lost(timeout=5)

Every wait sleeps on the controller's MSI-X eventfds (VFIO), never spins,
unless asked to (``poll=True``, for latency comparisons).  Opening the driver
resets this host's view of the controller (CONTROL_RESET): semaphores an
earlier incarnation held are released with new epochs, its queues emptied
(``reset=False`` keeps them, and then close() leaves them too).

Closing the VFIO device may make the guest kernel reset the function (FLR ->
DEVICE_RESET), which also releases this host's semaphores: a holder must
keep its driver open.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...devices.smc import regs
from ...devices.smc.regs import Error
from ..vfio import VfioPciDevice, find_pci_devices
from ..vfio.errors import InterruptTimeout, VfioError

__all__ = ["SmcDriver", "Message", "SmcError", "SmcTimeout"]

PCI_COMMAND = 0x04
PCI_COMMAND_MEMORY = 0x2
PCI_COMMAND_MASTER = 0x4


class SmcError(VfioError):
    """A controller operation failed; ``.code`` is the device's Error code when it said one."""

    def __init__(self, what: str, fix: str = "", code: int = 0):
        self.code = code
        super().__init__(what, fix)


class SmcTimeout(SmcError):
    pass


_FIXES = {
    Error.BAD_INDEX: "use a semaphore below NUM_SEMS and a host ID below NUM_HOSTS",
    Error.NOT_OWNER: "release only semaphores this host acquired",
    Error.STALE_EPOCH: "the semaphore was released (or its holder lost) since that epoch: acquire it again",
    Error.MBOX_FULL: "the receiver has not drained its mailbox: retry later",
    Error.DB_FULL: "the receiver has not drained its doorbell FIFO: retry later",
    Error.BAD_LENGTH: f"send 1 to {regs.MAILBOX_MSG_SIZE} bytes",
    Error.HOST_ABSENT: "the target host is not connected (HOSTS_ALIVE)",
    Error.BAD_REGISTER: "see docs/smc-device.md for the register map",
}


def _error(code: int, what: str) -> SmcError:
    name = Error(code).name if code in Error._value2member_map_ else f"error {code}"
    return SmcError(f"{what}: the controller said {name}", _FIXES.get(code, "see docs/smc-device.md"), code)


@dataclass(frozen=True)
class Message:
    src: int
    seq: int
    data: bytes


class SmcDriver:
    def __init__(self, device, *, reset: bool = True):
        """``device``: a VfioPciDevice (or anything with its bar/config/msix surface).
        ``reset=False`` keeps this host's controller state (queued doorbells and messages,
        semaphores it holds) -- for a program that takes over from another one."""
        self.device = device
        command = device.config.read16(PCI_COMMAND)   # no MSI-X without bus mastering in QEMU
        device.config.write16(PCI_COMMAND, command | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER)
        self.bar0 = device.bar(regs.BAR_REGS)
        if self.bar0.read32(regs.REG_ID) != regs.ID_MAGIC:
            raise SmcError("the device does not answer with the SMC's ID register",
                           "is it the vfio-cxl shared-memory controller?")
        self.vectors = device.msix(regs.MSIX_VECTORS)
        if reset:
            self.bar0.write32(regs.REG_CONTROL, regs.CONTROL_RESET)
        for v in range(regs.MSIX_VECTORS):
            self.vectors.pending(v)   # the state registers, not stale events, say what is queued
        self.reset_on_close = reset
        self.host_id = self.bar0.read32(regs.REG_HOST_ID)
        self.num_hosts = self.bar0.read32(regs.REG_NUM_HOSTS)
        self.num_sems = self.bar0.read32(regs.REG_NUM_SEMS)

    @classmethod
    def open(cls, bdf: str | None = None, *, reset: bool = True) -> "SmcDriver":
        if bdf is None:
            found = find_pci_devices(regs.PCI_VENDOR_ID, regs.PCI_DEVICE_ID)
            if not found:
                raise SmcError(f"no shared-memory controller [{regs.PCI_VENDOR_ID:04x}:"
                               f"{regs.PCI_DEVICE_ID:04x}] in this VM",
                               "boot a topology with an [smc.NAME] table naming this VM")
            bdf = found[0]
        device = VfioPciDevice.open(bdf)
        try:
            return cls(device, reset=reset)
        except BaseException:
            device.close()
            raise

    # -- helpers --------------------------------------------------------------------
    def _check(self, what: str) -> None:
        """Raise the error a posted write latched (a read after it is ordered behind it)."""
        code = self.bar0.read32(regs.REG_LAST_ERROR)
        if code:
            self.bar0.write32(regs.REG_LAST_ERROR, 0)
            raise _error(code, what)

    def _wait(self, vector: int, deadline: float | None, what: str) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise SmcTimeout(f"{what}: timed out", "is the other host alive? (HOSTS_ALIVE)")
        try:
            self.vectors.wait(vector, left)
        except InterruptTimeout:
            raise SmcTimeout(f"{what}: timed out after waiting for MSI-X vector {vector}",
                             "is the other host alive? (HOSTS_ALIVE)") from None

    @staticmethod
    def _deadline(timeout: float | None) -> float | None:
        return None if timeout is None else time.monotonic() + timeout

    def alive(self) -> set[int]:
        mask = self.bar0.read32(regs.REG_HOSTS_ALIVE)
        return {h for h in range(self.num_hosts) if mask >> h & 1}

    # -- semaphores -------------------------------------------------------------
    def try_acquire(self, sem: int) -> tuple[bool, int]:
        """(True, epoch) if granted, else (False, owner host ID)."""
        self._sem_index(sem)
        word = self.bar0.read32(regs.sem_reg(sem, regs.SEM_ACQUIRE))
        if word & regs.ACQ_GRANTED:
            return True, word & regs.ACQ_EPOCH_MASK
        return False, word & regs.ACQ_OWNER_MASK

    def acquire(self, sem: int, timeout: float | None = 10.0) -> int:
        """Acquire semaphore ``sem``; returns its epoch (the fencing token).  Sleeps on the
        SEM_FREE vector between tries."""
        deadline = self._deadline(timeout)
        while True:
            granted, value = self.try_acquire(sem)
            if granted:
                return value
            try:
                self._wait(regs.VEC_SEM_FREE, deadline, f"acquiring semaphore {sem} (held by host {value})")
            except SmcTimeout as exc:
                exc.owner = value
                raise

    def release(self, sem: int, epoch: int) -> None:
        self._sem_index(sem)
        self.bar0.write32(regs.sem_reg(sem, regs.SEM_RELEASE), epoch)
        self._check(f"releasing semaphore {sem} with epoch {epoch}")

    def state(self, sem: int) -> tuple[int | None, int]:
        """(owner host ID or None, current epoch)."""
        self._sem_index(sem)
        word = self.bar0.read32(regs.sem_reg(sem, regs.SEM_STATE))
        epoch = self.bar0.read32(regs.sem_reg(sem, regs.SEM_EPOCH))
        return (word & 0xFF if word & regs.STATE_HELD else None), epoch

    def semaphore(self, sem: int, timeout: float | None = 10.0) -> "_Held":
        return _Held(self, sem, timeout)

    def _sem_index(self, sem: int) -> None:
        if not 0 <= sem < self.num_sems:
            raise SmcError(f"semaphore {sem} does not exist", f"use 0..{self.num_sems - 1}",
                           Error.BAD_INDEX)

    # -- mailboxes ----------------------------------------------------------------
    def send(self, target: int, data: bytes, *, fence: tuple[int, int] | None = None) -> None:
        """Put ``data`` (1..64 bytes) into host ``target``'s mailbox.  ``fence=(sem, epoch)``:
        delivered only while this host holds ``sem`` with that epoch."""
        if not 1 <= len(data) <= regs.MAILBOX_MSG_SIZE:
            raise SmcError(f"a {len(data)}-byte message", f"send 1 to {regs.MAILBOX_MSG_SIZE} bytes",
                           Error.BAD_LENGTH)
        self.bar0.write(regs.REG_TX_DATA, bytes(data).ljust((len(data) + 3) & ~3, b"\0"))
        if fence is not None:
            self.bar0.write32(regs.REG_TX_FENCE, fence[1])
        self.bar0.write32(regs.REG_TX_CTRL, regs.tx_send_word(
            target, len(data), None if fence is None else fence[0]))
        status = self.bar0.read32(regs.REG_TX_SEND)      # the send itself, and its result
        if status:
            self.bar0.write32(regs.REG_LAST_ERROR, 0)
            raise _error(status, f"sending {len(data)} bytes to host {target}")

    def recv(self, timeout: float | None = 10.0) -> Message:
        deadline = self._deadline(timeout)
        while not self.bar0.read32(regs.REG_RX_COUNT):
            self._wait(regs.VEC_MAILBOX, deadline, "waiting for a mailbox message")
        src = self.bar0.read32(regs.REG_RX_SRC)
        seq = self.bar0.read32(regs.REG_RX_SEQ)
        length = self.bar0.read32(regs.REG_RX_LEN)
        data = self.bar0.read(regs.REG_RX_DATA, regs.MAILBOX_MSG_SIZE)[:length]
        self.bar0.read32(regs.REG_RX_POP)
        return Message(src, seq, bytes(data))

    # -- doorbells ------------------------------------------------------------------
    def ring(self, target: int, payload: int = 0) -> None:
        """Ring host ``target``'s doorbell: stage the payload (write), ring (read, with the result)."""
        if not 0 <= target < regs.MAX_HOSTS:
            raise SmcError(f"no host {target}", f"use 0..{self.num_hosts - 1}", Error.BAD_INDEX)
        self.bar0.write32(regs.doorbell_reg(target), payload & 0xFFFFFFFF)
        status = self.bar0.read32(regs.doorbell_reg(target))
        if status:
            self.bar0.write32(regs.REG_LAST_ERROR, 0)
            raise _error(status, f"ringing host {target}")

    def wait_doorbell(self, timeout: float | None = 10.0, *, poll: bool = False) -> tuple[int, int]:
        """(source host, payload) of the next doorbell; ``poll``: spin on DB_POP instead of
        sleeping on the vector."""
        deadline = self._deadline(timeout)
        while True:
            word = self.bar0.read32(regs.REG_DB_POP)
            if word & regs.POP_VALID:
                return word & 0xFF, self.bar0.read32(regs.REG_DB_PAYLOAD)
            if poll:
                if deadline is not None and time.monotonic() > deadline:
                    raise SmcTimeout("waiting for a doorbell (polling): timed out", "did the peer ring?")
                continue
            self._wait(regs.VEC_DOORBELL, deadline, "waiting for a doorbell")

    def drain_doorbells(self) -> list[tuple[int, int]]:
        """Pop every doorbell waiting in this host's FIFO: [(source host, payload), ...] (no wait)."""
        out = []
        while (word := self.bar0.read32(regs.REG_DB_POP)) & regs.POP_VALID:
            out.append((word & 0xFF, self.bar0.read32(regs.REG_DB_PAYLOAD)))
        return out

    def wait_peer_lost(self, timeout: float | None = 10.0) -> int:
        """The ID of the next host whose connection dropped."""
        deadline = self._deadline(timeout)
        while True:
            word = self.bar0.read32(regs.REG_LOST_POP)
            if word & regs.POP_VALID:
                return word & 0xFF
            self._wait(regs.VEC_PEER_LOST, deadline, "waiting for a lost peer")

    # -- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        if self.device is None:
            return
        try:
            if self.reset_on_close:
                self.bar0.write32(regs.REG_CONTROL, regs.CONTROL_RESET)
        finally:
            self.vectors.close()
            self.device.close()
            self.device = None

    def __enter__(self) -> "SmcDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Held:
    """``with smc.semaphore(i) as epoch:`` -- released with that epoch on exit."""

    def __init__(self, smc: SmcDriver, sem: int, timeout: float | None):
        self.smc, self.sem, self.timeout, self.epoch = smc, sem, timeout, None

    def __enter__(self) -> int:
        self.epoch = self.smc.acquire(self.sem, self.timeout)
        return self.epoch

    def __exit__(self, *exc) -> None:
        self.smc.release(self.sem, self.epoch)
