"""The guest SMC driver against the real controller over UNIX sockets.

Only the VFIO layer is a stand-in here (``ClientDevice``, said so): BAR
accesses and MSI-X eventfds go through the vfio-user client that plays
QEMU's part, writes posted as QEMU posts them.  The driver's own logic and
the device's answers are real.
"""

from __future__ import annotations

import os
import select
import threading

import pytest

from vfio_cxl.devices.smc import regs
from vfio_cxl.devices.smc.device import SmcController
from vfio_cxl.devices.smc.regs import Error
from vfio_cxl.devices.vfio_user.client import connect_when_ready
from vfio_cxl.guest.drivers.smc import SmcDriver, SmcError, SmcTimeout
from vfio_cxl.guest.vfio.errors import InterruptTimeout


class _Bar:
    def __init__(self, client):
        self.c = client

    def read32(self, off):
        return self.c.reg_read(off)

    def write32(self, off, value):
        self.c.reg_write(off, value, posted=True)

    def read(self, off, n):
        return self.c.read(regs.BAR_REGS, off, n)

    def write(self, off, data):
        self.c.write(regs.BAR_REGS, off, data, posted=True)


class _Config:
    def __init__(self, client):
        self.c = client

    def read16(self, off):
        return int.from_bytes(self.c.config_read(off, 2), "little")

    def write16(self, off, value):
        self.c.config_write(off, value.to_bytes(2, "little"))


class _Vectors:
    def __init__(self, client, n):
        self.eventfds = client.attach_msix(n)

    def wait(self, vector, timeout):
        p = select.poll()
        p.register(self.eventfds[vector], select.POLLIN)
        if not p.poll(None if timeout is None else max(0, int(timeout * 1000) + 1)):
            raise InterruptTimeout("MSI-X", vector, timeout)
        return os.eventfd_read(self.eventfds[vector])

    def pending(self, vector):
        try:
            return os.eventfd_read(self.eventfds[vector])
        except BlockingIOError:
            return 0

    def close(self):
        for fd in self.eventfds:
            os.close(fd)
        self.eventfds = []


class ClientDevice:
    """The VfioPciDevice surface SmcDriver uses, over the vfio-user client stand-in."""

    def __init__(self, path):
        self.client = connect_when_ready(str(path), timeout=10)
        self.client.negotiate()
        self.config = _Config(self.client)

    def bar(self, index):
        assert index == regs.BAR_REGS
        return _Bar(self.client)

    def msix(self, n):
        return _Vectors(self.client, n)

    def close(self):
        self.client.close()


@pytest.fixture
def drivers(tmp_path):
    paths = [str(tmp_path / f"h{h}.sock") for h in range(3)]
    ctl = SmcController(paths)
    ctl.listen()
    ctl.start()
    opened = []
    try:
        for p in paths:
            opened.append(SmcDriver(ClientDevice(p)))
        yield ctl, opened
    finally:
        for d in opened:
            d.close()
        ctl.close()


def test_identity(drivers):
    _, (a, b, c) = drivers
    assert (a.host_id, b.host_id, c.host_id) == (0, 1, 2)
    assert a.num_hosts == 3 and a.num_sems == regs.NUM_SEMAPHORES
    assert a.alive() == {0, 1, 2}


def test_acquire_blocks_until_release_and_fencing_token_grows(drivers):
    _, (a, b, _) = drivers
    e1 = a.acquire(0)
    got = []
    t = threading.Thread(target=lambda: got.append(b.acquire(0, timeout=10)))
    t.start()
    assert b.state(0)[0] == 0
    a.release(0, e1)
    t.join(15)
    assert got == [e1 + 1]
    with pytest.raises(SmcTimeout):
        a.acquire(0, timeout=0.2)
    with pytest.raises(SmcError) as exc:
        b.release(0, e1)
    assert exc.value.code == Error.STALE_EPOCH
    b.release(0, e1 + 1)


def test_semaphore_context_and_mutual_exclusion(drivers):
    _, hosts = drivers
    inside, count, errors = [], [0], []

    def work(d):
        try:
            for _ in range(15):
                with d.semaphore(4, timeout=20):
                    inside.append(d)
                    if len(inside) > 1:
                        errors.append("two holders")
                    v = count[0]
                    d.alive()
                    count[0] = v + 1
                    inside.remove(d)
        except BaseException as exc:
            errors.append(repr(exc))

    ts = [threading.Thread(target=work, args=(d,)) for d in hosts]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and count[0] == 45


def test_mailbox_and_fenced_send(drivers):
    _, (a, b, c) = drivers
    a.send(1, b"hello")
    m = b.recv(timeout=5)
    assert (m.src, m.seq, m.data) == (0, 1, b"hello")
    epoch = a.acquire(2)
    a.send(2, b"fenced", fence=(2, epoch))
    assert c.recv(timeout=5).data == b"fenced"
    with pytest.raises(SmcError) as exc:
        a.send(2, b"stale", fence=(2, epoch - 1))
    assert exc.value.code == Error.STALE_EPOCH
    with pytest.raises(SmcError):
        a.send(1, b"")
    with pytest.raises(SmcTimeout):
        c.recv(timeout=0.2)


def test_doorbell_wakes_a_blocked_waiter(drivers):
    _, (a, b, _) = drivers
    got = []
    t = threading.Thread(target=lambda: got.append(b.wait_doorbell(timeout=10)))
    t.start()
    a.ring(1, 0xABCD)
    t.join(15)
    assert got == [(0, 0xABCD)]
    a.ring(1, 7)
    assert b.wait_doorbell(timeout=5, poll=True) == (0, 7)
    with pytest.raises(SmcError):
        a.ring(9, 1)


def test_peer_lost_while_holding(drivers):
    ctl, (a, b, c) = drivers
    epoch = b.acquire(7)
    b.device.close()     # the host's connection drops (its QEMU died)
    assert a.wait_peer_lost(timeout=10) == 1
    assert c.wait_peer_lost(timeout=10) == 1
    owner, now = a.state(7)
    assert owner is None and now == epoch + 1
    assert a.acquire(7) == epoch + 2
    with pytest.raises(SmcError) as exc:
        a.send(2, b"zombie", fence=(7, epoch))
    assert exc.value.code == Error.STALE_EPOCH
    b.device = None   # already gone; the fixture must not reset it
    b.vectors.close()
