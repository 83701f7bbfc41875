"""A process's endpoint on the transport, and the way to reach other processes' endpoints.

Every roving process that creates a queue or a pipe runs one :class:`Node`: a ZeroMQ ROUTER socket bound
to the backend's address (loopback for the local backend), served by one I/O thread. The mailboxes of the
queues and pipes created in that process live there; other processes reach them with requests over
authenticated connections (:class:`Endpoint`). Inside the owning process the same operations run
directly on the mailboxes, without sockets.

A client first asks the node over ZeroMQ where its stream listener is (STREAMS), then sends its requests
over a stream of its own (:mod:`roving.transport.stream`), which the same I/O thread serves: same
requests, same answers, fewer thread hand-offs. ZeroMQ stays for other protocols (the pool's, locks',
managers') and for nodes that offer no streams.

Guarantees:

* A connection is mutually authenticated (:mod:`roving.transport.auth`) before the node reads any frame
  it would store for unpickling; frames from a peer that has not authenticated are dropped and logged.
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
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import zmq

from . import auth
from . import stream as _stream
from .mailbox import EMPTY, EOF, ERROR, FULL, OK, LocalWaiter, Mailbox, Waiter  # noqa: F401 (EOF: for callers)

log = logging.getLogger(__name__)

Frames = List[Any]

# Operations. One byte each; the header is (box id, request id, timeout in seconds, -1 = forever).
PUT, PUT_NOREPLY, GET, POLL, SIZE, TASK_DONE, JOIN, HOLD, RELEASE, PUT_FRONT, PING = (
    bytes([c]) for c in b"PpGLSTJHRFI"
)
# Pipe ends that talk over a direct stream (roving.transport.link): who uses which end, and the gate
# that keeps a direction's readers in order while a stream is taken down.
CLAIM, UNCLAIM, GATE, INSERT, UNGATE = (bytes([c]) for c in b"CUgiu")
# Asks a node where its stream listener is (roving.transport.stream): requests then go over a stream.
STREAMS = b"W"
_REQUEST, _ANSWER = b"Q", b"A"  # stream message kinds
_HEADER = struct.Struct("<QQd")
_REPLY = struct.Struct("<Qb")
# Operations sent without waiting for an answer.
NO_REPLY = frozenset({PUT_NOREPLY, HOLD, RELEASE, PUT_FRONT, INSERT, UNGATE})
# Statuses a timed-out wait is answered with.
_TIMEOUT_STATUS = {PUT: FULL, GET: EMPTY, POLL: EMPTY, JOIN: EMPTY}

_HELLO, _CHALLENGE, _PROOF, _WELCOME, _DENIED = b"hello", b"challenge", b"proof", b"welcome", b"denied"
_MAX_PENDING_HANDSHAKES = 1024
_LINGER_MS = 10_000


_COPY_BELOW = 65536  # frames smaller than this are copied into ZeroMQ: cheaper than tracking them


def send_frames(sock: zmq.Socket, frames: Frames) -> None:
    """Send a multipart message: small frames copied, large ones and received Frames without a copy.

    Several times cheaper than ``send_multipart`` for small messages, which matters on the hot path.
    The caller must not change a large frame's buffer until ZeroMQ has sent it (see ``_Connection.send``).
    """
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        flags = zmq.SNDMORE if i < last else 0
        if type(frame) is bytes:
            sock.send(frame, flags)
        else:
            sock.send(frame, flags, copy=_nbytes(frame) < _COPY_BELOW)


def _nbytes(frame: Any) -> int:
    if type(frame) is memoryview:
        return frame.nbytes
    return len(frame)  # bytes, bytearray, zmq.Frame


class TransportError(OSError):
    """A node could not be reached or answered with an error."""


def _context() -> zmq.Context:
    return zmq.Context.instance()


class _RemoteWaiter(Waiter):
    __slots__ = ("node", "ident", "req_id", "box_id")

    def __init__(self, node: "Node", ident: bytes, req_id: int, box_id: int) -> None:
        super().__init__()
        self.node, self.ident, self.req_id, self.box_id = node, ident, req_id, box_id

    def fulfil(self, status: int, frames: Optional[Frames] = None) -> None:
        self.done = True
        undeliverable = None
        if status == OK and frames:
            # An item handed to a reader whose process has gone goes back to the front of its mailbox.
            undeliverable = functools.partial(self.node._put_back, self.box_id, frames)
        self.node._post([self.ident, _REPLY.pack(self.req_id, status), *(frames or ())], undeliverable)


class _StreamWaiter(Waiter):
    __slots__ = ("node", "peer", "req_id", "box_id")

    def __init__(self, node: "Node", peer: _stream.ServedStream, req_id: int, box_id: int) -> None:
        super().__init__()
        self.node, self.peer, self.req_id, self.box_id = node, peer, req_id, box_id

    def fulfil(self, status: int, frames: Optional[Frames] = None) -> None:
        self.done = True
        undeliverable = None
        if status == OK and frames:
            undeliverable = functools.partial(self.node._put_back, self.box_id, frames)
        if not self.peer.write(_ANSWER, [_REPLY.pack(self.req_id, status), *(frames or ())], undeliverable) \
                and undeliverable is not None:
            self.node._defer(undeliverable)


class Node:
    """The endpoint of this process: mailboxes plus the ROUTER socket and I/O thread that serve them."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", advertise: Optional[str] = None) -> None:
        self.secret = secret
        self.lock = threading.Lock()
        self.boxes: Dict[int, Mailbox] = {}
        self._ids = itertools.count(1)
        self._handlers: Dict[bytes, Callable[[bytes, Frames], None]] = {}
        ctx = _context()
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # Sending to a peer that has gone raises instead of dropping silently, so no item is lost there;
        # no high-water mark, so that the I/O thread never blocks on a slow peer (requests bound the load).
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDHWM, 0)
        port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{advertise or host}:{port}"
        self.host, self.advertise = host, advertise
        # Pipe ends claimed for a direct stream: (inbox or 0, outbox or 0) -> the claim (a dict).
        self.claims: Dict[Tuple[int, int], dict] = {}
        # Other threads wake the I/O thread through a pipe: one system call, no ZeroMQ socket per thread.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_pending = False
        self._outbox: "collections.deque[Frames]" = collections.deque()
        self._deadlines: List[Tuple[float, int, int, Waiter, int]] = []
        self._seq = itertools.count()
        self._authenticated: set = set()
        self._handshakes: "collections.OrderedDict[bytes, Tuple[bytes, bytes]]" = collections.OrderedDict()
        self._at_close: List[Callable[[], None]] = []
        self._undeliverable: List[Callable[[], None]] = []
        self._services: Dict[str, Any] = {}
        self._services_lock = threading.Lock()
        # Streams (roving.transport.stream) that processes opened to this node, served by the I/O thread.
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._peers: Dict[int, _stream.ServedStream] = {}
        self._adopted: "collections.deque[_stream.Stream]" = collections.deque()
        self._writable: "collections.deque[_stream.ServedStream]" = collections.deque()
        self._purposes: Dict[str, Callable[[dict, _stream.Stream], bool]] = {}
        self._notices: Dict[bytes, Callable[[Frames], None]] = {}
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="roving-node", daemon=True)
        self._thread.start()

    # -- mailboxes ---------------------------------------------------------------------------
    def new_box(self, maxsize: int = 0, track_writers: bool = False) -> int:
        with self.lock:
            box_id = next(self._ids)
            self.boxes[box_id] = Mailbox(maxsize, track_writers)
            return box_id

    def drop_box(self, box_id: int) -> None:
        with self.lock:
            self.boxes.pop(box_id, None)

    def register_handler(self, op: bytes, handler: Callable[[bytes, Frames], None]) -> None:
        """Route authenticated messages whose first frame is ``op`` to ``handler(ident, frames)``.

        The handler runs on the I/O thread and must not block; it answers with :meth:`send_to`.
        """
        self._handlers[op] = handler

    def send_to(self, ident: bytes, frames: Frames,
                undeliverable: Optional[Callable[[], None]] = None) -> None:
        """Send ``frames`` to an authenticated peer; thread-safe.

        If the peer has gone, ``undeliverable()`` runs on the I/O thread, outside every lock, so that
        what the message handed over (an item, a lock) can be taken back.
        """
        self._post([ident, *frames], undeliverable)

    def register_notice(self, op: bytes, handler: Callable[[Frames], None]) -> None:
        """Route messages ``op`` sent with :meth:`Endpoint.tell` (no answer) to ``handler(payload)``,
        on the I/O thread: it must not block."""
        self._notices[op] = handler

    def streams(self) -> _stream.Listener:
        """This process's stream listener, started on first use."""
        return self.service("streams", lambda node: _stream.Listener(
            node.secret, node.host, node.advertise, node._on_stream))

    def register_stream_purpose(self, purpose: str, handler: Callable[[dict, _stream.Stream], bool]) -> None:
        """Hand streams opened with ``{"purpose": purpose, ...}`` to ``handler`` (see stream.Listener)."""
        self._purposes[purpose] = handler

    def _on_stream(self, request: dict, stream: _stream.Stream) -> bool:
        purpose = request.get("purpose")
        if purpose == "node":
            _stream.accept(stream)
            self._adopted.append(stream)
            self._wake()
            return True
        handler = self._purposes.get(str(purpose))
        return handler is not None and handler(request, stream)

    def _want_write(self, peer: _stream.ServedStream) -> None:
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

    def release_everywhere(self, key: Any) -> None:
        """Forget every pipe end that ``key`` (a process that ended) held, claimed or gated here."""
        uid = key.decode() if isinstance(key, bytes) else key
        with self.lock:
            for end in [e for e, c in self.claims.items() if c.get("uid") == uid]:
                del self.claims[end]
            for box in self.boxes.values():
                if box.gates:
                    box.open_gates_of(uid)
                if box.track_writers and key in box.writers:
                    box.release(key, all_holds=True)

    def _claim(self, request: dict) -> dict:
        """A process is about to use a pipe end (``request["end"]``: its inbox and outbox, 0 for none).

        The first process to claim an end has it until it unclaims it; another one is told "no" (two
        processes using one end at once keep to the mailboxes). When the other end is claimed by
        another process, the answer names it ("go"): the claimant opens a stream to it.
        """
        inbox, outbox = (int(x) for x in request["end"])
        uid = str(request["uid"])
        held = self.claims.get((inbox, outbox))
        if held is not None and held["uid"] != uid:
            return {"answer": "no"}
        self.claims[(inbox, outbox)] = {"uid": uid, "stream": request.get("stream"),
                                         "node": request.get("node")}
        peer = self.claims.get((outbox, inbox))
        if peer is not None and peer["uid"] != uid and peer.get("stream"):
            return {"answer": "go", "stream": peer["stream"], "node": peer["node"]}
        return {"answer": "wait"}

    # -- operations, shared by local callers and the I/O thread (lock held) --------------------
    def dispatch(self, op: bytes, box_id: int, timeout: float, payload: Frames,
                 waiter: Waiter) -> Tuple[int, Optional[Frames]]:
        """Run one operation. Returns (status, frames), or (-1, None) when ``waiter`` now waits."""
        box = self.boxes.get(box_id)
        if box is None:
            return ERROR, [b"no such queue or pipe here: the process that created it has closed it"]
        blocking = timeout != 0
        if op == GET:
            return box.get(waiter if blocking else None)
        if op in (PUT, PUT_NOREPLY):
            if op == PUT_NOREPLY and box.full():
                # Only unbounded mailboxes are written without a reply; keep the item regardless.
                box.items.append(payload)
                box.unfinished += 1
                return OK, None
            return box.put(payload, waiter if blocking else None), None
        if op == POLL:
            return box.poll(waiter if blocking else None), None
        if op == SIZE:
            return OK, [struct.pack("<QQ", len(box.items) + len(box.putters), box.unfinished)]
        if op == TASK_DONE:
            status = box.task_done()
            return status, [b"task_done() called too many times"] if status == ERROR else None
        if op == JOIN:
            return box.join(waiter if blocking else None), None
        if op == PUT_FRONT:
            box.put_front(payload)
            return OK, None
        if op == HOLD:
            box.hold(bytes(payload[0]))
            return OK, None
        if op == CLAIM:
            return OK, [json.dumps(self._claim(json.loads(bytes(payload[0])))).encode()]
        if op == UNCLAIM:
            request = json.loads(bytes(payload[0]))
            end = tuple(int(x) for x in request["end"])
            if self.claims.get(end, {}).get("uid") == request["uid"]:
                del self.claims[end]
            return OK, None
        if op == GATE:
            box.close_gate(bytes(payload[0]), bytes(payload[1]).decode(), bytes(payload[2]) == b"1")
            return OK, None
        if op == INSERT:
            box.insert_at_gate(bytes(payload[0]), list(payload[1:]))
            return OK, None
        if op == UNGATE:
            box.open_gate(bytes(payload[0]))
            return OK, None
        if op == RELEASE:
            box.release(bytes(payload[0]))
            return OK, None
        return ERROR, [b"unknown operation"]

    def call_local(self, op: bytes, box_id: int, timeout: float,
                   payload: Frames = ()) -> Tuple[int, Optional[Frames]]:
        """Run an operation from a thread of this process, waiting up to ``timeout`` (-1: forever)."""
        waiter = LocalWaiter()
        with self.lock:
            status, frames = self.dispatch(op, box_id, timeout, list(payload), waiter)
        if status != -1:
            return status, frames
        if not waiter.wait(-1 if timeout < 0 else timeout):
            with self.lock:
                box = self.boxes.get(box_id)
                if box is not None:
                    box.cancel(waiter, _TIMEOUT_STATUS.get(op, EMPTY))
                elif not waiter.done:
                    waiter.fulfil(ERROR, [b"closed while waiting"])
        return waiter.status, waiter.frames

    # -- I/O thread --------------------------------------------------------------------------
    def _post(self, frames: Frames, undeliverable: Optional[Callable[[], None]] = None) -> None:
        """Send ``frames`` (thread-safe); see :meth:`send_to` for ``undeliverable``."""
        if threading.get_ident() == self._thread.ident:
            self._send(frames, undeliverable)
            return
        self._outbox.append((frames, undeliverable))
        self._wake()

    def _send(self, frames: Frames, undeliverable: Optional[Callable[[], None]] = None) -> None:
        try:
            send_frames(self._router, frames)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.debug("roving node: a peer left before its answer")
            if undeliverable is not None:
                # Run later, on this thread and outside every lock: the sender may hold its own.
                self._undeliverable.append(undeliverable)

    def _put_back(self, box_id: int, frames: Frames) -> None:
        with self.lock:
            box = self.boxes.get(box_id)
            if box is not None:
                box.put_front(frames)

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
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def _serve(self) -> None:
        poller, router, wake = self._poller, self._router, self._wake_r
        while self._running:
            timeout_ms = None
            if self._deadlines:
                timeout_ms = max(0.0, (self._deadlines[0][0] - time.monotonic()) * 1000)
            try:
                ready = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                if not self._running:
                    return
                raise
            if wake in ready:
                self._wake_pending = False
                try:
                    os.read(wake, 4096)
                except BlockingIOError:
                    pass
            while self._adopted:
                peer = _stream.ServedStream(self._adopted.popleft(), self._want_write)
                self._peers[peer.fd] = peer
                poller.register(peer.fd, zmq.POLLIN)
            self._flush_outbox()
            if router in ready:
                for _ in range(256):
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._handle(frames)
                    except Exception:  # a bad message must never stop the node
                        log.exception("roving node: dropped a message that could not be handled")
                self._flush_outbox()
            for fd, events in ready.items():
                peer = self._peers.get(fd) if type(fd) is int else None
                if peer is not None:
                    self._serve_peer(peer, events)
            while self._writable:
                peer = self._writable.popleft()
                if self._peers.get(peer.fd) is peer:
                    poller.modify(peer.fd, zmq.POLLIN | (zmq.POLLOUT if peer.pending else 0))
            if self._deadlines:
                self._expire()
            if self._undeliverable:
                self._run_undeliverable()
                self._flush_outbox()

    def _serve_peer(self, peer: _stream.ServedStream, events: int) -> None:
        if events & zmq.POLLOUT:
            peer.flush()
            if not peer.pending:
                self._poller.modify(peer.fd, zmq.POLLIN)
        if not events & (zmq.POLLIN | zmq.POLLERR):
            return
        messages, ended = peer.pump()
        for kind, frames in messages:
            try:
                if kind != _REQUEST or len(frames) < 2:
                    raise ValueError(f"unexpected stream message {kind!r}")
                self._request(bytes(frames[0]), frames[1], frames[2:],
                              lambda req_id, box_id: _StreamWaiter(self, peer, req_id, box_id),
                              lambda out, undeliverable: peer.write(_ANSWER, out, undeliverable)
                              or (undeliverable is not None and self._defer(undeliverable)))
            except ValueError as exc:
                log.warning("roving node: dropped a malformed stream message: %s", exc)
            except Exception:  # a bad message must never stop the node
                log.exception("roving node: dropped a stream message that could not be handled")
        if ended or peer.closed:
            self._poller.unregister(peer.fd)
            del self._peers[peer.fd]
            self._undeliverable.extend(peer.drop())

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, _, box_id, waiter, status = heapq.heappop(self._deadlines)
                box = self.boxes.get(box_id)
                if box is not None:
                    box.cancel(waiter, status)

    def _handle(self, frames: List[zmq.Frame]) -> None:
        ident = frames[0].bytes
        if ident not in self._authenticated:
            self._handshake(ident, frames[1:])
            return
        op = frames[1].bytes
        handler = self._handlers.get(op)
        if handler is not None:
            handler(ident, frames[2:])
            return
        if len(frames) < 3:
            log.warning("roving node: malformed request from an authenticated peer dropped")
            return
        self._request(op, frames[2].bytes, frames[3:],
                      lambda req_id, box_id: _RemoteWaiter(self, ident, req_id, box_id),
                      lambda out, undeliverable: self._send([ident, *out], undeliverable))

    def _request(self, op: bytes, header: Any, payload: Frames,
                 waiter_for: Callable[[int, int], Waiter],
                 answer: Callable[[Frames, Optional[Callable[[], None]]], Any]) -> None:
        """Serve one request of an authenticated peer (over ZeroMQ or a stream alike)."""
        if len(header) != _HEADER.size:
            log.warning("roving node: malformed request from an authenticated peer dropped")
            return
        box_id, req_id, timeout = _HEADER.unpack(header)
        if op == PING:
            answer([_REPLY.pack(req_id, OK)], None)
            return
        if op == STREAMS:
            address = self.streams().address if streams_enabled else ""
            answer([_REPLY.pack(req_id, OK), address.encode()], None)
            return
        notice = self._notices.get(op)
        if notice is not None:
            notice(payload)
            return
        waiter = waiter_for(req_id, box_id)
        with self.lock:
            status, out = self.dispatch(op, box_id, timeout, payload, waiter)
            if status == -1:
                if timeout > 0:
                    heapq.heappush(self._deadlines, (time.monotonic() + timeout, next(self._seq), box_id,
                                                     waiter, _TIMEOUT_STATUS.get(op, EMPTY)))
                return
        if op not in NO_REPLY:
            item = None
            if op == GET and status == OK and out:
                item = functools.partial(self._put_back, box_id, out)
            answer([_REPLY.pack(req_id, status), *(out or ())], item)
        elif status == ERROR:
            log.warning("roving node: %s", bytes(out[0]).decode() if out else "error")

    def _handshake(self, ident: bytes, frames: List[zmq.Frame]) -> None:
        kind = frames[0].bytes if frames else b""
        if kind == _HELLO and len(frames) == 2 and len(frames[1]) == auth.NONCE_BYTES:
            client_nonce, server_nonce = frames[1].bytes, auth.new_nonce()
            self._handshakes[ident] = (client_nonce, server_nonce)
            while len(self._handshakes) > _MAX_PENDING_HANDSHAKES:
                self._handshakes.popitem(last=False)
            proof = auth.server_proof(self.secret, client_nonce, server_nonce)
            self._send([ident, _CHALLENGE, server_nonce, proof])
            return
        if kind == _PROOF and len(frames) == 2 and ident in self._handshakes:
            client_nonce, server_nonce = self._handshakes.pop(ident)
            if auth.verify(auth.client_proof(self.secret, client_nonce, server_nonce), frames[1].bytes):
                self._authenticated.add(ident)
                self._send([ident, _WELCOME])
                return
            log.warning("roving node %s: a peer failed authentication; it is ignored", self.address)
            self._send([ident, _DENIED])
            return
        log.warning("roving node %s: dropped %d frame(s) from a peer that has not authenticated",
                    self.address, len(frames))

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
            self._router.close(0)
            os.close(self._wake_r)
            os.close(self._wake_w)


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

    def _transmit(self, frames: Frames) -> None:
        raise NotImplementedError

    def _recv(self, timeout: Optional[float], what: str) -> List[Any]:
        raise NotImplementedError

    def send(self, op: bytes, box_id: int, timeout: float, payload: Frames) -> int:
        req_id = next(self._ids)
        if op in NO_REPLY:
            self.unacked = True
        self._transmit([op, _HEADER.pack(box_id, req_id, timeout), *payload])
        return req_id

    def call(self, op: bytes, box_id: int, timeout: float, payload: Frames,
             guard: Optional[float]) -> Tuple[int, Frames]:
        self.settle()
        req_id = self.send(op, box_id, timeout, payload)
        self.pending = (req_id, op, box_id)
        while True:
            frames = self._recv(guard, "answer")
            got, status = _REPLY.unpack(frames[0])
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
            except TransportError:
                return False
            got, status = _REPLY.unpack(frames[0])
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
            except TransportError:
                return
            got, status = _REPLY.unpack(frames[0])
            self._stale(got, status, frames[1:])

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

    def __init__(self, address: str, secret: bytes, connect_timeout: float) -> None:
        super().__init__()
        self.address = address
        self.sock = _context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self.sock.connect(address)
        try:
            self._authenticate(secret, connect_timeout)
        except BaseException:
            self.sock.close(0)
            raise

    def _authenticate(self, secret: bytes, timeout: float) -> None:
        client_nonce = auth.new_nonce()
        self.sock.send_multipart([_HELLO, client_nonce])
        frames = self._recv(timeout, "authentication challenge", copy=True)
        if len(frames) != 3 or frames[0] != _CHALLENGE or not auth.verify(
                auth.server_proof(secret, client_nonce, frames[1]), frames[2]):
            raise auth.AuthenticationError(f"the roving node at {self.address} failed to authenticate")
        self.sock.send_multipart([_PROOF, auth.client_proof(secret, client_nonce, frames[1])])
        frames = self._recv(timeout, "authentication result", copy=True)
        if frames[:1] != [_WELCOME]:
            raise auth.AuthenticationError(f"the roving node at {self.address} refused this process's "
                                           "secret: is it part of the same roving session?")

    def _recv(self, timeout: Optional[float], what: str, copy: bool = False) -> List[Any]:
        if timeout is not None and not self.sock.poll(timeout * 1000):
            raise TransportError(f"no {what} from the roving node at {self.address} within {timeout:g} s "
                                 "(has the process that owns it exited?)")
        return self.sock.recv_multipart(copy=copy)

    def _transmit(self, frames: Frames) -> None:
        if any(_nbytes(f) >= _COPY_BELOW for f in frames):
            tracker = self.sock.send_multipart(frames, copy=False, track=True)
            # The caller may reuse its buffers once send() returns: wait until ZeroMQ is done with them.
            tracker.wait()
        else:
            send_frames(self.sock, frames)

    def close(self) -> None:
        self.sock.close()


