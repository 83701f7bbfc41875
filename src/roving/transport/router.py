"""A node's ZeroMQ door (:class:`Router`): its ROUTER socket, who may talk through it, and how answers
leave by it.

The socket is bound to the node's address and served by the node's I/O thread (:mod:`.loop`). Before a
message reaches the node, the router lets it in: the connection must have authenticated
(:class:`.auth.Door`, which runs the handshake with peers that have not), a message in pieces is joined,
a goodbye forgets its peer; the node then gets the message under the connection's own identity, with
the peer (:class:`.identity.Peer`) that its credentials name.

Guarantees (the node's module states those of the whole node):

* A connection is known by the user id that its ZAP handler gave it (:mod:`.zap`), never by the routing
  id alone; frames from a peer that has not authenticated are never handed on (the handshake reads them,
  :class:`.auth.Door`), and at most :func:`.guard.cap_for_open_files` connections that have not
  authenticated are open at once (:class:`.guard.Unauthenticated`).
* ZeroMQ runs CURVE with the session's keys (:mod:`.crypto`, unless ``encrypt="off"``); libzmq drops a
  connection that has not completed its handshake within :data:`.wire.HANDSHAKE_IVL_MS`, and a frame
  larger than :data:`.wire.MAX_FRAME`.
* An answer goes to the connection its identity names and to no other that took its routing id; one
  that finds its peer gone is handed to its ``undeliverable`` callback (on the I/O thread, outside every
  lock). Answers sent from another thread leave in the order sent.
* The ends of connections (ZeroMQ's DISCONNECTED, on the socket's monitor) are read without ever waiting
  for them; a peer is forgotten once everything it sent before its end has been read.
"""
from __future__ import annotations

import collections
import logging
from typing import Callable, Deque, Optional, Tuple

import zmq
from zmq.utils import monitor as zmq_monitor

from . import auth
from . import crypto
from . import identity
from . import wire
from . import zap
from .auth import BYE
from .errors import MalformedMessage
from .guard import Refusals, Unauthenticated, cap_for_open_files
from .loop import Loop
from .wire import PIECES, Frames, send_frames

log = logging.getLogger(__name__)

__all__ = ["Router", "Admitted"]

#: What the node does with a message let in: ``admitted(connection identity, op, frames, who)``
#: (``frames`` as received: the routing id, the op, then the message's own frames).
Admitted = Callable[[bytes, bytes, Frames, identity.Peer], None]
#: What to do if a message cannot be delivered (run on the I/O thread, outside every lock).
Undeliverable = Optional[Callable[[], None]]


