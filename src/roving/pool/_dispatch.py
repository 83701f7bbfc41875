"""The parent's side of the pool protocol: work waiting, work out at workers, and results per item.

Everything here runs under one lock, from three kinds of threads: the callers that submit work, the
node's I/O thread that handles workers' messages (:meth:`Dispatcher.on_message`, which never blocks), and
the pool's upkeep thread that adds workers and reports those that ended (:meth:`Dispatcher.worker_lost`).
The dispatcher's table of workers is the pool's one registry of them, under that one lock: the upkeep
(:mod:`roving.pool._upkeep`) reads it with :meth:`Dispatcher.workers_now`. Outcomes reach the caller's
result objects only through :mod:`roving.pool._results`' writer functions, called from here.

Workers' messages reach a pool's dispatcher through its node's ``pool`` service
(:class:`roving.pool._router.Router`, made by ``node.service``): one handler per node for the pool operation,
routing by pool id.

Guarantees:

* Work goes only to a worker that asked for it (credit), idle workers first.
* Each item's result is delivered exactly once: a chunk keeps one "done" flag per item, and a result for
  an item already done (sent again by the worker that redid it after another died) is dropped.
* When a worker ends holding work, its unfinished items go back to the front of the line. The item it was
  running is blamed: it is tried again alone on an idle worker, and after ``max_task_retries`` deaths it
  fails with :class:`WorkerLostError` naming it; one whose workers were killed for memory
  ``max_memory_kills`` times in a row fails with :class:`OutOfMemoryError` (:mod:`roving.pool._memory`).
* A worker that says it will end (ENDING: a time limit, a preemption, its lifetime) gets no more work and
  is replaced at once; what it hands back or leaves unfinished goes back in line with no one blamed: a
  preemption never counts against ``max_task_retries``. (Once the pool terminates, the end a worker
  announces is the pool's own kill: it is not counted, and the terminating upkeep replaces nobody.)
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
import time
import types
from typing import Any, Callable, Deque, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union, cast

from .. import observe
from ..backends.base import JobStatus
from ..backends.memory import describe
from .. import process as _process
from . import _rerun
from ..transport import session as _session
from . import _protocol as P
from . import _results, _router
from ._memory import CallPeaks, Kills, WorkerMemory, death_words
from ._memory import out_of_memory as out_of_memory_error
from .errors import WorkerLostError

log = logging.getLogger(__name__)


#: Plain functions are pickled once per pool and kept by the workers under an id; this many at most
#: (further ones are pickled with each call).
MAX_CACHED_FUNCTIONS = 1024


class _Func:
    """A pickled function (with how it is called) and the id workers keep it under (0: not kept)."""

    __slots__ = ("id", "frames", "cached")

    def __init__(self, fid: int, frames: List[Any], cached: bool) -> None:
        self.id, self.frames, self.cached = fid, frames, cached


class _Call:
    """One call a caller submitted (an ``apply_async``, a ``map``, an ``imap``): its result object and the
    items of it still to finish (not a backend's job: the pool's workers are those)."""

    __slots__ = ("id", "key", "result", "name", "func", "inline", "left", "peak")

    def __init__(self, call_id: int, key: int, result: Any, name: str, func: _Func, inline: bool,
                 left: int) -> None:
        self.id, self.key, self.result, self.name = call_id, key, result, name
        self.func, self.inline, self.left = func, inline, left
        self.peak: Optional[int] = None  # the largest memory a worker reported while running one of its items


class _Chunk:
    """Items of one call that travel as one message; results are tracked per item."""

    __slots__ = ("id", "call", "base", "n", "args", "done", "left", "deaths", "kills")

    def __init__(self, chunk_id: int, call: _Call, base: int, n: int, args: List[Any]) -> None:
        self.id, self.call, self.base, self.n, self.args = chunk_id, call, base, n, args
        self.done = bytearray(n)
        self.left = n
        self.deaths: Optional[Dict[int, int]] = None
        self.kills: Optional[Dict[int, Kills]] = None  # offset -> its deaths for memory in a row


class _Unit:
    """A chunk, or the unfinished items of one, as given to one worker."""

    __slots__ = ("chunk", "offsets", "left", "revoked")

    def __init__(self, chunk: _Chunk, offsets: Optional[List[int]] = None) -> None:
        self.chunk, self.offsets, self.left, self.revoked = chunk, offsets, 0, False


def _unfinished(unit: "_Unit") -> List[int]:
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
        self.units: Dict[int, _Unit] = {}  # chunk id -> unit, in the order sent (= the order run)
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


def _view(w: WorkerState) -> WorkerView:
    return WorkerView(w, w.ident is not None, bool(w.units), w.retiring, w.seen, w.unreachable)


class Dispatcher:
    """One pool's work and workers: what waits, what is out at which worker, each item's outcome."""

    def __init__(self, pool_id: int, max_task_retries: int, max_memory_kills: int = 2) -> None:
        self.pool_id = pool_id
        self.max_task_retries = max_task_retries
        self.max_memory_kills = max_memory_kills
        self.lock = threading.Lock()
        self.node = _session.current().node()
        self.calls: Dict[int, _Call] = {}
        self.chunks: Dict[int, _Chunk] = {}
        self.pending: Deque[_Unit] = collections.deque()
        self.suspects: Deque[_Unit] = collections.deque()  # blamed items, each to run alone
        self.workers: Dict[int, WorkerState] = {}
        self.by_ident: Dict[bytes, WorkerState] = {}
        # Workers with credit, in the order they asked: a dict used as an ordered set (membership and
        # removal cost the same at 4,000 workers as at 4).
        self.ready: Dict[WorkerState, None] = {}
        self._retiring = 0  # workers in the table that are retiring (live() without a scan)
        # Workers given a second unit while they ran one: the only ones an idle worker may take a unit
        # from (_steal), so that finding none costs nothing per connected worker.
        self._deep: Dict[WorkerState, None] = {}
        self._call_ids = itertools.count(1)
        self._chunk_ids = itertools.count(1)
        self._keys: Dict[Any, int] = {}
        self._funcs: Dict[Any, _Func] = {}  # (function, mode) -> its pickle, for plain functions
        self._batch: Dict[WorkerState, List[Any]] = {}  # frames for each worker, sent at the end of _dispatch
        self._router: Optional[_router.Router] = None
        # items delivered ok / as a failure, sent again after a worker died (observe.py)
        self.done = self.failed = self.retried = 0
        self.handed_back = 0  # items of workers told they would end, run again elsewhere (not retries)
        self.ended_early = 0  # workers that said they would end (time limit, preemption, lifetime)
        self._terminating = False  # the pool kills its workers (``terminating``): their ends are its own
        self._last_failure: Any = None  # one event for an error that fails many items (fail_all)
        self.oom_kills = 0  # workers the cluster killed for memory
        self.memory_restarts = 0  # workers that left above worker_memory_limit
        self.call_peaks = CallPeaks()

    def attach(self) -> None:
        """Receive this pool's messages from workers: join the node's pool service."""
        self._router = self.node.service(_router.SERVICE, _router.Router)
        self._router.add(self)

    def detach(self) -> None:
        """Stop receiving them (the pool is finished)."""
        if self._router is not None:
            self._router.remove(self)

    # -- callers -------------------------------------------------------------------------------
    def submit(self, result: Any, func: Callable[..., Any], mode: int, items: Sequence[Any],
               chunksize: int, inline: bool) -> None:
        """Queue ``items`` for ``func``; pickling happens here, in the caller's thread.

        Raises SerializationError when the function or an item cannot be pickled (nothing is queued).
        """
        pickled = self._function(func, mode, inline)
        chunksize = max(1, chunksize)
        if len(items) == 1:
            pieces = [(0, P.list_frames([items[0]]))]
        else:
            pieces = [(i, P.list_frames(list(items[i:i + chunksize]))) for i in range(0, len(items), chunksize)]
        name = getattr(func, "__qualname__", None) or repr(func)
        if not items:
            return
        # The chunks are made outside the lock (ids from counters, atomic), so that the workers' messages
        # are not held up while a long map is queued.
        call_id = next(self._call_ids)
        key = self._apply_key(func) if inline else call_id
        call = _Call(call_id, key, result, name, pickled, inline, len(items))
        n = len(items)
        chunks = [_Chunk(next(self._chunk_ids), call, base, min(chunksize, n - base), args) for base, args in pieces]
        with self.lock:
            self.calls[call.id] = call
            self.chunks.update((chunk.id, chunk) for chunk in chunks)
            self.pending.extend(_Unit(chunk) for chunk in chunks)
            self._dispatch()

    def open_call(self, result: Any, func: Callable[..., Any], mode: int) -> _Call:
        """A call whose items come later (:meth:`add_items`), for imap over an iterator."""
        pickled = self._function(func, mode, False)
        name = getattr(func, "__qualname__", None) or repr(func)
        with self.lock:
            call_id = next(self._call_ids)
            call = _Call(call_id, call_id, result, name, pickled, False, 1)  # 1: held open
            self.calls[call.id] = call
            return call

    def add_items(self, call: _Call, base: int, items: List[Any]) -> None:
        """Items ``base``, ``base + 1``, ... of an open call, as one chunk. SerializationError if unpicklable."""
        args = P.list_frames(items)
        with self.lock:
            chunk = _Chunk(next(self._chunk_ids), call, base, len(items), args)
            call.left += len(items)
            self.chunks[chunk.id] = chunk
            self.pending.append(_Unit(chunk))
            self._dispatch()

    def close_call(self, call: _Call, length: int, error: Optional[BaseException] = None) -> None:
        """No more items for ``call``: its iterator gave ``length`` items, then (``error``) raised, or held
        an item that cannot be pickled; that error is then the outcome of item ``length``."""
        with self.lock:
            if error is not None:
                _results.deliver(call.result, length, False, [error])
                length += 1
            _results.set_length(call.result, length)
            call.left -= 1
            if call.left == 0:
                self._call_done(call)

    def _function(self, func: Callable[..., Any], mode: int, inline: bool) -> _Func:
        """The pickled function: a plain function is pickled once and kept by workers under its id, so
        that later jobs send only the id; any other callable (whose state may change) is pickled anew,
        kept by workers for the length of its call (map) or not at all (apply). SerializationError."""
        cacheable = isinstance(func, (types.FunctionType, types.BuiltinFunctionType))
        if cacheable:
            hit = self._funcs.get((func, mode))
            if hit is not None:
                return hit
        frames = P.function_frames(func, mode)
        with self.lock:
            if cacheable and len(self._funcs) < MAX_CACHED_FUNCTIONS:
                return self._funcs.setdefault((func, mode), _Func(next(self._call_ids), frames, True))
            return _Func(0 if inline else next(self._call_ids), frames, False)

    def _apply_key(self, func: Callable[..., Any]) -> int:
        """One key per function called with apply: workers learn how long its calls take."""
        try:
            ident: Any = (func.__module__, func.__qualname__)
        except AttributeError:
            ident = type(func)
        key = self._keys.get(ident)
        if key is None:  # called outside the lock: setdefault keeps one key per function across threads
            key = self._keys.setdefault(ident, next(self._call_ids))
        return key

    def workers_now(self) -> List[WorkerState]:
        """The pool's workers now: started and not yet ended (a snapshot)."""
        with self.lock:
            return list(self.workers.values())

    def views(self, workers: Optional[Iterable[WorkerState]] = None) -> List[WorkerView]:
        """Snapshots of ``workers`` (None: the pool's workers now), all taken at one moment."""
        with self.lock:
            return [_view(w) for w in (self.workers.values() if workers is None else workers)]

    def view(self, worker_id: int) -> Optional[WorkerView]:
        """A snapshot of worker ``worker_id``; None once it ended (or was never added)."""
        with self.lock:
            w = self.workers.get(worker_id)
            return None if w is None else _view(w)

    def live(self) -> int:
        """How many of the pool's workers are not retiring (without looking at each)."""
        with self.lock:
            return len(self.workers) - self._retiring

    def starting(self) -> int:
        """How many of the pool's workers have been started and not yet connected (looks at each)."""
        with self.lock:
            return sum(1 for w in self.workers.values() if w.ident is None and not w.retiring and not w.gone)

    def worker(self, worker_id: int) -> Optional[WorkerState]:
        with self.lock:
            return self.workers.get(worker_id)

    def remembered(self) -> Tuple[int, int]:
        """(workers in the table, connection identities mapped to workers): both only of live workers."""
        with self.lock:
            return len(self.workers), len(self.by_ident)

    def backlog(self) -> Tuple[int, int]:
        """(units of work waiting for a worker, connected workers holding none)."""
        with self.lock:
            free = sum(1 for w in self.workers.values() if w.ident is not None and not w.units
                       and not w.retiring)
            return len(self.pending) + len(self.suspects), free

    def figures(self) -> Dict[str, Any]:
        """This pool's figures now, for :mod:`roving.observe`: items queued (waiting for a worker), out
        at workers, done, failed, retried; each worker's state (starting, idle, busy, retiring)."""
        with self.lock:
            queued = sum(len(u.offsets) if u.offsets is not None else u.chunk.n
                         for q in (self.pending, self.suspects) for u in q)
            workers = [{"id": w.id, "name": w.proc.name, "items": sum(u.left for u in w.units.values()),
                        "state": "retiring" if w.retiring else "starting" if w.ident is None
                        else "busy" if w.units else "idle", **w.memory.figures()} for w in self.workers.values()]
            calls = self.call_peaks.figures([{"call": c.id, "name": c.name, "peak_memory": c.peak}
                                             for c in self.calls.values() if c.peak is not None])
            return {"queued": queued, "running": sum(w["items"] for w in workers), "done": self.done,
                    "failed": self.failed, "retried": self.retried, "handed_back": self.handed_back,
                    "ended_early": self.ended_early, "oom_kills": self.oom_kills,
                    "memory_restarts": self.memory_restarts, "workers": workers, "calls": calls}

    def busy(self) -> bool:
        with self.lock:
            return bool(self.calls)

    # -- worker messages (node I/O thread) -----------------------------------------------------
    def on_message(self, ident: bytes, kind: int, arg: int, key: int, frames: List[Any]) -> None:
        if kind == P.RESULTS:
            runs, values = P.read_results(frames)
            with self.lock:
                w = self.by_ident.get(ident)
                self._results(w, runs, values)
                if arg and w is not None:
                    self._credit(w, arg, key)
            return
        if kind == P.HEARTBEAT:
            w = self.workers.get(arg)
            if w is not None:
                w.seen = time.monotonic()
                if len(frames) > 1:
                    self._memory_seen(w, frames)
            return
        if kind == P.ENDING:
            with self.lock:
                w = self.workers.get(arg)
                if w is not None and not w.gone and not w.ending:
                    # the first of the workers ending now (a time limit, a preemption ends several at once)
                    first = not any(o.ending and not o.gone for o in self.workers.values())
                    w.ending = True
                    self._retire(w)  # no more work; the upkeep starts its replacement now
                    # the signal of the pool's own kill (Slurm sends TERM first), or of this process's own
                    # terminate() of the worker (at its exit, say): an end of its own, said nowhere
                    if self._terminating or _process.stop_asked(w.proc):
                        return
                    self.ended_early += 1
                    reason = P.read_ending_reason(frames) or "told so"
                    observe.event("worker-ending", f"pool {self.pool_id}", f"worker {w.id} will end within {key} s "
                                  f"({reason}): it hands back its work (no retry counted); a replacement starts",
                                  pool=self.pool_id, worker=w.id)
                    if first:
                        log.warning("roving pool %d: the cluster ends its workers (%s: a time limit or a "
                                    "preemption), the first within %d s: they take no more work, finish or hand "
                                    "back what they hold (no retry counted) and are replaced", self.pool_id,
                                    reason, key)
                    else:
                        log.info("roving pool %d: worker %s will end within %d s (%s)", self.pool_id, w.id, key,
                                 reason)
            return
        with self.lock:
            if kind == P.HELLO:
                w = self.workers.get(arg)
                if w is not None and not w.gone:
                    if w.ident is not None and w.ident != ident:
                        self._reconnected(w)
                    w.ident = ident
                    w.undeliverable = functools.partial(w.lost_contact, ident)
                    self.by_ident[ident] = w
                    if w.retiring:
                        self._send(w, P.STOP)
                return
            w = self.by_ident.get(ident)
            if w is None:
                return
            if kind == P.READY:
                self._credit(w, arg, key)
            elif kind == P.RETURNED:
                unit = w.units.pop(arg, None)
                if unit is not None:
                    unit.revoked = False
                    if w.ending:
                        self.handed_back += len(_unfinished(unit))
                    self.pending.appendleft(unit)
                    if not w.units:
                        w.alone = False
                    self._dispatch()
            elif kind == P.BYE and not w.gone:
                if arg == P.BYE_MEMORY_LIMIT:
                    self.memory_restarts += 1
                    observe.event("memory-restart", f"pool {self.pool_id}", f"worker {w.id} is above "
                                  f"worker_memory_limit after a task ({describe(key)}): replaced",
                                  pool=self.pool_id, worker=w.id)
                self._retire(w)
                self._send(w, P.ACK)

    def _memory_seen(self, w: WorkerState, frames: List[Any]) -> None:
        """A heartbeat's memory: kept for the worker and for the call whose item it runs."""
        sample = P.read_memory(frames)
        if sample is None:
            return
        with self.lock:
            peak = w.memory.seen(sample)
            if peak is not None and w.units:
                call = next(iter(w.units.values())).chunk.call  # the unit it runs: the first sent
                if call.peak is None or peak > call.peak:
                    call.peak = peak

    def _credit(self, w: WorkerState, n: int, key: int) -> None:
        if w.retiring or w.gone:
            return
        w.credit += n
        w.credit_key = key
        self.ready[w] = None
        self._dispatch()

    def _results(self, w: Optional[WorkerState], runs: List[P.Run], values: List[Any]) -> None:
        chunks = self.chunks
        freed = False
        at = 0
        for cid, first, count, ok in runs:
            part = values[at:at + count]
            at += count
            if w is not None:
                unit = w.units.get(cid)
                if unit is not None:  # counted even for duplicates: the unit's items are all back
                    unit.left -= count
                    if unit.left <= 0:
                        del w.units[cid]
                        if not w.units:
                            w.alone = False
                            freed = True
            chunk = chunks.get(cid)
            if chunk is None:
                continue  # every item already delivered
            if not ok:  # what was sent for each failed item, for roving.debug.rerun
                for i, exc in enumerate(part):
                    self._note_failure(chunk, first + i, exc)
            if chunk.done.find(1, first, first + count) == -1:
                self._deliver_run(chunk, first, ok, part)
            else:  # some already delivered (by a worker that died after sending them): the rest only
                for i, value in enumerate(part):
                    if not chunk.done[first + i]:
                        self._deliver_run(chunk, first + i, ok, [value])
        if freed:  # an idle worker may take a blamed item, or a unit another has not started
            self._dispatch()

    def _note_failure(self, chunk: _Chunk, offset: int, exc: Any) -> None:
        if isinstance(exc, BaseException):
            _rerun.note(exc, _rerun.FailedCall(chunk.call.func.frames, chunk.args, offset, chunk.base + offset,
                                               chunk.call.name))

    def _deliver_run(self, chunk: _Chunk, first: int, ok: bool, values: List[Any]) -> None:
        count = len(values)
        chunk.done[first:first + count] = b"\x01" * count
        chunk.left -= count
        if chunk.left == 0:
            del self.chunks[chunk.id]
        call = chunk.call
        if ok:
            self.done += count
        else:
            self.failed += count
            if values[0] is not self._last_failure and self.failed <= observe.MAX_TASK_FAILURES:
                self._last_failure = values[0]
                observe.task_failed(self.pool_id, call.name, chunk.base + first, values[0])
        try:
            _results.deliver(call.result, chunk.base + first, ok, values)
        except Exception:
            log.exception("roving pool: could not deliver a result")
        call.left -= count
        if call.left == 0:
            self._call_done(call)

    def _call_done(self, call: _Call) -> None:
        del self.calls[call.id]
        self.call_peaks.done(call.id, call.name, call.peak)
        fid = call.func.id
        if fid and not call.func.cached:
            for w in self.workers.values():
                if fid in w.known:
                    w.known.discard(fid)
                    w.forget.append(fid)

    # -- dispatch (lock held) ------------------------------------------------------------------
    def _dispatch(self) -> None:
        while self.suspects:
            w = next((w for w in self.ready if not w.units), None)
            if w is None:
                break
            if self._send_unit(w, self.suspects.popleft()):
                w.alone = True
        while self.pending and self.ready:
            w = next((w for w in self.ready if not w.units), None)
            if w is None:  # all busy: only to one that asked in advance for this kind of work
                key = self.pending[0].chunk.call.key
                w = next((w for w in self.ready if not w.alone and w.credit_key in (0, key)), None)
                if w is None:
                    break
            self._send_unit(w, self.pending.popleft())
        if not self.pending and self.ready:
            self._steal()
        if self._batch:
            # One message per worker for all the units it was given this time.
            for w, frames in self._batch.items():
                assert w.ident is not None, "a worker is given units once it said HELLO"
                self.node.send_to(w.ident, frames, w.undeliverable)
            self._batch.clear()

    def _steal(self) -> None:
        """Idle workers and nothing waiting: ask busy workers for units they have not started (only those
        that were given a second unit while running one can have such units)."""
        if not self._deep:
            return
        idle = sum(1 for w in self.ready if not w.units)
        for w in list(self._deep):
            if idle <= 0:
                return
            if w.retiring or w.gone or len(w.units) < 2:
                del self._deep[w]
                continue
            for unit in list(w.units.values())[:0:-1]:  # newest first; the first one is running
                if idle <= 0:
                    break
                if not unit.revoked:
                    unit.revoked = True
                    idle -= 1
                    assert w.ident is not None, "a worker is given units once it said HELLO"
                    self.node.send_to(w.ident, P.control(P.REVOKE, unit.chunk.id), w.undeliverable)

    def _send_unit(self, w: WorkerState, unit: _Unit) -> bool:
        chunk, call = unit.chunk, unit.chunk.call
        offsets = unit.offsets
        if offsets is not None:
            offsets = [o for o in offsets if not chunk.done[o]]
            if not offsets:
                return False
        func = call.func
        if func.id in w.known:
            func_frames = []
        else:
            func_frames = func.frames
            if func.id:
                w.known.add(func.id)
        self._batch.setdefault(w, []).extend(P.unit_frames(chunk.id, func.id, call.key, chunk.n, func_frames,
                                                           chunk.args, w.forget, offsets))
        if w.forget:
            w.forget = []
        unit.left = chunk.n if offsets is None else len(offsets)
        w.units[chunk.id] = unit
        if len(w.units) > 1:
            self._deep[w] = None
        w.credit -= 1
        if w.credit <= 0:
            del self.ready[w]
        return True

    def _send(self, w: WorkerState, kind: int) -> None:
        if w.ident is not None:
            self.node.send_to(w.ident, P.control(kind), w.undeliverable)

    def _retire(self, w: WorkerState) -> None:
        if not w.retiring and self.workers.get(w.id) is w:
            self._retiring += 1
        w.retiring = True
        w.credit = 0
        self.ready.pop(w, None)

    # -- worker upkeep (pool thread) -----------------------------------------------------------
    def add_worker(self, w: WorkerState) -> None:
        with self.lock:
            self.workers[w.id] = w

    def retire(self, w: WorkerState) -> None:
        """Ask ``w`` to leave once it has run what it holds; it gets no more work."""
        with self.lock:
            if not w.retiring:
                self._retire(w)
                self._send(w, P.STOP)  # a worker not yet connected is told at HELLO

    def _reconnected(self, w: WorkerState) -> None:
        """``w`` says HELLO over a new connection: the old one broke (a network drop) with the worker
        alive. What was sent either way over it may be lost, so its units go back to the front of the
        line, none blamed (it did not die; items done meanwhile count once), and it starts afresh
        (functions sent again, no credit until it asks) (lock held)."""
        assert w.ident is not None, "called on a worker's second HELLO"
        self.by_ident.pop(w.ident, None)
        units, w.units = list(w.units.values()), {}
        again = [_Unit(u.chunk, left) for u in units if (left := _unfinished(u))]
        # A worker running a blamed item alone held only that one: it stays with the blamed ones.
        (self.suspects if w.alone else self.pending).extendleft(reversed(again))
        w.known, w.forget, w.credit, w.credit_key, w.alone, w.unreachable = set(), [], 0, 0, False, 0.0
        self.ready.pop(w, None)
        log.warning("roving pool: worker %s reconnected after its connection broke; %d unit(s) it held go "
                    "back in line", w.id, len(again))
        self._dispatch()

    def worker_lost(self, w: WorkerState, exitcode: Optional[int], end: Optional[JobStatus] = None) -> None:
        """``w`` ended: its unfinished items go back to the front of the line (see module docstring).
        ``end``: how its job ended, as its backend says (killed for memory, its peak memory)."""
        out_of_memory = end is not None and end.out_of_memory
        with self.lock:
            if end is not None:
                w.memory.ended(end.memory_peak)
            w.gone = True
            w.unreachable = 0.0  # its contact does not matter any more
            self._retire(w)
            if self.workers.pop(w.id, None) is not None:
                self._retiring -= 1
            self._deep.pop(w, None)
            if w.ident is not None and self.by_ident.get(w.ident) is w:
                del self.by_ident[w.ident]  # a worker that is gone is forgotten
            units, w.units = list(w.units.values()), {}
            if out_of_memory:
                self.oom_kills += 1
            again: List[_Unit] = []
            blamed = w.ending  # a worker told it would end did not die of its work: nothing is blamed
            again_n = 0  # items sent again (observe.py)
            for unit in units:
                chunk = unit.chunk
                offsets = _unfinished(unit)
                if not offsets:
                    continue
                if not blamed:  # the first unfinished item is the one it was running
                    blamed = True
                    first, offsets = offsets[0], offsets[1:]
                    lost = self._blame(w, chunk, first, exitcode, out_of_memory)
                    if lost is not None:
                        self._note_failure(chunk, first, lost)
                        self._deliver_run(chunk, first, False, [lost])
                    else:
                        self.suspects.append(_Unit(chunk, [first]))
                        again_n += 1
                if offsets:
                    again.append(_Unit(chunk, offsets))
            self.pending.extendleft(reversed(again))
            again_n += sum(len(cast(List[int], u.offsets)) for u in again)  # each made with its offsets
            how = death_words(out_of_memory, w.memory, exitcode)
            if units and w.ending:
                self.handed_back += again_n
                log.info("roving pool: worker %s ended as it said it would (exit code %s); %d unfinished item(s) "
                         "go to other workers, no retry counted", w.id, exitcode, again_n)
            elif units:
                self.retried += again_n
                observe.event("retry", f"pool {self.pool_id}", f"{again_n} item(s) of worker {w.id} ({how}) "
                              "sent again to other workers", pool=self.pool_id, items=again_n)
                log.warning("roving pool: worker %s ended (%s) holding work; its unfinished items go to other "
                            "workers", w.id, how)
            elif out_of_memory:
                log.warning("roving pool: worker %s ended (%s)", w.id, how)
            self._dispatch()

    def _blame(self, w: WorkerState, chunk: _Chunk, first: int, exitcode: Optional[int],
               out_of_memory: bool) -> Optional[WorkerLostError]:
        """Count a death against item ``first`` of ``chunk``, which ``w`` was running: the error it fails
        with when it is not to be tried again (max_memory_kills, max_task_retries), else None."""
        deaths = chunk.deaths or {}
        chunk.deaths = deaths
        deaths[first] = deaths.get(first, 0) + 1
        kills = chunk.kills or {}
        chunk.kills = kills
        item = f"item {chunk.base + first} of {chunk.call.name}"
        call, peak = chunk.call, w.memory.peak
        if peak is not None and (call.peak is None or peak > call.peak):
            call.peak = peak  # what its job was seen to use when it died (its cluster's record, say)
        if out_of_memory:
            record = kills.setdefault(first, Kills())
            record.add(w.memory)
            if record.in_row >= self.max_memory_kills:
                return out_of_memory_error(item, record, self.max_memory_kills)
        else:
            kills.pop(first, None)  # a death of another kind ends a run of deaths for memory
        if deaths[first] >= self.max_task_retries:
            return WorkerLostError(
                f"{item} was running on {deaths[first]} pool worker(s) that died (last: "
                f"{death_words(out_of_memory, w.memory, exitcode)}); it is not tried again "
                f"(max_task_retries={self.max_task_retries})")
        return None

    def terminating(self) -> None:
        """The pool kills its workers now: a worker that then says it will end (the kill's own signal:
        Slurm's cancel sends SIGTERM before SIGKILL, Kubernetes deletes a pod the same way) is not one
        that ended early (and the upkeep, terminating, starts no replacement)."""
        with self.lock:
            self._terminating = True

    def fail_all(self, error: Union[str, BaseException]) -> None:
        """Terminate: every result not yet delivered fails with ``error`` (text: a RuntimeError)."""
        exc = RuntimeError(error) if isinstance(error, str) else error
        with self.lock:
            for chunk in list(self.chunks.values()):
                for off in range(chunk.n):
                    if not chunk.done[off]:
                        self._deliver_run(chunk, off, False, [exc])
            self.pending.clear()
            self.suspects.clear()
