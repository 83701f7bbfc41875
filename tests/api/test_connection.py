"""Pipe and Connection behave as in multiprocessing.connection, across processes."""
from __future__ import annotations

import array
import multiprocessing

import pytest

import helpers_targets as h
import roving
from helpers_core import TIMEOUT, start


def recv(conn):
    """recv() guarded by poll(), so that a bug cannot hang the suite (poll is True at EOF too)."""
    assert conn.poll(TIMEOUT), "nothing arrived within the timeout"
    return conn.recv()


# -- one process -------------------------------------------------------------------------------

def test_duplex_pipe_carries_objects_both_ways():
    a, b = roving.Pipe()
    assert a.readable and a.writable and b.readable and b.writable
    a.send({"to": "b"})
    b.send(["to", "a"])
    assert recv(b) == {"to": "b"}
    assert recv(a) == ["to", "a"]


def test_one_way_pipe_has_a_read_only_and_a_write_only_end():
    r, w = roving.Pipe(duplex=False)
    assert r.readable and not r.writable
    assert w.writable and not w.readable
    w.send("one way")
    assert recv(r) == "one way"
    with pytest.raises(OSError):
        r.send("wrong way")
    with pytest.raises(OSError):
        r.send_bytes(b"wrong way")
    with pytest.raises(OSError):
        w.recv()
    with pytest.raises(OSError):
        w.recv_bytes()
    with pytest.raises(OSError):
        w.poll()


def test_poll_is_false_until_something_is_sent_then_true():
    a, b = roving.Pipe()
    assert a.poll() is False
    assert a.poll(0.2) is False
    b.send(1)
    assert a.poll(TIMEOUT) is True
    assert a.poll() is True  # polling does not consume
    assert a.recv() == 1
    assert a.poll(0) is False


def test_send_bytes_with_offset_and_size_and_recv_bytes():
    a, b = roving.Pipe()
    a.send_bytes(b"0123456789")
    a.send_bytes(b"0123456789", 3)
    a.send_bytes(b"0123456789", 2, 5)
    a.send_bytes(bytearray(b"abc"))
    a.send_bytes(array.array("i", [1, 2, 3]), 4, 4)  # offset and size count bytes
    assert b.poll(TIMEOUT)
    assert b.recv_bytes() == b"0123456789"
    assert b.recv_bytes() == b"3456789"
    assert b.recv_bytes() == b"23456"
    assert b.recv_bytes() == b"abc"
    assert b.recv_bytes() == array.array("i", [2]).tobytes()


def test_send_bytes_rejects_bad_offset_and_size_with_value_error():
    a, _ = roving.Pipe()
    for offset, size in ((-1, None), (11, None), (0, -1), (5, 6)):
        with pytest.raises(ValueError):
            a.send_bytes(b"0123456789", offset, size)


def test_recv_bytes_longer_than_maxlength_raises_oserror():
    a, b = roving.Pipe()
    a.send_bytes(b"x" * 100)
    assert b.poll(TIMEOUT)
    with pytest.raises(OSError):
        b.recv_bytes(maxlength=10)
    with pytest.raises(ValueError):
        a.recv_bytes(maxlength=-1)


def test_recv_bytes_within_maxlength_returns_the_message():
    a, b = roving.Pipe()
    a.send_bytes(b"x" * 10)
    assert b.poll(TIMEOUT)
    assert b.recv_bytes(maxlength=10) == b"x" * 10


def test_recv_bytes_into_writes_at_offset_and_returns_size():
    a, b = roving.Pipe()
    a.send_bytes(b"hello")
    buf = bytearray(b"_" * 10)
    assert b.poll(TIMEOUT)
    assert b.recv_bytes_into(buf, 3) == 5
    assert buf == bytearray(b"___hello__")


def test_recv_bytes_into_a_too_short_buffer_raises_buffer_too_short_holding_the_message():
    a, b = roving.Pipe()
    a.send_bytes(b"a message longer than the buffer")
    buf = bytearray(4)
    assert b.poll(TIMEOUT)
    with pytest.raises(multiprocessing.BufferTooShort) as info:
        b.recv_bytes_into(buf)
    assert info.value.args[0] == b"a message longer than the buffer"
    assert roving.BufferTooShort is multiprocessing.BufferTooShort


def test_recv_bytes_of_send_gives_the_pickle_and_recv_of_send_bytes_is_not_required():
    import pickle

    a, b = roving.Pipe()
    a.send({"k": 1})
    assert b.poll(TIMEOUT)
    assert pickle.loads(b.recv_bytes()) == {"k": 1}


def test_closed_connection_raises_oserror_on_every_use():
    a, b = roving.Pipe()
    a.close()
    assert a.closed
    for use in (lambda: a.send(1), lambda: a.recv(), lambda: a.poll(), lambda: a.send_bytes(b"x"),
                lambda: a.recv_bytes(), lambda: a.recv_bytes_into(bytearray(4))):
        with pytest.raises(OSError):
            use()
    a.close()  # closing twice is fine


