"""Who may talk to us: the mutual HMAC challenge-response every roving connection runs first.

Both sides prove knowledge of the session secret without sending it: the client sends a random nonce,
the server answers with its own nonce and a MAC over both, and the client answers with a MAC in the
other direction. Only after that does either side read a frame it would unpickle. The secret never
crosses the wire; replayed answers fail because every connection uses fresh nonces.

A process that holds no member secret (:meth:`.identity.Credentials.certificate_only`: a pipeline node
that joined through the open door) takes part on its certificate alone: its certificate must mark it
untrusted, and its signature over both nonces (below) is then its whole proof. So the rule each member
applies is: a peer whose certificate is trusted proves the member secret as well; an untrusted one
proves its key. A process without the secret cannot check the other side's MAC and checks its
certificate and signature only (the CA's certificate is its anchor). An untrusted peer can do nothing
a member's connection can, whichever way it came in (:mod:`.mailbox`'s access rules, :mod:`.node`). With its proof
each side sends its certificate and a signature over both nonces (:mod:`.identity`): the client learns
which process the node is (and refuses one that is not the node its address names), the node which
process the client is (refusing revoked credentials); a signature made for one node is refused by any
other.

The same exchange runs over ZeroMQ (a node's ROUTER socket: :class:`Door` on the node's side,
:func:`prove` on the client's) and over streams (:mod:`.stream` moves the bytes of
:class:`ClientHandshake` and :class:`ServerHandshake`). Encryption (CURVE, TLS) is :mod:`.crypto`'s
and comes underneath; it does not replace this proof.

The proof is bound to the connection it is made on, so that a process of the session on the path (it
has credentials of its own, so it can end TLS, or run a ZeroMQ client, as itself) cannot relay it
between two others and then read and change what they send each other:

* **TLS streams**: the certificate in each side's proof must be, byte for byte, the one TLS verified
  for the peer (``getpeercert(binary_form=True)``), checked before the proof is read further. TLS 1.3
  proves in its own handshake that the peer holds that certificate's key, and a relay can show only
  its own certificate there, so a relayed proof names a certificate that is not the channel's.
  (Python's :mod:`ssl` has no keying-material exporter, and ``tls-unique`` is not defined for TLS 1.3:
  the certificate is the binding.)
* **Plain-text streams** (loopback): each side signs, with both nonces, the two endpoints' addresses as
  it sees them (the opener's and the listener's, IP and port: ``binding`` above). Both sides of one TCP
  connection see the same pair; a relay's two legs are two connections, and two connections never have
  the same pair on one machine (the pair names a TCP connection), so each side finds the other's
  signature made over another connection and refuses it. This also stops a relay that forwards the
  bytes untouched, which no proof without a binding could tell from a direct connection. (A relay that
  holds its legs in two network namespaces needs the machine's root, who reads loopback traffic
  anyway.) Addresses are bound only where both are
  loopback as each side sees them: across hosts a stream is TLS (with ``encrypt="off"``, where address
  translation would change them, nothing is bound: that mode protects against no one on the path). A
  plain-text connection that one side sees on loopback and the other not (an address translated on the
  way) has the two sides sign different things, and is refused.
* **ZeroMQ under CURVE** (every ZeroMQ socket unless ``encrypt="off"``) is bound already: the client
  pins the node's key (the one its address names) in CURVE's handshake, so its connection ends at the
  process that holds that key's secret, under short-term keys only the two ends have; knowing the
  session's shared CURVE client key does not help a relay (it lets it be a client, as itself, not the
  node to a client, nor a reader of another client's connection). A relay the client was sent to
  instead (its address, its key) gets a signature for its own key, which the real node refuses, and
  cannot pass the real node's proof on to the client, which expects the relay's key. With
  ``encrypt="off"`` ZeroMQ binds nothing, as plain text across hosts does not.

Guarantees of :class:`Door`: a node knows a peer by the user id that its ZAP handler gave the
connection (:mod:`.zap`), never by the routing id alone, which a peer may choose; a connection that has
not authenticated gets nothing read of what it sends, and is told so once, with the fixed word
:data:`REAUTH`; at most :data:`MAX_PENDING` handshakes are remembered half-way (the oldest are dropped).
A peer is forgotten when its connection says BYE, when a message to it finds it gone, and when its
connection ends without a word (a killed process): ZeroMQ's DISCONNECTED event names the connection's
file descriptor (:meth:`Door.disconnected`), and once the node has read every message that was waiting
on its socket (:meth:`Door.forget_disconnected`) the peer is gone from :attr:`Door.authenticated`. So
the peers remembered are those connected, plus those whose end the node has not yet caught up with;
what a peer sent before its end is still read as its own.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import zmq

from . import identity
from .errors import AuthenticationError, IdentityError

if TYPE_CHECKING:
    from .guard import Refusals

NONCE_BYTES = 32
#: The size of a proof (an HMAC-SHA256).
PROOF_BYTES = 32

# The handshake's words over ZeroMQ: the client's hello (with its nonce), the node's challenge (its
# nonce and proof), the client's proof, and the node's verdict.
HELLO, CHALLENGE, PROOF, WELCOME, DENIED = b"hello", b"challenge", b"proof", b"welcome", b"denied"
#: A client closing its ZeroMQ connection says so: the node forgets the connection's identity. A node
#: answers anything else from a connection that has not authenticated with REAUTH (and reads nothing of
#: it): a client whose connection ZeroMQ re-made after a network drop (a new connection, so a new
#: identity at the node) learns that what it sent since was dropped, instead of waiting for answers
#: that cannot come.
BYE, REAUTH = b"bye", b"reauth"
#: Connections a node remembers half-way through the handshake, or as told REAUTH.
MAX_PENDING = 1024


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


class ClientHandshake:
    """The opening side of one handshake: send :attr:`hello`, then answer the node's challenge with
    :meth:`answer`, which checks the node's proof of the member secret and of its identity first (and,
    given ``node_key``, that it is the node the client meant to reach). ``binding``: the connection's
    name as this side sees it (see above)."""

    def __init__(self, creds: "bytes | identity.Credentials", node_key: Optional[str] = None,
                 binding: bytes = b"") -> None:
        self._creds, self._expect, self._binding = identity.credentials(creds), node_key, binding
        #: The client's nonce: its first message.
        self.hello = new_nonce()
        #: Who answered (set by :meth:`answer`).
        self.peer: Optional[identity.Peer] = None

    def answer(self, server_nonce: bytes, proof: bytes, cert: bytes, signature: bytes, who: str) -> Tuple[bytes, bytes]:
        """(the client's proof, its signature) to send with its certificate; AuthenticationError (naming
        ``who``) when the node's proof is wrong, IdentityError when it is not the node meant."""
        secret_proved = self._creds.member and verify(server_proof(self._creds.secret, self.hello, server_nonce),
                                                      proof)
        try:
            peer = self._creds.check(cert, signature, True, self.hello, server_nonce, binding=self._binding)
        except IdentityError as exc:
            if self._creds.member and not secret_proved:
                raise AuthenticationError(f"{who} failed to authenticate") from None
            raise IdentityError(f"{who} failed to prove its identity: {exc}") from None
        if self._creds.member and not secret_proved and peer.trusted:
            raise AuthenticationError(f"{who} failed to authenticate")
        if self._expect is not None and peer.key != self._expect:
            raise IdentityError(
                f"{who} is the roving process {peer.node_id}, not the node its address names (a connection "
                "relayed to another node): refused")
        self.peer = peer
        proof_sent = client_proof(self._creds.secret, self.hello, server_nonce) if self._creds.member \
            else bytes(PROOF_BYTES)  # nothing to prove: its certificate speaks for it
        return proof_sent, self._creds.prove(False, self.hello, server_nonce, peer.key, self._binding)


