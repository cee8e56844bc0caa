"""The shared-memory controller over real UNIX sockets: one SmcController (N
vfio-user servers, one shared state) in this process, one vfio-user client
stand-in per host (vfio_cxl.devices.vfio_user.client, playing QEMU's part)."""

from __future__ import annotations

import os
import threading

import pytest

from vfio_cxl.devices.smc import regs
from vfio_cxl.devices.smc.serve import main as smc_main
from vfio_cxl.devices.smc.device import SmcController
from vfio_cxl.devices.smc.regs import Error
from vfio_cxl.devices.smc.state import Input, SmcState
from vfio_cxl.devices.vfio_user import wire
from vfio_cxl.devices.vfio_user.client import connect_when_ready, eventfd_count, wait_eventfd

TIMEOUT = 10.0


class Host:
    """One host's connection: client, its MSI-X eventfds, register helpers."""

    def __init__(self, path):
        self.client = connect_when_ready(str(path), timeout=TIMEOUT)
        self.client.negotiate()
        self.efds = self.client.attach_msix(regs.MSIX_VECTORS)

    def rd(self, reg):
        return self.client.reg_read(reg)

    def wr(self, reg, value):
        self.client.reg_write(reg, value)

    def acquire(self, sem):
        return self.rd(regs.sem_reg(sem, regs.SEM_ACQUIRE))

    def release(self, sem, epoch):
        self.wr(regs.sem_reg(sem, regs.SEM_RELEASE), epoch)

    def send(self, target, data, fence_sem=None, fence=0):
        padded = data.ljust((len(data) + 3) & ~3, b"\0")
        self.client.write(regs.BAR_REGS, regs.REG_TX_DATA, padded)
        if fence_sem is not None:
            self.wr(regs.REG_TX_FENCE, fence)
        self.wr(regs.REG_TX_CTRL, regs.tx_send_word(target, len(data), fence_sem))
        status = self.rd(regs.REG_TX_SEND)
        assert self.rd(regs.REG_TX_STATUS) == status
        return status

    def ring(self, target, payload):
        self.wr(regs.doorbell_reg(target), payload)
        return self.rd(regs.doorbell_reg(target))

    def close(self):
        if self.efds is None:
            return
        self.client.close()
        for fd in self.efds:
            os.close(fd)
        self.efds = None


@pytest.fixture
def smc(tmp_path):
    def make(n):
        paths = [tmp_path / f"host{h}.sock" for h in range(n)]
        ctl = SmcController([str(p) for p in paths])
        ctl.listen()
        ctl.start()
        made.append(ctl)
        hosts = [Host(p) for p in paths]
        opened.extend(hosts)
        return ctl, hosts
    made, opened = [], []
    yield make
    for h in opened:
        h.close()
    for ctl in made:
        ctl.close()


def wait_lost(host, ctl=None):
    assert wait_eventfd(host.efds[regs.VEC_PEER_LOST], TIMEOUT), "no peer-lost interrupt"


def test_identity_and_host_ids(smc):
    _, hosts = smc(3)
    for h, host in enumerate(hosts):
        assert host.rd(regs.REG_ID) == regs.ID_MAGIC
        assert host.rd(regs.REG_HOST_ID) == h
        assert host.rd(regs.REG_NUM_HOSTS) == 3
        assert host.rd(regs.REG_NUM_SEMS) == regs.NUM_SEMAPHORES
        assert host.rd(regs.REG_HOSTS_ALIVE) == 0b111
        ids = host.client.config_read(0, 4)
        assert int.from_bytes(ids[:2], "little") == regs.PCI_VENDOR_ID
        assert int.from_bytes(ids[2:], "little") == regs.PCI_DEVICE_ID
        assert int.from_bytes(host.client.config_read(0x09, 3), "little") == regs.PCI_CLASS_CODE


