"""Connections that break while both processes live on (a network drop, made here by a forwarder on
127.0.0.1 that cuts them): no call waits for an answer that cannot come, the next call works over a new
authenticated connection, and nothing already stored is lost; rpc callers and pools go on. Also: the
node forgets connections that close, and keepalive probes find a peer that vanished without closing."""
from __future__ import annotations

import concurrent.futures
import json
import socket

import pytest
import zmq

import roving
from helpers_core import TIMEOUT, run_script, wait_until, PROGRAMS
from helpers_net import CuttingProxy
from roving.transport import rpc as _rpc
from roving.transport import auth, crypto, identity
from roving.transport import channel as _channel
from roving.transport import endpoint as _endpoint
from roving.transport import node as _node
from roving.transport import session as _session
from roving.transport import stream as _stream
from roving.transport import wire as _wire
from roving.transport.serialize import dumps, loads


class _OneThread:
    """Runs calls on one thread of its own (an Endpoint keeps one connection per thread), each bounded
    by TIMEOUT: ``run(fn)`` returns (finished in time, its result or the exception it raised)."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def run(self, fn):
        future = self._pool.submit(fn)
        try:
            return True, future.result(timeout=TIMEOUT)
        except concurrent.futures.TimeoutError:
            return False, None
        except BaseException as exc:
            return True, exc


@pytest.fixture
def queue_via_proxy():
    q = roving.Queue()
    proxy = CuttingProxy(q._address)
    yield q, proxy
    proxy.close()


def test_a_zeromq_connection_remade_after_a_drop_raises_at_once_and_the_next_call_reconnects(queue_via_proxy):
    q, proxy = queue_via_proxy
    ep = _endpoint.Endpoint(proxy.address, _session.current().secret, None, connect_timeout=TIMEOUT)
    ep._streams = ""  # ZeroMQ only: no stream listener
    t = _OneThread()
    assert t.run(lambda: ep.call(_node.PUT, q._box, -1, dumps("before"))) == (True, (_node.OK, []))
    assert proxy.cut() == 1
    # ZeroMQ re-makes the connection under the hood: a new identity at the node, which drops what comes
    # over it unread. A put that waits for ever for its answer must not wait for ever.
    finished, got = t.run(lambda: ep.call(_node.PUT, q._box, -1, dumps("lost")))
    assert finished, "a call over a connection re-made after a drop waited for an answer that cannot come"
    assert isinstance(got, _endpoint.ConnectionLost), got
    assert "network drop" in str(got)
    # The next call opens a new connection, which authenticates anew, and works.
    assert t.run(lambda: ep.call(_node.PUT, q._box, -1, dumps("after"))) == (True, (_node.OK, []))
    assert proxy.accepted >= 2
    assert q.get(timeout=TIMEOUT) == "before"
    assert q.get(timeout=TIMEOUT) == "after"
    assert q.qsize() == 0  # the put sent over the unknown connection was dropped, not stored


def test_a_stream_that_breaks_raises_and_the_next_call_opens_a_new_one(monkeypatch):
    # TLS: a plain-text stream's proof names its connection's addresses, which a forwarder changes
    monkeypatch.setattr(crypto, "mode", lambda: "always")
    q = roving.Queue()
    node = _session.current().node()
    proxy = CuttingProxy(node.streams().address)
    try:
        ep = _endpoint.Endpoint(q._address, _session.current().secret, None, connect_timeout=TIMEOUT)
        ep._streams = proxy.address  # the stream goes through the forwarder
        t = _OneThread()
        assert t.run(lambda: isinstance(ep._conn(), _endpoint._StreamConnection)) == (True, True)
        assert t.run(lambda: ep.call(_node.PUT, q._box, -1, dumps(1))) == (True, (_node.OK, []))
        assert proxy.cut() == 1
        finished, got = t.run(lambda: ep.call(_node.GET, 999999, -1))
        assert finished and isinstance(got, _endpoint.ConnectionLost), got
        finished, (status, frames) = t.run(lambda: ep.call(_node.GET, q._box, TIMEOUT))
        assert finished and status == _node.OK and loads(frames) == 1
        assert proxy.accepted == 2
    finally:
        proxy.close()


def test_a_ping_after_a_drop_recovers_on_the_next_ping(queue_via_proxy):
    """The child's watch of its parent pings: one drop must not look like a parent that has gone."""
    q, proxy = queue_via_proxy
    ep = _endpoint.Endpoint(proxy.address, _session.current().secret, None, connect_timeout=TIMEOUT)
    ep._streams = ""
    assert ep.ping(TIMEOUT)
    proxy.cut()
    answers = [ep.ping(5) for _ in range(3)]  # this thread's connection, cut under it
    assert answers[1:] == [True, True], answers


