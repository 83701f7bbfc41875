"""How a process reaches the mailboxes and protocols of other processes' nodes (:mod:`.node`).

:class:`Endpoint` is the way to one node's mailboxes, local or remote alike: each thread gets its own
authenticated connection — a stream when the node offers one (:class:`_StreamConnection`, read and
written by the calling thread), else ZeroMQ (:class:`_ZmqConnection`). :class:`.channel.Channel`, a
connection for a protocol of one's own (the pool's), is built on :func:`zmq_socket` and
:func:`stream_listener`. :func:`close_connections` makes sure at exit that
what was sent without an answer has arrived.

Broken connections. A connection can break while both processes live on (a network drop): a stream
ends, or ZeroMQ quietly re-makes its TCP connection, which the node then knows as a stranger and answers
only with REAUTH. Either way the call in progress raises :class:`ConnectionLost` instead of waiting for
an answer that cannot come (it may or may not have taken effect), and the thread's next call opens a new
connection with a new handshake; if nothing listens at the node's address any more, that call raises at
once. A peer that vanished without closing is found by TCP keepalive (:mod:`.stream`), after about 25 s.
"""
from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import zmq
from zmq.utils import monitor as zmq_monitor

from . import addressing, auth
from . import crypto
from . import identity
from . import node as _node
from . import stream as _stream
from . import timeouts
from . import wire
from .errors import AuthenticationError, ConnectionLost, IdentityError, NodeError, TransportError
from .framing import is_bytes
from .mailbox import ERROR, OK
from .boxes import Boxes
from .node import Node
from .wire import (COPY_BELOW, GET, NO_REPLY, PING, PUT_FRONT, REQUEST, STREAMS, Frames, nbytes,
                   pack_header, send_frames, split_frames, unpack_reply)

__all__ = ["Endpoint", "ConnectionLost", "NodeError", "TransportError", "abandon", "close_connections", "flush_sent",
           "open_stream", "stream_listener", "zmq_socket"]

log = logging.getLogger(__name__)

#: This process's credentials (:class:`.identity.Credentials`), or raw secret bytes (ad hoc ones).
Secret = Union[bytes, identity.Credentials]

_LINGER_MS = 10_000  # how long a closing ZeroMQ connection keeps trying to deliver what it queued
#: Seconds to wait for a node's stream listener to take a new stream before using ZeroMQ instead.
STREAM_OPEN_TIMEOUT = 10.0
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_EVENTS = (_HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                     | zmq.EVENT_CONNECT_RETRIED)
#: Seconds of silence after which a ZeroMQ call that waits for ever pings, to learn whether its
#: connection was re-made under it (see _ZmqConnection._recv).
_PROBE_S = 5.0


def _gone(address: str) -> NodeError:
    """Nothing listens at the node's address any more (refused): its process has ended."""
    return NodeError(f"nothing listens at {address} any more: the process that owned it has ended")


def _lost(address: str) -> ConnectionLost:
    return ConnectionLost(f"the connection to the roving node at {address} was re-made after a network drop, "
                          "so the node no longer knows it: what was sent since was dropped unread")


