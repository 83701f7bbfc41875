"""Request/answer calls to an object server on some roving node, with liveness checks.

Shared by the synchronization primitives (:mod:`roving.synchronize`), shared ctypes
(:mod:`roving.sharedctypes`), managers (:mod:`roving.managers`) and shared data (:mod:`roving.shared`).
Each of these registers a handler for its own operation on a :class:`~roving.transport.node.Node`
(:meth:`Node.register_handler`) and talks to it over :class:`~roving.transport.channel.Channel`\\ s.

Wire format. Request: ``[op, header(req_id, kind), *payload]``; answer: ``[header(req_id, status),
*frames]``. ``kind`` PING is answered by the server's I/O thread at once, whatever else it is doing: that
is how a caller waiting on a long call (a lock, a ``queue.get()``) tells a slow server from a dead one.

Guarantees:

* :meth:`Caller.collect` never hangs on a server that has gone away: while no answer comes it pings every
  :data:`PING_EVERY` seconds, and when nothing at all has come back for :data:`DEAD_AFTER` seconds it
  raises :class:`ServerGone`; from then on every call to that address raises at once.
* Answers are matched to calls by id, so calls can be collected in any order.
* A connection that breaks while the server lives on (a network drop) is replaced by a new authenticated
  one; each call that was waiting for an answer then raises :class:`ConnectionLost` (it may or may not
  have taken effect), and later calls go over the new connection.
"""
from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from . import node as _node
from . import timeouts
from .channel import Channel
from .endpoint import Secret, flush_sent
from .errors import AuthenticationError, ConnectionLost, IdentityError, ServerGone
from .wire import pack_reply, unpack_reply

log = logging.getLogger(__name__)

REQ = struct.Struct("<QB")
# Request kinds.
CALL, PING, TELL, CALL_CONCURRENT = 0, 1, 2, 3
# Answer statuses (protocols may add their own, > 1).
OK, ERR = 0, 1

PING_EVERY = 1.0
DEAD_AFTER = 5.0

_dead: Set[str] = set()


def mark_dead(address: str) -> None:
    _dead.add(address)


def is_dead(address: str) -> bool:
    """Whether the server at ``address`` was found gone (every call to it now raises at once)."""
    return address in _dead


