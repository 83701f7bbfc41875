"""Pipes whose ends are used by two processes move to a direct stream (roving.transport.link): order,
completeness and end-of-file hold across the switch, across handing an end to another process, and
across a process exiting with messages unread; the stream listener refuses peers without the secret.
"""
from __future__ import annotations

import socket

import numpy as np
import pytest

import helpers_pipes as hp
import roving
from helpers_core import TIMEOUT, start
from roving.transport import auth, framing, stream


def recv(conn):
    assert conn.poll(TIMEOUT), "nothing arrived within the timeout"
    return conn.recv()


def test_a_pipe_between_two_processes_moves_to_a_stream_and_keeps_every_message_in_order():
    here, there = roving.Pipe()
    child = start(hp.echo_until_none, there)
    for i in range(300):  # sent before the child reads: these go through the mailbox
        here.send(i)
    got = [recv(here) for _ in range(300)]
    for i in range(300, 600):  # by now the ends have met: these go over the stream
        here.send(i)
        got.append(recv(here))
    here.send(None)
    assert got == list(range(600))
    assert recv(here) == ("linked", True)
    assert here._end.link is not None, "the parent's end never moved to a direct stream"
    child.join(TIMEOUT)
    assert child.exitcode == 0


def test_two_children_talk_over_a_stream_of_their_own_through_a_pipe_the_parent_made():
    here, there = roving.Pipe()
    out = roving.Queue()
    echo = start(hp.echo_until_none, there)
    pinger = start(hp.ping_then_report, here, 200, out)
    here.close()
    there.close()
    got, linked, echo_report = out.get(timeout=TIMEOUT)
    assert got == list(range(200))
    assert linked and echo_report == ("linked", True), "the children did not meet on a direct stream"
    echo.join(TIMEOUT)
    pinger.join(TIMEOUT)
    assert echo.exitcode == 0 and pinger.exitcode == 0


def test_large_arrays_and_bytes_cross_a_stream_intact_and_as_their_own_types():
    here, there = roving.Pipe()
    child = start(hp.echo_until_none, there)
    here.send("warm up")
    assert recv(here) == "warm up"
    rng = np.random.default_rng(0)
    array = rng.standard_normal(1 << 20)  # 8 MiB
    payload = rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    here.send(array)
    back = recv(here)
    assert np.array_equal(back, array) and back.flags.writeable
    here.send(payload)
    back = recv(here)
    assert type(back) is bytes and back == payload
    here.send(bytearray(payload[:100_000]))
    back = recv(here)
    assert type(back) is bytearray and back == payload[:100_000]
    here.send([array[:10], payload[:70_000], {"k": payload[-5:]}])
    back = recv(here)
    assert np.array_equal(back[0], array[:10]) and back[1] == payload[:70_000] and back[2] == {"k": payload[-5:]}
    here.send(None)
    assert recv(here) == ("linked", True)
    child.join(TIMEOUT)


def test_send_bytes_and_recv_bytes_over_a_stream():
    a, b = roving.Pipe()
    echo = start(hp.echo_bytes_until_empty, b)
    data = bytes(range(256)) * 4096  # 1 MiB
    for _ in range(3):  # the first goes through the mailbox, the rest over the stream
        a.send_bytes(data, 1000, 500_000)
        assert a.poll(TIMEOUT)
        back = a.recv_bytes()
        assert type(back) is bytes and back == data[1000:501_000]
    a.send_bytes(b"tiny")
    buf = bytearray(10)
    assert a.poll(TIMEOUT) and a.recv_bytes_into(buf, 3) == 4 and buf[3:7] == b"tiny"
    assert a._end.link is not None
    a.send_bytes(b"")
    echo.join(TIMEOUT)
    assert echo.exitcode == 0


def test_a_reading_end_handed_to_another_process_mid_stream_loses_nothing_and_keeps_order():
    here, there = roving.Pipe()
    handover, out = roving.Queue(), roving.Queue()
    first = start(hp.read_some_then_pass_on, there, 50, handover)
    here.send("ping")
    assert recv(here) == "ping"
    for i in range(2000):  # keeps coming while the end changes hands
        here.send(i)
    here.send(None)
    label, head = handover.get(timeout=TIMEOUT)
    assert label == "first" and head == list(range(50))
    second = start(hp.read_from_queue_until_none, handover, out)
    label, rest = out.get(timeout=TIMEOUT)
    assert label == "rest"
    assert head + rest == list(range(2000)), "messages were lost, repeated or reordered"
    first.join(TIMEOUT)
    second.join(TIMEOUT)