class _StreamConnection(_Connection):
    """Over a stream to the node's stream listener, read and written by the calling thread."""

    def __init__(self, address: str, stream_address: str, secret: bytes, connect_timeout: float) -> None:
        super().__init__()
        self.address = address
        self.stream = _stream.connect(stream_address, secret, {"purpose": "node"}, connect_timeout)

    def _transmit(self, frames: Frames) -> None:
        try:
            self.stream.send(_REQUEST, frames)
        except OSError as exc:
            raise TransportError(f"the roving node at {self.address} closed the connection: {exc}") from exc

    def _recv(self, timeout: Optional[float], what: str) -> List[Any]:
        if timeout is not None and not self.stream.readable(timeout):
            raise TransportError(f"no {what} from the roving node at {self.address} within {timeout:g} s "
                                 "(has the process that owns it exited?)")
        try:
            return self.stream.recv()[1]
        except EOFError as exc:
            raise TransportError(f"the roving node at {self.address} closed the connection "
                                 "(has the process that owns it exited?)") from exc

    def close(self) -> None:
        self.stream.close()


class Channel:
    """An authenticated DEALER connection to a node, for a protocol of one's own (the pool uses it).

    ``send([op, *frames])`` reaches the handler the node registered for ``op``
    (:meth:`Node.register_handler`); what that handler sends back with :meth:`Node.send_to` is what
    :meth:`recv` returns. Messages each way arrive in the order sent. Not thread-safe: one thread, one
    channel. Raises :class:`TransportError` or ``AuthenticationError`` when it cannot connect within
    ``connect_timeout`` seconds.
    """

    def __init__(self, address: str, secret: bytes, connect_timeout: float = 30.0) -> None:
        self.address = address
        self._sock = _ZmqConnection(address, secret, connect_timeout).sock

    def send(self, frames: Frames) -> None:
        """Queue a message; the frames' buffers must not change until the channel is closed."""
        send_frames(self._sock, frames)

    def recv(self, timeout: Optional[float]) -> Optional[Frames]:
        """The next message (a list of zmq.Frame), or None when none comes within ``timeout`` s."""
        if timeout is not None and not self._sock.poll(max(0.0, timeout) * 1000):
            return None
        return self._sock.recv_multipart(copy=False)

    def close(self, linger: float = 10.0) -> None:
        """Close, waiting up to ``linger`` seconds for queued messages to leave."""
        self._sock.close(int(linger * 1000))


