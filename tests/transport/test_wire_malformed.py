"""A node drops a malformed message in pieces from an authenticated peer with one warning line that names
the peer and what was wrong (no traceback), and goes on serving that peer."""
from __future__ import annotations

import logging
import os

import pytest
import zmq

from helpers_core import TIMEOUT, wait_until
from roving.transport import auth, crypto, identity
from roving.transport import node as _node
from roving.transport import wire


@pytest.mark.parametrize("frames, reason", [
    ([wire.PIECES], "has no layout frame"),
    ([wire.PIECES, b"abc"], "not a multiple of 8"),
    ([wire.PIECES, (5).to_bytes(8, "little"), b"only one"], "5 pieces announced, 1 came"),
])
def test_a_malformed_message_in_pieces_is_dropped_with_one_line_naming_the_peer(frames, reason, caplog):
    secret = os.urandom(32)
    node = _node.Node(secret)
    got = []
    node.register_handler(b"after", lambda ident, fr: got.append(ident))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    crypto.curve_client(sock, secret, identity.node_key(node.address))
    sock.connect(identity.bare(node.address))
    try:
        def recv(what: str):
            assert sock.poll(TIMEOUT * 1000), f"no {what}"
            return sock.recv_multipart()

        auth.prove(sock.send_multipart, recv, secret, node.address)
        (ident,) = list(node.router.door.authenticated)
        token = node.router.door.tokens[ident]  # what handlers know the connection by
        with caplog.at_level(logging.WARNING, logger="roving.transport.router"):
            sock.send_multipart(frames)
            sock.send_multipart([b"after"])  # the node goes on, and still knows the peer
            assert wait_until(lambda: got == [token], TIMEOUT), got
        records = [r for r in caplog.records if r.name == "roving.transport.router"]
        assert len(records) == 1, [r.getMessage() for r in records]
        (record,) = records
        line = record.getMessage()
        assert record.levelno == logging.WARNING and record.exc_info is None, line
        assert "malformed" in line and reason in line and ident.hex() in line and "127.0.0.1" in line, line
        assert "\n" not in line
    finally:
        sock.close(0)
        node.close()