class Router:
    """The ROUTER socket of a node bound to ``host`` (a port of ``port_range``, or any), advertised as
    ``advertise`` (default: ``host``); AddressError when it cannot be bound. Served by ``loop``."""

    def __init__(self, creds: identity.Credentials, host: str, advertise: Optional[str],
                 port_range: Optional[Tuple[int, int]], encrypt: str, loop: Loop) -> None:
        self._loop = loop
        ctx = wire.context()
        self.socket = sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # Sending to a peer that has gone raises instead of dropping silently, so no item is lost there;
        # no high-water mark, so that the I/O thread never blocks on a slow peer (requests bound the load).
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        wire.keep_alive(sock)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME)
        sock.setsockopt(zmq.HANDSHAKE_IVL, wire.HANDSHAKE_IVL_MS)
        curve = crypto.zmq_encrypted(encrypt, host)
        if curve:
            crypto.curve_server(sock, creds)
        self._zap_domain = zap.register(ctx, crypto.session_client_key(creds) if curve else None)
        sock.setsockopt(zmq.ZAP_DOMAIN, self._zap_domain)
        try:
            port = wire.bind_router(sock, host, port_range)
        except BaseException:
            zap.unregister(self._zap_domain)
            sock.close(0)
            raise
        shown = advertise or host
        #: The node's address; it names the node's key: a client reaches this node or none.
        self.address = (f"tcp://[{shown}]:{port}" if ":" in shown else f"tcp://{shown}:{port}") + "#" + creds.key
        #: Refusals of peers, logged at most once a minute each (:class:`.guard.Refusals`).
        self.refusals = Refusals(log, f"node {self.address}")
        #: Who may talk to the node over ZeroMQ (:mod:`.auth`); its tables are read inline below.
        self.door = auth.Door(creds, self.send, self.refusals)
        self._authenticated = self.door.authenticated
        self._tokens = self.door.tokens
        self._outbox: Deque[Tuple[Frames, Undeliverable]] = collections.deque()
        # libzmq tells of handshakes that failed before its ZAP handler was asked (a stranger's CURVE
        # hello made with another key, a protocol error): logged, throttled, like every refusal
        # (not NO_DETAIL: a connection closed during its handshake, such as a probe of whether the
        # port listens, is no refusal). DISCONNECTED: a connection ended, said goodbye or not (a killed
        # worker): its peer is forgotten (auth.Door.disconnected). ACCEPTED: a connection yet to
        # authenticate, counted against a cap (guard.Unauthenticated).
        #: Connections open that have not authenticated yet.
        self.unauthenticated = Unauthenticated(cap_for_open_files())
        #: The socket's monitor: its events are read on the I/O thread, never waited for.
        self.monitor = wire.watch(sock, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_DISCONNECTED
                                  | zmq.EVENT_ACCEPTED)
        loop.watch(sock)
        loop.watch(self.monitor)

    def known_peers(self) -> int:
        """How many peers the door remembers as authenticated now (any thread; a snapshot)."""
        return self.door.known_peers()

    def post(self, frames: Frames, undeliverable: Undeliverable = None) -> None:
        """Send ``[identity or routing id, *frames]`` (any thread; from another thread, in the order
        of the calls)."""
        if self._loop.on_thread():
            self.send(frames, undeliverable)
            return
        self._outbox.append((frames, undeliverable))
        self._loop.wake()

    # -- I/O thread ------------------------------------------------------------------------------
    def send(self, frames: Frames, undeliverable: Undeliverable = None) -> None:
        """Send ``frames`` now (the I/O thread); see :meth:`post`."""
        if frames[0][:1] == auth.CONNECTION_MARK:
            # To the connection the identity names, and to no other under its routing id: ends that
            # ZeroMQ has reported are taken first (a connection that took the routing id of one that
            # left comes after its end).
            self.read_monitor()
            ident = self.door.route(frames[0])
            if ident is None:
                log.debug("roving node: a peer left before its answer")
                if undeliverable is not None:
                    self._loop.later((undeliverable,))
                return
            frames = [ident, *frames[1:]]
        try:
            send_frames(self.socket, frames)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                log.debug("roving node: a peer left before its answer")
                self.door.forget(frames[0])  # its connection is gone: so is its identity
            elif not self._loop.running:
                return
            else:
                log.warning("roving node %s: a message could not be sent (%s); handled as undeliverable",
                            self.address, exc)
            if undeliverable is not None:
                # Run later, on this thread and outside every lock: the sender may hold its own.
                self._loop.later((undeliverable,))

    def flush(self) -> None:
        """Send what other threads posted."""
        while self._outbox:
            self.send(*self._outbox.popleft())

    def read_monitor(self) -> None:
        """Take the socket's monitor events that have arrived, without waiting."""
        while True:
            try:
                event = zmq_monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.unauthenticated.opened(int(event["value"]))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.unauthenticated.closed(int(event["value"]))
                self.door.disconnected(int(event["value"]))
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                # libzmq names the listening address here, not the peer's
                self.refusals.refuse("a ZeroMQ peer", "its ZeroMQ handshake failed with a protocol error "
                                     "(a stranger, or a peer with another session's key)")

    def read(self, admitted: Admitted, settle: Callable[[], None]) -> None:
        """Let in up to 256 messages waiting (then the turn goes on to the streams): each that passes
        the door goes to ``admitted``; ``settle()`` runs before each (the node's revocations)."""
        for _ in range(256):
            try:
                frames = wire.recv_message(self.socket)
            except zmq.Again:
                # Nothing waits: what ended connections sent before their end has all been read.
                self.door.forget_disconnected()
                break
            try:
                settle()
                self._let_in(frames, admitted)
            except Exception:  # a bad message must never stop the node
                log.exception("roving node: dropped a message that could not be handled")

    def _let_in(self, frames: Frames, admitted: Admitted) -> None:  # zmq.Frames
        ident = frames[0].bytes
        known = self._authenticated.get(ident)
        if known is None or frames[1].get("User-Id") != known:
            # Ends of connections first: one that ended before this connection was made may have had
            # its file descriptor, and its end must not be taken for this one's (auth.Door.disconnected).
            self.read_monitor()
            self.door.knock(ident, frames[1:])
            if self._authenticated.get(ident, self) == frames[1].get("User-Id"):  # it just got in
                self.unauthenticated.settled(_source_fd(frames[1]))
            return
        token = self._tokens[ident]  # the connection's own identity: answers go to it, not to the routing id
        op = frames[1].bytes
        if op == PIECES:
            try:
                frames = [frames[0], *wire.join_pieces(frames[2:])]
            except MalformedMessage as exc:
                log.warning("roving node %s: dropped a malformed message from the peer at %s (routing id %s): "
                            "%s", self.address, frames[1].get("Peer-Address"), ident.hex(), exc)
                return
            op = frames[1].bytes if type(frames[1]) is zmq.Frame else bytes(frames[1])
        if op == BYE:
            self.door.forget(ident)
            return
        who = self.door.peer(token)
        if who is None:
            return  # forgotten meanwhile (revoked): nothing of it is served
        admitted(token, op, frames, who)

    def stop(self) -> None:
        """Stop taking new connections' authentication (ZAP) for this socket (any thread)."""
        zap.unregister(self._zap_domain)

    def close(self) -> None:
        """Close the socket and its monitor (after the I/O thread has ended)."""
        # The monitor stops before its reader closes (see wire.watch): else libzmq's I/O thread blocks
        # for good on the events of the connections that closing the router ends.
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)


def _source_fd(frame: zmq.Frame) -> Optional[int]:
    """The descriptor of the connection a message came on (ZeroMQ's SRCFD), or None where not known."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
