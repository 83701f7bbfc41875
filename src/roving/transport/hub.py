"""A node's stream hub (:class:`StreamHub`): the streams other processes opened to the node, served on
its I/O thread (:mod:`.loop`).

A client that learnt the node's stream address (STREAMS) opens a stream of its own to it
(:mod:`.stream`, purpose ``"node"``) and sends its requests there: the hub reads them and hands each to
the node, which answers on the same stream. A protocol of one's own (the pool's) can run over such a
stream too: a MESSAGE reaches the handler registered for its operation, under an identity the hub gives
the stream at its first message (:meth:`StreamHub.channel` finds the stream again from it, for
:meth:`.node.Node.send_to`); the identity is forgotten when the stream ends.

Guarantees: a stream that cannot be served is dropped, never the node, and what it had not yet written
goes to its ``undeliverable`` callbacks (on the I/O thread, outside every lock); an untrusted process's
streams carry requests to the node and nothing else (no handler's message, no other purpose); the
streams are watched by a selector of their own (epoll here), which the node's poller watches as one
descriptor, so a turn costs the same with 4,000 streams open as with 4.
"""
from __future__ import annotations

import collections
import itertools
import logging
import selectors
from typing import Any, Callable, Deque, Dict, List, Optional

from . import identity
from . import stream as _stream
from .boxes import Answer
from .loop import Loop
from .served import ServedStream
from .wire import ANSWER, MESSAGE, REQUEST, Frames

log = logging.getLogger(__name__)

__all__ = ["StreamHub", "Handler", "Serve", "CHANNEL_MARK"]

#: A handler of a protocol of one's own: ``handler(identity, frames)``, on the I/O thread.
Handler = Callable[[bytes, Frames], None]
#: How the node serves one request: ``serve(op, header, payload, answer, who)``.
Serve = Callable[[bytes, Any, Frames, Answer, identity.Peer], None]

#: First byte of the identities the hub gives streams that carry handlers' messages (ZeroMQ's own
#: routing ids begin with a zero byte; a peer's chosen id is never taken for a stream's: send_to looks
#: streams up first, and never passes an identity with this mark to ZeroMQ).
CHANNEL_MARK = b"\xfe"