def test_acquire_busy_release_epochs(smc):
    _, (a, b) = smc(2)
    got = a.acquire(0)
    assert got & regs.ACQ_GRANTED and got & regs.ACQ_EPOCH_MASK == 1
    assert a.acquire(0) == got, "re-reading ACQUIRE as the holder returns the same grant"
    busy = b.acquire(0)
    assert busy == regs.ACQ_BUSY | 0, "BUSY with owner host 0"
    assert b.rd(regs.sem_reg(0, regs.SEM_STATE)) == regs.STATE_HELD | 0
    a.release(0, 1)
    assert wait_eventfd(b.efds[regs.VEC_SEM_FREE], TIMEOUT), "waiter not told the semaphore is free"
    assert b.rd(regs.sem_reg(0, regs.SEM_STATE)) == regs.NO_HOST
    got = b.acquire(0)
    assert got == regs.ACQ_GRANTED | 2
    assert b.rd(regs.sem_reg(0, regs.SEM_EPOCH)) == 2


def test_mutual_exclusion_across_connections(smc):
    """Four hosts, each on its own thread and connection, increment a counter only
    while holding semaphore 3; a second holder at any moment fails the test."""
    _, hosts = smc(4)
    inside, counter, epochs, errors = [], [0], [], []
    rounds = 25

    def worker(host):
        try:
            for _ in range(rounds):
                while True:
                    got = host.acquire(3)
                    if got & regs.ACQ_GRANTED:
                        break
                    assert got & regs.ACQ_BUSY
                    wait_eventfd(host.efds[regs.VEC_SEM_FREE], 0.05)
                epoch = got & regs.ACQ_EPOCH_MASK
                inside.append(host)
                if len(inside) != 1:
                    errors.append(f"{len(inside)} holders at once")
                value = counter[0]
                host.rd(regs.REG_ID)          # a round trip while holding it
                counter[0] = value + 1
                epochs.append(epoch)
                inside.remove(host)
                host.release(3, epoch)
                assert host.rd(regs.REG_LAST_ERROR) == 0
        except BaseException as exc:   # reported by the main thread
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert counter[0] == rounds * len(hosts)
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs), "epochs grow with every grant"


def test_holder_disconnect_bumps_epoch_and_signals_peer_lost(smc):
    ctl, (a, b, c) = smc(3)
    got = b.acquire(5)
    stale = got & regs.ACQ_EPOCH_MASK
    b.close()
    for survivor in (a, c):
        wait_lost(survivor)
        assert survivor.rd(regs.REG_INTR_STATUS) & regs.INTR_PEER_LOST
        assert survivor.rd(regs.REG_LOST_COUNT) == 1
        assert survivor.rd(regs.REG_LOST_POP) == regs.POP_VALID | 1
        assert survivor.rd(regs.REG_LOST_POP) == 0, "one event per lost host"
        assert survivor.rd(regs.REG_HOSTS_ALIVE) == 0b101
    assert a.rd(regs.sem_reg(5, regs.SEM_STATE)) == regs.NO_HOST
    assert a.rd(regs.sem_reg(5, regs.SEM_EPOCH)) == stale + 1
    got = a.acquire(5)
    assert got == regs.ACQ_GRANTED | (stale + 2)
    # a send fenced with the lost holder's token is refused; with the new one it goes through
    assert a.send(2, b"zombie", fence_sem=5, fence=stale) == Error.STALE_EPOCH
    assert c.rd(regs.REG_RX_COUNT) == 0
    assert a.send(2, b"fresh", fence_sem=5, fence=stale + 2) == Error.OK
    assert c.rd(regs.REG_RX_COUNT) == 1


def test_doorbell_fifo(smc):
    _, (a, b) = smc(2)
    assert b.ring(0, 0xCAFE) == Error.OK
    assert b.ring(0, 0xBEEF) == Error.OK
    assert wait_eventfd(a.efds[regs.VEC_DOORBELL], TIMEOUT)
    assert a.rd(regs.REG_DB_COUNT) == 2
    assert a.rd(regs.REG_DB_POP) == regs.POP_VALID | 1
    assert a.rd(regs.REG_DB_PAYLOAD) == 0xCAFE
    assert a.rd(regs.REG_DB_POP) == regs.POP_VALID | 1
    assert a.rd(regs.REG_DB_PAYLOAD) == 0xBEEF
    assert a.rd(regs.REG_DB_POP) == 0
    a.wr(regs.REG_INTR_STATUS, regs.INTR_DOORBELL)
    assert a.rd(regs.REG_INTR_STATUS) & regs.INTR_DOORBELL == 0
    for i in range(regs.DOORBELL_FIFO_DEPTH + 2):
        b.ring(0, i)
    assert a.rd(regs.REG_DB_COUNT) == regs.DOORBELL_FIFO_DEPTH
    assert a.rd(regs.REG_DB_DROPPED) == 2
    assert b.rd(regs.REG_LAST_ERROR) == Error.DB_FULL
    assert b.rd(regs.REG_ERROR_REG) == regs.doorbell_reg(0)