def test_recv_raises_eof_once_the_other_end_is_closed_in_the_same_process():
    a, b = roving.Pipe()
    b.send("last words")
    b.close()
    assert recv(a) == "last words"  # what was sent before the close is still delivered
    assert a.poll(TIMEOUT) is True  # poll is True at end-of-file, as in multiprocessing
    with pytest.raises(EOFError):
        a.recv()
    with pytest.raises(EOFError):
        a.recv_bytes()


def test_one_way_pipe_reader_sees_eof_when_the_writer_is_closed():
    r, w = roving.Pipe(duplex=False)
    w.close()
    assert r.poll(TIMEOUT)
    with pytest.raises(EOFError):
        r.recv()


def test_context_manager_closes_the_connection():
    a, b = roving.Pipe()
    with a:
        a.send(1)
    assert a.closed
    assert recv(b) == 1
    assert b.poll(TIMEOUT)
    with pytest.raises(EOFError):
        b.recv()


# -- across processes --------------------------------------------------------------------------

def test_child_echoes_over_a_duplex_pipe():
    parent_end, child_end = roving.Pipe()
    p = start(h.pipe_echo, child_end, 3)
    child_end.close()
    for i in range(3):
        parent_end.send(i)
        assert recv(parent_end) == (i, "echo")
    assert parent_end.poll(TIMEOUT)
    with pytest.raises(EOFError):
        parent_end.recv()
    p.join(TIMEOUT)
    assert p.exitcode == 0


def test_eof_after_the_child_closes_its_end():
    r, w = roving.Pipe(duplex=False)
    p = start(h.send_then_close, w, ["a", "b"])
    w.close()
    assert [recv(r), recv(r)] == ["a", "b"]
    assert r.poll(TIMEOUT)
    with pytest.raises(EOFError):
        r.recv()
    p.join(TIMEOUT)


def test_eof_after_the_child_holding_the_end_exits_without_closing_it():
    r, w = roving.Pipe(duplex=False)
    p = start(h.send_then_exit, w, ["only"])
    w.close()
    assert recv(r) == "only"
    assert r.poll(TIMEOUT)
    with pytest.raises(EOFError):
        r.recv()
    p.join(TIMEOUT)
    assert p.exitcode == 0


@pytest.mark.parametrize("how", ["kill", "terminate"])
def test_eof_after_the_child_holding_the_end_is_killed(how):
    parent_end, child_end = roving.Pipe()
    p = start(h.ready_then_sleep, child_end, 60)
    child_end.close()
    assert recv(parent_end) == "ready"
    getattr(p, how)()
    assert parent_end.poll(TIMEOUT), "no end-of-file after the child holding the other end was killed"
    with pytest.raises(EOFError):
        parent_end.recv()
    p.join(TIMEOUT)
    assert p.exitcode == (-9 if how == "kill" else -15)


def test_no_eof_while_the_parent_still_holds_a_copy_of_the_end_it_gave_the_child():
    r, w = roving.Pipe(duplex=False)
    p = start(h.send_then_close, w, ["x"])
    assert recv(r) == "x"
    p.join(TIMEOUT)
    assert r.poll(0.3) is False  # w is still open here, as with multiprocessing
    w.close()
    assert r.poll(TIMEOUT)
    with pytest.raises(EOFError):
        r.recv()


def test_child_reads_until_eof_when_the_parent_closes_the_writing_end():
    r, w = roving.Pipe(duplex=False)
    outq = roving.Queue()
    p = start(h.recv_all_until_eof, r, outq)
    r.close()
    for i in range(5):
        w.send(i)
    w.close()
    assert outq.get(timeout=TIMEOUT) == ("until eof", [0, 1, 2, 3, 4])
    p.join(TIMEOUT)
    assert p.exitcode == 0


def test_connection_sent_inside_a_queue_message_works_in_the_child():
    r, w = roving.Pipe(duplex=False)
    q = roving.Queue()
    p = start(h.conn_from_queue_send, q, "through the queue")
    q.put(w)
    w.close()
    assert recv(r) == "through the queue"
    assert r.poll(TIMEOUT)
    with pytest.raises(EOFError):
        r.recv()
    p.join(TIMEOUT)
    assert p.exitcode == 0


def test_child_sends_bytes_with_offset_and_size():
    r, w = roving.Pipe(duplex=False)
    p = start(h.send_bytes_pieces, w, b"abcdefghij", 2, 4)
    w.close()
    assert r.poll(TIMEOUT)
    assert r.recv_bytes() == b"cdef"
    p.join(TIMEOUT)


def test_a_transit_release_that_overtakes_its_hold_still_ends_in_eof():
    """A pipe end sent through a third process is held by the sender and released by the receiver over
    two connections; if the release arrives first, the reader must still see end-of-file."""
    from roving.transport.mailbox import EOF, Mailbox

    box = Mailbox(track_writers=True)
    box.hold(b"uid-parent")
    box.release(b"transit-0123")  # the receiver's release arrives first
    box.hold(b"transit-0123")     # then the sender's hold
    box.release(b"uid-parent")
    assert box.get()[0] == EOF
