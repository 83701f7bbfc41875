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
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence

from .. import observe
from ..backends.memory import describe
from .. import process as _process
from . import _rerun
from ..transport import session as _session
from . import _protocol as P
from . import _results, _router
from ._memory import CallPeaks
from ._snapshots import Snapshots
from ._worker_events import WorkerEvents
from ._work import Call as _Call, Chunk as _Chunk, Func as _Func, Unit as _Unit, WorkerState
from ._work import unfinished as _unfinished

log = logging.getLogger(__name__)


#: Plain functions are pickled once per pool and kept by the workers under an id; this many at most
#: (further ones are pickled with each call).
MAX_CACHED_FUNCTIONS = 1024


class Dispatcher(Snapshots, WorkerEvents):
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