class Endpoint:
    """How this process reaches the mailboxes at one node address; local or remote alike.

    ``call`` blocks up to ``timeout`` seconds (-1: forever, 0: not at all) and returns (status, frames);
    ``tell`` sends an operation that needs no answer.
    """

    def __init__(self, address: str, secret: bytes, local: Optional[Node],
                 connect_timeout: float = 30.0) -> None:
        self.address = address
        self.local = local
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._threads = threading.local()
        self._streams: Optional[str] = None  # the node's stream listener; "" when there is none

    def _conn(self, connect_timeout: Optional[float] = None) -> _Connection:
        conn = getattr(self._threads, "conn", None)
        if conn is None:
            conn = self._connect(connect_timeout or self._connect_timeout)
            self._threads.conn = conn
            _open_connections.append(conn)
        return conn

    def _connect(self, timeout: float) -> _Connection:
        """A stream connection where the node has a stream listener, else ZeroMQ."""
        if self._streams is None:
            zconn = _ZmqConnection(self.address, self._secret, timeout)
            try:
                status, frames = zconn.call(STREAMS, 0, 0, [], timeout)
                self._streams = bytes(frames[0]).decode() if status == OK and frames else ""
            except TransportError:
                self._streams = ""
            if not streams_enabled or not self._streams:
                return zconn
            zconn.close()
        if streams_enabled and self._streams:
            try:
                return _StreamConnection(self.address, self._streams, self._secret, timeout)
            except (OSError, ConnectionError) as exc:
                log.warning("roving: no stream to the node at %s (%s); using ZeroMQ", self.address, exc)
                self._streams = ""
        return _ZmqConnection(self.address, self._secret, timeout)

    def call(self, op: bytes, box_id: int, timeout: float = -1,
             payload: Frames = ()) -> Tuple[int, Frames]:
        if self.local is not None:
            status, frames = self.local.call_local(op, box_id, timeout, _own(payload))
            return status, frames or []
        conn = self._conn()
        # The node answers every wait itself; this guard only catches a node that has gone away.
        guard = None if timeout < 0 else timeout + 30.0
        return conn.call(op, box_id, timeout, list(payload), guard)

    def tell(self, op: bytes, box_id: int, payload: Frames = ()) -> None:
        if self.local is not None:
            status, frames = self.local.call_local(op, box_id, 0, _own(payload))
            if status == ERROR:
                raise TransportError(bytes(frames[0]).decode() if frames else "error")
            return
        self._conn().send(op, box_id, 0, list(payload))

    def ping(self, timeout: float) -> bool:
        """True when the node answers within ``timeout`` seconds."""
        if self.local is not None:
            return True
        try:
            return self._conn(connect_timeout=timeout).ping(timeout)
        except (TransportError, zmq.ZMQError):
            return False