def test_mailbox_send_receive_and_full(smc):
    _, (a, b) = smc(2)
    for i in range(regs.MAILBOX_SLOTS):
        assert a.send(1, bytes([i + 1]) * (10 + i)) == Error.OK
    assert a.send(1, b"one too many") == Error.MBOX_FULL
    assert wait_eventfd(b.efds[regs.VEC_MAILBOX], TIMEOUT) == regs.MAILBOX_SLOTS
    for i in range(regs.MAILBOX_SLOTS):
        assert b.rd(regs.REG_RX_COUNT) == regs.MAILBOX_SLOTS - i
        assert b.rd(regs.REG_RX_SRC) == 0
        assert b.rd(regs.REG_RX_SEQ) == i + 1
        n = b.rd(regs.REG_RX_LEN)
        assert n == 10 + i
        data = b.client.read(regs.BAR_REGS, regs.REG_RX_DATA, regs.MAILBOX_MSG_SIZE)
        assert data == (bytes([i + 1]) * n).ljust(regs.MAILBOX_MSG_SIZE, b"\0")
        assert b.rd(regs.REG_RX_POP) == regs.MAILBOX_SLOTS - i - 1
    assert b.rd(regs.REG_RX_POP) == 0, "popping an empty mailbox is harmless"
    assert b.rd(regs.REG_RX_SRC) == regs.NO_HOST
    assert a.send(1, b"x" * 64) == Error.OK


@pytest.mark.parametrize("action, error", [
    (lambda a: a.release(0, 1), Error.NOT_OWNER),
    (lambda a: a.ring(9, 1), Error.BAD_INDEX),                            # no host 9 of 2
    (lambda a: a.wr(regs.REG_ID, 1), Error.BAD_REGISTER),
    (lambda a: a.wr(0xF00, 1), Error.BAD_REGISTER),
    (lambda a: a.send(1, b""), Error.BAD_LENGTH),
    (lambda a: a.send(7, b"x"), Error.BAD_INDEX),
    (lambda a: a.send(1, b"x", fence_sem=40, fence=1), Error.BAD_INDEX),
])
def test_bad_input_latches_an_error_and_changes_nothing(smc, action, error):
    _, (a, b) = smc(2)
    action(a)
    assert a.rd(regs.REG_LAST_ERROR) == error
    a.wr(regs.REG_LAST_ERROR, 0)
    assert a.rd(regs.REG_LAST_ERROR) == 0 and a.rd(regs.REG_ERROR_REG) == 0
    assert b.rd(regs.REG_RX_COUNT) == 0
    assert all(a.rd(regs.sem_reg(i, regs.SEM_STATE)) == regs.NO_HOST for i in range(regs.NUM_SEMAPHORES))
    assert a.acquire(0) & regs.ACQ_GRANTED, "the controller still works"


def test_semaphore_block_covers_exactly_the_semaphores():
    assert regs.sem_reg(regs.NUM_SEMAPHORES, 0) == regs.REG_TX_DATA, \
        "the spec says a semaphore index is out of range only in a fenced send"


def test_release_with_stale_epoch_is_refused(smc):
    _, (a, b) = smc(2)
    epoch = a.acquire(1) & regs.ACQ_EPOCH_MASK
    a.release(1, epoch + 7)
    assert a.rd(regs.REG_LAST_ERROR) == Error.STALE_EPOCH
    assert a.rd(regs.sem_reg(1, regs.SEM_STATE)) == regs.STATE_HELD | 0, "still held"
    b.release(1, epoch)
    assert b.rd(regs.REG_LAST_ERROR) == Error.NOT_OWNER


def test_reset_releases_with_new_epoch_and_clears_queues(smc):
    _, (a, b) = smc(2)
    epoch = a.acquire(2) & regs.ACQ_EPOCH_MASK
    b.ring(0, 5)
    a.wr(regs.REG_CONTROL, regs.CONTROL_RESET)
    assert a.rd(regs.sem_reg(2, regs.SEM_STATE)) == regs.NO_HOST
    assert a.rd(regs.sem_reg(2, regs.SEM_EPOCH)) == epoch + 1
    assert a.rd(regs.REG_DB_COUNT) == 0
    assert eventfd_count(b.efds[regs.VEC_PEER_LOST]) == 0, "a reset is not a lost host"
    b.client.reset()   # DEVICE_RESET: b's own state only
    assert a.rd(regs.REG_HOSTS_ALIVE) == 0b11