class ServerHandshake:
    """The listening side of one handshake, made from the client's hello: send :attr:`nonce`,
    :attr:`proof` and :attr:`signature` with this process's certificate, then check the client's
    answer with :meth:`accepts`. ``binding``: the connection's name as this side sees it (see above)."""

    def __init__(self, creds: "bytes | identity.Credentials", client_nonce: bytes, binding: bytes = b"") -> None:
        self._creds = creds = identity.credentials(creds)
        self._client_nonce, self._binding = client_nonce, binding
        self.nonce = new_nonce()
        #: The server's nonce and proof, as sent.
        self.proof = server_proof(creds.secret, client_nonce, self.nonce)
        self.signature = creds.prove(True, client_nonce, self.nonce, creds.key, binding)

    @property
    def challenge(self) -> bytes:
        """The nonce and the proof of the member secret, as sent first."""
        return self.nonce + self.proof

    @property
    def cert(self) -> bytes:
        """This process's certificate (DER), sent with the challenge."""
        return self._creds.cert_der

    def accepts(self, proof: bytes, cert: bytes, signature: bytes) -> identity.Peer:
        """The client that answered; AuthenticationError when it does not know the member secret,
        IdentityError when its certificate or signature is not valid (or revoked)."""
        secret_proved = self._creds.member and verify(
            client_proof(self._creds.secret, self._client_nonce, self.nonce), proof)
        try:
            peer = self._creds.check(cert, signature, False, self._client_nonce, self.nonce, self._creds.key,
                                     self._binding)
        except IdentityError:
            if self._creds.member and not secret_proved:
                raise AuthenticationError("it failed to prove the session secret") from None
            raise
        if self._creds.member and not secret_proved and peer.trusted:
            raise AuthenticationError("it failed to prove the session secret")
        return peer


