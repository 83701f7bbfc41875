"""Queue, SimpleQueue and JoinableQueue behave as in multiprocessing, across processes."""
from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

import helpers_targets as h
import roving
import roving.transport.session
from helpers_core import TIMEOUT, finish, serves_connection_of, start, wait_until


# -- one process -------------------------------------------------------------------------------

def test_put_get_is_fifo_and_keeps_values_equal():
    q = roving.Queue()
    items = [1, "two", (3, [4]), {"five": 5.0}, None, b"six"]
    for item in items:
        q.put(item)
    assert [q.get(timeout=TIMEOUT) for _ in items] == items


def test_put_serializes_at_once_so_later_changes_do_not_reach_the_queue():
    q = roving.Queue()
    data = [1, 2]
    q.put(data)
    data.append(3)
    assert q.get(timeout=TIMEOUT) == [1, 2]


def test_get_on_empty_queue_raises_empty_without_block_and_after_timeout():
    q = roving.Queue()
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(block=False)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    with pytest.raises(queue.Empty):
        q.get(True, 0.1)


def test_bounded_queue_raises_full_without_block_and_after_timeout():
    q = roving.Queue(maxsize=2)
    q.put(1)
    q.put_nowait(2)
    assert q.full()
    assert q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    with pytest.raises(queue.Full):
        q.put(3, block=False)
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.2)
    assert q.get(timeout=TIMEOUT) == 1
    assert not q.full()
    q.put(3, timeout=TIMEOUT)
    assert [q.get(timeout=TIMEOUT), q.get(timeout=TIMEOUT)] == [2, 3]
    assert q.empty()


def test_blocked_put_on_full_queue_completes_when_a_reader_makes_room():
    q = roving.Queue(maxsize=1)
    q.put("first")
    done = threading.Event()

    def blocked_put():
        q.put("second", timeout=TIMEOUT)
        done.set()

    t = threading.Thread(target=blocked_put)
    t.start()
    assert not done.wait(0.2)  # room is needed first
    assert q.get(timeout=TIMEOUT) == "first"
    t.join(TIMEOUT)
    assert done.is_set()
    assert q.get(timeout=TIMEOUT) == "second"


def test_qsize_empty_and_full_follow_the_contents():
    q = roving.Queue()
    assert q.empty() and q.qsize() == 0 and not q.full()
    q.put("a")
    q.put("b")
    assert q.qsize() == 2 and not q.empty()
    assert not q.full()  # unbounded: never full
    q.get(timeout=TIMEOUT)
    q.get(timeout=TIMEOUT)
    assert q.empty()


def test_negative_timeout_raises_value_error_like_multiprocessing():
    q = roving.Queue()
    with pytest.raises(ValueError):
        q.get(timeout=-1)


def test_closed_queue_raises_value_error_on_put_and_get():
    q = roving.Queue()
    q.put(1)
    q.close()
    with pytest.raises(ValueError):
        q.put(2)
    with pytest.raises(ValueError):
        q.get(timeout=TIMEOUT)
    with pytest.raises(ValueError):
        q.put_nowait(2)
    with pytest.raises(ValueError):
        q.get_nowait()


def test_join_thread_after_close_returns_and_cancel_join_thread_is_accepted():
    q, out = roving.Queue(), roving.Queue()
    q.put(1)
    assert q.cancel_join_thread() is None  # accepted: put() left nothing pending
    q.close()
    assert q.join_thread() is None  # returns (at once: there is no feeder thread to wait for)
    p = start(h.echo_once, q, out)  # and what was put before close() is still delivered
    assert out.get(timeout=TIMEOUT) == 1
    finish(p)
    assert p.exitcode == 0


def test_join_thread_before_close_raises_assertion_error_like_multiprocessing():
    q = roving.Queue()
    with pytest.raises(AssertionError):  # multiprocessing.Queue.join_thread: assert self._closed
        q.join_thread()


# -- across processes --------------------------------------------------------------------------