def test_reconnected_host_starts_clean(smc, tmp_path):
    ctl, (a, b) = smc(2)
    a.ring(1, 1)
    b.close()
    wait_lost(a)
    b2 = Host(tmp_path / "host1.sock")
    try:
        assert b2.rd(regs.REG_HOST_ID) == 1
        assert b2.rd(regs.REG_DB_COUNT) == 0
        assert a.rd(regs.REG_HOSTS_ALIVE) == 0b11
    finally:
        b2.close()


def test_state_rejects_unknown_host():
    state = SmcState(2)
    with pytest.raises(ValueError, match="host 2"):
        state.input(Input.READ, 2, regs.REG_ID)
    with pytest.raises(ValueError, match="1 to 16"):
        SmcState(17)


def test_cli_bad_arguments(capsys):
    assert smc_main(["serve", "--socket", "/x/a", "--socket", "/x/a"]) == 2
    assert "twice" in capsys.readouterr().err
    assert smc_main(["serve", "--sockets", "/nonexistent", "--hosts", "40"]) == 2
    assert "1 to 16" in capsys.readouterr().err
    # a sockets directory that cannot be made (under a file): named, nothing listens
    assert smc_main(["serve", "--sockets", "/dev/null/smc", "--hosts", "2"]) == 1
    assert "cannot create the sockets directory /dev/null/smc" in capsys.readouterr().err


def test_a_repeated_release_is_a_no_op_after_others_took_and_released_it(smc):
    """Three hosts contending (seen in the three-host VM test): a's release reached the device
    twice, the second time after b and c had each taken and released the semaphore."""
    _, (a, b, c) = smc(3)
    epoch = a.acquire(0) & regs.ACQ_EPOCH_MASK
    a.release(0, epoch)
    for h in (b, c):
        e = h.acquire(0) & regs.ACQ_EPOCH_MASK
        h.release(0, e)
    a.release(0, epoch)                       # the late repeat
    assert a.rd(regs.REG_LAST_ERROR) == 0
    e = c.acquire(0) & regs.ACQ_EPOCH_MASK
    a.release(0, epoch)                       # and while c holds it: still a no-op, c keeps it
    assert a.rd(regs.REG_LAST_ERROR) == 0 and c.rd(regs.sem_reg(0, regs.SEM_STATE)) == regs.STATE_HELD | 2
    a.release(0, e)                           # a release of an epoch a never held is refused
    assert a.rd(regs.REG_LAST_ERROR) != 0


def test_every_write_is_idempotent(smc):
    """A guest BAR write may reach the device twice (seen through QEMU): writing each
    register twice must leave the same state as writing it once."""
    _, (a, b) = smc(2)
    epoch = a.acquire(0) & regs.ACQ_EPOCH_MASK
    a.release(0, epoch)
    a.release(0, epoch)                       # the repeated release is a no-op, not an error
    assert a.rd(regs.REG_LAST_ERROR) == 0
    assert b.acquire(0) == regs.ACQ_GRANTED | (epoch + 1)
    a.release(0, epoch)                       # still a no-op after someone else took it
    assert a.rd(regs.REG_LAST_ERROR) == 0 and b.rd(regs.sem_reg(0, regs.SEM_STATE)) == regs.STATE_HELD | 1
    for reg in (regs.doorbell_reg(1), regs.REG_TX_CTRL, regs.REG_TX_FENCE, regs.REG_TX_DATA):
        a.wr(reg, 0x01000001)
        a.wr(reg, 0x01000001)
    assert b.rd(regs.REG_DB_COUNT) == 0 and b.rd(regs.REG_RX_COUNT) == 0, "writes only stage"
    assert a.rd(regs.doorbell_reg(1)) == Error.OK and b.rd(regs.REG_DB_COUNT) == 1
    assert a.rd(regs.REG_TX_SEND) == Error.OK and b.rd(regs.REG_RX_COUNT) == 1
