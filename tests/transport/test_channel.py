"""A Channel over a stream: a handler's messages both ways, in order; the node forgets a stream that ended,
also when the process that held it was killed; ZeroMQ when there is no stream; a busy listener is waited
for rather than given up on."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import roving
from helpers_core import ROOT, TIMEOUT
from roving.transport import auth
from roving.transport import endpoint as _endpoint
from roving.transport import node as _node
from roving.transport import session as _session
from roving.transport import stream as _stream
from roving.transport.channel import Channel, ConnectionLost

OP = b"echo-test"


class Echo:
    """A handler that answers every message with its frames, and remembers who sent what."""

    def __init__(self, node):
        self.node, self.seen, self.idents = node, [], set()
        self.undelivered = threading.Event()
        node.register_handler(OP, self.on_message)

    def on_message(self, ident, frames):
        self.idents.add(ident)
        self.seen.append([bytes(f) for f in frames])
        self.node.send_to(ident, [bytes(f) for f in frames], self.undelivered.set)


def wait_for(cond, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def node():
    n = _node.Node(os.urandom(32))
    yield n
    n.close()


def test_messages_go_both_ways_over_a_stream_in_the_order_sent(node):
    echo = Echo(node)
    chan = Channel(node.address, node.secret, TIMEOUT, stream=True)
    try:
        assert chan.over_stream
        for i in range(500):
            chan.send([OP, b"%d" % i, bytes(i % 7)])
        got = [chan.recv(TIMEOUT) for _ in range(500)]
        assert [bytes(f[0]) for f in got] == [b"%d" % i for i in range(500)]
        assert [bytes(f[1]) for f in got] == [bytes(i % 7) for i in range(500)]
        assert chan.recv(0.05) is None  # nothing more
        (ident,) = echo.idents
        assert ident[:1] == b"\xfe"  # a stream's identity, never a ZeroMQ routing id
        assert node.known_channels() == 1
    finally:
        chan.close()


def test_a_large_frame_and_a_pickled_value_arrive_whole(node):
    Echo(node)
    chan = Channel(node.address, node.secret, TIMEOUT, stream=True)
    try:
        big = os.urandom(5 << 20)
        chan.send([OP, big])
        (back,) = chan.recv(TIMEOUT)
        assert bytes(back) == big
    finally:
        chan.close()


def test_the_node_forgets_a_closed_stream_and_a_send_to_it_is_undeliverable(node):
    echo = Echo(node)
    chan = Channel(node.address, node.secret, TIMEOUT, stream=True)
    chan.send([OP, b"hello"])
    assert chan.recv(TIMEOUT) is not None
    (ident,) = echo.idents
    chan.close()
    assert wait_for(lambda: node.known_channels() == 0)
    gone = threading.Event()
    node.send_to(ident, [b"to nobody"], gone.set)
    assert gone.wait(TIMEOUT)  # run on the I/O thread: the sender can take back what it handed over


def test_a_stream_the_node_closes_raises_connection_lost(node):
    Echo(node)
    chan = Channel(node.address, node.secret, TIMEOUT, stream=True)
    chan.send([OP, b"x"])
    assert chan.recv(TIMEOUT) is not None
    node.close()
    with pytest.raises(ConnectionLost, match="ended"):
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            chan.recv(0.1)
    chan.close()


def test_without_a_stream_listener_the_channel_is_zeromq(node, monkeypatch):
    echo = Echo(node)
    monkeypatch.setattr(_node, "streams_enabled", False)
    chan = Channel(node.address, node.secret, TIMEOUT, stream=True)
    try:
        assert not chan.over_stream
        chan.send([OP, b"over zeromq"])
        assert [bytes(f) for f in chan.recv(TIMEOUT)] == [b"over zeromq"]
        (ident,) = echo.idents
        assert ident[:1] != b"\xfe"
    finally:
        chan.close()


def test_a_wrong_secret_is_refused_and_no_message_reaches_the_handler(node):
    echo = Echo(node)
    with pytest.raises((auth.AuthenticationError, _endpoint.TransportError)):
        Channel(node.address, os.urandom(32), 3.0, stream=True)
    assert echo.seen == []


def test_many_channels_opened_at_once_all_get_streams(node, monkeypatch):
    """The listener admits only so many handshakes at once from one address and closes the rest: a
    channel tries again (with back-off) instead of falling back to ZeroMQ."""
    Echo(node)
    count = 3 * _stream._MAX_HANDSHAKES_PER_SOURCE
    chans, errors = [], []
    start = threading.Barrier(count)

    def open_one():
        try:
            start.wait(TIMEOUT)
            chans.append(Channel(node.address, node.secret, TIMEOUT, stream=True))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    _endpoint.stream_listener(node.address, node.secret, TIMEOUT)  # known before the rush
    threads = [threading.Thread(target=open_one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    try:
        assert errors == []
        assert len(chans) == count
        assert all(c.over_stream for c in chans)
        for i, c in enumerate(chans):
            c.send([OP, b"%d" % i])
        assert [bytes(c.recv(TIMEOUT)[0]) for c in chans] == [b"%d" % i for i in range(count)]
    finally:
        for c in chans:
            c.close()


HOLDER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from roving.transport.channel import Channel
address, secret, n = sys.argv[2], bytes.fromhex(sys.argv[3]), int(sys.argv[4])
chans = [Channel(address, secret, 30.0, stream=True) for _ in range(n)]
assert all(c.over_stream for c in chans)
for c in chans:
    c.send([b"echo-test", b"here"])
for c in chans:
    assert c.recv(30.0) is not None
print("ready", flush=True)
time.sleep(600)
"""