def test_queue_passed_to_child_carries_items_both_ways():
    inq, outq = roving.Queue(), roving.Queue()
    p = start(h.double_from_to, inq, outq)
    inq.put(21)
    assert outq.get(timeout=TIMEOUT) == 42
    finish(p)


def test_items_from_several_child_producers_all_arrive_in_order_per_producer():
    q = roving.Queue()
    procs = [start(h.put_many, q, k * 1000, 50) for k in range(3)]
    got = [q.get(timeout=TIMEOUT) for _ in range(150)]
    finish(*procs)
    for k in range(3):
        mine = [x for x in got if k * 1000 <= x < k * 1000 + 50]
        assert mine == list(range(k * 1000, k * 1000 + 50))
    with pytest.raises(queue.Empty):
        q.get(timeout=0.1)


def test_items_put_right_before_a_child_exits_are_delivered():
    """Each child puts one item and exits at once; none of the items may be lost."""
    q = roving.Queue()
    procs = [start(h.put_value, q, i) for i in range(12)]
    for p in procs:
        p.join(TIMEOUT)
    got = []
    try:
        for _ in procs:
            got.append(q.get(timeout=5))
    except queue.Empty:
        pass
    assert sorted(got) == list(range(12)), f"lost items: {sorted(set(range(12)) - set(got))}"


def test_qsize_seen_by_parent_counts_items_put_by_child():
    q = roving.Queue(maxsize=3)  # bounded: a put returns once the owner has the item
    p = start(h.put_many, q, 0, 3)
    finish(p)
    assert q.qsize() == 3 and q.full()
    assert [q.get(timeout=TIMEOUT) for _ in range(3)] == [0, 1, 2]


def test_bounded_queue_applies_back_pressure_to_a_child_producer():
    q = roving.Queue(maxsize=2)
    p = start(h.put_many, q, 0, 6)
    got = [q.get(timeout=TIMEOUT) for _ in range(6)]
    finish(p)
    assert got == list(range(6))


def test_idle_reader_gets_nothing_while_the_active_reader_gets_every_item():
    """A message never waits at a reader that is not reading."""
    q, outq = roving.Queue(), roving.Queue()
    sleeper = start(h.get_once_then_sleep, q, outq, 60)
    q.put("for the sleeper")
    assert outq.get(timeout=TIMEOUT) == ("sleeper got", "for the sleeper")
    reader = start(h.read_n, q, outq, 10)
    for i in range(10):
        q.put(i)
    assert outq.get(timeout=TIMEOUT) == ("reader got", list(range(10)))
    finish(reader)
    sleeper.kill()
    sleeper.join(TIMEOUT)


def test_get_that_timed_out_in_a_child_does_not_swallow_a_later_item():
    q, outq = roving.Queue(), roving.Queue()
    p = start(h.get_with_timeout_then_retry, q, outq, 0.3)
    assert outq.get(timeout=TIMEOUT) == ("first get timed out", None)
    q.put("late item")
    assert outq.get(timeout=TIMEOUT) == ("retry got", "late item")
    finish(p)
    assert q.empty()


def test_child_readers_share_items_of_one_queue_without_loss_or_duplicates():
    q, outq = roving.Queue(), roving.Queue()
    readers = [start(h.read_n, q, outq, 20) for _ in range(3)]
    for i in range(60):
        q.put(i)
    got = []
    for _ in readers:
        kind, items = outq.get(timeout=TIMEOUT)
        got.extend(items)
    finish(*readers)
    assert sorted(got) == list(range(60))


def test_hundred_mib_numpy_array_crosses_a_queue_to_a_child_and_back_intact():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 2**63 - 1, size=100 * 2**20 // 8, dtype=np.int64)
    assert array.nbytes == 100 * 2**20
    inq, outq = roving.Queue(), roving.Queue()
    p = start(h.echo_once, inq, outq)
    inq.put(array)
    back = outq.get(timeout=120)
    finish(p)
    assert back.dtype == array.dtype and back.shape == array.shape
    assert np.array_equal(back, array)


