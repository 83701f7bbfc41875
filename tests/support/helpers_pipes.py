"""Module-level targets for the tests of pipes on direct streams (tests/api/test_pipe_streams.py)."""
from __future__ import annotations


TIMEOUT = 30


def _recv(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError("nothing arrived")
    return conn.recv()


def echo_until_none(conn):
    """Echo every message until None; then report whether this end was on a direct stream."""
    while True:
        msg = _recv(conn)
        if msg is None:
            break
        conn.send(msg)
    link = conn._end.link
    conn.send(("linked", link is not None and link.in_ == 1 and link.out == 1))


def read_some_then_pass_on(conn, count, q, echo_first=True):
    """Echo one message (the ends meet), read ``count`` messages, then hand the (still open) end to
    whoever reads ``q``."""
    if echo_first:
        conn.send(_recv(conn))
    got = [_recv(conn) for _ in range(count)]
    q.put(("first", got))
    q.put(conn)


def _until_none(conn):
    got = []
    while (msg := _recv(conn)) is not None:
        got.append(msg)
    return got


def read_from_queue_until_none(q, out):
    out.put(("rest", _until_none(q.get(timeout=TIMEOUT))))


def read_some_then_exit(conn, count, out):
    """Echo one message (the ends meet), read ``count`` messages and end without closing the end."""
    conn.send(_recv(conn))
    out.put([_recv(conn) for _ in range(count)])


def read_until_none(conn, out):
    out.put(_until_none(conn))


def write_range_then_pass_on(conn, start, stop, q):
    for i in range(start, stop):
        conn.send(i)
    q.put(conn)


def write_range_from_queue(q, start, stop):
    conn = q.get(timeout=TIMEOUT)
    for i in range(start, stop):
        conn.send(i)
    conn.send(None)


def echo_bytes_until_empty(conn):
    """Echo raw messages (recv_bytes / send_bytes) until an empty one."""
    while True:
        if not conn.poll(TIMEOUT):
            raise TimeoutError("nothing arrived")
        data = conn.recv_bytes()
        if not data:
            return
        conn.send_bytes(data)


def echo_once_then_exit_while_a_thread_reads(conn):
    """Echo one message (the ends meet), then leave a daemon thread blocked reading the end and exit."""
    import threading

    conn.send(_recv(conn))
    threading.Thread(target=conn.recv, daemon=True).start()



def ping_then_report(conn, count, out):
    """Send ``count`` numbers, read their echoes, end the echo; report what came back and whether this
    end was on a direct stream."""
    got = []
    for i in range(count):
        conn.send(i)
        got.append(_recv(conn))
    linked = conn._end.link is not None
    conn.send(None)
    out.put((got, linked, _recv(conn)))
