"""Top-level Lock, RLock, Semaphore, BoundedSemaphore, Event, Condition, Barrier, Value and Array work
across roving processes, with multiprocessing's semantics and errors."""
from __future__ import annotations

import threading
import time

import pytest

import roving
from roving.transport import rpc as _rpc
from helpers_core import TIMEOUT, finish, serves_connection_of, start, wait_until


# -- targets run in children (imported by reference from this module) ---------------------------

def add_under_lock(value, n):
    for _ in range(n):
        with value.get_lock():
            value.value += 1


def try_acquire(lock, timeout, out):
    t0 = time.monotonic()
    got = lock.acquire(timeout=timeout)
    out.put((got, time.monotonic() - t0))


def release_foreign(lock, out):
    try:
        lock.release()
        out.put("released")
    except Exception as exc:
        out.put(type(exc).__name__)


def wait_event(event, out):
    out.put(event.wait(TIMEOUT))


def wait_condition(cond, ready, out):
    with cond:
        ready.set()
        out.put(cond.wait(TIMEOUT))


def barrier_party(barrier, out):
    try:
        out.put(barrier.wait())
    except Exception as exc:
        out.put(type(exc).__name__)


def hold_semaphore(sem, inside, out, leave):
    with sem:
        inside.put(1)
        leave.wait(TIMEOUT)
        out.put(1)


def make_lock_and_exit(out):
    out.put(roving.Lock())


def write_array(arr):
    with arr.get_lock():
        arr[0] = 42
        arr[1:3] = [7, 8]


def hold_until(lock, held, done):
    with lock:
        held.set()
        done.wait(TIMEOUT)


def count_action(counter):
    with counter.get_lock():
        counter.value += 1


# -- locks ------------------------------------------------------------------------------------

def test_lock_makes_read_modify_write_of_a_value_exact_across_processes():
    v = roving.Value("i", 0)
    procs = [start(add_under_lock, v, 150) for _ in range(2)]
    add_under_lock(v, 100)
    finish(*procs)
    assert v.value == 400


def test_acquire_timeout_is_kept_by_the_home_and_nonblocking_returns_false():
    lock, out = roving.Lock(), roving.Queue()
    assert lock.acquire()
    assert lock.acquire(block=False) is False
    p = start(try_acquire, lock, 0.3, out)
    got, waited = out.get(timeout=TIMEOUT)
    finish(p)
    assert got is False and 0.25 <= waited < TIMEOUT
    lock.release()
    assert lock.acquire(timeout=0) is True
    lock.release()


def test_lock_released_twice_raises_valueerror_and_a_foreign_release_is_allowed_as_in_mp():
    lock, out = roving.Lock(), roving.Queue()
    with pytest.raises(ValueError):
        lock.release()
    lock.acquire()
    p = start(release_foreign, lock, out)
    assert out.get(timeout=TIMEOUT) == "released"  # multiprocessing.Lock is a semaphore: no owner check
    finish(p)
    assert lock.acquire(block=False) is True


def test_rlock_is_reentrant_per_thread_and_a_non_owner_release_raises_assertionerror():
    rlock, out = roving.RLock(), roving.Queue()
    assert rlock.acquire() and rlock.acquire()
    p = start(release_foreign, rlock, out)
    assert out.get(timeout=TIMEOUT) == "AssertionError"
    finish(p)
    other = []
    t = threading.Thread(target=lambda: other.append(rlock.acquire(timeout=0.1)))
    t.start()
    t.join(TIMEOUT)
    assert other == [False]  # another thread of the owner process is not the owner
    rlock.release()
    assert rlock.acquire(block=False)  # still held once more, reentrant
    rlock.release()
    rlock.release()
    with pytest.raises(AssertionError):
        rlock.release()


def test_waiters_are_served_in_the_order_they_started_waiting():
    lock = roving.Lock()
    lock.acquire()
    order, threads = [], []
    waiting = _rpc_home_waiters(lock)
    for i in range(4):
        def grab(i=i):
            with lock:
                order.append(i)
        t = threading.Thread(target=grab)
        t.start()
        threads.append(t)
        assert wait_until(lambda: waiting() == i + 1, TIMEOUT)  # each one queued up before the next
    lock.release()
    for t in threads:
        t.join(TIMEOUT)
    assert order == [0, 1, 2, 3]


