"""A process's endpoint on the transport: the node that serves the mailboxes created in it.

Every roving process that creates a queue or a pipe runs one :class:`Node`: a ZeroMQ ROUTER socket bound
to the backend's address (loopback for the local backend), served by one I/O thread. The mailboxes of the
queues and pipes created in that process live there; other processes reach them with requests over
authenticated connections (:mod:`roving.transport.endpoint`). Inside the owning process the same
operations run directly on the mailboxes, without sockets: the mailboxes and their operations are
:class:`.boxes.Boxes`, which a Node is; what travels, and how, is :mod:`.wire`'s.

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
import heapq
import itertools
import logging
import os
import selectors
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import zmq
from zmq.utils import monitor as zmq_monitor

from . import addressing, auth
from .auth import BYE
from .boxes import TIMEOUT_STATUS, Answer, Boxes, RemoteWaiter
from . import crypto
from . import identity
from . import stream as _stream
from .errors import AddressError, MalformedMessage
from .served import ServedStream
from . import timeouts
from . import wire
from . import zap
from .guard import Refusals, Unauthenticated, cap_for_open_files, raise_open_files
from .mailbox import EMPTY, EOF, ERROR, FULL, OK, Access, LocalWaiter, Waiter  # noqa: F401 (EOF, FULL, Access: for callers)

# The operations are the wire format's (roving.transport.wire); they are also names of this module for
# the layers that call a node's operations (node.PUT, node.GET...), as the statuses are (node.OK...).
from .wire import (ANSWER, CLAIM, GATE, GET, HEADER, HOLD, INSERT, JOIN, MESSAGE,  # noqa: F401
                   NO_REPLY, PIECES, PING, POLL, PUT, PUT_FRONT, PUT_NOREPLY, RELEASE, REPLY,
                   REQUEST, SIZE, STREAMS, TASK_DONE, UNCLAIM, UNGATE, Frames, send_frames)

log = logging.getLogger(__name__)


class Node(Boxes):
    """The endpoint of this process: mailboxes plus the ROUTER socket and I/O thread that serve them."""

    def __init__(self, secret: "bytes | identity.Credentials", host: str = "127.0.0.1",
                 advertise: Optional[str] = None, port_range: Optional[Tuple[int, int]] = None,
                 encrypt: Optional[str] = None) -> None:
        """Bind ``host`` (a port of ``port_range``, or any) and advertise ``advertise`` (default: ``host``).
        ``secret``: this process's credentials (:mod:`.identity`; raw bytes: the ad hoc ones they make).
        AddressError when the address cannot be bound, naming it.

        Long for a reason: it sets every piece of state the node's I/O thread uses, each with why it is
        there, in one place (the thread starts at its end)."""
        raise_open_files()  # the first use of the transport in a process: before it holds any connection
        #: Whose node this is (:class:`.identity.Credentials`); its address names their node key.
        self.credentials = creds = identity.credentials(secret)
        #: The member secret every connection proves.
        self.secret = creds.secret
        #: The ``encrypt`` option this node serves under (roving.transport.crypto).
        self.encrypt = encrypt or crypto.mode()
        super().__init__(creds.node_id)
        self._handlers: Dict[bytes, Callable[[bytes, Frames], None]] = {}
        ctx = wire.context()
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # Sending to a peer that has gone raises instead of dropping silently, so no item is lost there;
        # no high-water mark, so that the I/O thread never blocks on a slow peer (requests bound the load).
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDHWM, 0)
        wire.keep_alive(self._router)
        self._router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME)
        self._router.setsockopt(zmq.HANDSHAKE_IVL, wire.HANDSHAKE_IVL_MS)
        curve = crypto.zmq_encrypted(self.encrypt, host)
        if curve:
            crypto.curve_server(self._router, creds)
        self._zap_domain = zap.register(ctx, crypto.session_client_key(creds) if curve else None)
        self._router.setsockopt(zmq.ZAP_DOMAIN, self._zap_domain)
        port = wire.bind_router(self._router, host, port_range)
        shown = advertise or host
        # The address names the node's key: a client reaches this node or none (identity.node_key).
        self.address = (f"tcp://[{shown}]:{port}" if ":" in shown else f"tcp://{shown}:{port}") + "#" + creds.key
        self._refusals = Refusals(log, f"node {self.address}")
        self.host, self.advertise, self.port_range = host, advertise, port_range
        #: How this address was chosen, in words (for errors that name it).
        self.why = f"host={host}" + (f", advertise={advertise}" if advertise else "")
        # Other threads wake the I/O thread through a pipe: one system call, no ZeroMQ socket per thread.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_pending = False
        self._outbox: "collections.deque[Tuple[Frames, Optional[Callable[[], None]]]]" = collections.deque()
        self._deadlines: List[Tuple[float, int, int, Waiter, int]] = []
        self._seq = itertools.count()
        # Who may talk to this node over ZeroMQ (roving.transport.auth); its peers read inline on the hot path.
        self._door = auth.Door(creds, self._send, self._refusals)
        self._authenticated = self._door.authenticated
        self._tokens = self._door.tokens
        self._at_close: List[Callable[[], None]] = []
        self._undeliverable: List[Callable[[], None]] = []
        #: node ids revoked and not yet applied; checked before every message is served, so that nothing
        #: sent after :func:`.identity.revoke` returned is served
        self._revoking: Deque[str] = collections.deque()
        self._services: Dict[str, Any] = {}
        self._services_lock = threading.Lock()
        # Streams (roving.transport.stream) that processes opened to this node, served by the I/O thread.
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        # libzmq tells of handshakes that failed before its ZAP handler was asked (a stranger's CURVE
        # hello made with another key, a protocol error): logged, throttled, like every refusal
        # (not NO_DETAIL: a connection closed during its handshake, such as a probe of whether the
        # port listens, is no refusal)
        # DISCONNECTED: a connection ended, said goodbye or not (a killed worker): its peer is forgotten
        # (auth.Door.disconnected). Read on this node's I/O thread, never waited for (_read_monitor).
        # ACCEPTED: a connection yet to authenticate, counted against a cap (guard.Unauthenticated).
        self._unauthenticated = Unauthenticated(cap_for_open_files())
        self._monitor = wire.watch(self._router, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_DISCONNECTED
                                   | zmq.EVENT_ACCEPTED)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._peers: Dict[int, ServedStream] = {}
        # The streams are watched by a selector of their own (epoll here), which the poller watches as
        # one descriptor: a turn costs the same with 4,000 streams open as with 4 (zmq's poller scans
        # every descriptor it is given on every call: 0.8 ms a turn at 4,000 here).
        self._selector = selectors.DefaultSelector()
        self._poller.register(self._selector.fileno(), zmq.POLLIN)
        # Streams that carry handlers' messages (MESSAGE), by the identity the node gave each; read by
        # send_to on any thread, changed on the I/O thread only.
        self._channels: Dict[bytes, ServedStream] = {}
        self._channel_of: Dict[int, bytes] = {}  # stream fd -> its identity
        self._channel_ids = itertools.count(1)
        self._adopted: "collections.deque[_stream.Stream]" = collections.deque()
        self._writable: "collections.deque[ServedStream]" = collections.deque()
        self._purposes: Dict[str, Callable[[dict, _stream.Stream], bool]] = {}
        self._notices: Dict[bytes, Callable[[Frames], None]] = {}
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="roving-node", daemon=True)
        self._thread.start()
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
        return self._door.known_peers()

    def register_handler(self, op: bytes, handler: Callable[[bytes, Frames], None]) -> None:
        """Route authenticated messages whose first frame is ``op`` to ``handler(ident, frames)``.

        The handler runs on the I/O thread and must not block; it answers with :meth:`send_to`.
        """
        self._handlers[op] = handler

    def send_to(self, ident: bytes, frames: Frames,
                undeliverable: Optional[Callable[[], None]] = None) -> None:
        """Send ``frames`` to an authenticated peer; thread-safe.

        If the peer has gone, ``undeliverable()`` runs on the I/O thread, outside every lock, so that
        what the message handed over (an item, a lock) can be taken back. To a peer on a stream the
        message is written by the calling thread (what the socket does not take at once, by the I/O
        thread later), in the order of the calls.
        """
        peer = self._channels.get(ident)
        if peer is not None:
            if not peer.write(MESSAGE, frames, undeliverable) and undeliverable is not None:
                self._defer(undeliverable)
            return
        if ident[:1] == _CHANNEL_MARK:  # a stream that has ended: never a ZeroMQ peer's identity
            if undeliverable is not None:
                self._defer(undeliverable)
            return
        self._post([ident, *frames], undeliverable)

    def peer(self, ident: bytes) -> Optional[identity.Peer]:
        """Who sent the messages that a handler got with ``ident`` (the process whose credentials
        authenticated that connection or stream), or None once it has gone; any thread."""
        served = self._channels.get(ident)
        if served is not None:
            return served.peer
        return self._door.peer(ident)

    def revoked(self, node_id: str) -> None:
        """``node_id``'s credentials were revoked (:func:`.identity.revoke`): its connections to this
        node are closed (on the I/O thread, before it serves another message); any thread."""
        if self._running:
            self._revoking.append(node_id)
            self._wake()

    def _apply_revocations(self) -> None:
        while self._revoking:
            self._close_revoked(self._revoking.popleft())

    def _close_revoked(self, node_id: str) -> None:
        closed = self._door.revoke(node_id)
        for served in list(self._peers.values()):
            if served.peer is not None and served.peer.node_id == node_id:
                self._drop_peer(served)
                closed += 1
        if closed:
            log.warning("roving node %s: closed %d connection(s) of %s, whose credentials were revoked",
                        self.address, closed, node_id)

    def register_notice(self, op: bytes, handler: Callable[[Frames], None]) -> None:
        """Route messages ``op`` sent with :meth:`Endpoint.tell` (no answer) to ``handler(payload)``,
        on the I/O thread: it must not block."""
        self._notices[op] = handler

    def streams(self) -> _stream.Listener:
        """This process's stream listener, started on first use."""
        return self.service("streams", lambda node: _stream.Listener(
            node.credentials, node.host, node.advertise, node._on_stream, node.port_range, node.encrypt))

    def register_stream_purpose(self, purpose: str, handler: Callable[[dict, _stream.Stream], bool]) -> None:
        """Hand streams opened with ``{"purpose": purpose, ...}`` to ``handler`` (see stream.Listener)."""
        self._purposes[purpose] = handler

    def _on_stream(self, request: dict, stream: _stream.Stream) -> bool:
        purpose = request.get("purpose")
        if purpose != "node" and (stream.peer is None or not stream.peer.trusted):
            return False  # an untrusted process's streams carry requests to the node, nothing else
        if purpose == "node":
            _stream.accept(stream)
            self._adopted.append(stream)
            self._wake()
            return True
        handler = self._purposes.get(str(purpose))
        return handler is not None and handler(request, stream)

    def _want_write(self, peer: ServedStream) -> None:
        self._writable.append(peer)
        self._wake()

    def _defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread, outside every lock."""
        self._undeliverable.append(fn)
        self._wake()

    def service(self, key: str, factory: Callable[["Node"], Any]) -> Any:
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

    # -- I/O thread --------------------------------------------------------------------------
    def _post(self, frames: Frames, undeliverable: Optional[Callable[[], None]] = None) -> None:
        """Send ``frames`` (thread-safe); see :meth:`send_to` for ``undeliverable``."""
        if threading.get_ident() == self._thread.ident:
            self._send(frames, undeliverable)
            return
        self._outbox.append((frames, undeliverable))
        self._wake()

    def _send(self, frames: Frames, undeliverable: Optional[Callable[[], None]] = None) -> None:
        if frames[0][:1] == auth.CONNECTION_MARK:
            # To the connection the identity names, and to no other under its routing id: ends that
            # ZeroMQ has reported are taken first (a connection that took the routing id of one that
            # left comes after its end).
            self._read_monitor()
            ident = self._door.route(frames[0])
            if ident is None:
                log.debug("roving node: a peer left before its answer")
                if undeliverable is not None:
                    self._undeliverable.append(undeliverable)
                return
            frames = [ident, *frames[1:]]
        try:
            send_frames(self._router, frames)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                log.debug("roving node: a peer left before its answer")
                self._door.forget(frames[0])  # its connection is gone: so is its identity
            elif not self._running:
                return
            else:
                log.warning("roving node %s: a message could not be sent (%s); handled as undeliverable",
                            self.address, exc)
            if undeliverable is not None:
                # Run later, on this thread and outside every lock: the sender may hold its own.
                self._undeliverable.append(undeliverable)

    def _run_undeliverable(self) -> None:
        while self._undeliverable:
            try:
                self._undeliverable.pop(0)()
            except Exception:
                log.exception("roving node: taking back an undeliverable message failed")

    def _flush_outbox(self) -> None:
        while self._outbox:
            self._send(*self._outbox.popleft())

    def _wake(self) -> None:
        """Make the I/O thread go round its loop (any thread). A writer sets the flag before it writes
        and the I/O thread clears it only after reading the pipe, so a set flag always has a byte on
        its way and no wake-up is lost; while the flag is set, further calls write nothing."""
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def _serve(self) -> None:
        """The I/O thread. Nothing that goes wrong in one turn stops it: every other process of the
        session depends on it, and a node that stops answering looks to them like a hang. A peer whose
        stream cannot be served is dropped; any other error is logged with its traceback, and serving
        goes on (after a pause, should the same error repeat at once)."""
        failures = 0
        while self._running:
            try:
                self._serve_once()
                failures = 0
            except Exception:
                if not self._running:
                    return
                failures += 1
                log.exception("roving node %s: an error in the I/O thread (serving goes on)", self.address)
                time.sleep(min(1.0, 0.001 * 2 ** min(failures, 10)))

    def _serve_once(self) -> None:
        poller, router, wake = self._poller, self._router, self._wake_r
        timeout_ms: Optional[int] = None
        if self._deadlines:  # (int() as pyzmq makes a float timeout)
            timeout_ms = int(max(0.0, (self._deadlines[0][0] - time.monotonic()) * 1000))
        if self._door.ending:  # ends reported mid-turn: applied on the next look at the router, now
            timeout_ms = 0
        try:
            ready = dict(poller.poll(timeout_ms))
        except zmq.ZMQError:
            if not self._running:
                return
            raise
        if wake in ready:
            # Read first, then clear the flag: cleared first, a wake-up written in between would be
            # read while the flag stayed set, and every later _wake() would then skip its write.
            try:
                os.read(wake, 4096)  # a byte written after this read stays for the next poll
            except BlockingIOError:
                pass
            self._wake_pending = False
        if self._adopted:
            self._adopt_streams()
        if self._revoking:
            self._apply_revocations()
        self._flush_outbox()
        if self._monitor in ready:
            self._read_monitor()
        if router in ready or self._door.ending:
            self._read_router()
            self._flush_outbox()
        if self._selector.fileno() in ready:
            self._serve_streams()
        if self._writable:
            self._rewatch_writable()
        if self._deadlines:
            self._expire()
        if self._undeliverable:
            self._run_undeliverable()
            self._flush_outbox()

    def _adopt_streams(self) -> None:
        """Serve the streams handed over since the last turn (``_on_stream``)."""
        while self._adopted:
            stream = self._adopted.popleft()
            try:
                peer = ServedStream(stream, self._want_write)
            except OSError as exc:  # it ended before it could be served
                log.debug("roving node: a stream ended before it was served: %s", exc)
                stream.close()
                continue
            self._peers[peer.fd] = peer
            self._selector.register(peer.fd, selectors.EVENT_READ)

    def _read_router(self) -> None:
        """Handle up to 256 ZeroMQ messages waiting (then the turn goes on to the streams)."""
        for _ in range(256):
            try:
                frames = wire.recv_message(self._router)
            except zmq.Again:
                # Nothing waits: what ended connections sent before their end has all been read.
                self._door.forget_disconnected()
                break
            try:
                self._handle(frames)
            except Exception:  # a bad message must never stop the node
                log.exception("roving node: dropped a message that could not be handled")

    def _serve_streams(self) -> None:
        """Read and write the streams that are ready; one that fails is dropped, never the node."""
        for key, events in self._selector.select(0):
            served = self._peers.get(key.fd)
            if served is not None:
                try:
                    self._serve_peer(served, events)
                except Exception:
                    log.exception("roving node %s: a stream could not be served; it is dropped", self.address)
                    self._drop_peer(served)

    def _rewatch_writable(self) -> None:
        """Watch for writability exactly the streams that have bytes pending."""
        while self._writable:
            peer = self._writable.popleft()
            if self._peers.get(peer.fd) is peer:
                try:
                    self._selector.modify(peer.fd, selectors.EVENT_READ
                                          | (selectors.EVENT_WRITE if peer.pending else 0))
                except Exception:
                    log.exception("roving node %s: a stream could not be watched; it is dropped", self.address)
                    self._drop_peer(peer)
    def _read_monitor(self) -> None:
        """Take the router's monitor events that have arrived, without waiting (I/O thread only)."""
        while True:
            try:
                event = zmq_monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._unauthenticated.opened(int(event["value"]))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._unauthenticated.closed(int(event["value"]))
                self._door.disconnected(int(event["value"]))
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                # libzmq names the listening address here, not the peer's
                self._refusals.refuse("a ZeroMQ peer", "its ZeroMQ handshake failed with a protocol error "
                                      "(a stranger, or a peer with another session's key)")

    def _drop_peer(self, peer: ServedStream) -> None:
        """Stop serving a stream: what it had not yet written goes to its ``undeliverable`` callbacks,
        and the identity it had as a channel is forgotten."""
        if self._peers.get(peer.fd) is peer:
            del self._peers[peer.fd]
            ident = self._channel_of.pop(peer.fd, None)
            if ident is not None:
                self._channels.pop(ident, None)
            try:
                self._selector.unregister(peer.fd)
            except (KeyError, ValueError):
                pass
        self._undeliverable.extend(peer.drop())

    def _serve_peer(self, peer: ServedStream, events: int) -> None:
        """Serve one stream the selector found ready (``events``: selectors.EVENT_READ/EVENT_WRITE; an
        error or hang-up is both)."""
        if events & selectors.EVENT_WRITE:
            peer.flush()
            if not peer.pending:
                self._selector.modify(peer.fd, selectors.EVENT_READ)
        if not events & selectors.EVENT_READ:
            return
        if self._revoking:
            self._apply_revocations()
            if peer.closed or self._peers.get(peer.fd) is not peer:
                return
        messages, ended = peer.pump()

        def answer(out: Frames, undeliverable: Optional[Callable[[], None]]) -> None:
            if not peer.write(ANSWER, out, undeliverable) and undeliverable is not None:
                self._defer(undeliverable)  # the stream has ended: taken back on the I/O thread

        for kind, frames in messages:
            try:
                if kind == MESSAGE:
                    self._channel_message(peer, frames)
                    continue
                if kind != REQUEST or len(frames) < 2:
                    raise ValueError(f"unexpected stream message {kind!r}")
                if peer.peer is None:
                    raise ValueError("a request on a stream with no peer")
                self._request(bytes(frames[0]), frames[1], frames[2:], answer, peer.peer)
            except ValueError as exc:
                log.warning("roving node: dropped a malformed stream message: %s", exc)
            except Exception:  # a bad message must never stop the node
                log.exception("roving node: dropped a stream message that could not be handled")
        if ended or peer.closed:
            self._drop_peer(peer)

    def _channel_message(self, peer: ServedStream, frames: List[Any]) -> None:
        """A handler's message over a stream: to the handler of its operation, as from ZeroMQ, under the
        identity this stream has (given at its first message)."""
        handler = self._handlers.get(bytes(frames[0])) if frames else None
        if handler is None:
            raise ValueError("a channel message for no handler of this node")
        if peer.peer is None or not peer.peer.trusted:
            raise ValueError("a channel message from an untrusted process: it may use no service of a node")
        ident = self._channel_of.get(peer.fd)
        if ident is None:
            ident = _CHANNEL_MARK + next(self._channel_ids).to_bytes(8, "little")
            self._channel_of[peer.fd] = ident
            self._channels[ident] = peer
        handler(ident, frames[1:])

    def known_channels(self) -> int:
        """Streams that carry handlers' messages now (those of peers that are gone are not counted)."""
        return len(self._channels)

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, _, box_id, waiter, status = heapq.heappop(self._deadlines)
                box = self.boxes.get(box_id)
                if box is not None:
                    box.cancel(waiter, status)

    def _handle(self, frames: Frames) -> None:  # zmq.Frames; after PIECES, the pieces joined
        if self._revoking:
            self._apply_revocations()
        ident = frames[0].bytes
        known = self._authenticated.get(ident)
        if known is None or frames[1].get("User-Id") != known:
            # Ends of connections first: one that ended before this connection was made may have had
            # its file descriptor, and its end must not be taken for this one's (auth.Door.disconnected).
            self._read_monitor()
            self._door.knock(ident, frames[1:])
            if self._authenticated.get(ident, self) == frames[1].get("User-Id"):  # it just got in
                self._unauthenticated.settled(_source_fd(frames[1]))
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
            self._door.forget(ident)
            return
        who = self._door.peer(token)
        if who is None:
            return  # forgotten meanwhile (revoked): nothing of it is served
        handler = self._handlers.get(op)
        if handler is not None:
            if who.trusted:
                handler(token, frames[2:])
            else:
                self._refusals.refuse(who.node_id, "an untrusted process may use no service of a node")
            return
        if len(frames) < 3:
            log.warning("roving node: malformed request from an authenticated peer dropped")
            return
        self._request(op, bytes(frames[2]), frames[3:],
                      lambda out, undeliverable: self._post([token, *out], undeliverable), who)

    def _request(self, op: bytes, header: Any, payload: Frames, answer: Answer, who: identity.Peer) -> None:
        """Serve one request of the authenticated peer ``who``, over ZeroMQ or a stream alike: ``answer``
        (any thread) sends a reply back the way the request came. An untrusted peer gets a ping, the
        stream address and the mailboxes it may use (:class:`.boxes.Boxes`), nothing else."""
        if len(header) != HEADER.size:
            log.warning("roving node: malformed request from an authenticated peer dropped")
            return
        box_id, req_id, timeout = HEADER.unpack(header)
        timeout = timeouts.from_wire(timeout)  # inf or NaN from a peer must not reach the deadlines
        if op == PING:
            answer([REPLY.pack(req_id, OK)], None)
            return
        if op == STREAMS:
            try:
                address = self.streams().address if streams_enabled else ""
            except (RuntimeError, OSError) as exc:  # no thread or socket for it (at interpreter exit)
                log.warning("roving node: no stream listener (%s); peers keep to ZeroMQ", exc)
                address = ""
            answer([REPLY.pack(req_id, OK), address.encode()], None)
            return
        notice = self._notices.get(op)
        if notice is not None:
            if who.trusted:
                notice(payload)
            else:
                self._refusals.refuse(who.node_id, "an untrusted process may send a node no notice")
            return
        waiter = RemoteWaiter(self, answer, req_id, box_id)
        with self.lock:
            status, out = self.dispatch(op, box_id, timeout, payload, waiter, who)
            if status == -1:
                if timeout > 0:
                    heapq.heappush(self._deadlines, (time.monotonic() + timeout, next(self._seq), box_id,
                                                     waiter, TIMEOUT_STATUS.get(op, EMPTY)))
                return
        if op not in NO_REPLY:
            item = None
            if op == GET and status == OK and out:
                item = functools.partial(self.put_back, box_id, out)
            answer([REPLY.pack(req_id, status), *(out or ())], item)
        elif status == ERROR:
            why = bytes(out[0]).decode(errors="replace") if out else "error"
            if who.trusted:
                log.warning("roving node: %s", why)
            else:  # what an untrusted process makes fail is logged at most once a minute
                self._refusals.refuse(who.node_id, why)

    def close(self) -> None:
        """Stop serving. Waiting local callers are answered with an error."""
        if not self._running:
            return
        for fn in self._at_close:
            try:
                fn()
            except Exception:
                log.exception("roving node: a close callback failed")
        self._running = False
        zap.unregister(self._zap_domain)
        with self.lock:
            for box in self.boxes.values():
                for waiter in [*box.getters, *box.pollers, *box.joiners, *(w for w, _ in box.putters)]:
                    if not waiter.done and isinstance(waiter, LocalWaiter):
                        waiter.fulfil(ERROR, [b"the roving node was closed"])
            self.boxes.clear()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2)
        listener = self._services.get("streams")
        if listener is not None:
            listener.close()
        if not self._thread.is_alive():
            for peer in list(self._peers.values()):
                peer.drop()
            self._peers.clear()
            self._selector.close()
            # The monitor stops before its reader closes (see _watch): else libzmq's I/O thread blocks
            # for good on the events of the connections that closing the router ends.
            self._router.disable_monitor()
            self._monitor.close(0)
            self._router.close(0)
            os.close(self._wake_r)
            os.close(self._wake_w)


def _source_fd(frame: zmq.Frame) -> Optional[int]:
    """The descriptor of the connection a message came on (ZeroMQ's SRCFD), or None where not known."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None


#: First byte of the identities the node gives streams that carry handlers' messages (ZeroMQ's own
#: routing ids begin with a zero byte; a peer's chosen id is never taken for a stream's: send_to looks
#: streams up first, and never passes an identity with this mark to ZeroMQ).
_CHANNEL_MARK = b"\xfe"

#: Set to False (before anything else is set up) to serve and send every request over ZeroMQ: other
#: processes of the session then do too (benchmarks compare both ways).
streams_enabled = True
