"""The ZeroMQ authentication handler (ZAP, ZeroMQ RFC 27) of this process's nodes.

libzmq asks the handler about every connection a node's ROUTER takes, during the ZeroMQ handshake and
before any message of it is delivered. For each node (a ZAP domain of its own, :func:`register`):

* With CURVE, only the session's client key is accepted (:func:`roving.transport.crypto.curve_keys`),
  and the node keys of processes admitted without the member secret (:func:`admit`: a pipeline node
  that joined through the open door): a stranger never completes the handshake, so it can neither
  send a message nor hold its connection open past ZeroMQ's handshake interval. Refusals are logged,
  throttled, with the peer's address.
* Every accepted connection gets a fresh random user id, which libzmq attaches to each message of that
  connection (the ``User-Id`` property; the peer cannot set it). The node ties a peer's authentication
  to it (:mod:`roving.transport.node`), not to the routing id, which a peer may choose: a new
  connection that takes the routing id of one that left is a stranger.

One handler serves the whole ZeroMQ context (libzmq's rule); it runs on a daemon thread of its own.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Dict, Optional

import zmq
from zmq.utils import z85

from . import identity
from .guard import Refusals

log = logging.getLogger(__name__)

_ENDPOINT = "inproc://zeromq.zap.01"
_domains: Dict[bytes, Optional[bytes]] = {}  # domain -> the accepted CURVE client key (raw), None: NULL
_admitted: Dict[bytes, str] = {}  # the node keys (raw) of admitted non-members -> their node ids
_lock = threading.Lock()
_started: Dict[int, threading.Thread] = {}
_refusals = Refusals(log, "node (ZeroMQ handshake)")


def refusals() -> Refusals:
    """The handler's refusal log (its ``count`` is read by tests)."""
    return _refusals


def register(ctx: zmq.Context, client_key: Optional[bytes]) -> bytes:
    """A new ZAP domain for one node: CURVE peers must present ``client_key`` (Z85), or None for a
    node without CURVE (every connection accepted; each still gets its own user id). Set the returned
    domain as the socket's ZAP_DOMAIN before it binds."""
    _start(ctx)
    domain = b"roving-" + os.urandom(8).hex().encode()
    with _lock:
        _domains[domain] = None if client_key is None else z85.decode(client_key)
    return domain


def admit(node_key: str, node_id: str) -> None:
    """Accept, at every CURVE node of this process, connections that present ``node_key`` (the
    :attr:`.identity.Credentials.key` of a process that holds no member secret, as its certificate and
    address name it) as their client key. What such a process may then do is decided by its
    certificate in roving's own handshake (:mod:`.auth`): this only lets it reach that handshake."""
    raw = z85.decode(identity.curve_server_key(node_key))
    with _lock:
        _admitted[raw] = node_id


def withdraw(node_id: str) -> None:
    """Accept the keys :func:`admit` took for ``node_id`` no more (new connections; its credentials'
    revocation closes the ones it has)."""
    with _lock:
        for raw in [k for k, who in _admitted.items() if who == node_id]:
            del _admitted[raw]


def unregister(domain: bytes) -> None:
    with _lock:
        _domains.pop(domain, None)


def _start(ctx: zmq.Context) -> None:
    with _lock:
        if id(ctx) in _started:
            return
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(_ENDPOINT)  # before any node binds: libzmq lets a CURVE peer in when no handler is there
        thread = threading.Thread(target=_serve, args=(sock,), name="roving-zap", daemon=True)
        _started[id(ctx)] = thread
        thread.start()


def _serve(sock: zmq.Socket) -> None:
    while True:
        try:
            request = sock.recv_multipart()
        except zmq.ContextTerminated:
            sock.close(0)
            return
        except zmq.ZMQError:
            log.exception("roving ZAP handler: a request could not be read")
            continue
        try:
            reply = _answer(request)
        except Exception:  # never leave libzmq without an answer: it would hold the connection
            log.exception("roving ZAP handler: a request could not be answered; refused")
            reply = [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"internal error", b"", b""]
        try:
            sock.send_multipart(reply)
        except zmq.ContextTerminated:
            sock.close(0)
            return


def _answer(request: list) -> list:
    version, request_id, domain, address, _identity, mechanism, *credentials = request
    if version != b"1.0":
        return [b"1.0", request_id, b"400", b"unsupported ZAP version", b"", b""]
    with _lock:
        known = domain in _domains
        key = _domains.get(domain)
        admitted = mechanism == b"CURVE" and bool(credentials) and credentials[0] in _admitted
    source = address.decode(errors="replace")
    if not known:
        why = "not a roving node's connection"
    elif key is None:
        if mechanism == b"NULL":
            return [version, request_id, b"200", b"OK", os.urandom(16).hex().encode(), b""]
        why = f"unexpected mechanism {mechanism.decode(errors='replace')}"
    elif mechanism == b"CURVE" and credentials and (credentials[0] == key or admitted):
        return [version, request_id, b"200", b"OK", os.urandom(16).hex().encode(), b""]
    else:
        why = ("a CURVE key that is not this session's (a stranger, or a process of another session)"
               if mechanism == b"CURVE" else f"mechanism {mechanism.decode(errors='replace')} where CURVE is required")
    _refusals.refuse(source, why)
    return [version, request_id, b"400", why.encode(), b"", b""]


class _Withdrawals:
    """Revoked credentials (:func:`.identity.revoke`) take their admitted key with them."""

    def revoked(self, node_id: str) -> None:
        withdraw(node_id)


_withdrawals = _Withdrawals()
identity.on_revoke(_withdrawals)