def test_array_received_from_a_child_is_writable_as_with_multiprocessing():
    inq, outq = roving.Queue(), roving.Queue()
    p = start(h.echo_once, inq, outq)
    inq.put(np.zeros(1 << 20))
    back = outq.get(timeout=TIMEOUT)
    finish(p)
    assert back.flags.writeable
    back += 1
    assert back.sum() == 1 << 20


# -- SimpleQueue -------------------------------------------------------------------------------

def test_simple_queue_put_get_empty_and_close_across_a_child():
    inq, outq = roving.SimpleQueue(), roving.SimpleQueue()
    assert inq.empty()
    p = start(h.simple_queue_echo, inq, outq)
    inq.put({"k": [1, 2]})
    result = []
    t = threading.Thread(target=lambda: result.append(outq.get()), daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert result == [("simple", {"k": [1, 2]})]
    finish(p)
    assert outq.empty()
    outq.close()
    with pytest.raises(OSError):  # as multiprocessing.SimpleQueue: its pipe handle is closed
        outq.put(1)
    with pytest.raises(OSError):
        outq.get()


# -- JoinableQueue -----------------------------------------------------------------------------

def test_joinable_queue_join_returns_after_a_child_marks_every_item_done():
    jq, outq = roving.JoinableQueue(), roving.Queue()
    for i in range(5):
        jq.put(i)
    joined = threading.Event()
    t = threading.Thread(target=lambda: (jq.join(), joined.set()), daemon=True)
    t.start()
    assert not joined.wait(0.2)  # nothing is done yet
    p = start(h.consume_joinable, jq, outq, 5)
    assert outq.get(timeout=TIMEOUT) == [0, 1, 2, 3, 4]
    t.join(TIMEOUT)
    assert joined.is_set()
    finish(p)


def test_joinable_queue_join_waits_for_task_done_not_for_get():
    jq = roving.JoinableQueue()
    jq.put("x")
    assert jq.get(timeout=TIMEOUT) == "x"
    joined = threading.Event()
    t = threading.Thread(target=lambda: (jq.join(), joined.set()), daemon=True)
    t.start()
    assert not joined.wait(0.2)
    jq.task_done()
    t.join(TIMEOUT)
    assert joined.is_set()


def test_joinable_queue_join_on_empty_queue_returns_at_once():
    jq = roving.JoinableQueue()
    done = []
    t = threading.Thread(target=lambda: done.append(jq.join()), daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert len(done) == 1


def test_task_done_called_too_often_raises_value_error():
    jq = roving.JoinableQueue()
    jq.put(1)
    jq.get(timeout=TIMEOUT)
    jq.task_done()
    with pytest.raises(ValueError):
        jq.task_done()
    with pytest.raises(ValueError):
        roving.JoinableQueue().task_done()


def test_an_item_for_a_reader_killed_while_waiting_goes_to_the_next_reader():
    q = roving.Queue()
    p = start(h.echo_once, q, roving.Queue())  # blocks in q.get() until killed
    assert wait_for_waiting_reader(q, p)
    p.kill()
    p.join(TIMEOUT)
    assert wait_until(lambda: not serves_connection_of(p.node_id), TIMEOUT)  # the node saw it close
    q.put("item")
    assert q.get(timeout=TIMEOUT) == "item"


def wait_for_waiting_reader(q, p, timeout=TIMEOUT):
    """True once the child has sent its get() (the queue's owner holds it as a waiting reader)."""
    boxes = roving.transport.session.current().node().mailboxes

    def waiting() -> bool:
        with boxes.lock:
            return bool(boxes.boxes[q._box].getters)
    return wait_until(waiting, timeout, interval=0.02)


def test_a_child_that_puts_from_many_short_lived_threads_keeps_few_connections_and_loses_nothing():
    q, out = roving.Queue(), roving.Queue()
    p = roving.Process(target=h.put_from_many_threads, args=(q, 40, out))
    p.start()
    got = sorted(q.get(timeout=TIMEOUT) for _ in range(40))
    assert got == list(range(40))
    assert out.get(timeout=TIMEOUT) <= 3  # each ended thread's connection was closed (was: one per thread)
    p.join(TIMEOUT)
    assert p.exitcode == 0
