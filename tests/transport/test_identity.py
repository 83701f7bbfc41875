"""Every process its own identity (issue 31): the session CA issues each process's credentials, every
stream and ZeroMQ connection checks that it reached the node it meant, every message is attributable
to the process that sent it, answers go to the connection that asked, and revoked credentials get
nowhere."""
from __future__ import annotations

import os
import time

import pytest
import zmq

import helpers_targets as targets
import roving
from helpers_core import TIMEOUT
from helpers_net import CuttingProxy
from roving.transport import auth, crypto, identity
from roving.transport import channel as _channel
from roving.transport import endpoint as _endpoint
from roving.transport import node as _node
from roving.transport import wire as _wire
from roving.transport import session as _session
from roving.transport import stream as _stream
from roving.transport.wire import HEADER

WHO = b"who"


class _Processes:
    """Credentials of several processes of one session, as the root's CA issues them (the root's own
    first); each node made here is one of those processes' node."""

    def __init__(self) -> None:
        self.root = identity.root(os.urandom(32), "root-" + os.urandom(4).hex())
        self.nodes = []

    def issue(self, name: str) -> identity.Credentials:
        node_id = f"{name}-{os.urandom(4).hex()}"
        return identity.Credentials(self.root.secret, self.root.authority.issue(node_id))

    def node(self, creds: identity.Credentials, encrypt: str = "auto") -> _node.Node:
        n = _node.Node(creds, encrypt=encrypt)
        self.nodes.append(n)
        return n

    def close(self) -> None:
        for n in self.nodes:
            n.close()


@pytest.fixture
def session():
    s = _Processes()
    yield s
    s.close()


def _recording(node: _node.Node) -> list:
    """A handler WHO on ``node`` that records who sent each message (node.peer) and answers it."""
    seen = []

    def handle(ident, frames):
        seen.append(node.peer(ident))
        node.send_to(ident, [b"ok"])

    node.register_handler(WHO, handle)
    return seen


# -- a relayed connection to the wrong node ------------------------------------------------------

@pytest.mark.parametrize("encrypt", ["auto", "always", "off"])
def test_a_stream_relayed_to_another_node_of_the_session_is_refused_and_the_put_lands_nowhere(
        session, monkeypatch, encrypt):
    monkeypatch.setattr(crypto, "mode", lambda: encrypt)
    a = session.node(session.issue("a"), encrypt)
    b = session.node(session.issue("b"), encrypt)
    client = session.issue("client")
    box_a, box_b = a.mailboxes.new_box(), b.mailboxes.new_box()
    assert box_a == box_b  # mailbox ids start at 1 in every node: the id alone does not tell them apart
    relay = CuttingProxy(b.streams().address)  # a relay that sends what is meant for A to B
    # over TLS the client finds B's certificate where A's was meant; over plain text (loopback, also
    # with encrypt="off") B's signature names the relay's leg to B, not this connection (issue 51)
    refused = "not the node its address names" if encrypt == "always" else "over this connection"
    try:
        with pytest.raises(identity.IdentityError, match=refused):
            _endpoint._StreamConnection(a.address, relay.address, client, TIMEOUT)
        with pytest.raises(identity.IdentityError):
            _channel._open_channel_stream(a.address, relay.address, client, TIMEOUT)
        if encrypt == "always":
            # the same stream to B itself, as B's address names it, is taken: the refusal is the relay's
            direct = _endpoint._StreamConnection(b.address, relay.address, client, TIMEOUT)
            assert direct.stream.peer.node_id == b.credentials.node_id
            direct.close()
        else:  # a forwarder of plain bytes is a relay, wherever it sends them
            with pytest.raises(identity.IdentityError, match="over this connection"):
                _endpoint._StreamConnection(b.address, relay.address, client, TIMEOUT)
    finally:
        relay.close()
    assert _wire.unpack_sizes(b.mailboxes.call_local(_node.SIZE, box_b, 0, [])[1][0]).items == 0


@pytest.mark.parametrize("encrypt", ["auto", "off"])
def test_a_zeromq_connection_relayed_to_another_node_of_the_session_is_refused(session, monkeypatch, encrypt):
    monkeypatch.setattr(crypto, "mode", lambda: encrypt)
    a = session.node(session.issue("a"), encrypt)
    b = session.node(session.issue("b"), encrypt)
    client = session.issue("client")
    box = b.mailboxes.new_box()
    relay = CuttingProxy(b.address.partition("#")[0] + "#" + identity.node_key(a.address))  # A's name, B's port
    try:
        # under CURVE the client pins A's key, so B cannot finish ZeroMQ's handshake; without CURVE
        # roving's handshake finds B's certificate where A's was meant
        with pytest.raises((auth.AuthenticationError, identity.IdentityError)):
            ep = _endpoint.Endpoint(relay.address, client, None, connect_timeout=5)
            ep.call(_node.PUT, box, 0, [b"meant for A"])
    finally:
        relay.close()
    assert b.mailboxes.call_local(_node.GET, box, 0, [])[0] == _node.EMPTY