#: Set to False (before anything else is set up) to serve and send every request over ZeroMQ: other
#: processes of the session then do too (benchmarks compare both ways).
streams_enabled = True


def _own(payload: Frames) -> Frames:
    """Out-of-band buffers share memory with the caller's objects; a mailbox of this process keeps a
    copy, so that changing an object after put() does not change what was put (as over a socket).
    The memory of a bytes object cannot change: it is kept as it is."""
    if len(payload) < 2:
        return payload
    return [payload[0], *(frame if _stream._is_bytes(frame) else bytearray(frame) for frame in payload[1:])]


_open_connections: List[_Connection] = []


def abandon(address: str) -> None:
    """The node at ``address`` is known to be gone: what this process sent it without an answer is
    lost, and exit does not wait for it to answer (``close_connections``)."""
    for conn in list(_open_connections):
        if conn.address == address:
            conn.unacked = False


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
    while _open_connections:
        conn = _open_connections.pop()
        if conn.unacked and conn.pending is None and not _listening(conn.address):
            log.debug("roving: %s has gone; not waiting for it to answer", conn.address)
        elif not conn.flush(max(0.5, deadline - time.monotonic())):
            log.warning("roving: messages to %s may be lost: it did not answer before exit", conn.address)
        try:
            conn.close()
        except zmq.ZMQError:
            pass