def prove(send: Callable[[List[bytes]], None], recv: Callable[[str], List[Any]],
          creds: "bytes | identity.Credentials", address: str) -> identity.Peer:
    """The client's side of the handshake over a ZeroMQ connection to the node at ``address``:
    ``send(frames)`` sends a message, ``recv(what)`` returns the next one (bytes frames) or raises
    when ``what`` does not come in time. The node reached; AuthenticationError when either side fails
    to prove the member secret, IdentityError when the node is not the one ``address`` names."""
    creds = identity.credentials(creds)
    handshake = ClientHandshake(creds, identity.expected_key(address, creds))
    send([HELLO, handshake.hello])
    frames = recv("authentication challenge")
    if len(frames) != 5 or frames[0] != CHALLENGE:
        raise AuthenticationError(f"the roving node at {address} failed to authenticate")
    answer, signature = handshake.answer(frames[1], frames[2], frames[3], frames[4],
                                         f"the roving node at {address}")
    send([PROOF, answer, creds.cert_der, signature])
    frames = recv("authentication result")
    if frames[:1] != [WELCOME]:
        raise AuthenticationError(f"the roving node at {address} refused this process's "
                                  "secret or identity: is it part of the same roving session, and not revoked?")
    assert handshake.peer is not None
    return handshake.peer


def _source_fd(frame: Any) -> Any:
    """The file descriptor of the connection a ZeroMQ message came on (None if not known)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except Exception:  # not a ZeroMQ frame (a test's stand-in), or the property is not there
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def is_reauth(frames: List[Any]) -> bool:
    """Whether a message is the node's "this connection has not authenticated" (:data:`REAUTH`)."""
    return len(frames) == 1 and len(frames[0]) == len(REAUTH) and bytes(frames[0]) == REAUTH


#: First byte of the identities a node gives its authenticated ZeroMQ connections (:attr:`Door.tokens`):
#: never a routing id libzmq makes (those begin with a zero byte).
CONNECTION_MARK = b"\xfd"