def test_an_address_that_names_no_node_key_is_refused_under_curve(session):
    a = session.node(session.issue("a"))
    with pytest.raises(identity.IdentityError, match="names no node key"):
        _endpoint._ZmqConnection(identity.bare(a.address), session.issue("client"), TIMEOUT)


# -- every message attributable; one process cannot present another's id -------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_the_node_knows_which_process_sent_each_message(session, stream):
    node = session.node(session.issue("owner"))
    seen = _recording(node)
    one, two = session.issue("one"), session.issue("two")
    for creds in (one, two, one):
        chan = _channel.Channel(node.address, creds, TIMEOUT, stream=stream)
        try:
            assert chan.over_stream == stream
            chan.send([WHO])
            assert chan.recv(TIMEOUT) is not None
        finally:
            chan.close()
    assert [p.node_id for p in seen] == [one.node_id, two.node_id, one.node_id]
    assert [p.key for p in seen] == [one.key, two.key, one.key]


def test_the_ca_issues_a_node_id_once(session):
    taken = session.issue("w")
    with pytest.raises(identity.IdentityError, match="issued already"):
        session.root.authority.issue(taken.node_id)


def test_a_process_that_shows_another_process_certificate_is_refused(session):
    """It has the victim's certificate (that is public) but signs with its own key: refused, over ZeroMQ
    and streams alike; a certificate of its own making, naming the victim, is refused too."""
    node = session.node(session.issue("owner"))
    victim, thief = session.issue("victim"), session.issue("thief")
    forger = identity.Authority(os.urandom(32))  # a CA of its own, not the session's
    forged = identity.Credentials(session.root.secret, forger.issue(victim.node_id))
    before = node.router.refusals.count

    for cert, signer in ((victim.cert_der, thief), (forged.cert_der, forged)):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        crypto.curve_client(sock, session.root.secret, identity.node_key(node.address))
        sock.connect(identity.bare(node.address))
        try:
            nonce = auth.new_nonce()
            sock.send_multipart([auth.HELLO, nonce])
            assert sock.poll(TIMEOUT * 1000)
            kind, node_nonce, _, _, _ = sock.recv_multipart()
            assert kind == auth.CHALLENGE
            sock.send_multipart([auth.PROOF, auth.client_proof(session.root.secret, nonce, node_nonce), cert,
                                 signer.prove(False, nonce, node_nonce, identity.node_key(node.address))])
            assert sock.poll(TIMEOUT * 1000) and sock.recv_multipart() == [auth.DENIED]
        finally:
            sock.close(0)
    assert node.router.refusals.count >= before + 2 and not node.router.door.authenticated

    impostor = identity.child(thief.secret, thief.node_id, thief.private_part(),
                              {"cert": thief.cert_pem, "ca": thief.ca_pem})
    impostor.cert_der = victim.cert_der  # the thief's key, showing the victim's certificate
    with pytest.raises(auth.AuthenticationError, match="refused this process's secret or identity"):
        _stream.connect(node.streams().address, impostor, {"purpose": "node"}, TIMEOUT)
    with pytest.raises((auth.AuthenticationError, identity.IdentityError)):  # (it does not trust the node either)
        _stream.connect(node.streams().address, forged, {"purpose": "node"}, TIMEOUT)
    assert not node.hub.peers  # no stream of either got in


# -- revocation ------------------------------------------------------------------------------------

def test_a_workers_stolen_credentials_are_refused_once_it_is_revoked(session):
    node = session.node(session.issue("parent"))
    seen = _recording(node)
    worker, other = session.issue("worker"), session.issue("other")
    box = node.mailboxes.new_box()
    # the thief holds a copy of everything the worker was given: member secret, seed, certificates
    stolen = identity.child(worker.secret, worker.node_id, worker.private_part(),
                            {"cert": worker.cert_pem, "ca": worker.ca_pem})
    before = [_endpoint._StreamConnection(node.address, node.streams().address, stolen, TIMEOUT),
              _endpoint._ZmqConnection(node.address, stolen, TIMEOUT)]
    for conn in before:
        assert conn.call(_node.PUT, box, 0, [b"before"], TIMEOUT)[0] == _node.OK  # it works until revoked
    channel = _channel.Channel(node.address, stolen, TIMEOUT, stream=True)
    channel.send([WHO])
    assert channel.recv(TIMEOUT) is not None and seen[-1].node_id == worker.node_id

    identity.revoke(worker.node_id)

    # its open connections are closed: the stream ends, ZeroMQ is told it is not known any more
    for conn in before:
        with pytest.raises(_endpoint.ConnectionLost):
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                conn.call(_node.PUT, box, 0, [b"after"], TIMEOUT)
                time.sleep(0.05)
        conn.close()
    with pytest.raises(_channel.ConnectionLost):
        channel.recv(TIMEOUT)
    channel.close()
    # and new ones are refused, over streams and ZeroMQ
    with pytest.raises(auth.AuthenticationError):
        _stream.connect(node.streams().address, stolen, {"purpose": "node"}, TIMEOUT)
    with pytest.raises(auth.AuthenticationError):
        _endpoint._ZmqConnection(node.address, stolen, TIMEOUT)
    assert [bytes(node.mailboxes.call_local(_node.GET, box, 0, [])[1][0]) for _ in range(2)] == [b"before"] * 2
    assert node.mailboxes.call_local(_node.GET, box, 0, [])[0] == _node.EMPTY  # nothing it sent after got in
    # another worker is not affected
    conn = _endpoint._StreamConnection(node.address, node.streams().address, other, TIMEOUT)
    assert conn.call(_node.PING, 0, 0, [], TIMEOUT)[0] == _node.OK
    conn.close()


