"""A process's endpoint on the transport: the node that serves the mailboxes created in it.

Every roving process that creates a queue or a pipe runs one :class:`Node`: a ZeroMQ ROUTER socket bound
to the backend's address (loopback for the local backend), served by one I/O thread. The mailboxes of the
queues and pipes created in that process live there; other processes reach them with requests over
authenticated connections (:mod:`roving.transport.endpoint`). Inside the owning process the same
operations run directly on the mailboxes, without sockets (:attr:`Node.mailboxes`).

A node is made of four parts, each a class of its own that it holds: the mailboxes and their operations
(:class:`.boxes.Boxes`), the I/O loop (:class:`.loop.Loop`: the thread, its poller, wake-ups, timers),
the ZeroMQ door (:class:`.router.Router`: the socket, authentication, the outbox) and the stream hub
(:class:`.hub.StreamHub`: the streams served). The node routes what they let in to the mailboxes and to
the handlers other layers register; what travels, and how, is :mod:`.wire`'s.

A client first asks the node over ZeroMQ where its stream listener is (STREAMS), then sends its requests
over a stream of its own (:mod:`roving.transport.stream`), which the same I/O thread serves: same
requests, same answers, fewer thread hand-offs. A protocol of one's own (the pool's) can run over such a
stream too (:class:`roving.transport.channel.Channel` with ``stream=True``): its messages reach the
handler registered for their operation as they would over ZeroMQ, under an identity the node gives the
stream, and :meth:`Node.send_to` that identity writes to the stream from the sending thread itself. The
node forgets that identity when the stream ends. ZeroMQ stays for other protocols (locks', managers')
and for nodes that offer no streams.

Guarantees:

* A connection is mutually authenticated (:class:`roving.transport.auth.Door` decides who may talk to
  the node) before the node reads any frame it would store for unpickling; frames from a peer that has not
  authenticated are dropped and logged
  (throttled, :mod:`.guard`), and the peer is told once, with a fixed word (REAUTH), that its connection
  is not known here. Authentication belongs to the connection: the node knows a peer by the user id
  that its ZAP handler gave the connection (:mod:`.zap`), never by the routing id alone, which a peer
  may choose; handlers and answers know it by a connection identity of its own (:class:`.auth.Door`),
  so what is sent to a connection that has gone goes to no other that took its routing id (it is
  undeliverable: an item goes back to its mailbox).
* Every message is attributable: :meth:`Node.peer` names the process (:class:`.identity.Peer`) whose
  credentials authenticated the connection or stream it came on. The node's address names its key
  (``tcp://HOST:PORT#KEY``): a client reaches this node or none. When credentials are revoked
  (:func:`.identity.revoke`), the node closes the connections opened with them.
* Peers that are gone are forgotten: on BYE, when a message to them finds them gone, and when their
  connection ends without a word (a killed process). ZeroMQ reports such an end on the router's monitor
  (DISCONNECTED); the I/O thread reads those events without ever waiting for them, before each
  handshake step and whenever they arrive, and forgets the peer once it has read everything that was
  waiting on the router (so a message sent just before the end is still handled as the peer's).
  The table of authenticated peers (:meth:`Node.known_peers`) stays bounded by the connected ones.
* Before authentication, bounds: ZeroMQ runs CURVE with the session's keys (:mod:`.crypto`, unless
  ``encrypt="off"``), so a stranger does not complete ZeroMQ's handshake, and libzmq drops a connection
  that has not completed it within :data:`.wire.HANDSHAKE_IVL_MS`; no frame larger than
  :data:`.wire.MAX_FRAME` is taken from anyone (larger ones are sent in pieces,
  :func:`.wire.split_frames`, and joined here); at most :func:`.guard.cap_for_open_files` connections
  that have not authenticated are open at once (:class:`.guard.Unauthenticated`): a flood of
  connections cannot fill the process's descriptor table.
  The node never unpickles a mailbox payload: only the thread that reads an item does. Handlers that
  other layers register (the pool, synchronization objects) decode their own messages, and they only
  ever see messages of authenticated peers.
* Requests of one thread to one node are handled in the order sent.
* A request that can wait (get, a put on a full bounded queue, poll, join) carries its timeout to the
  node, which answers when the wait ends; an item is never handed to a reader that has given up, and
  an item answered to a reader whose process has gone (its connection closed) goes back to the front
  of its mailbox.
"""
from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from . import addressing
from .boxes import TIMEOUT_STATUS, Answer, Boxes, RemoteWaiter
from . import crypto
from . import identity
from . import stream as _stream
from .errors import AddressError, MalformedMessage
from .guard import raise_open_files
from .hub import CHANNEL_MARK, Handler, StreamHub
from .loop import Loop, Ready
from . import timeouts
from .mailbox import EMPTY, EOF, ERROR, FULL, OK, Access, LocalWaiter, Waiter  # noqa: F401 (EOF, FULL, Access: for callers)
from .router import Router

