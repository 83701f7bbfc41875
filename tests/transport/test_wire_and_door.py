"""The wire format's pieces and the handshake's two halves, on their own (no sockets): large frames
are cut into pieces that come back whole; a proof made with another secret is refused on both sides;
a node's Door lets in only a connection that proved the secret, knows it by its ZeroMQ user id, and
tells an unknown connection REAUTH once."""
import logging
import os

import pytest
import zmq

from roving.transport import auth, identity, wire
from roving.transport.guard import Refusals


class _Frame:
    """What a node's Door reads of a zmq.Frame: its bytes and its connection's properties."""

    def __init__(self, data: bytes, user: str = "u1", peer: str = "127.0.0.1") -> None:
        self.bytes, self._props = data, {"User-Id": user, "Peer-Address": peer}

    def __len__(self) -> int:
        return len(self.bytes)

    def get(self, name: str) -> str:
        return self._props[name]


def test_large_frames_travel_in_pieces_no_larger_than_a_node_takes_and_come_back_whole():
    small, large = b"op", os.urandom(2 * wire.MAX_FRAME + 5)
    assert wire.split_frames([small, b"x" * 100]) == [small, b"x" * 100]  # nothing to cut: unchanged
    cut = wire.split_frames([small, large, b"tail"])
    assert cut[0] == wire.PIECES
    assert all(wire.nbytes(piece) <= wire.MAX_FRAME for piece in cut[2:])
    joined = wire.join_pieces([zmq.Frame(bytes(f)) for f in cut[1:]])
    assert [bytes(f) for f in joined] == [small, large, b"tail"]


def test_pieces_that_do_not_match_their_layout_are_refused():
    cut = wire.split_frames([os.urandom(2 * wire.MAX_FRAME)])
    with pytest.raises(ValueError, match="layout"):
        wire.join_pieces([zmq.Frame(bytes(f)) for f in cut[1:-1]])  # a piece missing


def _layout(*counts: int) -> zmq.Frame:
    return zmq.Frame(b"".join(c.to_bytes(8, "little") for c in counts))


@pytest.mark.parametrize("frames, reason", [
    ([], "has no layout frame"),
    ([zmq.Frame(b"abc")], "is 3 bytes, not a multiple of 8"),
    ([zmq.Frame(b"")], "names no frame"),
    ([_layout(1, 0), zmq.Frame(b"x")], "gives a frame no pieces"),
    ([_layout(2 ** 64 - 1), zmq.Frame(b"x")], f"{2 ** 64 - 1} pieces announced, 1 came"),
    ([_layout(3), zmq.Frame(b"x")], "3 pieces announced, 1 came"),
    ([_layout(1), zmq.Frame(b"x"), zmq.Frame(b"y")], "1 pieces announced, 2 came"),
])
def test_a_malformed_message_in_pieces_raises_the_wire_error_with_a_one_line_reason(frames, reason):
    with pytest.raises(wire.MalformedMessage) as caught:
        wire.join_pieces(frames)
    assert isinstance(caught.value, ValueError)  # what callers that catch ValueError still see
    text = str(caught.value)
    assert reason in text and "\n" not in text, text


def test_the_handshake_passes_with_one_secret_and_fails_either_way_with_another():
    secret, other = os.urandom(32), os.urandom(32)
    client = auth.ClientHandshake(secret)
    server = auth.ServerHandshake(secret, client.hello)
    assert len(server.challenge) == auth.NONCE_BYTES + auth.PROOF_BYTES
    me = identity.credentials(secret)
    assert server.accepts(*client.answer(server.nonce, server.proof, server.cert, server.signature,
                                         "the test server")[:1], me.cert_der,
                          client.answer(server.nonce, server.proof, server.cert, server.signature, "x")[1]) \
        == client.peer
    # a server without the secret cannot prove it; a client without it cannot either
    stranger = auth.ServerHandshake(other, client.hello)
    with pytest.raises(auth.AuthenticationError, match="the test server failed to authenticate"):
        auth.ClientHandshake(secret).answer(stranger.nonce, stranger.proof, stranger.cert, stranger.signature,
                                            "the test server")
    impostor = auth.ClientHandshake(other)
    fresh = auth.ServerHandshake(secret, impostor.hello)
    with pytest.raises(auth.AuthenticationError):
        fresh.accepts(auth.client_proof(other, impostor.hello, fresh.nonce), me.cert_der, bytes(64))
    # every handshake has fresh nonces: an old proof does not pass a new challenge
    again = auth.ServerHandshake(secret, client.hello)
    assert again.nonce != server.nonce
    old_proof, old_signature = client.answer(server.nonce, server.proof, server.cert, server.signature, "x")
    with pytest.raises(auth.AuthenticationError):
        again.accepts(old_proof, me.cert_der, old_signature)