def test_semaphore_admits_value_holders_and_bounded_semaphore_rejects_extra_release():
    sem, inside, out = roving.Semaphore(2), roving.Queue(), roving.Queue()
    assert sem.get_value() == 2
    leave = roving.Event()
    procs = [start(hold_semaphore, sem, inside, out, leave) for _ in range(2)]
    for _ in range(2):
        inside.get(timeout=TIMEOUT)
    assert sem.acquire(timeout=0.1) is False  # both permits are held by the children
    leave.set()
    finish(*procs)
    assert sem.get_value() == 2
    bsem = roving.BoundedSemaphore(1)
    with pytest.raises(ValueError):
        bsem.release()
    unbounded = roving.Semaphore(0)
    unbounded.release()
    assert unbounded.get_value() == 1
    with pytest.raises(ValueError):
        roving.Semaphore(-1)


# -- event, condition, barrier --------------------------------------------------------------

def test_event_set_in_one_process_wakes_a_waiter_in_another():
    event, out = roving.Event(), roving.Queue()
    assert event.wait(0.1) is False
    p = start(wait_event, event, out)
    assert wait_until(lambda: _rpc_home_waiters(event)() == 1, TIMEOUT)  # the child waits at the home
    event.set()
    assert out.get(timeout=TIMEOUT) is True
    finish(p)
    assert event.is_set()
    event.clear()
    assert not event.is_set()


def test_condition_notify_wakes_a_waiter_in_another_process_and_wait_times_out():
    cond, ready, out = roving.Condition(), roving.Event(), roving.Queue()
    p = start(wait_condition, cond, ready, out)
    assert ready.wait(TIMEOUT)
    with cond:  # the child released the lock by waiting
        cond.notify()
    assert out.get(timeout=TIMEOUT) is True
    finish(p)
    with cond:
        assert cond.wait(0.1) is False
        assert cond.wait_for(lambda: True, 0.1) is True
    with pytest.raises(RuntimeError):
        cond.notify()
    with pytest.raises(RuntimeError):
        cond.wait(0.1)


def test_condition_over_a_plain_lock_and_bad_lock_type():
    cond = roving.Condition(roving.Lock())
    with cond:
        cond.notify_all()
        assert cond.wait(0.05) is False
    with pytest.raises(TypeError):
        roving.Condition(threading.Lock())


def test_barrier_releases_all_parties_with_distinct_indices_and_runs_the_action_once():
    counter = roving.Value("i", 0)
    barrier, out = roving.Barrier(3, action=_Action(counter)), roving.Queue()
    procs = [start(barrier_party, barrier, out) for _ in range(2)]
    mine = barrier.wait(TIMEOUT)
    theirs = [out.get(timeout=TIMEOUT) for _ in procs]
    finish(*procs)
    assert sorted([mine, *theirs]) == [0, 1, 2]
    assert counter.value == 1
    assert barrier.parties == 3 and barrier.n_waiting == 0 and not barrier.broken


def test_barrier_wait_timeout_breaks_it_for_every_party():
    barrier, out = roving.Barrier(3), roving.Queue()
    p = start(barrier_party, barrier, out)
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait(0.5)
    assert out.get(timeout=TIMEOUT) == "BrokenBarrierError"
    finish(p)
    assert barrier.broken
    barrier.reset()
    assert not barrier.broken


class _Action:
    def __init__(self, counter):
        self.counter = counter

    def __call__(self):
        count_action(self.counter)


# -- Value / Array ----------------------------------------------------------------------------

def test_array_indexing_slicing_and_lock_as_in_multiprocessing():
    arr = roving.Array("i", 4)
    assert len(arr) == 4 and arr[:] == [0, 0, 0, 0]
    p = start(write_array, arr)
    finish(p)
    assert arr[:] == [42, 7, 8, 0] and list(arr) == [42, 7, 8, 0] and arr[-1] == 0
    raw = roving.Array("d", [1.5, 2.5], lock=False)
    assert not hasattr(raw, "get_lock") and raw[1] == 2.5
    chars = roving.Array("c", b"hello")
    assert chars.value == b"hello" and chars.raw == b"hello"
    with pytest.raises(IndexError):
        arr[10]
    with pytest.raises(TypeError):
        roving.Array("Q!", 3)


def test_value_get_obj_shares_the_home_and_a_given_lock_is_used():
    lock = roving.Lock()
    v = roving.Value("d", 1.0, lock=lock)
    assert v.get_lock() is lock
    v.get_obj().value = 2.5
    assert v.value == 2.5
    with v:
        assert lock.acquire(block=False) is False
    assert roving.RawValue("i", 3).value == 3 and roving.RawArray("i", [1, 2])[:] == [1, 2]
    with pytest.raises(AttributeError):
        roving.Value("i", 0, lock=object())