class Caller:
    """Calls to one server (``op`` on the node at ``address``) over one channel; thread-safe.

    ``alive`` is an optional check of the server's liveness that costs nothing (e.g. the exit code of a
    Process this process started): when it says False, calls raise at once.
    """

    def __init__(self, address: str, secret: Secret, op: bytes, what: str,
                 connect_timeout: float = 30.0, alive: Optional[Callable[[], bool]] = None) -> None:
        self.address, self.op, self.what, self.alive = address, op, what, alive
        self._lock = threading.Lock()
        self._ids = iter(range(1, 1 << 62))
        self._answers: Dict[int, Tuple[int, List[Any]]] = {}
        self._late: Dict[int, Callable[[int, List[Any]], None]] = {}
        self._outstanding: Set[int] = set()  # calls sent, not yet answered
        self._lost: Set[int] = set()  # calls whose connection broke before their answer came
        self._secret, self._connect_timeout = secret, connect_timeout
        self._check()
        try:
            self._chan = Channel(address, secret, connect_timeout)
        except OSError as exc:  # every error of the transport's that a connect raises is one
            if not isinstance(exc, (AuthenticationError, IdentityError)):  # refused is not gone
                mark_dead(address)
            raise self._gone(f"cannot connect: {exc}") from exc
        self._ping_id: Optional[int] = None
        self._ping_sent = 0.0

    def _gone(self, why: str) -> ServerGone:
        return ServerGone(f"{self.what} at {self.address} is gone ({why}); the process that served it has "
                          "ended, so this object can no longer be used")

    def _check(self) -> None:
        if self.address in _dead:
            raise self._gone("it stopped answering earlier")
        if self.alive is not None and not self.alive():
            mark_dead(self.address)
            raise self._gone("its process has exited")

    def submit(self, payload: List[Any], kind: int = CALL) -> int:
        """Send a request; returns its id (TELL: no answer will come). What the calling thread sent
        without an answer before is first confirmed at its nodes (causal order: see flush_sent)."""
        flush_sent()
        self._check()
        with self._lock:
            req_id = next(self._ids)
            if kind != TELL:
                self._outstanding.add(req_id)
            self._chan.send([self.op, REQ.pack(req_id, kind), *payload])
        return req_id

    def tell(self, payload: List[Any]) -> None:
        if self.address in _dead:
            return
        with self._lock:
            self._chan.send([self.op, REQ.pack(0, TELL), *payload])

    def call(self, payload: List[Any], kind: int = CALL,
             on_late: Optional[Callable[[int, List[Any]], None]] = None) -> Tuple[int, List[Any]]:
        req_id = self.submit(payload, kind)
        answer = self.collect(req_id, None, on_late)
        assert answer is not None  # no timeout: an answer, or ConnectionLost
        return answer

    def collect(self, req_id: int, timeout: Optional[float] = None,
                on_late: Optional[Callable[[int, List[Any]], None]] = None) -> Optional[Tuple[int, List[Any]]]:
        """The answer to ``req_id``; None if it does not come within ``timeout`` seconds (None: forever).

        If the wait is interrupted (KeyboardInterrupt...), an answer that arrives later is passed to
        ``on_late`` (e.g. to give back a lock granted to a caller that left).
        """
        deadline = timeouts.deadline(timeout)
        try:
            while True:
                answer = self._answers.pop(req_id, None)
                if answer is not None:
                    return answer
                if req_id in self._lost:
                    self._lost.discard(req_id)
                    raise ConnectionLost(f"the connection to {self.what} at {self.address} broke before "
                                         "this call's answer came (a network drop?): it may or may not have "
                                         "taken effect; later calls use a new connection")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if not self._lock.acquire(timeout=-1 if left is None else left):
                    return None
                try:
                    if req_id in self._answers:
                        continue
                    self._receive(PING_EVERY if left is None else min(left, PING_EVERY))
                finally:
                    self._lock.release()
        except BaseException as exc:
            if on_late is not None and req_id not in self._answers and not isinstance(exc, ServerGone):
                self._late[req_id] = on_late
            raise

    def _receive(self, slice_s: float) -> None:
        """Read at most one answer, waiting up to ``slice_s`` seconds (lock held); ping when silent."""
        self._check()
        try:
            frames = self._chan.recv(slice_s)
        except ConnectionLost:
            self._reconnect()
            return
        now = time.monotonic()
        if frames is None:
            if self._ping_id is None:
                self._ping_id, self._ping_sent = next(self._ids), now
                self._chan.send([self.op, REQ.pack(self._ping_id, PING)])
            elif now - self._ping_sent >= DEAD_AFTER:
                mark_dead(self.address)
                raise self._gone(f"no answer to a ping for {DEAD_AFTER:g} s")
            return
        got, status = unpack_reply(frames[0].bytes)
        if self._ping_id is not None:
            # Anything from the server shows it alive; the ping's own answer may still come.
            self._ping_sent = now
        if got == self._ping_id:
            self._ping_id = None
            return
        self._outstanding.discard(got)
        late = self._late.pop(got, None)
        if late is not None:
            try:
                late(status, frames[1:])
            except Exception:
                log.exception("roving: could not undo a call that was abandoned")
            return
        self._answers[got] = (status, frames[1:])

    def _reconnect(self) -> None:
        """The channel broke with the server still there (lock held): every call still waiting for an
        answer is lost; later ones go over a new channel."""
        log.warning("roving: the connection to %s at %s broke; reconnecting", self.what, self.address)
        self._chan.close(0)
        self._lost |= self._outstanding
        self._outstanding.clear()
        for req_id in list(self._late):
            if req_id in self._lost:  # nothing will come back to undo
                del self._late[req_id]
                self._lost.discard(req_id)
        self._ping_id = None
        try:
            self._chan = Channel(self.address, self._secret, self._connect_timeout)
        except OSError as exc:
            mark_dead(self.address)
            raise self._gone(f"cannot reconnect: {exc}") from exc

    def close(self) -> None:
        self._chan.close(0)


class Server:
    """The server side: routes a node's ``op`` messages to :meth:`serve` and answers pings."""

    def __init__(self, node: "_node.Node", op: bytes) -> None:
        self.node, self.op = node, op
        node.register_handler(op, self._on_message)

    def _on_message(self, ident: bytes, frames: List[Any]) -> None:
        req_id, kind = REQ.unpack(frames[0].bytes)
        if kind == PING:
            self.node.send_to(ident, [pack_reply(req_id, OK)])
            return
        self.serve(ident, req_id, kind, frames[1:])

    def serve(self, ident: bytes, req_id: int, kind: int, frames: List[Any]) -> None:
        raise NotImplementedError

    def answer(self, ident: bytes, req_id: int, status: int, frames: Sequence[Any] = (),
               undeliverable: Optional[Callable[[], None]] = None) -> None:
        """Answer a request; ``undeliverable()`` runs if the asker's process has gone."""
        self.node.send_to(ident, [pack_reply(req_id, status), *frames], undeliverable)
