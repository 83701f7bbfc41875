"""Timeouts are clamped wherever a caller's or a peer's value meets the clock (issue 18, finding 5):
``inf`` and huge values mean "no timeout", negative ones "do not wait", NaN is a ValueError; a huge
timeout from a child or from a raw authenticated request never stops a queue's owner from serving."""
from __future__ import annotations

import math
import queue
import threading
import time

import pytest

import roving
from helpers_core import TIMEOUT, finish, start, wait_until, waiting_readers
from roving.transport import node as _node
from roving.transport import session as _session
from roving.transport import timeouts
from roving.transport.endpoint import Endpoint

INF = float("inf")


# -- targets run in children -------------------------------------------------------------------

def get_forever(q, out, timeout):
    out.put(("got", q.get(timeout=timeout)))


def round_trips(requests, answers, n):
    for i in range(n):
        requests.put(i)
        assert answers.get(timeout=TIMEOUT) == i * 2


# -- the helper ----------------------------------------------------------------------------------

def test_the_helper_maps_inf_and_huge_to_no_timeout_negative_to_zero_and_refuses_nan():
    assert timeouts.limit(None) is None and timeouts.limit(INF) is None and timeouts.limit(1e300) is None
    assert timeouts.limit(2.5) == 2.5 and timeouts.limit(-3) == 0.0 and timeouts.limit(timeouts.LONGEST) == 1e9
    with pytest.raises(ValueError, match="'timeout'.*NaN"):
        timeouts.limit(math.nan)
    with pytest.raises(TypeError, match="'timeout' must be a number"):
        timeouts.limit("soon")
    assert timeouts.to_wire(False, INF) == 0.0 and timeouts.to_wire(True, INF) == timeouts.FOREVER
    assert timeouts.to_wire(True, None) == timeouts.FOREVER and timeouts.to_wire(True, 4) == 4.0
    for sent, want in [(INF, -1.0), (1e300, -1.0), (-INF, -1.0), (-5, -1.0), (math.nan, 0.0), ("x", 0.0),
                       (0, 0.0), (7.5, 7.5)]:
        assert timeouts.from_wire(sent) == want, sent
    assert timeouts.deadline(INF) is None and timeouts.deadline(None) is None
    assert abs(timeouts.deadline(10) - time.monotonic() - 10) < 1


# -- queues ----------------------------------------------------------------------------------

def test_a_get_with_an_infinite_timeout_from_a_child_waits_and_the_owner_keeps_serving_others():
    # Before the fix the owner's node raised OverflowError on every turn from here on.
    q, out = roving.Queue(), roving.Queue()
    requests, answers = roving.Queue(), roving.Queue()
    waiting = start(get_forever, q, out, INF)
    # its get is at the owner (this process's node) before the others go on
    assert wait_until(lambda: waiting_readers(q) == 1, TIMEOUT)
    other = start(round_trips, requests, answers, 20)
    for _ in range(20):
        answers.put(requests.get(timeout=TIMEOUT) * 2)
    finish(other)
    assert other.exitcode == 0
    with pytest.raises(queue.Empty):
        out.get(timeout=0.5)  # still waiting, as told
    q.put("late item")
    assert out.get(timeout=TIMEOUT) == ("got", "late item")
    waiting.join(INF)
    assert waiting.exitcode == 0


def test_local_waits_take_inf_and_huge_timeouts_and_refuse_nan():
    q = roving.Queue()
    threading.Timer(0.3, q.put, ("x",)).start()
    assert q.get(timeout=INF) == "x"
    threading.Timer(0.3, q.put, ("y",)).start()
    assert q.get(timeout=1e300) == "y"
    with pytest.raises(ValueError, match="NaN"):
        q.get(timeout=math.nan)
    with pytest.raises(ValueError, match="non-negative"):
        q.get(timeout=-1)
    jq = roving.JoinableQueue()
    assert jq.join(timeout=INF) is True


@pytest.mark.parametrize("sent", [1e300, INF, -INF, math.nan])
def test_a_raw_authenticated_request_with_a_huge_timeout_does_not_break_the_node(sent):
    q = roving.Queue()
    requests, answers = roving.Queue(), roving.Queue()
    session = _session.current()
    raw = Endpoint(q._address, session.secret, None)  # over the network, as another process's would be
    got = []
    caller = threading.Thread(target=lambda: got.append(raw.call(_node.GET, q._box, sent)), daemon=True)
    caller.start()
    # the node has the request: it waits there (or, with NaN, it was answered at once: no wait)
    assert wait_until(lambda: waiting_readers(q) == 1 or got, TIMEOUT)
    other = start(round_trips, requests, answers, 10)  # the node still serves everyone else
    for _ in range(10):
        answers.put(requests.get(timeout=TIMEOUT) * 2)
    finish(other)
    assert other.exitcode == 0
    q.put("item")
    caller.join(TIMEOUT)
    assert not caller.is_alive()
    status, frames = got[0]
    if math.isnan(sent):  # NaN from a peer: no wait (answered at once, before the item came)
        assert status == _node.EMPTY
        assert q.get(timeout=TIMEOUT) == "item"
    else:
        assert status == _node.OK and len(frames) > 0
        with pytest.raises(queue.Empty):
            q.get(timeout=0.2)  # the raw call took it


# -- synchronization, pipes, pools ---------------------------------------------------------------

def test_lock_event_condition_semaphore_and_barrier_take_an_infinite_timeout():
    lock = roving.Lock()
    assert lock.acquire(timeout=INF) is True
    threading.Timer(0.3, lock.release).start()
    assert lock.acquire(timeout=INF) is True  # waited for the release
    lock.release()
    ev = roving.Event()
    threading.Timer(0.3, ev.set).start()
    assert ev.wait(INF) is True
    assert roving.Semaphore(1).acquire(timeout=1e300) is True
    cond = roving.Condition()
    with cond:
        assert cond.wait_for(lambda: True, timeout=INF) is True
    assert roving.Barrier(1).wait(timeout=INF) == 0
    with pytest.raises(ValueError, match="NaN"):
        lock.acquire(timeout=math.nan)


def test_a_pipe_polls_with_an_infinite_timeout():
    a, b = roving.Pipe()
    threading.Timer(0.3, a.send, ("hello",)).start()
    assert b.poll(INF) is True and b.recv() == "hello"
    assert b.poll(-1) is False  # negative: do not wait, as multiprocessing
    with pytest.raises(ValueError, match="NaN"):
        b.poll(math.nan)


def test_pool_results_take_an_infinite_timeout():
    with roving.Pool(1) as pool:
        assert pool.apply_async(abs, (-3,)).get(timeout=INF) == 3
        it = pool.imap(abs, [-1, -2])
        assert [it.next(timeout=INF), it.next(timeout=1e300)] == [1, 2]
        pool.close()
        pool.join(INF)