# -- a home that has gone ----------------------------------------------------------------------

def test_a_primitive_whose_home_process_ended_raises_promptly_instead_of_hanging():
    out = roving.Queue()
    p = start(make_lock_and_exit, out)
    lock = out.get(timeout=TIMEOUT)
    finish(p)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        lock.acquire()
    assert "gone" in str(info.value)
    assert time.monotonic() - t0 < 5  # its port refuses: no waiting out connect_timeout (10 s)
    t0 = time.monotonic()
    with pytest.raises(_rpc.ServerGone):
        lock.release()
    assert time.monotonic() - t0 < 1


def test_a_lock_handed_to_a_waiter_killed_while_waiting_is_taken_back():
    for make in (roving.Lock, roving.RLock, lambda: roving.Semaphore(1)):
        lock = make()
        assert lock.acquire()
        p = start(try_acquire, lock, None, roving.Queue())  # blocks until killed
        waiting = _rpc_home_waiters(lock)
        assert wait_until(lambda: waiting() > 0, TIMEOUT), "the child never started waiting"
        p.kill()
        p.join(TIMEOUT)
        # the home has seen the connection close
        assert wait_until(lambda: not serves_connection_of(p.node_id), TIMEOUT)
        lock.release()  # hands the lock to the dead waiter: it must come back
        assert lock.acquire(timeout=5), f"{make}: the lock went to a process that had gone"
        lock.release()


def _rpc_home_waiters(lock):
    """A function counting those waiting on ``lock`` (a lock, semaphore or event) at its home (this
    process)."""
    from roving import synchronize

    objects = synchronize.home().objects

    def waiting() -> int:
        state = objects[lock._id]
        return len(state.queue if hasattr(state, "queue") else state.waiters)
    return waiting


# -- reprs ------------------------------------------------------------------------------------

def _reprs(m):
    """The reprs multiprocessing's tests and users see, for module ``m`` (multiprocessing or roving)."""
    out = {}
    lock, rlock = m.Lock(), m.RLock()
    out["lock free"] = repr(lock)
    with lock:
        out["lock mine"] = repr(lock)
        seen = []
        t = threading.Thread(target=lambda: seen.append(repr(lock)), name="Reader")
        t.start()
        t.join(TIMEOUT)
        out["lock other thread"] = seen[0]

        def own_in_thread():
            with lock2:
                seen.append(repr(lock2))
        lock2 = m.Lock()
        t = threading.Thread(target=own_in_thread, name="Owner")
        t.start()
        t.join(TIMEOUT)
        out["lock mine in thread"] = seen[1]
    out["rlock free"] = repr(rlock)
    with rlock, rlock:
        out["rlock mine"] = repr(rlock)
    out["sem"] = repr(m.Semaphore(3))
    out["bsem"] = repr(m.BoundedSemaphore(2))
    bsem = m.BoundedSemaphore(2)
    bsem.acquire()
    out["bsem taken"] = repr(bsem)
    cond = m.Condition(m.Lock())
    out["cond"] = repr(cond)
    event = m.Event()
    out["event unset"] = repr(event).replace(hex(id(event)), "ADDR")
    event.set()
    out["event set"] = repr(event).replace(hex(id(event)), "ADDR")
    return out


def test_reprs_read_as_multiprocessing_s_do():
    import multiprocessing

    expected = _reprs(multiprocessing.get_context("spawn"))
    got = _reprs(roving)
    assert got == expected
    assert expected["event unset"] == "<Event at ADDR unset>"  # the format the issue names
    assert expected["lock mine in thread"] == "<Lock(owner=MainProcess|Owner)>"


def test_a_lock_held_by_another_process_reads_someotherprocess_as_in_multiprocessing():
    lock, rlock, held, done = roving.Lock(), roving.RLock(), roving.Event(), roving.Event()
    p = start(hold_until, lock, held, done)
    q = start(hold_until, rlock, held, done)
    try:
        assert wait_until(lambda: repr(lock) == "<Lock(owner=SomeOtherProcess)>"
                          and repr(rlock) == "<RLock(SomeOtherProcess, nonzero)>", TIMEOUT), (lock, rlock)
    finally:
        done.set()
    finish(p, q)
    assert repr(lock) == "<Lock(owner=None)>" and repr(rlock) == "<RLock(None, 0)>"
