"""Mutual HMAC challenge-response between a roving peer and a roving endpoint.

Both sides prove knowledge of the session secret without sending it: the client sends a random nonce,
the server answers with its own nonce and a MAC over both, and the client answers with a MAC in the other
direction. Only after that does either side read a frame it would unpickle. The secret never crosses the
wire; replayed answers fail because every connection uses fresh nonces.
"""
from __future__ import annotations

import hashlib
import hmac
import multiprocessing
import os

NONCE_BYTES = 32


class AuthenticationError(multiprocessing.AuthenticationError, ConnectionError):
    """A peer failed to prove that it knows the session secret (also ``roving.AuthenticationError``)."""


def new_secret() -> bytes:
    """A fresh random session secret."""
    return os.urandom(32)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, b"roving-server" + client_nonce + server_nonce, hashlib.sha256).digest()


def client_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, b"roving-client" + server_nonce + client_nonce, hashlib.sha256).digest()


def verify(expected: bytes, received: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, received)