def test_reconnecting_to_a_node_that_has_gone_fails_at_once():
    """After a break, a node whose port refuses connections is reported gone, not waited for."""
    secret = _session.current().secret
    other = _node.Node(secret)
    box = other.mailboxes.new_box()
    ep = _endpoint.Endpoint(other.address, secret, None, connect_timeout=TIMEOUT)
    t = _OneThread()
    assert t.run(lambda: ep.call(_node.PUT, box, -1, dumps("x"))) == (True, (_node.OK, []))
    other.close()
    finished, got = t.run(lambda: ep.call(_node.GET, box, 1))  # the connection breaks
    assert finished and isinstance(got, _endpoint.ConnectionLost), got
    finished, got = t.run(lambda: ep.call(_node.GET, box, 1))
    assert finished and isinstance(got, _endpoint.TransportError) and "nothing listens" in str(got), got


def test_a_thread_that_first_connects_after_the_node_has_gone_is_told_so_at_once():
    """A thread with no connection yet to a node whose stream listener and port both refuse: the node
    has ended, said at once, not waited for on ZeroMQ for ``connect_timeout`` (what a first connection
    to a node that may still be starting does). Its connection was never broken, so the check made on
    replacing a broken one does not run: this is the other path to the same answer."""
    secret = _session.current().secret
    other = _node.Node(secret)
    box = other.mailboxes.new_box()
    ep = _endpoint.Endpoint(other.address, secret, None, connect_timeout=TIMEOUT)
    assert _OneThread().run(lambda: ep.call(_node.PUT, box, -1, dumps("x"))) == (True, (_node.OK, []))
    assert ep._streams, "the node was to have a stream listener"  # learnt: the path under test
    other.close()
    finished, got = _OneThread().run(lambda: ep.call(_node.GET, box, 1))  # another thread: no connection yet
    assert finished and isinstance(got, _endpoint.NodeError) and "nothing listens" in str(got), got
    assert other.address.partition("#")[0] in str(got)


def test_a_stranger_is_told_once_that_it_has_not_authenticated_and_nothing_it_sent_is_read(tmp_path):
    q = roving.Queue()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # past ZeroMQ's CURVE handshake with the session's keys, as a re-made connection of a session
    # process is; not authenticated to roving
    crypto.curve_client(sock, _session.current().secret, identity.node_key(q._address))
    sock.connect(identity.bare(q._address))
    try:
        for i in range(3):
            sock.send_multipart([_node.PUT_NOREPLY, _wire.HEADER.pack(q._box, i, 0.0), dumps("junk")[0]])
        assert sock.poll(TIMEOUT * 1000)
        assert sock.recv_multipart() == [auth.REAUTH]
        assert not sock.poll(500)  # once, not once per message
    finally:
        sock.close(0)
    assert q.qsize() == 0


def test_the_node_forgets_the_connections_that_close():
    secret = _session.current().secret
    node = _node.Node(secret)
    try:
        conns = [_endpoint._ZmqConnection(node.address, secret, TIMEOUT) for _ in range(5)]
        assert wait_until(lambda: len(node.router.door.authenticated) == 5, TIMEOUT)
        for conn in conns:
            conn.close()
        assert wait_until(lambda: len(node.router.door.authenticated) == 0, TIMEOUT), node.router.door.authenticated
        chan = _channel.Channel(node.address, secret, TIMEOUT)
        assert wait_until(lambda: len(node.router.door.authenticated) == 1, TIMEOUT)
        chan.close()
        assert wait_until(lambda: len(node.router.door.authenticated) == 0, TIMEOUT)
    finally:
        node.close()


def test_an_rpc_caller_fails_the_call_in_flight_and_reconnects_after_a_drop():
    """Locks, managers and shared data talk over transport.rpc: a drop fails the call whose answer it lost
    (it may have taken effect) and later calls work over a new connection."""
    secret = _session.current().secret
    node = _node.Node(secret)
    served = []

    class Echo(_rpc.Server):
        def serve(self, ident, req_id, kind, frames):
            served.append(bytes(frames[0]))
            if bytes(frames[0]) != b"hold":  # "hold" is never answered: a call waiting when the drop comes
                self.answer(ident, req_id, _rpc.OK, [frames[0]])

    Echo(node, b"E")
    proxy = CuttingProxy(node.address)
    try:
        caller = _rpc.Caller(proxy.address, secret, b"E", "the echo server", connect_timeout=TIMEOUT)
        status, frames = caller.call([b"one"])
        assert status == _rpc.OK and bytes(frames[0]) == b"one"
        held = caller.submit([b"hold"])
        assert wait_until(lambda: b"hold" in served, TIMEOUT)
        proxy.cut()
        finished, got = _OneThread().run(lambda: caller.collect(held))
        assert finished and isinstance(got, _endpoint.ConnectionLost), got
        status, frames = caller.call([b"two"])
        assert status == _rpc.OK and bytes(frames[0]) == b"two"
        assert proxy.accepted >= 2  # a new connection (ZeroMQ's own re-made one may count too)
    finally:
        proxy.close()
        node.close()