# The operations are the wire format's (roving.transport.wire); they are also names of this module for
# the layers that call a node's operations (node.PUT, node.GET...), as the statuses are (node.OK...).
from .wire import (ANSWER, CLAIM, GATE, GET, HOLD, INSERT, JOIN, MESSAGE,  # noqa: F401
                   NO_REPLY, PIECES, PING, POLL, PUT, PUT_FRONT, PUT_NOREPLY, RELEASE,
                   REQUEST, SIZE, STREAMS, TASK_DONE, UNCLAIM, UNGATE, Frames, pack_reply, unpack_header)

log = logging.getLogger(__name__)

#: A service's server side, made once per node by the factory given to :meth:`Node.service`.
Service = Any


class Node:
    """The endpoint of this process: its mailboxes, served through a ZeroMQ door and a stream hub by
    one I/O loop (the module says what each part guarantees)."""

    def __init__(self, secret: "bytes | identity.Credentials", host: str = "127.0.0.1",
                 advertise: Optional[str] = None, port_range: Optional[Tuple[int, int]] = None,
                 encrypt: Optional[str] = None) -> None:
        """Bind ``host`` (a port of ``port_range``, or any) and advertise ``advertise`` (default: ``host``).
        ``secret``: this process's credentials (:mod:`.identity`; raw bytes: the ad hoc ones they make).
        AddressError when the address cannot be bound, naming it."""
        raise_open_files()  # the first use of the transport in a process: before it holds any connection
        #: Whose node this is (:class:`.identity.Credentials`); its address names their node key.
        self.credentials = creds = identity.credentials(secret)
        #: The member secret every connection proves.
        self.secret = creds.secret
        #: The ``encrypt`` option this node serves under (roving.transport.crypto).
        self.encrypt = encrypt or crypto.mode()
        self.host, self.advertise, self.port_range = host, advertise, port_range
        #: How this address was chosen, in words (for errors that name it).
        self.why = f"host={host}" + (f", advertise={advertise}" if advertise else "")
        #: The mailboxes of the queues and pipes created in this process, and their operations.
        self.mailboxes = Boxes(creds.node_id)
        #: The I/O thread and what it watches.
        self.loop = Loop()
        #: The ZeroMQ door: the socket, who may talk through it, the answers that leave by it.
        self.router = Router(creds, host, advertise, port_range, self.encrypt, self.loop)
        self.address = self.router.address
        self.loop.label = f"roving node {self.address}"
        self._handlers: Dict[bytes, Handler] = {}
        self._notices: Dict[bytes, Callable[[Frames], None]] = {}
        #: The streams other processes opened to this node (requests, and handlers' messages).
        self.hub = StreamHub(self.loop, self._handlers, self._request, self._apply_revocations)
        #: node ids revoked and not yet applied; checked before every message is served, so that nothing
        #: sent after :func:`.identity.revoke` returned is served
        self._revoking: Deque[str] = collections.deque()
        self._services: Dict[str, Service] = {}
        self._services_lock = threading.Lock()
        self._at_close: List[Callable[[], None]] = []
        self.loop.start(self._turn, lambda: bool(self.router.door.ending))
        identity.on_revoke(self)

    @classmethod
    def at(cls, secret: "bytes | identity.Credentials", choice: addressing.Choice) -> "Node":
        """A node at the address :func:`addressing.choose` picked; AddressError (naming why that address
        was chosen) when it cannot be bound."""
        try:
            node = cls(secret, choice.bind, choice.advertise, choice.port_range)
        except AddressError as exc:
            raise AddressError(f"{exc} (chosen by {choice.why})") from None
        node.why = choice.why
        return node

    def known_peers(self) -> int:
        """How many ZeroMQ peers this node remembers as authenticated now (any thread; a snapshot).

        A peer whose connection ended, with or without a goodbye (a killed process), is forgotten by
        the node's I/O thread once it has read what that connection sent: the first time, after
        ZeroMQ reported the end, that it finds no message waiting on its socket (at once on an idle
        node; under a steady stream of messages, when the stream next pauses). So this counts the
        connected peers, plus ended ones not yet caught up with; it does not grow with dead peers."""
        return self.router.known_peers()

    def known_channels(self) -> int:
        """Streams that carry handlers' messages now (those of peers that are gone are not counted)."""
        return self.hub.known_channels()

    def register_handler(self, op: bytes, handler: Handler) -> None:
        """Route authenticated messages whose first frame is ``op`` to ``handler(ident, frames)``.

        The handler runs on the I/O thread and must not block; it answers with :meth:`send_to`.
        """
        self._handlers[op] = handler

    def register_notice(self, op: bytes, handler: Callable[[Frames], None]) -> None:
        """Route messages ``op`` sent with :meth:`Endpoint.tell` (no answer) to ``handler(payload)``,
        on the I/O thread: it must not block."""
        self._notices[op] = handler

    def register_stream_purpose(self, purpose: str, handler: Callable[[dict, _stream.Stream], bool]) -> None:
        """Hand streams opened with ``{"purpose": purpose, ...}`` to ``handler`` (see stream.Listener)."""
        self.hub.register_purpose(purpose, handler)

    def send_to(self, ident: bytes, frames: Frames,
                undeliverable: Optional[Callable[[], None]] = None) -> None:
        """Send ``frames`` to an authenticated peer; thread-safe.

        If the peer has gone, ``undeliverable()`` runs on the I/O thread, outside every lock, so that
        what the message handed over (an item, a lock) can be taken back. To a peer on a stream the
        message is written by the calling thread (what the socket does not take at once, by the I/O
        thread later), in the order of the calls.
        """
        peer = self.hub.channel(ident)
        if peer is not None:
            if not peer.write(MESSAGE, frames, undeliverable) and undeliverable is not None:
                self.loop.defer(undeliverable)
            return
        if ident[:1] == CHANNEL_MARK:  # a stream that has ended: never a ZeroMQ peer's identity
            if undeliverable is not None:
                self.loop.defer(undeliverable)
            return
        self.router.post([ident, *frames], undeliverable)

    def peer(self, ident: bytes) -> Optional[identity.Peer]:
        """Who sent the messages that a handler got with ``ident`` (the process whose credentials
        authenticated that connection or stream), or None once it has gone; any thread."""
        served = self.hub.channel(ident)
        if served is not None:
            return served.peer
        return self.router.door.peer(ident)

    def revoked(self, node_id: str) -> None:
        """``node_id``'s credentials were revoked (:func:`.identity.revoke`): its connections to this
        node are closed (on the I/O thread, before it serves another message); any thread."""
        if self.loop.running:
            self._revoking.append(node_id)
            self.loop.wake()

    def streams(self) -> _stream.Listener:
        """This process's stream listener, started on first use."""
        return self.service("streams", lambda node: _stream.Listener(
            node.credentials, node.host, node.advertise, node.hub.on_stream, node.port_range, node.encrypt))

    def service(self, key: str, factory: Callable[["Node"], Service]) -> Service:
        """The one ``factory(node)`` object of this node for ``key`` (a protocol's server side), made on
        first use; thread-safe."""
        with self._services_lock:
            obj = self._services.get(key)
            if obj is None:
                obj = self._services[key] = factory(self)
            return obj

    def at_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` when the node closes: when this process's session ends, also in a child (whose
        exit skips atexit handlers). Used by roving.shared to let go of shared memory."""
        self._at_close.append(fn)

    def close(self) -> None:
        """Stop serving. Waiting local callers are answered with an error."""
        if not self.loop.running:
            return
        for fn in self._at_close:
            try:
                fn()
            except Exception:
                log.exception("roving node: a close callback failed")
        self.loop.running = False
        self.router.stop()
        boxes = self.mailboxes
        with boxes.lock:
            for box in boxes.boxes.values():
                for waiter in [*box.getters, *box.pollers, *box.joiners, *(w for w, _ in box.putters)]:
                    if not waiter.done and isinstance(waiter, LocalWaiter):
                        waiter.fulfil(ERROR, [b"the roving node was closed"])
            boxes.boxes.clear()
        self.loop.stop()
        ended = self.loop.join(2)
        listener = self._services.get("streams")
        if listener is not None:
            listener.close()
        if ended:
            self.hub.close()
            self.router.close()
            self.loop.close()

    # -- I/O thread --------------------------------------------------------------------------
    def _turn(self, ready: Ready) -> None:
        """One turn of the I/O loop, each part called only when its work is there."""
        hub, router = self.hub, self.router
        if hub.adopted:
            hub.adopt()
        if self._revoking:
            self._apply_revocations()
        router.flush()
        if router.monitor in ready:
            router.read_monitor()
        if router.socket in ready or router.door.ending:
            router.read(self._admitted, self._apply_revocations)
            router.flush()
        if hub.fileno in ready:
            hub.serve()
        if hub.writable:
            hub.rewatch()

    def _apply_revocations(self) -> None:
        while self._revoking:
            node_id = self._revoking.popleft()
            closed = self.router.door.revoke(node_id) + self.hub.drop_of(node_id)
            if closed:
                log.warning("roving node %s: closed %d connection(s) of %s, whose credentials were revoked",
                            self.address, closed, node_id)

    def _admitted(self, token: bytes, op: bytes, frames: Frames, who: identity.Peer) -> None:
        """A ZeroMQ message the door let in: to its handler, or served as a request."""
        handler = self._handlers.get(op)
        if handler is not None:
            if who.trusted:
                handler(token, frames[2:])
            else:
                self.router.refusals.refuse(who.node_id, "an untrusted process may use no service of a node")
            return
        if len(frames) < 3:
            log.warning("roving node: malformed request from an authenticated peer dropped")
            return
        post = self.router.post
        self._request(op, bytes(frames[2]), frames[3:],
                      lambda out, undeliverable: post([token, *out], undeliverable), who)

    def _request(self, op: bytes, header: Any, payload: Frames, answer: Answer, who: identity.Peer) -> None:
        """Serve one request of the authenticated peer ``who``, over ZeroMQ or a stream alike: ``answer``
        (any thread) sends a reply back the way the request came. An untrusted peer gets a ping, the
        stream address and the mailboxes it may use (:class:`.boxes.Boxes`), nothing else."""
        try:
            box_id, req_id, timeout = unpack_header(header)
        except MalformedMessage:
            log.warning("roving node: malformed request from an authenticated peer dropped")
            return
        timeout = timeouts.from_wire(timeout)  # inf or NaN from a peer must not reach the deadlines
        if op == PING:
            answer([pack_reply(req_id, OK)], None)
            return
        if op == STREAMS:
            answer([pack_reply(req_id, OK), self._stream_address().encode()], None)
            return
        notice = self._notices.get(op)
        if notice is not None:
            if who.trusted:
                notice(payload)
            else:
                self.router.refusals.refuse(who.node_id, "an untrusted process may send a node no notice")
            return
        boxes = self.mailboxes
        waiter = RemoteWaiter(boxes, answer, req_id, box_id)
        with boxes.lock:
            status, out = boxes.dispatch(op, box_id, timeout, payload, waiter, who)
            if status == -1:
                if timeout > 0:
                    self.loop.at(time.monotonic() + timeout,
                                 functools.partial(self._time_out, box_id, waiter, TIMEOUT_STATUS.get(op, EMPTY)))
                return
        if op not in NO_REPLY:
            item = None
            if op == GET and status == OK and out:
                item = functools.partial(boxes.put_back, box_id, out)
            answer([pack_reply(req_id, status), *(out or ())], item)
        elif status == ERROR:
            why = bytes(out[0]).decode(errors="replace") if out else "error"
            if who.trusted:
                log.warning("roving node: %s", why)
            else:  # what an untrusted process makes fail is logged at most once a minute
                self.router.refusals.refuse(who.node_id, why)

    def _stream_address(self) -> str:
        """The stream listener's address for STREAMS ("": none, so peers keep to ZeroMQ)."""
        try:
            return self.streams().address if streams_enabled else ""
        except (RuntimeError, OSError) as exc:  # no thread or socket for it (at interpreter exit)
            log.warning("roving node: no stream listener (%s); peers keep to ZeroMQ", exc)
            return ""

    def _time_out(self, box_id: int, waiter: Waiter, status: int) -> None:
        """A waiting request's time is up: answered ``status`` unless it was answered meanwhile."""
        boxes = self.mailboxes
        with boxes.lock:
            box = boxes.boxes.get(box_id)
            if box is not None:
                box.cancel(waiter, status)


#: Set to False (before anything else is set up) to serve and send every request over ZeroMQ: other
#: processes of the session then do too (benchmarks compare both ways).
streams_enabled = True
