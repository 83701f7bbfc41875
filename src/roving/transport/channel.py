"""A connection to a node for a protocol of one's own (the pool's): over a stream, or ZeroMQ.

A pool's parent and its workers exchange many small messages; each crossing of a thread costs. Over
ZeroMQ a message crosses ZeroMQ's I/O thread on both sides and the node's I/O thread on the parent's; over
a stream (:mod:`.stream`) the worker's own thread reads and writes its socket, and the parent's node
writes from whichever thread sends (:meth:`.node.Node.send_to`): a round trip costs about half
(``benchmarks/RESULTS.md``, "Pool round trip over streams"). Authentication and encryption are those of
the stream (the session secret's proof both ways before anything is read; TLS beyond loopback) or of
ZeroMQ (CURVE and the node's door).
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Union

import zmq

from . import auth
from . import identity
from . import node as _node
from . import stream as _stream
from .endpoint import Secret, open_stream, say_bye, stream_listener, zmq_socket
from .errors import AuthenticationError, ConnectionLost, IdentityError, NodeError, TransportError
from .wire import MESSAGE, Frames, send_frames, split_frames

__all__ = ["Channel", "ConnectionLost", "NodeError", "TransportError"]

log = logging.getLogger(__name__)


class Channel:
    """An authenticated connection to a node, for a protocol of one's own (the pool uses it).

    ``send([op, *frames])`` reaches the handler the node registered for ``op``
    (:meth:`.node.Node.register_handler`); what that handler sends back with :meth:`.node.Node.send_to` is what
    :meth:`recv` returns, as a list of bytes-like frames. Messages each way arrive in the order sent. Not
    thread-safe: one thread, one channel. Raises :class:`.errors.NodeError` or ``AuthenticationError`` when
    it cannot connect within ``connect_timeout`` seconds.

    With ``stream=True`` the channel is a stream to the node's stream listener where the node has one
    (:mod:`.stream`: TLS beyond loopback, read and written by the calling thread, no ZeroMQ I/O thread on
    either side: a round trip costs about half), else ZeroMQ. A stream that ends (the node closed it, or
    the connection broke) raises :class:`ConnectionLost` from ``send`` or ``recv``; over ZeroMQ only
    ``recv`` does, when the node no longer knows a connection ZeroMQ re-made. Either way: open a new one.
    """

    def __init__(self, address: str, secret: Secret, connect_timeout: float = 30.0, *,
                 stream: bool = False) -> None:
        secret = identity.credentials(secret)
        self.address = address
        self._stream: Optional[_stream.Stream] = None
        self._sock: Any = None
        listener = stream_listener(address, secret, connect_timeout) if stream and _node.streams_enabled else ""
        if listener:
            self._stream = _open_channel_stream(address, listener, secret, connect_timeout)
        if self._stream is None:
            self._sock = zmq_socket(address, secret, connect_timeout)

    @property
    def over_stream(self) -> bool:
        """Whether this channel is a stream (else ZeroMQ)."""
        return self._stream is not None

    @property
    def pollable(self) -> Union[zmq.Socket, int]:
        """What a ``zmq.Poller`` can watch for this channel's messages (and names in what it returns):
        its ZeroMQ socket, or its stream's file descriptor. A stream may hold whole messages read
        already: call ``recv(0)`` until None after each wake-up."""
        return self._stream.sock.fileno() if self._stream is not None else self._sock

    def send(self, frames: Frames) -> None:
        """Queue (ZeroMQ) or write (a stream) a message; the frames' buffers must not change until the
        channel is closed (ZeroMQ) or ``send`` returns (a stream)."""
        if self._stream is not None:
            try:
                self._stream.send(MESSAGE, frames)
            except OSError as exc:
                raise ConnectionLost(f"the stream to the roving node at {self.address} ended: {exc}") from exc
            return
        send_frames(self._sock, split_frames(frames))

    def recv(self, timeout: Optional[float]) -> Optional[Frames]:
        """The next message (a list of frames), or None when none comes within ``timeout`` s.

        Raises :class:`ConnectionLost` when the connection can carry nothing more (see the class): messages
        sent since it broke were dropped, and no answer to what was sent before will come.
        """
        if self._stream is not None:
            if not self._stream.readable(timeout):
                return None
            try:
                return self._stream.recv()[1]
            except EOFError as exc:
                raise ConnectionLost(f"the stream to the roving node at {self.address} ended: {exc}") from exc
        if timeout is not None and not self._sock.poll(max(0.0, timeout) * 1000):
            return None
        frames = self._sock.recv_multipart(copy=False)
        if auth.is_reauth(frames):
            raise ConnectionLost(f"the connection to the roving node at {self.address} was re-made after a "
                                 "network drop, so the node no longer knows it: what was sent since was dropped")
        return frames

    def close(self, linger: float = 10.0) -> None:
        """Close, waiting up to ``linger`` seconds for queued messages to leave (a stream queues
        nothing: what ``send`` wrote is in the kernel, which delivers it after the close, unless
        messages came in that were never read: then the kernel resets the connection, and what was
        still on its way may be lost. Close after the peer's last word, as the pool's workers do: after
        the parent's ACK.)"""
        if self._stream is not None:
            self._stream.close()
            return
        say_bye(self._sock)
        self._sock.close(int(linger * 1000))


def _open_channel_stream(address: str, listener: str, secret: identity.Credentials,
                         timeout: float) -> Optional[_stream.Stream]:
    """A stream for a channel to the node at ``address``, or None (then ZeroMQ) when the listener does
    not take one within ``endpoint.STREAM_OPEN_TIMEOUT`` (:func:`.endpoint.open_stream` tries again
    meanwhile) or nothing listens there."""
    try:
        return open_stream(address, listener, secret, timeout)
    except (AuthenticationError, IdentityError):
        raise
    except (OSError, ConnectionError) as exc:
        log.warning("roving: no stream to the node at %s (listener %s: %s); using ZeroMQ", address, listener, exc)
        return None
