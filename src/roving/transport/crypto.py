"""How the session's connections are encrypted and integrity-protected, with whose keys.

* **ZeroMQ: CurveZMQ.** Each node serves with its own CURVE key pair (:mod:`.identity`: made from its
  process's seed, its public key named by the node's address), and a client pins that key: it completes
  ZeroMQ's handshake only with the node it meant to reach. Clients use one CURVE key pair derived from
  the member secret (HKDF-SHA256, RFC 5869): a node's ROUTER accepts only that key (:mod:`.zap`), so a
  stranger never completes the ZeroMQ handshake; who a client is, it proves in roving's handshake
  (:mod:`.auth`, :mod:`.identity`).
* **Streams: TLS 1.3** (Python's :mod:`ssl`, mutual), each process with its own certificate, issued by
  the session CA, the only trust anchor of both sides. Host names are not checked: the handshake's
  proof names the node.

Which connections are encrypted is the ``encrypt`` option (:func:`mode`): ``auto`` (the default)
encrypts every stream whose address is not loopback and runs every ZeroMQ socket with CURVE (which also
keeps strangers out of the ZeroMQ handshake, on loopback too); ``always`` encrypts everything; ``off``
nothing (logged when a connection leaves loopback). roving's HMAC handshake (:mod:`.auth`) runs on top
of either, unchanged.
"""
from __future__ import annotations

import logging
import ssl
from typing import Dict, NamedTuple, Tuple

import zmq
from zmq.utils import z85

from . import identity
from .addressing import is_loopback

log = logging.getLogger(__name__)


def mode() -> str:
    """The ``encrypt`` option in force in this process."""
    from .. import config  # late: config is imported by much of roving

    return config.current().encrypt


def derive(secret: bytes, label: str, length: int = 32) -> bytes:
    """A key of ``length`` bytes for ``label``, derived from the member secret (HKDF-SHA256)."""
    return identity.derive(secret, label, length)


class CurveKeys(NamedTuple):
    """The session's CURVE client key pair, Z85-encoded as ZeroMQ's socket options take them."""
    client_public: bytes
    client_secret: bytes


_curve_cache: Dict[bytes, CurveKeys] = {}


def curve_keys(secret: bytes) -> CurveKeys:
    """The CURVE key pair every client of the session uses (derived from the member secret)."""
    keys = _curve_cache.get(secret)
    if keys is None:
        client_secret = z85.encode(derive(secret, "curve-client"))
        keys = _curve_cache[secret] = CurveKeys(zmq.curve_public(client_secret), client_secret)
    return keys


def curve_server(sock: zmq.Socket, creds: "identity.Credentials") -> None:
    """Make ``sock`` a CURVE server with this process's own node key (before it binds)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, creds.curve_secret)


def curve_client(sock: zmq.Socket, creds: "bytes | identity.Credentials", node_key: str) -> None:
    """Make ``sock`` a CURVE client that completes ZeroMQ's handshake only with the node whose key is
    ``node_key`` (:func:`.identity.node_key` of its address; before it connects). A member presents the
    session's client key; a process that is not one (``creds.member`` false) its own node key, which a
    node accepts once told of it (:func:`.zap.admit`). Raw bytes: a member's secret."""
    creds = identity.credentials(creds)
    if creds.member:
        keys = curve_keys(creds.secret)
        public, secret = keys.client_public, keys.client_secret
    else:
        public, secret = creds.curve_public, creds.curve_secret
    sock.setsockopt(zmq.CURVE_SERVERKEY, identity.curve_server_key(node_key))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def session_client_key(creds: "identity.Credentials") -> bytes:
    """The public half (Z85) of the session's shared CURVE client key, which this process's nodes accept
    from members: derived from the member secret, or as told to a process that is not a member."""
    if creds.member:
        return curve_keys(creds.secret).client_public
    assert creds.session_client_key is not None
    return creds.session_client_key


def tls_contexts(creds: "identity.Credentials") -> Tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) TLS 1.3 contexts of this process: mutual, the session CA the only trust anchor."""
    return identity.credentials(creds).tls_contexts()


_warned_off: set = set()


def stream_encrypted(host: str, encrypt: str) -> bool:
    """Whether a stream to or from ``host`` is encrypted under the ``encrypt`` option."""
    if encrypt == "always":
        return True
    loopback = is_loopback(host)
    if encrypt == "off":
        if not loopback and host not in _warned_off:
            _warned_off.add(host)
            log.warning("roving: encrypt='off': traffic with %s leaves loopback in plain text, without "
                        "integrity protection", host)
        return False
    return not loopback


def zmq_encrypted(encrypt: str, host: str = "127.0.0.1") -> bool:
    """Whether ZeroMQ sockets run CURVE under the ``encrypt`` option (all of them, or none); ``host``
    is the address bound or connected to (warned about once when ``off`` lets traffic leave loopback)."""
    if encrypt == "off":
        if not is_loopback(host) and ("zmq", host) not in _warned_off:
            _warned_off.add(("zmq", host))
            log.warning("roving: encrypt='off': ZeroMQ traffic with %s is plain text; strangers that reach "
                        "a node's port can hold connections and memory until they fail to authenticate",
                        host)
        return False
    return True