def test_an_end_handed_on_before_its_reader_reached_the_stream_keeps_order():
    """The reader is still working through messages sent before the stream opened when its end is
    handed on: what the stream carried must come after those, not before."""
    import time

    here, there = roving.Pipe()
    handover, out = roving.Queue(), roving.Queue()
    for i in range(100):  # before the child exists: through the mailbox
        here.send(i)
    first = start(hp.read_some_then_pass_on, there, 20, handover, False)
    deadline = time.monotonic() + TIMEOUT
    while here._end.link is None and time.monotonic() < deadline:  # the child's first read met this end
        time.sleep(0.01)
    assert here._end.link is not None
    for i in range(100, 300):  # over the stream
        here.send(i)
    here.send(None)
    label, head = handover.get(timeout=TIMEOUT)
    assert head == list(range(20))
    second = start(hp.read_from_queue_until_none, handover, out)
    label, rest = out.get(timeout=TIMEOUT)
    assert head + rest == list(range(300))
    first.join(TIMEOUT)
    second.join(TIMEOUT)


def test_a_writing_end_handed_to_another_process_keeps_order():
    here, there = roving.Pipe()
    handover = roving.Queue()
    first = start(hp.write_range_then_pass_on, there, 0, 1000, handover)
    assert recv(here) == 0  # the reader meets the first writer: a stream
    second = start(hp.write_range_from_queue, handover, 1000, 2000)
    got = [0]
    while True:
        msg = recv(here)
        if msg is None:
            break
        got.append(msg)
    assert got == list(range(2000))
    first.join(TIMEOUT)
    second.join(TIMEOUT)


def test_messages_a_reader_left_unread_at_exit_go_back_to_the_pipe_for_the_next_reader():
    here, there = roving.Pipe()
    out = roving.Queue()
    first = start(hp.read_some_then_exit, there, 3, out)
    here.send("ping")
    assert recv(here) == "ping"
    for i in range(10):
        here.send(i)
    assert out.get(timeout=TIMEOUT) == [0, 1, 2]
    first.join(TIMEOUT)
    assert first.exitcode == 0
    second = start(hp.read_until_none, there, out)  # the parent's own copy of the same end
    here.send(None)
    assert out.get(timeout=TIMEOUT) == list(range(3, 10))
    second.join(TIMEOUT)


def test_eof_reaches_the_reader_when_the_writer_on_a_stream_is_killed():
    here, there = roving.Pipe()
    child = start(hp.echo_until_none, there)
    here.send("x")
    assert recv(here) == "x"
    here.send("y")
    assert recv(here) == "y"
    assert here._end.link is not None
    there.close()
    child.kill()
    child.join(TIMEOUT)
    assert here.poll(TIMEOUT)
    with pytest.raises(EOFError):
        here.recv()


def test_a_child_exits_although_a_thread_of_it_is_blocked_reading_a_stream():
    import time

    here, there = roving.Pipe()
    child = start(hp.echo_once_then_exit_while_a_thread_reads, there)
    there.close()
    here.send("ping")
    assert recv(here) == "ping"
    began = time.monotonic()
    child.join(TIMEOUT)
    assert child.exitcode == 0, "the child did not exit"
    assert time.monotonic() - began < 20
    assert here.poll(TIMEOUT)
    with pytest.raises(EOFError):
        here.recv()


# -- the stream listener --------------------------------------------------------------------------