class _Connection:
    """One thread's authenticated connection to one remote node: requests out, answers back in order.

    Two kinds: over ZeroMQ (:class:`_ZmqConnection`, always possible) and over a stream of its own
    (:class:`_StreamConnection`, which the calling thread reads and writes itself: no I/O thread on
    this side, one on the node's side).
    """

    address: str

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.pending: Optional[Tuple[int, bytes, int]] = None
        # Something was sent without an answer since the last answer: flush() makes sure it arrived.
        self.unacked = False
        # The connection itself broke (not just a slow answer): the Endpoint replaces it before its next use.
        self.broken = False
        self.thread: Callable[[], Optional[threading.Thread]] = lambda: None  # the thread it serves

    def interrupt(self) -> None:
        """From any thread: the node is known to be gone. The connection is replaced before its next
        use; a thread blocked on it returns at once with ConnectionLost where the connection can wake
        it (a stream: a write to a peer that stopped reading blocks once the kernel's buffers are full).
        ZeroMQ's sends queue up to the high-water mark instead of blocking on a dead peer."""
        self.broken = True

    def _transmit(self, frames: Frames) -> None:
        raise NotImplementedError

    def _recv(self, timeout: Optional[float], what: str) -> List[Any]:
        raise NotImplementedError

    def send(self, op: bytes, box_id: int, timeout: float, payload: Frames) -> int:
        if self.broken:
            raise ConnectionLost(f"the connection to the roving node at {self.address} broke")
        req_id = next(self._ids)
        if op in NO_REPLY:
            self.unacked = True
            unconfirmed = _unconfirmed()
            if self not in unconfirmed:
                unconfirmed.append(self)
        self._transmit([op, pack_header(box_id, req_id, timeout), *payload])
        return req_id

    def call(self, op: bytes, box_id: int, timeout: float, payload: Frames,
             guard: Optional[float]) -> Tuple[int, Frames]:
        self.settle()
        req_id = self.send(op, box_id, timeout, payload)
        self.pending = (req_id, op, box_id)
        while True:
            frames = self._recv(guard, "answer")
            got, status = unpack_reply(frames[0])
            if got == req_id:
                self.pending = None
                self.unacked = False  # the node handles a connection's messages in order
                return status, frames[1:]
            self._stale(got, status, frames[1:])

    def ping(self, timeout: float) -> bool:
        """True when the node answers within ``timeout`` seconds; all sent before has then arrived."""
        self.settle()
        req_id = self.send(PING, 0, 0, [])
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                frames = self._recv(left, "answer")
            except NodeError:
                return False
            got, status = unpack_reply(frames[0])
            if got == req_id:
                self.unacked = False
                return True
            self._stale(got, status, frames[1:])

    def flush(self, timeout: float) -> bool:
        """Wait until the node has received every message sent without an answer (bounded)."""
        if not self.unacked or self.pending is not None:
            return True
        try:
            return self.ping(timeout)
        except (zmq.ZMQError, OSError):
            return False

    def settle(self) -> None:
        """Answers to calls that were abandoned (interrupted) can still arrive: take them first."""
        while self.pending is not None:
            try:
                frames = self._recv(0, "answer")
            except NodeError:
                return
            got, status = unpack_reply(frames[0])
            self._stale(got, status, frames[1:])

    def closes_safely(self) -> bool:
        """Whether closing now loses nothing: no answer can still come, nothing sent is unconfirmed."""
        return self.pending is None and not self.unacked

    def _stale(self, got: int, status: int, frames: Frames) -> None:
        if self.pending is None or got != self.pending[0]:
            return
        _, op, box_id = self.pending
        self.pending = None
        if op == GET and status == OK:
            # The item was handed over after its reader gave up: give it back, at the front.
            self.send(PUT_FRONT, box_id, 0, frames)

    def close(self) -> None:
        raise NotImplementedError