def test_the_node_forgets_the_streams_of_killed_processes_the_count_stays_bounded(node):
    """200 identities of processes killed with SIGKILL (they say no goodbye), 20 per process: after each
    kill the node knows only the live channel's stream again."""
    echo = Echo(node)
    live = Channel(node.address, node.secret, TIMEOUT, stream=True)
    live.send([OP, b"live"])
    assert live.recv(TIMEOUT) is not None
    try:
        for round_ in range(10):
            proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(ROOT / "src"), node.address,
                                     node.secret.hex(), "20"], stdout=subprocess.PIPE, text=True)
            try:
                assert proc.stdout.readline().strip() == "ready"
                assert node.known_channels() == 21
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(TIMEOUT)
            assert wait_for(lambda: node.known_channels() == 1), (round_, node.known_channels())
        assert len(echo.idents) == 201
        live.send([OP, b"still talks"])
        assert [bytes(f) for f in live.recv(TIMEOUT)] == [b"still talks"]
    finally:
        live.close()


def test_pool_workers_talk_to_their_parent_over_streams():
    with roving.Pool(3) as pool:
        assert pool.map(abs, range(-50, 50)) == [abs(i) for i in range(-50, 50)]
        node = _session.current().node()
        # each worker: its work channel and its heartbeat channel
        assert wait_for(lambda: node.known_channels() >= 6), node.known_channels()


def test_a_listener_that_refuses_connections_is_left_for_zeromq_at_once(node, monkeypatch):
    """Nothing listening at the stream listener's address (ECONNREFUSED) is not waited on with back-off."""
    Echo(node)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    monkeypatch.setitem(_endpoint._listeners, node.address, f"127.0.0.1:{port}")
    started = time.monotonic()
    chan = Channel(node.address, node.secret, TIMEOUT, stream=True)
    try:
        assert not chan.over_stream
        assert time.monotonic() - started < _endpoint.STREAM_OPEN_TIMEOUT / 2  # not retried until it passes
        chan.send([OP, b"over zeromq"])
        assert [bytes(f) for f in chan.recv(TIMEOUT)] == [b"over zeromq"]
    finally:
        chan.close()
