"""A node forgets the identities of peers that are gone, also of those killed before their goodbye (issue 22).

Over 200 kills (kill -9 of processes each holding authenticated connections, 20 per process) the node's
count of remembered peers stays bounded by those alive; a live peer that reconnects is remembered; what a
peer sent before its end is still handled as its own; and watching for those ends never stops ZeroMQ in
the process (closing a node with peers connected once froze libzmq's I/O thread for every node).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

import zmq

from helpers_core import TIMEOUT, wait_until
from roving.transport import auth, crypto, identity
from roving.transport import node as _node
from roving.transport import wire as _wire
from roving.transport.guard import Refusals
from roving.transport.channel import Channel

PER_PROCESS = 20
ROUNDS = 10  # 200 identities killed

_CLIENT = """
import os, sys, time
from roving.transport.channel import Channel
chans = [Channel(sys.argv[1], bytes.fromhex(os.environ["FORGET_TEST_SECRET"]), 30.0) for _ in range(int(sys.argv[2]))]
for c in chans:
    c.send([b"ping-test"])
print("ready", flush=True)
time.sleep(600)
"""


def test_identities_of_killed_peers_are_forgotten_and_live_ones_kept():
    secret = os.urandom(32)
    node = _node.Node(secret)
    seen = []
    node.register_handler(b"ping-test", lambda ident, frames: seen.append(ident))
    env = dict(os.environ, FORGET_TEST_SECRET=secret.hex())
    try:
        live = Channel(node.address, secret, TIMEOUT)
        live.send([b"ping-test"])
        assert wait_until(lambda: node.known_peers() == 1, TIMEOUT), node.known_peers()
        most = 0
        for _ in range(ROUNDS):
            proc = subprocess.Popen([sys.executable, "-c", _CLIENT, node.address, str(PER_PROCESS)], env=env,
                                    stdout=subprocess.PIPE)
            try:
                assert proc.stdout.readline().strip() == b"ready"
                assert wait_until(lambda: node.known_peers() == 1 + PER_PROCESS, TIMEOUT), node.known_peers()
            finally:
                proc.send_signal(signal.SIGKILL)  # no goodbye
                proc.wait(TIMEOUT)
            most = max(most, node.known_peers())
            assert wait_until(lambda: node.known_peers() == 1, TIMEOUT), \
                f"{node.known_peers()} peers remembered after a kill; 1 is alive"
        assert most <= 1 + PER_PROCESS
        # the live peer was never forgotten: it still talks
        before = len(seen)
        live.send([b"ping-test"])
        assert wait_until(lambda: len(seen) == before + 1, TIMEOUT)
        # a peer that reconnects (its old connection cut without a word) is remembered under its new one
        live._sock.close(0)
        again = Channel(node.address, secret, TIMEOUT)
        again.send([b"ping-test"])
        assert wait_until(lambda: len(seen) == before + 2, TIMEOUT)
        assert wait_until(lambda: node.known_peers() == 1, TIMEOUT), node.known_peers()
        again.close()
        assert wait_until(lambda: node.known_peers() == 0, TIMEOUT), node.known_peers()
    finally:
        node.close()


class _Frame:
    """A stand-in for a zmq.Frame as the Door reads it: bytes, User-Id and the connection's descriptor."""

    def __init__(self, data: bytes, user: str, fd: int) -> None:
        self.bytes, self._props = data, {"User-Id": user, "Peer-Address": "127.0.0.1", zmq.SRCFD: fd}

    def __len__(self) -> int:
        return len(self.bytes)

    def get(self, name):
        return self._props[name]


def _let_in(door, ident: bytes, user: str, fd: int, sent: list, secret: bytes) -> None:
    client = auth.ClientHandshake(secret)
    door.knock(ident, [_Frame(auth.HELLO, user, fd), _Frame(client.hello, user, fd)])
    _, _, nonce, proof, cert, signature = sent[-1]
    answer, mine = client.answer(nonce, proof, cert, signature, "door")
    door.knock(ident, [_Frame(auth.PROOF, user, fd), _Frame(answer, user, fd),
                       _Frame(identity.credentials(secret).cert_der, user, fd), _Frame(mine, user, fd)])
    assert sent[-1] == [ident, auth.WELCOME]


