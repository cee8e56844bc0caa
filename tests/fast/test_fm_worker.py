"""The fabric manager's op worker (vfio_cxl.lab.fm.worker): one job at a time, under the lock,
the lock dropped only around a blocking call, the outbox, and the stop."""

from __future__ import annotations

import selectors
import threading

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab.fm.worker import OpWorker


def wait_outbox(worker: OpWorker) -> list:
    """Wait (on the wake-up socket, as the loop does) until the worker posted something."""
    with selectors.DefaultSelector() as sel:
        sel.register(worker.wake[0], selectors.EVENT_READ)
        while True:
            assert sel.select(timeout=10), "the worker posted nothing within 10 s"
            out = worker.take_outbox()
            if out:
                return out


def test_jobs_run_in_order_on_the_worker_thread_with_the_lock_held():
    seen = []

    def run(kind, client, request):
        seen.append((kind, request["n"], worker.lock.locked(), worker.in_worker()))
        worker.post(client, f"done {request['n']}".encode())

    worker = OpWorker(run, "lab1")
    worker.start()
    try:
        for n in range(3):
            worker.put("op", "c", {"n": n})
        out = []
        while len(out) < 3:
            out += wait_outbox(worker)
        assert out == [("c", b"done 0"), ("c", b"done 1"), ("c", b"done 2")]
        assert seen == [("op", n, True, True) for n in range(3)]
        assert not worker.in_worker()
    finally:
        assert worker.stop(10)


def test_unlocked_drops_the_lock_for_the_call_only():
    inside = threading.Event()
    release = threading.Event()
    during = []

    def blocking():
        inside.set()
        assert release.wait(10)
        return 42

    def run(kind, client, request):
        result = worker.unlocked(blocking)
        during.append((result, worker.lock.locked()))
        worker.post(None, b"x")

    worker = OpWorker(run, "lab1")
    worker.start()
    try:
        worker.put("op", None, {})
        assert inside.wait(10)
        with worker.lock:   # the loop can take the lock while the worker blocks
            release.set()
        wait_outbox(worker)
        assert during == [(42, True)]
    finally:
        assert worker.stop(10)


def test_outside_the_worker_unlocked_just_calls():
    worker = OpWorker(lambda *job: None, "lab1")
    assert worker.unlocked(lambda a, b=0: a + b, 1, b=2) == 3
    assert worker.stop(1)


def test_a_stop_ends_the_running_job_at_its_next_blocking_step_and_skips_the_queue():
    inside, release = threading.Event(), threading.Event()
    errors, ran = [], []

    def run(kind, client, request):
        ran.append(request["n"])
        try:
            worker.unlocked(lambda: inside.set() or release.wait(10))
        except LabError as err:
            errors.append(err)

    worker = OpWorker(run, "lab1")
    worker.start()
    worker.put("op", None, {"n": 1})
    worker.put("op", None, {"n": 2})
    assert inside.wait(10)
    stopper = threading.Thread(target=worker.stop, args=(10,))
    stopper.start()
    while not worker._stopping:   # stop() has set the flag (under the lock) before it joins
        pass
    release.set()
    stopper.join(10)
    assert ran == [1]
    assert [(e.what, e.fix) for e in errors] == [("lab lab1 is stopping", "start it again")]


def test_post_without_a_loop_does_not_raise():
    worker = OpWorker(lambda *job: None, "lab1")
    worker.stop(1)   # closes the wake-up pair
    worker.post(None, b"x")
    with pytest.raises(OSError):
        worker.wake[0].recv(1)
