"""A node's mailboxes and the operations on them, without sockets (:class:`Boxes`).

:class:`roving.transport.node.Node` serves them to other processes; threads of the owning process call
:meth:`Boxes.call_local` directly. Both run every operation through :meth:`Boxes.dispatch` under
:attr:`Boxes.lock`, so a mailbox behaves the same whoever uses it. The operations are
:mod:`.wire`'s; the mailbox semantics (waiting readers and writers, gates, writers held) are
:mod:`.mailbox`'s. This module also keeps the claims of pipe ends that talk over a direct stream
(:mod:`.link`), and the waiter of another process's request (:class:`RemoteWaiter`).
"""
from __future__ import annotations

import functools
import itertools
import json
import threading
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, cast

from . import timeouts
from .identity import Peer
from .mailbox import EMPTY, ERROR, FULL, OK, SHARED, Access, LocalWaiter, Mailbox, Waiter
from .wire import (CLAIM, GATE, GET, HOLD, INSERT, JOIN, POLL, PUT, PUT_FRONT, PUT_NOREPLY, RELEASE, SIZE,
                   TASK_DONE, UNCLAIM, UNGATE, Frames, Sizes, pack_reply, pack_sizes)

#: Statuses a timed-out wait is answered with.
TIMEOUT_STATUS = {PUT: FULL, GET: EMPTY, POLL: EMPTY, JOIN: EMPTY}


#: What an untrusted member may do to a mailbox open to it (:class:`.mailbox.Access`).
_UNTRUSTED_OPS = frozenset((PUT, PUT_NOREPLY, SIZE))
#: Answer to an operation the peer may not make: the same whether or not the mailbox exists.
_REFUSED = b"no such queue or pipe here, or not one this process may use"