class Door:
    """Which ZeroMQ connections may talk to a node, and the handshakes that let them in.

    ``creds`` are the node's (:mod:`.identity`); ``send(frames)`` sends ``[routing id, *frames]``
    from the node's socket (its I/O thread); ``refusals`` logs each refusal (throttled,
    :class:`.guard.Refusals`). Every method runs on the node's I/O thread.

    Each authenticated connection gets a *connection identity* (:attr:`tokens`, beginning with
    :data:`CONNECTION_MARK`) that names it and nothing else: the node hands it to handlers and sends
    answers to it, and :meth:`route` gives the routing id only while that very connection lives. A
    connection that later takes the same routing id (with ``encrypt="off"`` a stranger can choose it)
    is another connection, and gets nothing meant for the one that left. :meth:`peer` tells who
    (:class:`.identity.Peer`) authenticated each.
    """

    def __init__(self, creds: "bytes | identity.Credentials", send: Callable[[List[Any]], None],
                 refusals: Refusals) -> None:
        self._creds, self._send, self._refusals = identity.credentials(creds), send, refusals
        #: Authenticated peers: routing id -> the user id of the connection that authenticated (zap).
        #: The node reads it on its hot path: a peer is known when ``authenticated.get(ident)`` is
        #: the user id of the message's connection.
        self.authenticated: Dict[bytes, str] = {}
        #: Routing id -> the connection identity of the authenticated connection under it (hot path).
        self.tokens: Dict[bytes, bytes] = {}
        # Connection identity -> (routing id, user id) while the connection lives; -> who it is.
        self._routes: Dict[bytes, Tuple[bytes, str]] = {}
        self._peers: Dict[bytes, identity.Peer] = {}
        self._counter = itertools.count(1)
        # The file descriptor (ZeroMQ's SRCFD) of each authenticated connection, both ways, so that
        # the end of a connection (which ZeroMQ names by its descriptor) forgets its peer.
        self._fd_of: Dict[bytes, int] = {}
        self._ident_at: Dict[int, bytes] = {}
        # Peers (routing id, user id) whose connection's end was reported, to forget (forget_disconnected).
        self._ended: List[Tuple[bytes, Any]] = []
        # Connections (routing id, user id) told REAUTH, and those half-way through the handshake.
        self.told: "collections.OrderedDict[Tuple[bytes, str], None]" = collections.OrderedDict()
        self.handshakes: "collections.OrderedDict[Tuple[bytes, str], ServerHandshake]" = \
            collections.OrderedDict()

    def route(self, token: bytes) -> Optional[bytes]:
        """The routing id of the connection ``token`` names, or None once it has ended or been forgotten."""
        known = self._routes.get(token)
        if known is None or self.authenticated.get(known[0]) != known[1]:
            return None
        return known[0]

    def peer(self, token: bytes) -> Optional[identity.Peer]:
        """Who authenticated the connection ``token`` names (None when it is not known)."""
        return self._peers.get(token)

    def forget(self, ident: bytes) -> None:
        """The connection with this routing id has gone (or said BYE): forgotten now."""
        self.authenticated.pop(ident, None)
        token = self.tokens.pop(ident, None)
        if token is not None:
            self._routes.pop(token, None)
            self._peers.pop(token, None)
        fd = self._fd_of.pop(ident, None)
        if fd is not None and self._ident_at.get(fd) == ident:
            del self._ident_at[fd]

    def revoke(self, node_id: str) -> int:
        """Forget every connection that ``node_id`` authenticated (its credentials were revoked): what it
        sends from now on is dropped, and it is told REAUTH; a new connection of it is refused. How many."""
        idents = [ident for ident, token in self.tokens.items()
                  if getattr(self._peers.get(token), "node_id", None) == node_id]
        for ident in idents:
            self.forget(ident)
        return len(idents)

    def disconnected(self, fd: int) -> None:
        """ZeroMQ says that the connection on file descriptor ``fd`` ended (with or without a BYE).

        The peer that authenticated on ``fd`` is looked up now and forgotten at the next
        :meth:`forget_disconnected`, not at once: messages it sent before its end may still wait on the
        node's socket, and they are read as its own. Nothing is sent to it any more (:meth:`route`).
        Looked up now, because libzmq reports the end
        before it closes the descriptor, so before a new connection can get the same number; the node
        reads these events before every handshake step (see :meth:`knock`'s caller), so a newer
        connection on ``fd`` has not authenticated when this runs. Unknown descriptors are ignored."""
        ident = self._ident_at.pop(fd, None)
        if ident is not None:
            self._fd_of.pop(ident, None)
            token = self.tokens.get(ident)
            if token is not None:
                self._routes.pop(token, None)
            self._ended.append((ident, self.authenticated.get(ident)))

    def forget_disconnected(self) -> None:
        """Forget the peers whose connections :meth:`disconnected` reported. The node calls it when it
        has found its socket with no message waiting, so that everything they sent has been read. A
        routing id that a new connection has authenticated under since is kept (it is that one's)."""
        ended, self._ended = self._ended, []
        for ident, user in ended:
            if user is not None and self.authenticated.get(ident) == user:
                self.forget(ident)

    @property
    def ending(self) -> int:
        """How many reported ends :meth:`forget_disconnected` has still to apply."""
        return len(self._ended)

    def known_peers(self) -> int:
        """How many peers are remembered as authenticated now."""
        return len(self.authenticated)

    def knock(self, ident: bytes, frames: List[Any]) -> None:
        """A message (zmq.Frames, routing id off) from a connection that has not authenticated: a
        step of its handshake, or something that is dropped unread (the connection is told REAUTH).
        The caller reports the connection ends that ZeroMQ has announced (:meth:`disconnected`) first."""
        if not frames:
            return
        if ident in self.authenticated:  # a new connection under the routing id of one that has gone
            self.forget(ident)
        user = frames[0].get("User-Id")
        key = (ident, user)  # a handshake belongs to its connection, as its outcome does
        kind = frames[0].bytes if len(frames[0]) <= 16 else b""
        if kind == HELLO and len(frames) == 2 and len(frames[1]) == NONCE_BYTES:
            handshake = self.handshakes[key] = ServerHandshake(self._creds, frames[1].bytes)
            while len(self.handshakes) > MAX_PENDING:
                self.handshakes.popitem(last=False)
            self._send([ident, CHALLENGE, handshake.nonce, handshake.proof, handshake.cert, handshake.signature])
            return
        if kind == PROOF and key in self.handshakes:
            try:
                handshake = self.handshakes.pop(key)
                if len(frames) != 4:
                    raise IdentityError("its proof came without a certificate and signature")
                peer = handshake.accepts(frames[1].bytes, frames[2].bytes, frames[3].bytes)
            except (AuthenticationError, IdentityError) as exc:
                self._refusals.refuse(frames[0].get("Peer-Address"), str(exc))
                self._send([ident, DENIED])
                return
            self.authenticated[ident] = user
            token = CONNECTION_MARK + next(self._counter).to_bytes(8, "little")
            self.tokens[ident] = token
            self._routes[token] = (ident, user)
            self._peers[token] = peer
            fd = _source_fd(frames[0])
            if fd is not None:
                old = self._ident_at.get(fd)
                if old is not None and old != ident:  # its end was not reported: it is gone
                    self.forget(old)
                self._fd_of[ident], self._ident_at[fd] = fd, ident
            self._send([ident, WELCOME])
            return
        if kind in (BYE, HELLO, PROOF):  # a late goodbye, or a handshake message out of turn
            return
        # Once per connection: its peer re-connects (a new, authenticated connection) or gives up.
        if key not in self.told:
            self.told[key] = None
            while len(self.told) > MAX_PENDING:
                self.told.popitem(last=False)
            self._refusals.refuse(frames[0].get("Peer-Address"),
                                  f"dropped {len(frames)} frame(s) from a connection that has not "
                                  "authenticated (a client re-connected after a network drop, or a "
                                  "stranger); it is told so")
            self._send([ident, REAUTH])