# -- answers go to the connection that asked --------------------------------------------------------

def _raw_dealer(node, creds, routing_id=None, curve=True):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if curve:
        crypto.curve_client(sock, creds.secret, identity.node_key(node.address))
    sock.connect(identity.bare(node.address))
    return sock


def test_with_encrypt_off_a_stranger_that_takes_a_departed_peers_routing_id_gets_nothing_meant_for_it(session):
    node = session.node(session.issue("owner"), encrypt="off")
    reader = session.issue("reader")
    box = node.mailboxes.new_box()
    owner = _raw_dealer(node, reader, curve=False)
    auth.prove(owner.send_multipart, lambda what: owner.recv_multipart() if owner.poll(TIMEOUT * 1000) else [],
               reader, node.address)
    owner.send_multipart([_node.GET, HEADER.pack(box, 7, 60.0)])  # a get that waits for an item
    deadline = time.monotonic() + TIMEOUT
    while not node.mailboxes.boxes[box].getters and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.mailboxes.boxes[box].getters
    (ident,) = list(node.router.door.authenticated)
    owner.close(0)  # gone without a goodbye, its get still waiting at the node
    # a stranger (no secret, no certificate) takes the routing id once libzmq lets it
    deadline = time.monotonic() + TIMEOUT
    while True:
        thief = _raw_dealer(node, reader, routing_id=ident, curve=False)
        thief.send_multipart([_node.PING, HEADER.pack(0, 1, 0.0)])
        if thief.poll(1000):
            assert thief.recv_multipart() == [auth.REAUTH]  # it holds the id now, and is not known
            break
        thief.close(0)
        assert time.monotonic() < deadline, "libzmq never let the stranger have the routing id"
    try:
        node.mailboxes.call_local(_node.PUT, box, 0, [b"the item the departed reader waited for"])
        assert not thief.poll(1000), thief.recv_multipart()  # nothing meant for the departed reader
        # the item went back to the queue, for the next reader
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            status, frames = node.mailboxes.call_local(_node.GET, box, 0, [])
            if status == _node.OK:
                break
            time.sleep(0.02)
        assert status == _node.OK and bytes(frames[0]) == b"the item the departed reader waited for"
    finally:
        thief.close(0)


# -- in real processes -----------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_a_child_has_its_own_identity_and_no_ca(stream):
    me = _session.current()
    node = me.node()
    seen = []
    op = b"who-" + os.urandom(4).hex().encode()

    def handle(ident, frames):
        seen.append(node.peer(ident))
        node.send_to(ident, [b"ok"])

    node.register_handler(op, handle)
    q = roving.Queue()
    p = roving.Process(target=targets.tell_node_who_i_am, args=(node.address, op, stream, q))
    p.start()
    got = q.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert got["answered"] and got["node_id"] == got["uid"] and not got["holds_ca"]
    assert me.credentials.authority is not None  # the root holds the CA
    assert [peer.node_id for peer in seen] == [got["uid"]]  # the parent knows the child by its own id
    assert seen[0].key == identity.node_key(got["address"]) != me.credentials.key


def test_a_pool_revokes_the_credentials_of_a_worker_it_declares_lost():
    with roving.Pool(2) as pool:
        assert pool.map(abs, [-1, -2, -3]) == [1, 2, 3]
        victim, other = pool._pool  # multiprocessing's list of the workers
        victim.kill()
        deadline = time.monotonic() + TIMEOUT
        while not identity.is_revoked(victim._uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert identity.is_revoked(victim._uid)
        assert not identity.is_revoked(other._uid)
        assert pool.map(abs, [-4, -5]) == [4, 5]  # the pool goes on with the others


def test_revoking_a_child_closes_the_pipe_stream_this_process_has_with_it():
    import helpers_pipes as hp

    here, there = roving.Pipe()
    child = roving.Process(target=hp.echo_until_none, args=(there,))
    child.start()
    try:
        for i in range(50):
            here.send(i)
            assert here.poll(TIMEOUT) and here.recv() == i
        link = here._end.link
        assert link is not None and link.stream.peer.node_id == child._uid  # over a stream, with the child
        child.revoke_credentials()
        deadline = time.monotonic() + TIMEOUT
        while not link.stream.closed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert link.stream.closed
    finally:
        here.send(None)
        child.join(TIMEOUT)
    assert child.exitcode is not None