class Boxes:
    """The mailboxes of one node, by id, and the pipe-end claims made there; thread-safe.

    Access (:class:`.mailbox.Access`): every operation of another process names the peer its
    connection authenticated (:meth:`dispatch`'s ``peer``); a mailbox with an ``owner`` serves that
    process alone, an untrusted peer may only put into (and size) a mailbox open to untrusted writers
    or use one it owns, and is refused everything else with one answer that does not tell whether
    the mailbox exists. Items put into a stamped mailbox begin with their writer's node id.
    """

    def __init__(self, node_id: str = "") -> None:
        #: The node id a local put is stamped with (this process's).
        self.node_id = node_id
        self.lock = threading.Lock()
        self.boxes: Dict[int, Mailbox] = {}
        self._ids = itertools.count(1)
        # Pipe ends claimed for a direct stream: (inbox or 0, outbox or 0) -> the claim (a dict).
        self.claims: Dict[Tuple[int, int], dict] = {}

    def new_box(self, maxsize: int = 0, track_writers: bool = False, access: Access = SHARED) -> int:
        with self.lock:
            box_id = next(self._ids)
            self.boxes[box_id] = Mailbox(maxsize, track_writers, access)
            return box_id

    def overflowed(self, box_id: int) -> Dict[str, int]:
        """The untrusted writers whose items a mailbox refused for its bound (:class:`.mailbox.Access`),
        with how many; taken (the count starts again)."""
        with self.lock:
            box = self.boxes.get(box_id)
            if box is None:
                return {}
            taken, box.overflowed = box.overflowed, {}
            return taken

    def items_in(self, box_id: int) -> int:
        """How many items a mailbox holds now (0 when there is no such mailbox)."""
        with self.lock:
            box = self.boxes.get(box_id)
            return len(box.items) if box is not None else 0

    def drop_box(self, box_id: int) -> None:
        with self.lock:
            self.boxes.pop(box_id, None)

    def release_everywhere(self, key: bytes) -> None:
        """Forget every pipe end that ``key`` (a process that ended: its uid) held, claimed or gated here."""
        uid = key.decode()
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
            # Its holder must stop writing to its stream before this claimant writes to the mailbox.
            return {"answer": "no", "holder": held.get("node")}
        self.claims[(inbox, outbox)] = {"uid": uid, "stream": request.get("stream"),
                                         "node": request.get("node")}
        peer = self.claims.get((outbox, inbox))
        if peer is not None and peer["uid"] != uid and peer.get("stream"):
            return {"answer": "go", "stream": peer["stream"], "node": peer["node"]}
        return {"answer": "wait"}

    def dispatch(self, op: bytes, box_id: int, timeout: float, payload: Frames,
                 waiter: Waiter, peer: Optional[Peer] = None) -> Tuple[int, Optional[Frames]]:
        """Run one operation, for ``peer`` (None: a thread of this process). Returns (status, frames),
        or (-1, None) when ``waiter`` now waits."""
        box = self.boxes.get(box_id)
        if box is None:
            if peer is not None and not peer.trusted:
                return ERROR, [_REFUSED]
            return ERROR, [b"no such queue or pipe here: the process that created it has closed it"]
        access = box.access
        if peer is not None and access is not SHARED:
            if access.owner is not None:
                if peer.node_id != access.owner:
                    return ERROR, [_REFUSED]
            elif not peer.trusted and not (access.untrusted and op in _UNTRUSTED_OPS):
                return ERROR, [_REFUSED]
        elif peer is not None and not peer.trusted:
            return ERROR, [_REFUSED]
        blocking = timeout != 0
        if op == GET:
            return box.get(waiter if blocking else None)
        if access.stamp and op in (PUT, PUT_NOREPLY):
            writer = self.node_id if peer is None else peer.node_id
            if peer is not None and not peer.trusted and not box.admits(writer, sum(len(f) for f in payload)):
                return ERROR, [b"this mailbox holds as much of yours as it takes: wait for it to be read"]
            payload = [writer.encode(), *payload]
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
            return OK, [pack_sizes(Sizes(len(box.items) + len(box.putters), box.unfinished))]
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
            end = cast(Tuple[int, int], tuple(int(x) for x in request["end"]))  # the claim key, as the asker sent it
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
                   payload: Sequence[Any] = ()) -> Tuple[int, Optional[Frames]]:
        """Run an operation from a thread of this process, waiting up to ``timeout`` (-1: forever)."""
        timeout = timeouts.from_wire(timeout)
        waiter = LocalWaiter()
        with self.lock:
            status, frames = self.dispatch(op, box_id, timeout, list(payload), waiter)
        if status != -1:
            return status, frames
        if not waiter.wait(timeout):
            with self.lock:
                box = self.boxes.get(box_id)
                if box is not None:
                    box.cancel(waiter, TIMEOUT_STATUS.get(op, EMPTY))
                elif not waiter.done:
                    waiter.fulfil(ERROR, [b"closed while waiting"])
        return waiter.status, waiter.frames

    def put_back(self, box_id: int, frames: Frames) -> None:
        with self.lock:
            box = self.boxes.get(box_id)
            if box is not None:
                box.put_front(frames)


#: How a request of another process is answered: ``answer(frames, undeliverable)`` (any thread).
Answer = Callable[[Frames, Optional[Callable[[], None]]], Any]


class RemoteWaiter(Waiter):
    """A waiting request of another process: ``answer(frames, undeliverable)`` sends its reply back the
    way the request came (ZeroMQ or a stream), from whichever thread fulfils it."""

    __slots__ = ("node", "answer", "req_id", "box_id")

    def __init__(self, node: "Boxes", answer: Answer, req_id: int, box_id: int) -> None:
        super().__init__()
        self.node, self.answer, self.req_id, self.box_id = node, answer, req_id, box_id

    def fulfil(self, status: int, frames: Optional[Frames] = None) -> None:
        self.done = True
        undeliverable = None
        if status == OK and frames:
            # An item handed to a reader whose process has gone goes back to the front of its mailbox.
            undeliverable = functools.partial(self.node.put_back, self.box_id, frames)
        self.answer([pack_reply(self.req_id, status), *(frames or ())], undeliverable)