class _ZmqConnection(_Connection):
    """Over an authenticated ZeroMQ DEALER socket."""

    def __init__(self, address: str, secret: Secret, connect_timeout: float) -> None:
        super().__init__()
        creds = identity.credentials(secret)
        self.address = address
        key = identity.expected_key(address, creds)
        curve = crypto.zmq_encrypted(crypto.mode(), addressing.host_of(address))
        if curve and key is None:
            raise IdentityError(f"{address} names no node key (tcp://HOST:PORT#KEY): the roving node "
                                "meant cannot be told from another")
        self.sock = wire.context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, wire.HANDSHAKE_IVL_MS)
        wire.keep_alive(self.sock)
        monitor = None
        try:
            if curve:
                assert key is not None
                crypto.curve_client(self.sock, creds, key)
                monitor = self.sock.get_monitor_socket(_HANDSHAKE_EVENTS)
            self.sock.connect(identity.bare(address))
            deadline = time.monotonic() + connect_timeout
            if monitor is not None:
                self._await_curve(monitor, connect_timeout)
            #: Who the node is (:class:`.identity.Peer`), as its handshake proved.
            self.peer = self._authenticate(creds, max(0.0, deadline - time.monotonic()))
        except BaseException:
            self.sock.close(0)
            raise

    def _await_curve(self, monitor: zmq.Socket, timeout: float) -> None:
        """Wait up to ``timeout`` s for the CURVE handshake; AuthenticationError when the node ends it
        unfinished (its key is not this session's, or it refused this process's key); NodeError at once
        when its port refuses the connection (ZeroMQ would try again until the timeout: a node listens
        on its port as long as it lives, so it has ended). On a timeout the challenge's wait (in
        _authenticate, with the time left: none) says that nothing answered."""
        deadline = time.monotonic() + timeout
        connected = False
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not monitor.poll(int(left * 1000)):  # (as pyzmq makes a float timeout)
                    return
                event = zmq_monitor.recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return
                if event == zmq.EVENT_CONNECTED:
                    connected = True
                elif event == zmq.EVENT_CONNECT_RETRIED and not _listening(self.address):
                    raise _gone(self.address)
                elif event & _HANDSHAKE_FAILED or (event == zmq.EVENT_DISCONNECTED and connected):
                    raise AuthenticationError(
                        f"the roving node at {self.address} ended the encrypted ZeroMQ handshake: it is not "
                        "the node this address names (another process there, or a relay to another "
                        "node), not part of this roving session (another secret), or it runs with "
                        "encrypt='off' where this process does not")
        finally:
            self.sock.disable_monitor()
            monitor.close(0)

    def _authenticate(self, creds: identity.Credentials, timeout: float) -> identity.Peer:
        return auth.prove(self.sock.send_multipart, lambda what: self._recv(timeout, what, copy=True), creds,
                          self.address)

    def _recv(self, timeout: Optional[float], what: str, copy: bool = False) -> List[Any]:
        if timeout is None:
            # Waiting for ever (a get() without a timeout): ZeroMQ may re-make the connection meanwhile
            # without a word, and the answer would then never come. A ping now and then is answered,
            # or, over a re-made connection, met with REAUTH.
            while not self.sock.poll(_PROBE_S * 1000):
                self.send(PING, 0, 0, [])
        elif not self.sock.poll(timeout * 1000):
            raise NodeError(f"no {what} from the roving node at {self.address} within {timeout:g} s "
                                 "(has the process that owns it exited?)")
        frames = self.sock.recv_multipart(copy=copy)
        if auth.is_reauth(frames):
            self.broken = True
            raise _lost(self.address)
        return frames

    def _transmit(self, frames: Frames) -> None:
        if any(nbytes(f) >= COPY_BELOW for f in frames):
            tracker = self.sock.send_multipart(split_frames(frames), copy=False, track=True)
            # The caller may reuse its buffers once send() returns: wait until ZeroMQ is done with them.
            tracker.wait()
        else:
            send_frames(self.sock, frames)

    def close(self) -> None:
        say_bye(self.sock)
        self.sock.close()


