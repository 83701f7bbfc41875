"""The pool's bookkeeping of outstanding work, as the dispatcher (:mod:`roving.pool._dispatch`) keeps it:
the functions sent to workers, each call a caller submitted, its chunks of items with one "done" flag per
item, the units of work given to a worker, and the parent's view of each worker. Plain records: every
change to them is the dispatcher's, under its lock."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from ._memory import Kills, WorkerMemory


class Func:
    """A pickled function (with how it is called) and the id workers keep it under (0: not kept)."""

    __slots__ = ("id", "frames", "cached")

    def __init__(self, fid: int, frames: List[Any], cached: bool) -> None:
        self.id, self.frames, self.cached = fid, frames, cached


class Call:
    """One call a caller submitted (an ``apply_async``, a ``map``, an ``imap``): its result object and the
    items of it still to finish (not a backend's job: the pool's workers are those)."""

    __slots__ = ("id", "key", "result", "name", "func", "inline", "left", "peak")

    def __init__(self, call_id: int, key: int, result: Any, name: str, func: Func, inline: bool,
                 left: int) -> None:
        self.id, self.key, self.result, self.name = call_id, key, result, name
        self.func, self.inline, self.left = func, inline, left
        self.peak: Optional[int] = None  # the largest memory a worker reported while running one of its items


class Chunk:
    """Items of one call that travel as one message; results are tracked per item."""

    __slots__ = ("id", "call", "base", "n", "args", "done", "left", "deaths", "kills")

    def __init__(self, chunk_id: int, call: Call, base: int, n: int, args: List[Any]) -> None:
        self.id, self.call, self.base, self.n, self.args = chunk_id, call, base, n, args
        self.done = bytearray(n)
        self.left = n
        self.deaths: Optional[Dict[int, int]] = None
        self.kills: Optional[Dict[int, Kills]] = None  # offset -> its deaths for memory in a row


class Unit:
    """A chunk, or the unfinished items of one, as given to one worker."""

    __slots__ = ("chunk", "offsets", "left", "revoked")

    def __init__(self, chunk: Chunk, offsets: Optional[List[int]] = None) -> None:
        self.chunk, self.offsets, self.left, self.revoked = chunk, offsets, 0, False


def unfinished(unit: "Unit") -> List[int]:
    """The offsets of ``unit``'s items whose results have not arrived."""
    chunk = unit.chunk
    return [o for o in (unit.offsets if unit.offsets is not None else range(chunk.n)) if not chunk.done[o]]


class WorkerState:
    """The parent's view of one worker process."""

    __slots__ = ("id", "proc", "ident", "credit", "credit_key", "units", "known", "forget", "retiring",
                 "gone", "alone", "seen", "unreachable", "undeliverable", "ending", "memory")

    def __init__(self, worker_id: int, proc: Any) -> None:
        self.id, self.proc = worker_id, proc
        self.ident: Optional[bytes] = None
        self.credit = 0
        self.credit_key = 0  # while busy, its credit is for work of this key only (0: any)
        self.units: Dict[int, Unit] = {}  # chunk id -> unit, in the order sent (= the order run)
        self.known: set = set()  # ids of the functions this worker holds
        self.forget: List[int] = []
        self.retiring = False
        self.gone = False
        self.alone = False  # running a blamed item: gets nothing else meanwhile
        self.seen = time.monotonic()  # last heartbeat
        # When a message to it could not be delivered (monotonic time; 0: never): its connection to the
        # parent broke though its process may live on. It reconnects when it next talks (HELLO again,
        # see Dispatcher.on_message); the upkeep kills one that has not within the heartbeat timeout.
        self.unreachable = 0.0

        self.undeliverable: Optional[Callable[[], None]] = None  # for messages to ``ident`` (see HELLO)
        self.ending = False  # it said it will end (ENDING): what it leaves costs no retry
        self.memory = WorkerMemory()  # what its heartbeats said of its memory

    def lost_contact(self, ident: bytes) -> None:
        """A message to ``ident`` could not be delivered (on the node's I/O thread). A connection this
        worker has since replaced (it said HELLO again) does not count."""
        if ident == self.ident and not self.unreachable:
            self.unreachable = time.monotonic()


class WorkerView(NamedTuple):
    """A worker's state as the upkeep reads it: a snapshot taken under the dispatcher's lock (the node's
    I/O thread changes a :class:`WorkerState` under that lock at any moment)."""

    worker: WorkerState
    connected: bool  #: it said HELLO
    busy: bool  #: it holds units of work
    retiring: bool
    seen: float  #: its last heartbeat (monotonic time)
    unreachable: float  #: when a message to it could not be delivered (0: not since it last said HELLO)


def view(w: WorkerState) -> WorkerView:
    """A snapshot of ``w`` (taken under the dispatcher's lock)."""
    return WorkerView(w, w.ident is not None, bool(w.units), w.retiring, w.seen, w.unreachable)