def test_a_pool_finishes_every_item_when_its_workers_connections_are_cut():
    """The workers behind the forwarder learn that the parent no longer knows their connection,
    reconnect and say HELLO again; the parent puts the units they held back in line. Every item comes
    back once, no worker is lost (the heartbeat timeout is 600 s: it cannot be what finishes the map).
    Cut again once idle, they find it out and reconnect with no work to make them talk."""
    # TLS streams: a plain-text stream's proof names its connection's addresses, which a forwarder changes
    out = run_script(PROGRAMS / "pool_through_drop.py",
                     env={"ROVING_POOL_HEARTBEAT_TIMEOUT": "600", "ROVING_ENCRYPT": "always"}, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["values"] == [x * x for x in range(120)]
    assert got["missing"] == []
    assert got["cut"] >= 4  # both connections of both workers behind the forwarder
    assert got["idle_reconnected"], "idle workers did not find their cut connections"
    assert out.stderr.count("reconnected after its connection broke") == 4, out.stderr  # busy, then idle
    assert "exits:" not in out.stderr and "is killed" not in out.stderr and "ended (exit code" not in out.stderr


def test_every_connection_asks_for_tcp_keepalive():
    """A peer whose machine vanished without closing is found by keepalive probes (25 s), so a read
    waiting on it fails instead of waiting for ever."""
    q = roving.Queue()
    node = _session.current().node()
    listener = node.streams()
    stream = _stream.connect(listener.address, _session.current().secret, {"purpose": "node"}, TIMEOUT)
    try:
        s = stream.sock
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == _stream.KEEPALIVE_IDLE_S
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == _stream.KEEPALIVE_INTERVAL_S
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == _stream.KEEPALIVE_COUNT
    finally:
        stream.close()
    conn = _endpoint._ZmqConnection(q._address, _session.current().secret, TIMEOUT)
    try:
        assert conn.sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
        assert conn.sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == _stream.KEEPALIVE_IDLE_S
    finally:
        conn.close()


def test_the_pool_parent_marks_a_worker_it_cannot_deliver_to_and_puts_its_work_back_when_it_reconnects():
    """The parent's side of a worker cut off: work sent to it that cannot be delivered marks it, and the
    pool's upkeep then kills it (its work is re-run as for any lost worker)."""
    import helpers_pool as h
    from roving.pool import _protocol as P
    from roving.pool._dispatch import Dispatcher, WorkerState

    class Recorder:
        def _set_run(self, index, ok, values):
            pass

    delivered, late = [], []

    def send_to(self, ident, frames, undeliverable=None):
        if ident == b"w1":
            undeliverable()  # its connection is gone
            late.append(undeliverable)
        else:
            delivered.append(ident)

    disp = Dispatcher(10_000, max_task_retries=3)
    disp.node = type("Node", (), {"send_to": send_to})()
    disp.submit(Recorder(), h.square, P.MAP, list(range(4)), 1, inline=False)  # 4 units of 1 item
    w1, w2 = WorkerState(1, None), WorkerState(2, None)
    for w in (w1, w2):
        disp.add_worker(w)
        disp.on_message(b"w%d" % w.id, P.HELLO, w.id, 0, [])
    disp.on_message(b"w2", P.READY, 1, 0, [])
    assert delivered == [b"w2"] and not w2.unreachable
    disp.on_message(b"w1", P.READY, 1, 0, [])
    assert w1.unreachable and len(w1.units) == 1  # sent, never delivered
    # It reconnects (HELLO over a new connection): what it held goes back in line, to the front.
    held = next(iter(w1.units.values())).chunk
    disp.on_message(b"w1-again", P.HELLO, 1, 0, [])
    assert not w1.unreachable and w1.units == {} and w1.ident == b"w1-again" and b"w1" not in disp.by_ident
    assert disp.pending[0].chunk is held and w1.known == set() and w1.credit == 0
    late[0]()  # a message to the old connection fails after the HELLO: it does not count any more
    assert not w1.unreachable
    # A worker that was running a blamed item alone: the item stays with the blamed ones (run alone).
    w2.alone = True
    alone_unit = next(iter(w2.units.values()))
    disp.on_message(b"w2-again", P.HELLO, 2, 0, [])
    assert w2.units == {} and not w2.alone
    assert disp.suspects and disp.suspects[0].chunk is alone_unit.chunk


def test_a_zeromq_call_waiting_for_ever_finds_out_that_its_connection_was_remade(queue_via_proxy, monkeypatch):
    """A get() without a timeout sends nothing while it waits: it pings now and then (every
    ``_PROBE_S`` seconds, 0.2 here) so that a connection re-made under it is found out."""
    q, proxy = queue_via_proxy
    monkeypatch.setattr(_endpoint, "_PROBE_S", 0.2)
    ep = _endpoint.Endpoint(proxy.address, _session.current().secret, None, connect_timeout=TIMEOUT)
    ep._streams = ""
    t = _OneThread()
    assert t.run(lambda: ep.ping(TIMEOUT)) == (True, True)
    waiting = t._pool.submit(lambda: ep.call(_node.GET, q._box, -1))
    assert wait_until(lambda: _session.current().node().mailboxes.boxes[q._box].getters, TIMEOUT)
    proxy.cut()
    with pytest.raises(_endpoint.ConnectionLost):
        waiting.result(timeout=TIMEOUT)
    q.put("kept")  # the node's answer to the lost reader cannot be delivered: the item stays
    assert q.get(timeout=TIMEOUT) == "kept"
    assert t.run(lambda: ep.call(_node.PUT, q._box, -1, dumps("again"))) == (True, (_node.OK, []))
    assert q.get(timeout=TIMEOUT) == "again"


def test_a_pool_that_recycles_its_workers_leaves_no_connections_known_at_the_parent():
    """Each worker's two connections (work, heartbeats) say goodbye when it exits, so the parent's node
    does not keep an identity per worker that ever ran (maxtasksperchild recycles many)."""
    import helpers_pool as hp

    node = _session.current().node()
    before = len(node.router.door.authenticated)
    with roving.Pool(2, maxtasksperchild=1) as pool:
        assert pool.map(hp.square, range(12), chunksize=1) == [x * x for x in range(12)]
        pool.close()
        pool.join(TIMEOUT)
    # At least 12 workers ran (one item each), each with two connections: before goodbyes, 24 or more
    # identities stayed. A worker killed while it starts (the pool closing) cannot say goodbye: a few may.
    known = node.router.door.authenticated
    assert wait_until(lambda: len(known) <= before + 6, TIMEOUT), (before, len(known))


def test_a_peer_that_vanishes_without_closing_is_found_by_keepalive(monkeypatch):
    """A machine that loses power or its network sends no FIN and no RST: a get() waiting on it would
    wait for ever. Keepalive probes find it. Here the vanishing is made with iptables, which drops every
    packet to and from the node's stream port on 127.0.0.1 (the Docker engine's package installs it),
    and the probes are made faster (1 s idle, 2 probes 1 s apart) so that the test takes seconds."""
    import shutil
    import subprocess

    iptables = shutil.which("iptables")
    assert iptables, "iptables is missing: scripts/test.sh installs it (with docker.io)"
    monkeypatch.setattr(_stream, "KEEPALIVE_IDLE_S", 1)
    monkeypatch.setattr(_stream, "KEEPALIVE_INTERVAL_S", 1)
    monkeypatch.setattr(_stream, "KEEPALIVE_COUNT", 2)
    secret = _session.current().secret
    node = _node.Node(secret)
    box = node.mailboxes.new_box()
    port = node.streams().address.rpartition(":")[2]
    rules = [["INPUT", "-i", "lo", "-p", "tcp", "--dport", port, "-j", "DROP"],
             ["INPUT", "-i", "lo", "-p", "tcp", "--sport", port, "-j", "DROP"]]
    added = []
    try:
        ep = _endpoint.Endpoint(node.address, secret, None, connect_timeout=TIMEOUT)
        t = _OneThread()
        assert t.run(lambda: isinstance(ep._conn(), _endpoint._StreamConnection)) == (True, True)
        waiting = t._pool.submit(lambda: ep.call(_node.GET, box, -1))  # an empty queue: it waits
        assert wait_until(lambda: node.mailboxes.boxes[box].getters, TIMEOUT)
        for rule in rules:
            subprocess.run([iptables, "-I", *rule], check=True, capture_output=True, timeout=30)
            added.append(rule)
        with pytest.raises(_endpoint.ConnectionLost):
            waiting.result(timeout=TIMEOUT)
    finally:
        for rule in added:
            subprocess.run([iptables, "-D", *rule], capture_output=True, timeout=30)
        node.close()


def test_the_node_forgets_a_connection_that_ended_without_a_goodbye_once_it_cannot_send_to_it():
    secret = _session.current().secret
    node = _node.Node(secret)
    try:
        conn = _endpoint._ZmqConnection(node.address, secret, TIMEOUT)
        assert wait_until(lambda: len(node.router.door.authenticated) == 1, TIMEOUT)
        ident = next(iter(node.router.door.authenticated))
        conn.sock.close(0)  # a process killed: no goodbye
        # The node learns that the connection has gone when a message to it cannot be sent.
        known = node.router.door.authenticated
        assert wait_until(lambda: node.send_to(ident, [b"anyone there?"]) or ident not in known, TIMEOUT)
    finally:
        node.close()