def test_the_door_forgets_the_peer_of_an_ended_connection_and_only_that_one():
    secret = os.urandom(32)
    sent: list = []
    door = auth.Door(secret, sent.append, Refusals(logging.getLogger("test-door"), "the test door"))

    def ended(fd: int) -> None:  # as the node does: the end reported, then forgotten when all is read
        door.disconnected(fd)
        door.forget_disconnected()

    _let_in(door, b"a", "ua", 7, sent, secret)
    _let_in(door, b"b", "ub", 8, sent, secret)
    assert door.known_peers() == 2
    door.disconnected(7)
    assert door.known_peers() == 2 and door.ending == 1  # a's last messages may still wait: still a's
    door.forget_disconnected()
    assert door.authenticated == {b"b": "ub"} and door.ending == 0
    ended(7)  # told twice, or of a descriptor nobody authenticated on: nothing more goes
    ended(99)
    assert door.authenticated == {b"b": "ub"}
    # descriptor 7 reused by a new connection: its end forgets the new peer, not b
    _let_in(door, b"c", "uc", 7, sent, secret)
    ended(7)
    assert door.authenticated == {b"b": "ub"}
    # routing id b taken over by a new connection (on descriptor 9) after b's left unnoticed: the end of
    # descriptor 8 no longer names b
    _let_in(door, b"b", "ub2", 9, sent, secret)
    ended(8)
    assert door.authenticated == {b"b": "ub2"}
    # b's end reported, and before it is applied a new connection authenticates under routing id b (a
    # newer connection, another user id): it is kept
    door.disconnected(9)
    _let_in(door, b"b", "ub3", 10, sent, secret)
    door.forget_disconnected()
    assert door.authenticated == {b"b": "ub3"}
    ended(10)
    assert door.known_peers() == 0


def _authenticated_dealer(address: str, secret: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    crypto.curve_client(sock, secret, identity.node_key(address))
    sock.connect(identity.bare(address))

    def recv(what: str):
        assert sock.poll(TIMEOUT * 1000), f"no {what}"
        return sock.recv_multipart()

    auth.prove(sock.send_multipart, recv, secret, address)
    return sock


def test_what_a_peer_sent_before_its_connection_ended_is_handled_as_its_own():
    """More messages than the node reads in one turn, then the end of the connection without a goodbye,
    reported before the node has read them all: every one is handled, then the peer is forgotten."""
    secret = os.urandom(32)
    node = _node.Node(secret)
    got, first, closed = [], threading.Event(), threading.Event()

    def handler(ident, frames):
        got.append(bytes(frames[0]))
        if len(got) == 1:  # on the node's I/O thread: hold it until the end has been reported
            first.set()
            assert closed.wait(TIMEOUT)
            assert node.router.monitor.poll(TIMEOUT * 1000)  # ZeroMQ's DISCONNECTED is waiting to be read
    node.register_handler(b"count", handler)
    count = 600  # over two turns' worth (256 messages a turn)
    try:
        sock = _authenticated_dealer(node.address, secret)
        assert node.known_peers() == 1
        sock.send_multipart([b"count", b"0"])
        assert first.wait(TIMEOUT)
        for i in range(1, count):
            sock.send_multipart([b"count", str(i).encode()])
        sock.close(int(TIMEOUT * 1000))  # sent in full (linger), then the connection ends, no goodbye
        closed.set()
        assert wait_until(lambda: len(got) == count and node.known_peers() == 0, TIMEOUT), \
            (len(got), node.known_peers())
        assert got == [str(i).encode() for i in range(count)]
    finally:
        closed.set()
        node.close()


def test_closing_a_node_with_peers_connected_leaves_zeromq_serving_the_others():
    """A node closed while peers are connected: the ends of their connections are no longer watched, and
    libzmq's I/O thread (shared by every ZeroMQ socket of the process) goes on: a new node answers."""
    for _ in range(3):
        secret = os.urandom(32)
        node = _node.Node(secret)
        peers = [Channel(node.address, secret, TIMEOUT) for _ in range(5)]
        for p in peers:
            p.send([b"anything"])
        assert wait_until(lambda: node.known_peers() == 5, TIMEOUT), node.known_peers()
        node.close()  # the five connections end now, with the node's monitor running until then
        other = _node.Node(secret)
        try:
            got = []
            other.register_handler(b"hi", lambda ident, frames: got.append(ident))
            chan = Channel(other.address, secret, TIMEOUT)  # TransportError if ZeroMQ had stopped
            chan.send([b"hi"])
            assert wait_until(lambda: got, TIMEOUT)
            chan.close()
        finally:
            other.close()
            for p in peers:
                p._sock.close(0)


def test_monitor_events_left_unread_never_stop_zeromq():
    """libzmq sends monitor events with a blocking send from its I/O thread: the node's monitor pipe has
    no high-water mark, so events that pile up unread (a busy I/O thread) never stop that thread. With
    pyzmq's default monitor socket this loop stops after about 670 connections (2,000 events)."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    monitor = _wire.watch(router, zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    try:
        for i in range(1500):  # three events each, none read
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send(b"x")
            assert router.poll(TIMEOUT * 1000), f"ZeroMQ stopped after {i} connections"
            router.recv_multipart()
            dealer.close(0)
    finally:
        while monitor.poll(0):  # (were libzmq's thread stuck on a full pipe, this frees it to stop)
            monitor.recv_multipart()
        router.disable_monitor()
        monitor.close(0)
        router.close(0)
