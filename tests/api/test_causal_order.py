"""Messages that happen-before others arrive before them, also across writers: process A sends, then
passes a Barrier (or releases a Lock, sets an Event, puts on a Queue), and process C, once past it,
sends; the reader must see A's message first, as with multiprocessing's one pipe."""
from __future__ import annotations

import pytest

import roving
from helpers_core import TIMEOUT, finish, start

ROUNDS = 100


def write_then_barrier(conn, barrier, tag, first):
    """Round r: the writer whose turn it is sends, then both pass the barrier twice."""
    for r in range(ROUNDS):
        if (r % 2 == 0) == first:
            conn.send((tag, r))
        barrier.wait(TIMEOUT)
        barrier.wait(TIMEOUT)


def write_under_lock(q_or_conn, lock, turn, tag, first):
    """Rounds alternate between two writers; each waits for its turn (a Value) under the lock."""
    import time

    for r in range(ROUNDS):
        if (r % 2 == 0) != first:
            continue
        while True:
            with lock:
                if turn.value == r:
                    # A's messages are large (they take a while to cross), C's small.
                    message = (tag, r, b"x" * (4 << 20) if first else b"")
                    if hasattr(q_or_conn, "send"):
                        q_or_conn.send(message)
                    else:
                        q_or_conn.put(message)
                    turn.value = r + 1
                    break
            time.sleep(0.0005)


def read_all(take, n):
    return [take() for _ in range(n)]


def test_a_pipe_written_by_two_processes_keeps_the_order_a_barrier_makes():
    reader, writer = roving.Pipe(duplex=False)
    barrier = roving.Barrier(2)
    a = start(write_then_barrier, writer, barrier, "A", True)
    c = start(write_then_barrier, writer, barrier, "C", False)
    got = read_all(lambda: reader.recv() if reader.poll(TIMEOUT) else "nothing came", ROUNDS)
    finish(a, c)
    assert [r for _, r in got] == list(range(ROUNDS)), got


@pytest.mark.parametrize("channel", ["pipe", "queue"])
def test_messages_sent_under_a_lock_by_two_processes_arrive_in_the_lock_s_order(channel):
    if channel == "pipe":
        reader, writer = roving.Pipe(duplex=False)
        take = lambda: reader.recv() if reader.poll(TIMEOUT) else "nothing came"
    else:
        writer = roving.Queue()
        take = lambda: writer.get(timeout=TIMEOUT)
    lock, turn = roving.Lock(), roving.Value("i", 0, lock=False)
    a = start(write_under_lock, writer, lock, turn, "A", True)
    c = start(write_under_lock, writer, lock, turn, "C", False)
    got = read_all(take, ROUNDS)
    finish(a, c)
    assert [m[1] for m in got] == list(range(ROUNDS)), [m[:2] for m in got]


def send_then_signal(conn, signal, done):
    for r in range(ROUNDS):
        conn.send(("A", r, b"x" * (4 << 20)))
        signal.put(r)
        done.get(timeout=TIMEOUT)


def wait_signal_then_send(conn, signal, done):
    for r in range(ROUNDS):
        assert signal.get(timeout=TIMEOUT) == r
        conn.send(("C", r, b""))
        done.put(r)


def test_a_message_sent_before_a_queue_put_arrives_before_one_sent_after_its_get():
    reader, writer = roving.Pipe(duplex=False)
    signal, done = roving.Queue(), roving.Queue()
    a = start(send_then_signal, writer, signal, done)
    c = start(wait_signal_then_send, writer, signal, done)
    got = read_all(lambda: reader.recv() if reader.poll(TIMEOUT) else "nothing came", 2 * ROUNDS)
    finish(a, c)
    assert [m[:2] for m in got] == [(tag, r) for r in range(ROUNDS) for tag in "AC"]