def say_bye(sock: zmq.Socket) -> None:  # public for roving.transport.channel
    """Tell the node this connection ends (it forgets the connection's identity); after all sent before."""
    try:
        sock.send(auth.BYE, zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


def open_stream(address: str, listener: str, secret: Secret, timeout: float) -> _stream.Stream:
    """A stream to the node at ``address`` through its stream listener at ``listener``, opened within
    ``min(timeout, STREAM_OPEN_TIMEOUT)`` seconds.

    A connection that ends or is spoiled during its handshake is opened again, with back-off, until
    then: a listener closes handshakes it cannot take on now (it admits only so many at once from one
    address, and evicts the oldest of a source that floods it), and a TLS record that does not decrypt
    ends the connection it came on, never the next one. Raises at once AuthenticationError and
    IdentityError (no other try would pass: the listener refused this process, or it is not the node
    meant), and StreamError when nothing listens at ``listener`` (refused) or the time is up; the
    StreamError is the last try's.
    """
    creds = identity.credentials(secret)
    deadline = time.monotonic() + min(timeout, STREAM_OPEN_TIMEOUT)
    pause = 0.02
    while True:
        try:
            return _stream.connect(listener, creds, {"purpose": "node"}, max(0.1, deadline - time.monotonic()),
                                   expect=identity.expected_key(address, creds))
        except (AuthenticationError, IdentityError):
            raise
        except (OSError, ConnectionError) as exc:
            if time.monotonic() + pause >= deadline or isinstance(exc.__cause__, ConnectionRefusedError):
                raise
            log.debug("roving: a stream to the node at %s ended during its handshake (%s); trying again",
                      address, exc)
            time.sleep(pause)
            pause = min(0.5, pause * 2)


class _StreamConnection(_Connection):
    """Over a stream to the node's stream listener, read and written by the calling thread."""

    def __init__(self, address: str, stream_address: str, secret: Secret, connect_timeout: float) -> None:
        super().__init__()
        self.address = address
        self.stream = open_stream(address, stream_address, secret, connect_timeout)

    def _transmit(self, frames: Frames) -> None:
        try:
            self.stream.send(REQUEST, frames)
        except OSError as exc:
            self.broken = True
            raise ConnectionLost(f"the connection to the roving node at {self.address} broke: {exc}") from exc

    def _recv(self, timeout: Optional[float], what: str) -> List[Any]:
        if timeout is not None and not self.stream.readable(timeout):
            raise NodeError(f"no {what} from the roving node at {self.address} within {timeout:g} s "
                                 "(has the process that owns it exited?)")
        try:
            return self.stream.recv()[1]
        except (EOFError, OSError) as exc:
            self.broken = True
            raise ConnectionLost(f"the connection to the roving node at {self.address} broke "
                                 f"({exc or 'closed by the other end'}; has the process that owns it "
                                 "exited?)") from exc

    def closes_safely(self) -> bool:
        # What send() wrote is in the kernel, and the node reads it before it sees the stream end
        # (nothing unread on this side, so the close is a FIN, not a reset).
        return self.pending is None

    def interrupt(self) -> None:
        super().interrupt()
        self.stream.interrupt()

    def close(self) -> None:
        self.stream.close()


def zmq_socket(address: str, secret: Secret, connect_timeout: float) -> zmq.Socket:
    """An authenticated ZeroMQ DEALER to the node at ``address`` (what :class:`.channel.Channel` runs
    over when there is no stream); NodeError, AuthenticationError or IdentityError (it is not the
    node ``address`` names) within ``connect_timeout``."""
    return _ZmqConnection(address, identity.credentials(secret), connect_timeout).sock


#: Node address -> its stream listener's address ("": none), learnt once per process (a node's listener
#: lives as long as the node).
_listeners: dict = {}
_listeners_lock = threading.Lock()


def stream_listener(address: str, secret: Secret, timeout: float) -> str:
    """The address of the stream listener of the node at ``address`` ("" when it has none), asked over
    ZeroMQ once per process; NodeError or AuthenticationError when the node cannot be reached."""
    with _listeners_lock:
        known = _listeners.get(address)
    if known is not None:
        return known
    zconn = _ZmqConnection(address, identity.credentials(secret), timeout)
    try:
        status, frames = zconn.call(STREAMS, 0, 0, [], timeout)
        found = bytes(frames[0]).decode() if status == OK and frames else ""
    except NodeError:
        found = ""
    finally:
        zconn.close()
    with _listeners_lock:
        _listeners[address] = found
    return found


class Endpoint:
    """How this process reaches the mailboxes at one node address; local or remote alike.

    ``call`` blocks up to ``timeout`` seconds (-1: forever, 0: not at all) and returns (status, frames);
    ``tell`` sends an operation that needs no answer.
    """

    def __init__(self, address: str, secret: Secret, local: Optional[Node],
                 connect_timeout: float = 30.0) -> None:
        self.address = address
        #: This process's own mailboxes when the node at ``address`` is this process's: called directly.
        self.local: Optional[Boxes] = None if local is None else local.mailboxes
        self._secret = identity.credentials(secret)
        self._connect_timeout = connect_timeout
        self._threads = threading.local()
        self._streams: Optional[str] = None  # the node's stream listener; "" when there is none

    def _conn(self, connect_timeout: Optional[float] = None) -> _Connection:
        conn = getattr(self._threads, "conn", None)
        if conn is not None and conn.broken:
            self._replace(conn)
            conn = None
        if conn is None:
            _close_for_ended_threads()
            conn = self._connect(connect_timeout or self._connect_timeout)
            conn.thread = weakref.ref(threading.current_thread())
            self._threads.conn = conn
            with _open_lock:
                _open_connections.append(conn)
        return conn

    def _replace(self, conn: _Connection) -> None:
        """Let go of this thread's broken connection; the next one is new, and authenticates anew. If
        nothing listens at the node's address any more, its process has ended: say so at once rather
        than wait ``connect_timeout`` for a node that will not come back."""
        self._threads.conn = None
        with _open_lock:
            if conn in _open_connections:
                _open_connections.remove(conn)
        if conn.unacked:
            log.warning("roving: the connection to %s broke; what was sent to it without an answer since "
                        "its last answer may not have arrived", self.address)
        try:
            conn.close()
        except (zmq.ZMQError, OSError):
            pass
        if not _listening(self.address):
            raise _gone(self.address)

    def _connect(self, timeout: float) -> _Connection:
        """A stream connection where the node has a stream listener, else ZeroMQ."""
        if self._streams is None:
            zconn = _ZmqConnection(self.address, self._secret, timeout)
            try:
                status, frames = zconn.call(STREAMS, 0, 0, [], timeout)
                self._streams = bytes(frames[0]).decode() if status == OK and frames else ""
            except NodeError:
                self._streams = ""
            if not _node.streams_enabled or not self._streams:
                return zconn
            zconn.close()
        if _node.streams_enabled and self._streams:
            try:
                # ZeroMQ is there to fall back on: a listener that does not take the stream soon is
                # not waited for as long as a node that may still be starting.
                return _StreamConnection(self.address, self._streams, self._secret,
                                         min(timeout, STREAM_OPEN_TIMEOUT))
            except IdentityError:
                raise  # not the node meant: no other way to it is either
            except (OSError, ConnectionError) as exc:
                # The listener lives as long as its node: refused there and at the node's own port, the
                # node has ended (it may have ended after the last connection broke, and that check).
                if isinstance(exc.__cause__ or exc, ConnectionRefusedError) and not _listening(self.address):
                    raise _gone(self.address) from exc
                log.warning("roving: no stream to the node at %s (%s); using ZeroMQ", self.address, exc)
                self._streams = ""
        return _ZmqConnection(self.address, self._secret, timeout)

    def call(self, op: bytes, box_id: int, timeout: float = -1,
             payload: Sequence[Any] = ()) -> Tuple[int, Frames]:
        if self.local is not None:
            flush_sent()
            status, frames = self.local.call_local(op, box_id, timeout, _own(payload))
            return status, frames or []
        conn = self._conn()
        flush_sent(keep=conn)
        # The node answers every wait itself; this guard only catches a node that has gone away.
        wait = timeouts.from_wire(timeout)
        guard = None if wait < 0 else wait + 30.0
        return conn.call(op, box_id, timeout, list(payload), guard)

    def tell(self, op: bytes, box_id: int, payload: Sequence[Any] = ()) -> None:
        if self.local is not None:
            flush_sent()
            status, frames = self.local.call_local(op, box_id, 0, _own(payload))
            if status == ERROR:
                raise NodeError(bytes(frames[0]).decode() if frames else "error")
            return
        conn = self._conn()
        flush_sent(keep=conn)
        conn.send(op, box_id, 0, list(payload))

    def ping(self, timeout: float) -> bool:
        """True when the node answers within ``timeout`` seconds."""
        if self.local is not None:
            return True
        try:
            return self._conn(connect_timeout=timeout).ping(timeout)
        except (NodeError, zmq.ZMQError):
            return False


def _own(payload: Sequence[Any]) -> Sequence[Any]:
    """Out-of-band buffers share memory with the caller's objects; a mailbox of this process keeps a
    copy, so that changing an object after put() does not change what was put (as over a socket).
    The memory of a bytes object cannot change: it is kept as it is."""
    if len(payload) < 2:
        return payload
    return [payload[0], *(frame if is_bytes(frame) else bytearray(frame) for frame in payload[1:])]


_open_connections: List[_Connection] = []
_open_lock = threading.Lock()


def _alive(thread: Optional[threading.Thread]) -> bool:
    return thread is not None and thread.is_alive()


def _close_for_ended_threads() -> None:
    """Close the connections of threads that have ended (a program that starts many short-lived threads
    would otherwise keep one socket per thread), where that cannot lose anything; the others stay for
    the exit flush (close_connections). Never waits."""
    with _open_lock:
        ended = [c for c in _open_connections if not _alive(c.thread()) and c.closes_safely()]
        for conn in ended:
            _open_connections.remove(conn)
    for conn in ended:
        try:
            conn.close()
        except (zmq.ZMQError, OSError):
            pass


_sent = threading.local()  # .conns: this thread's connections that carried a send not yet confirmed


def _unconfirmed() -> List["_Connection"]:
    conns = getattr(_sent, "conns", None)
    if conns is None:
        conns = _sent.conns = []
    return conns


def flush_sent(timeout: float = 30.0, keep: Optional["_Connection"] = None) -> None:
    """Wait until every message the calling thread sent without an answer (a pipe send or queue put
    over the mailboxes) has reached its node, up to ``timeout`` s for each connection; ``keep``, the
    connection about to be used, is not waited for (a node handles one connection's messages in
    order). Every operation another process can observe calls this first — a synchronization
    primitive's, a manager's, and a send or put towards another node — so that a message that
    happens-before another arrives before it, also across writers (causal order, as with
    multiprocessing's one pipe). Costs nothing when the thread's last sends went where it sends now."""
    conns = _unconfirmed()
    if not conns or (len(conns) == 1 and conns[0] is keep):
        return
    for conn in conns:
        if conn is keep or not conn.unacked or conn.pending is not None:
            continue
        if not conn.flush(timeout):
            log.warning("roving: %s did not confirm what this thread sent it within %s s", conn.address,
                        timeout)
    conns[:] = [c for c in conns if c.unacked and c is not keep and not c.broken] + \
        ([keep] if keep is not None and keep.unacked else [])


def abandon(address: str) -> None:
    """The node at ``address`` is known to be gone: what this process sent it without an answer is
    lost, and exit does not wait for it to answer (``close_connections``). A thread of this process
    blocked sending to it returns with ConnectionLost (``_Connection.interrupt``), so that none is left
    inside the transport, on a peer that will never read, when the process exits."""
    with _open_lock:
        conns = [conn for conn in _open_connections if conn.address == address]
    for conn in conns:
        conn.unacked = False
        conn.interrupt()


def _listening(address: str) -> bool:
    """False when nothing listens at a node's TCP address any more (its process has ended): there is
    then nobody to wait for. True when something answers, or when that cannot be told."""
    host, _, port = address.partition("#")[0][len("tcp://"):].rpartition(":")
    if not address.startswith("tcp://") or not port.isdigit():
        return True
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    return True


def close_connections(timeout: float = 10.0) -> None:
    """Close this process's outgoing connections, first making sure that what was sent without an
    answer (puts on unbounded queues, pipe sends) has reached its node — up to ``timeout`` seconds in
    all. A node whose process has ended (nothing listens at its address) is not waited for: what was
    sent to it and not yet taken went with it."""
    deadline = time.monotonic() + timeout
    while True:
        with _open_lock:
            if not _open_connections:
                break
            conn = _open_connections.pop()
        if conn.unacked and conn.pending is None and not _listening(conn.address):
            log.debug("roving: %s has gone; not waiting for it to answer", conn.address)
        elif not conn.flush(max(0.5, deadline - time.monotonic())):
            log.warning("roving: messages to %s may be lost: it did not answer before exit", conn.address)
        try:
            conn.close()
        except zmq.ZMQError:
            pass