def _proof(client, nonce, proof, cert, signature, secret):
    """The frames of a client's answer to a challenge: its proof, certificate and signature."""
    answer, mine = client.answer(nonce, proof, cert, signature, "the door")
    return [_Frame(answer), _Frame(identity.credentials(secret).cert_der), _Frame(mine)]


def _door(secret):
    sent = []
    refusals = Refusals(logging.getLogger("test-door"), "the test door")
    return auth.Door(secret, sent.append, refusals), sent, refusals


def test_the_door_lets_in_a_connection_that_proves_the_secret_and_knows_it_by_its_user_id():
    secret = os.urandom(32)
    door, sent, refusals = _door(secret)
    client = auth.ClientHandshake(secret)
    door.knock(b"id1", [_Frame(auth.HELLO), _Frame(client.hello)])
    (ident, word, nonce, proof, cert, signature), = sent
    assert (ident, word) == (b"id1", auth.CHALLENGE)
    door.knock(b"id1", [_Frame(auth.PROOF), *_proof(client, nonce, proof, cert, signature, secret)])
    assert sent[-1] == [b"id1", auth.WELCOME]
    assert door.authenticated == {b"id1": "u1"} and not door.handshakes and refusals.count == 0
    (token,) = door.tokens.values()
    assert door.peer(token) == identity.credentials(secret).check_certificate(identity.credentials(secret).cert_der)
    door.forget(b"id1")
    assert door.authenticated == {}


def test_the_door_refuses_a_wrong_proof_and_a_proof_from_another_connection():
    secret = os.urandom(32)
    door, sent, refusals = _door(secret)
    client = auth.ClientHandshake(secret)
    door.knock(b"id1", [_Frame(auth.HELLO), _Frame(client.hello)])
    _, _, nonce, proof, cert, signature = sent[-1]
    good = _proof(client, nonce, proof, cert, signature, secret)
    # the same routing id on another connection (another user id) is not the one that said hello
    door.knock(b"id1", [_Frame(auth.PROOF, user="u2"), *good])
    assert door.authenticated == {}
    door.knock(b"id1", [_Frame(auth.PROOF), _Frame(os.urandom(auth.PROOF_BYTES)), *good[1:]])
    assert sent[-1] == [b"id1", auth.DENIED] and door.authenticated == {} and refusals.count == 1


def test_the_door_tells_an_unknown_connection_reauth_once_and_reads_nothing_of_it():
    door, sent, refusals = _door(os.urandom(32))
    for _ in range(3):
        door.knock(b"id9", [_Frame(wire.PUT), _Frame(b"header"), _Frame(b"payload")])
    assert sent == [[b"id9", auth.REAUTH]] and refusals.count == 1
    door.knock(b"id9", [_Frame(auth.BYE)])  # a late goodbye is no refusal
    assert len(sent) == 1 and refusals.count == 1


def test_the_door_remembers_a_bounded_number_of_half_done_handshakes():
    door, _, _ = _door(os.urandom(32))
    for i in range(auth.MAX_PENDING + 10):
        door.knock(b"id%d" % i, [_Frame(auth.HELLO), _Frame(auth.new_nonce())])
    assert len(door.handshakes) == auth.MAX_PENDING
    assert (b"id0", "u1") not in door.handshakes  # the oldest went first