class StreamHub:
    """The streams served on a node's I/O thread, and the identities of those that carry handlers'
    messages. ``handlers`` is the node's table of them (read here, filled by the node); ``serve`` serves
    one request; ``settle()`` runs before a stream's messages are read (the node's revocations)."""

    def __init__(self, loop: Loop, handlers: Dict[bytes, Handler], serve: Serve,
                 settle: Callable[[], None]) -> None:
        self._loop, self._handlers, self._serve_request, self._settle = loop, handlers, serve, settle
        # The streams, by descriptor, watched by a selector of their own (epoll here), which the poller
        # watches as one descriptor (zmq's poller scans every descriptor it is given on every call).
        self.selector = selectors.DefaultSelector()
        #: The selector's descriptor, as the node's poller reports it ready.
        self.fileno = self.selector.fileno()
        loop.watch(self.fileno)
        #: The streams served now, by descriptor (I/O thread).
        self.peers: Dict[int, ServedStream] = {}
        # Streams that carry handlers' messages, by the identity the hub gave each; read by the node's
        # send_to on any thread, changed on the I/O thread only.
        self._channels: Dict[bytes, ServedStream] = {}
        self._channel_of: Dict[int, bytes] = {}  # stream descriptor -> its identity
        self._channel_ids = itertools.count(1)
        #: Streams handed over by the listener, to serve from the next turn on.
        self.adopted: Deque[_stream.Stream] = collections.deque()
        #: Streams whose pending bytes changed: watched for writability again at the end of the turn.
        self.writable: Deque[ServedStream] = collections.deque()
        self._purposes: Dict[str, Callable[[dict, _stream.Stream], bool]] = {}

    def channel(self, ident: bytes) -> Optional[ServedStream]:
        """The stream that carries handlers' messages under ``ident``, or None (any thread)."""
        return self._channels.get(ident)

    def known_channels(self) -> int:
        """Streams that carry handlers' messages now (those of peers that are gone are not counted)."""
        return len(self._channels)

    def register_purpose(self, purpose: str, handler: Callable[[dict, _stream.Stream], bool]) -> None:
        """Hand streams opened with ``{"purpose": purpose, ...}`` to ``handler`` (see stream.Listener)."""
        self._purposes[purpose] = handler

    def on_stream(self, request: dict, stream: _stream.Stream) -> bool:
        """The stream listener's callback (its thread): a stream for the node is served from the next
        turn on; one of another purpose goes to that purpose's handler."""
        purpose = request.get("purpose")
        if purpose != "node" and (stream.peer is None or not stream.peer.trusted):
            return False  # an untrusted process's streams carry requests to the node, nothing else
        if purpose == "node":
            _stream.accept(stream)
            self.adopted.append(stream)
            self._loop.wake()
            return True
        handler = self._purposes.get(str(purpose))
        return handler is not None and handler(request, stream)

    # -- I/O thread ------------------------------------------------------------------------------
    def adopt(self) -> None:
        """Serve the streams handed over since the last turn."""
        while self.adopted:
            stream = self.adopted.popleft()
            try:
                peer = ServedStream(stream, self._want_write)
            except OSError as exc:  # it ended before it could be served
                log.debug("roving node: a stream ended before it was served: %s", exc)
                stream.close()
                continue
            self.peers[peer.fd] = peer
            self.selector.register(peer.fd, selectors.EVENT_READ)

    def serve(self) -> None:
        """Read and write the streams that are ready; one that fails is dropped, never the node."""
        for key, events in self.selector.select(0):
            served = self.peers.get(key.fd)
            if served is not None:
                try:
                    self._serve_peer(served, events)
                except Exception:
                    log.exception("%s: a stream could not be served; it is dropped", self._loop.label)
                    self.drop(served)

    def rewatch(self) -> None:
        """Watch for writability exactly the streams that have bytes pending."""
        while self.writable:
            peer = self.writable.popleft()
            if self.peers.get(peer.fd) is peer:
                try:
                    self.selector.modify(peer.fd, selectors.EVENT_READ
                                         | (selectors.EVENT_WRITE if peer.pending else 0))
                except Exception:
                    log.exception("%s: a stream could not be watched; it is dropped", self._loop.label)
                    self.drop(peer)

    def drop(self, peer: ServedStream) -> None:
        """Stop serving a stream: what it had not yet written goes to its ``undeliverable`` callbacks,
        and the identity it had as a channel is forgotten."""
        if self.peers.get(peer.fd) is peer:
            del self.peers[peer.fd]
            ident = self._channel_of.pop(peer.fd, None)
            if ident is not None:
                self._channels.pop(ident, None)
            try:
                self.selector.unregister(peer.fd)
            except (KeyError, ValueError):
                pass
        self._loop.later(peer.drop())

    def drop_of(self, node_id: str) -> int:
        """Drop every stream that ``node_id`` opened (its credentials were revoked); how many."""
        gone = [served for served in self.peers.values()
                if served.peer is not None and served.peer.node_id == node_id]
        for served in gone:
            self.drop(served)
        return len(gone)

    def close(self) -> None:
        """Drop every stream without serving it again (the I/O thread has ended)."""
        for peer in list(self.peers.values()):
            peer.drop()
        self.peers.clear()
        self.selector.close()

    def _want_write(self, peer: ServedStream) -> None:
        self.writable.append(peer)
        self._loop.wake()

    def _serve_peer(self, peer: ServedStream, events: int) -> None:
        """Serve one stream the selector found ready (``events``: selectors.EVENT_READ/EVENT_WRITE; an
        error or hang-up is both)."""
        if events & selectors.EVENT_WRITE:
            peer.flush()
            if not peer.pending:
                self.selector.modify(peer.fd, selectors.EVENT_READ)
        if not events & selectors.EVENT_READ:
            return
        self._settle()
        if peer.closed or self.peers.get(peer.fd) is not peer:
            return  # revoked meanwhile
        messages, ended = peer.pump()

        def answer(out: Frames, undeliverable: Optional[Callable[[], None]]) -> None:
            if not peer.write(ANSWER, out, undeliverable) and undeliverable is not None:
                self._loop.defer(undeliverable)  # the stream has ended: taken back on the I/O thread

        for kind, frames in messages:
            try:
                if kind == MESSAGE:
                    self._channel_message(peer, frames)
                    continue
                if kind != REQUEST or len(frames) < 2:
                    raise ValueError(f"unexpected stream message {kind!r}")
                if peer.peer is None:
                    raise ValueError("a request on a stream with no peer")
                self._serve_request(bytes(frames[0]), frames[1], frames[2:], answer, peer.peer)
            except ValueError as exc:
                log.warning("roving node: dropped a malformed stream message: %s", exc)
            except Exception:  # a bad message must never stop the node
                log.exception("roving node: dropped a stream message that could not be handled")
        if ended or peer.closed:
            self.drop(peer)

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
            ident = CHANNEL_MARK + next(self._channel_ids).to_bytes(8, "little")
            self._channel_of[peer.fd] = ident
            self._channels[ident] = peer
        handler(ident, frames[1:])