def dropped(sock) -> bool:
    """The listener hung up on ``sock`` (a close, or a reset when our bytes were left unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def listener():
    opened = []

    def on_open(request, s):
        opened.append(request)
        stream.accept(s)
        return True

    lst = stream.Listener(b"s" * 32, "127.0.0.1", None, on_open)
    yield lst, opened
    lst.close()


def test_the_stream_listener_refuses_a_peer_without_the_secret_and_reads_nothing_from_it(listener):
    lst, opened = listener
    with pytest.raises(auth.AuthenticationError):
        stream.connect(lst.address, b"x" * 32, {"token": "t"}, timeout=5)
    host, port = lst.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # garbage, then hang up
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 10)
        sock.settimeout(5)
        assert dropped(sock)
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # a proof that is wrong
        nonce = auth.new_nonce()
        sock.sendall(b"roving-stream/1\n" + nonce)
        sock.settimeout(5)
        answer = b""
        while len(answer) < 66 or len(answer) < 66 + int.from_bytes(answer[64:66], "little") + 64:
            answer += sock.recv(4096)  # nonce, proof, the listener's certificate and signature
        sock.sendall(b"\x00" * 32 + (0).to_bytes(2, "little") + bytes(64)  # proof, no certificate
                     + (10).to_bytes(8, "little") + b'{"a": 1}  ')
        assert sock.recv(1) == b"\x02"  # told it is refused, and nothing more
        assert dropped(sock)
    assert opened == [], "the listener acted on a peer that did not authenticate"
    s = stream.connect(lst.address, b"s" * 32, {"token": "ok"}, timeout=5)
    s.close()
    assert opened == [{"token": "ok"}]


def test_a_stream_carries_messages_whole_and_reports_its_end(listener):
    lst, _ = listener
    accepted = []
    lst._on_open = lambda request, s: (stream.accept(s), accepted.append(s)) and True
    a = stream.connect(lst.address, b"s" * 32, {}, timeout=5)
    big = np.arange(300_000, dtype=np.int64)
    a.send(b"D", [b"small", memoryview(big), b"z" * 100_000, bytearray(b"ba")])
    for _ in range(100):
        if accepted:
            break
        import time
        time.sleep(0.05)
    b = accepted[0]
    assert b.readable(5)
    kind, frames = b.recv()
    assert kind == b"D" and frames[0] == b"small" and type(frames[2]) is bytes and frames[2] == b"z" * 100_000
    assert np.array_equal(np.frombuffer(frames[1], dtype=np.int64), big) and frames[3] == b"ba"
    assert not b.readable(0.05)
    a.close()
    with pytest.raises(EOFError):
        b.recv()
    b.close()


def test_a_recv_interrupted_by_a_signal_resumes_and_loses_nothing(listener):
    import os
    import signal
    import threading
    import time

    lst, _ = listener
    accepted = []
    lst._on_open = lambda request, s: (stream.accept(s), accepted.append(s)) and True
    a = stream.connect(lst.address, b"s" * 32, {}, timeout=5)
    deadline = time.monotonic() + TIMEOUT
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    b = accepted[0]
    wire = b"".join(bytes(part) for part in framing.encode(b"D", [b"head", bytes(range(256)) * 800]))
    a.sock.sendall(wire[:100_000])  # the header and part of the large frame: recv blocks for the rest

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(Interrupted):
            b.recv()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    a.sock.sendall(wire[100_000:])
    kind, frames = b.recv()
    assert kind == b"D" and frames[0] == b"head" and frames[1] == bytes(range(256)) * 800
    a.close()
    b.close()


# -- the mailbox's gate (what keeps a direction in order while a stream is taken down) --------------

@pytest.mark.parametrize("where", ["consumed", "switch item in the box", "switch item not put yet"])
def test_the_gate_stands_where_the_streams_messages_belong_and_readers_stop_at_it(where):
    from roving.transport.mailbox import EMPTY, OK, SWITCH, Mailbox

    box = Mailbox(track_writers=True)
    box.hold(b"writer")
    if where != "consumed":  # (a reader that consumed the switch item had read everything before it)
        box.put([b"old"])
    else:
        box.put([b"after"])  # the writer switched back on its own, before the reader closed the gate
    if where == "switch item in the box":
        box.put([SWITCH, b"t"])
    box.close_gate(b"t", "relayer", consumed=where == "consumed")
    if where == "switch item not put yet":
        box.put([SWITCH, b"t"])  # the writer's switch item arrives after the gate: it stays behind it
    if where != "consumed":
        box.put([b"after"])  # the writer, back on the mailbox
    box.insert_at_gate(b"t", [b"relayed"])
    got = []
    while (answer := box.get())[0] == OK:
        got.append(bytes(answer[1][0]))
    assert answer == (EMPTY, None)  # stopped at the gate: "after" must wait for the stream's rest
    box.open_gate(b"t")
    while (answer := box.get())[0] == OK:
        if bytes(answer[1][0]) != SWITCH:
            got.append(bytes(answer[1][0]))
    expected = [b"relayed", b"after"] if where == "consumed" else [b"old", b"relayed", b"after"]
    assert got == expected


def test_a_gate_whose_relaying_process_died_is_opened():
    from roving.transport.mailbox import EMPTY, OK, Mailbox

    box = Mailbox(track_writers=True)
    box.hold(b"writer")
    box.close_gate(b"t", "relayer", consumed=True)
    box.put([b"after"])
    assert box.get() == (EMPTY, None)
    box.open_gates_of("someone else")
    assert box.get() == (EMPTY, None)
    box.open_gates_of("relayer")
    assert box.get() == (OK, [b"after"])
