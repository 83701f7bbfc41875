"""A pool's worker upkeep: starting workers (with a backoff after failures), autoscaling between ``min`` and
``max``, liveness (a job that ended, heartbeats, a connection cut off), and the pool's upkeep thread.

The workers themselves are registered in one place, the pool's dispatcher (:mod:`roving.pool._dispatch`),
under its lock: the upkeep adds a worker there when its job starts, reads the table each round as
snapshots taken under that lock (:meth:`~roving.pool._dispatch.Dispatcher.views`: connected, busy,
retiring, last heard from; never a worker's fields directly, which the node's I/O thread changes at any
moment) and reports there each worker that ended. Its own
lock guards the rest of the pool's state: RUN, CLOSE or TERMINATE; how many workers it keeps (now, min,
max); their shape; multiprocessing's list of member processes. Lock order: this one, then the
dispatcher's (never the other way round).

Liveness costs per event, not per worker and round: a round looks at a worker when its job ended (its
sentinel fired), when its heartbeat deadline came, or, for a process without a sentinel, every round; an
idle pool's rounds look at none (``Upkeep.checks`` counts the looks).

The upkeep thread holds the pool only weakly: a running pool nobody references any more is collected,
warned about (``Pool.__del__``) and its workers killed here, never in the thread that dropped the last
reference (which may be the transport's own, inside the dispatcher's lock). A pool that was closed or
terminated is held (:meth:`Upkeep.keep`) until its work is done.
"""
from __future__ import annotations

import collections
import functools
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from .. import _sentinels
from .. import backends
from .. import config as _config
from .. import observe
from .. import process as _process
from ..process import Process, start_many
from ..transport.serialize import SerializationError
from . import _worker
from ._dispatch import Dispatcher
from ._work import WorkerState, WorkerView
from ._results import CallbackRunner
from ._sizing import Sizing
from .errors import PoolStartError

__all__ = ["Upkeep", "RUN", "CLOSE", "TERMINATE"]

log = logging.getLogger(__name__)

RUN, CLOSE, TERMINATE = "RUN", "CLOSE", "TERMINATE"
_UPKEEP_S = 0.1
_MAX_BACKOFF_S = 10.0


class Upkeep(Sizing):
    """The workers of one pool kept as many and as alive as the pool says (see the module docstring).

    ``size`` workers are kept (``low`` <= size <= ``high``; autoscaling when they differ); each is a
    :class:`roving.Process` running the worker loop with ``initializer``, ``initargs``, ``maxtasks`` and
    ``memory_limit`` (bytes: ``worker_memory_limit``) and asking the backend for ``shape``.
    """

    def __init__(self, disp: Dispatcher, runner: CallbackRunner, size: int, low: int, high: int, *,
                 idle_timeout: float, shape: Dict[str, Any], initializer: Optional[Callable[..., Any]],
                 initargs: Tuple[Any, ...], maxtasks: Optional[int], memory_limit: Optional[int] = None) -> None:
        self.disp, self.runner = disp, runner
        self.lock = threading.RLock()  # guards state, size, min, max, shape, the members, idle times
        self.state = RUN
        self.size, self.min, self.max = size, low, high
        self.shape = shape
        #: Workers that could not start, as (time.time(), reason); the latest 100.
        self.start_failures: List[Tuple[float, str]] = []
        #: Set when workers failed to start pool_start_failures times in a row: every call raises it.
        self.broken: Optional[Exception] = None  # PoolStartError, or a worker's EnvironmentMismatchError
        #: Set to run a round of upkeep now (after a change, or when the pool was collected).
        self.wake = threading.Event()
        self._idle_timeout = idle_timeout
        self._heartbeat_timeout = _config.current().pool_heartbeat_timeout
        self._initializer, self._initargs, self._maxtasks = initializer, initargs, maxtasks
        self._memory_limit = memory_limit
        self._worker_ids = itertools.count(1)
        #: multiprocessing's ``_pool``: workers leave it when they end while the pool runs (replaced or
        #: retired); after close()/terminate() the workers of the end stay in it, ended.
        self._members: Dict[int, Process] = {}
        self._idle_since: Dict[int, float] = {}
        self._failures = 0
        self._abandoned: List[Process] = []  # killed workers whose jobs have not ended yet
        self._next_start = 0.0
        self._hold: List[Any] = []  # the pool, once closed or terminated
        self._thread: Optional[threading.Thread] = None
        self.lost = 0  # workers that ended unasked (observe.py)
        # Liveness per event, not per round: a round looks only at the workers whose job ended (their
        # sentinel fired: _ended_ids), whose heartbeat deadline came (_deadlines: one entry per worker,
        # due when it would be silent for the heartbeat timeout if nothing more came), and those whose
        # process offers no sentinel (_polled, asked each round).
        self._ended_ids: Deque[int] = collections.deque()
        self._sentinels: Dict[int, int] = {}  # worker id -> this upkeep's own copy of its sentinel
        self._deadlines: List[Tuple[float, int]] = []
        self._polled: Dict[int, WorkerState] = {}
        #: Workers looked at one by one in rounds (a job asked whether it lives, a heartbeat deadline
        #: checked): grows with events, not with rounds times workers.
        self.checks = 0

    # -- called by the pool ----------------------------------------------------------------------
    def start(self, pool: Any) -> None:
        """Start the upkeep thread, holding ``pool`` weakly."""
        observe.track_pool(self.disp.pool_id, pool, self.figures)
        self._thread = threading.Thread(target=self._run, args=(weakref.ref(pool),), name="roving-pool",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout: Optional[float]) -> None:
        """Wait up to ``timeout`` seconds for the upkeep thread to end (after close or terminate)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def members(self) -> List[Process]:
        """multiprocessing's ``Pool._pool``, in the order the workers started."""
        with self.lock:
            return [self._members[wid] for wid in sorted(self._members)]

    def figures(self) -> Dict[str, Any]:
        """The pool's figures for :mod:`roving.observe` (the dispatcher's, and state, size, lost)."""
        with self.lock:
            mine = {"state": self.state, "size": self.size, "min": self.min, "max": self.max, "lost": self.lost,
                    "start_failures": len(self.start_failures)}
        return {**self.disp.figures(), **mine}

    def close(self, pool: Any) -> None:
        """No more work: the workers leave once everything submitted is done."""
        with self.lock:
            if self.state == RUN:
                self.state = CLOSE
        self.keep(pool)
        self.wake.set()

    def terminate(self, pool: Any) -> None:
        """Kill the workers now; every result not yet delivered fails."""
        with self.lock:
            self.state = TERMINATE
        self.disp.terminating()
        workers = self.disp.workers_now()
        self.keep(pool)
        for w in workers:
            try:
                w.proc.kill()
            except Exception:
                pass
        self.disp.fail_all("the pool was terminated before this task finished")
        self.wake.set()

    def keep(self, pool: Any) -> None:
        """Closed or terminated on purpose: the upkeep thread holds ``pool`` until its work is done, so
        dropping it then neither warns nor kills its workers."""
        with self.lock:
            if not self._hold:
                self._hold.append(pool)

    # -- starting workers --------------------------------------------------------------------------
    def start_workers(self) -> None:
        """Start as many workers as are missing, unless a backoff after a failure is still running; no
        more at once than the backend's start window (:meth:`Backend.start_window`) has room for: the
        rest at the next rounds, as those connect. SerializationError if the initializer or its arguments
        cannot be pickled."""
        if self.broken is not None or _process.exiting():  # its workers are being ended with the program
            return
        with self.lock:
            want = self.size - self.disp.live()
        now = time.monotonic()
        if want <= 0 or now < self._next_start:
            return
        disp = self.disp
        node = disp.node
        cfg = _config.current()
        window = backends.get(cfg.backend).start_window()
        if window is not None:
            want = min(want, window - disp.starting())
            if want <= 0:
                return
        batch: List[WorkerState] = []
        for _ in range(want):
            worker_id = next(self._worker_ids)
            proc = Process(target=_worker.serve, name=f"PoolWorker-{disp.pool_id}-{worker_id}",
                           args=(node.address, disp.pool_id, worker_id, self._initializer,
                                 self._initargs, self._maxtasks, cfg.connect_timeout, self._memory_limit,
                                 beat_interval(cfg.heartbeat_interval, self._heartbeat_timeout, self.max)),
                           daemon=True, resources=self.shape)
            w = WorkerState(worker_id, proc)
            asked = self.shape.get("memory") or cfg.memory
            w.memory.asked = _config.parse_memory(asked) if asked is not None else None
            batch.append(w)
        # Known to the dispatcher before any of their jobs exists: a worker that starts early (the first
        # of 64 sbatch calls, say) says HELLO at once, and a HELLO from an unknown worker is ignored.
        for w in batch:
            disp.add_worker(w)
        # one submission for all of them (a Slurm job array, concurrent container creation)
        try:
            if len(batch) == 1:
                batch[0].proc.start()
                errors: List[Optional[Exception]] = [None]
            else:
                errors = start_many([w.proc for w in batch])
        except SerializationError:
            for w in batch:
                disp.worker_lost(w, None)
            raise
        except Exception as exc:
            errors = [exc] * len(batch)
        except BaseException:
            for w in batch:
                disp.worker_lost(w, None)
            raise
        failed = None
        for w, error in zip(batch, errors):
            if error is not None:
                failed = failed or error
                disp.worker_lost(w, None)  # it never started: nothing of it is left
                continue
            with self.lock:
                self._members[w.id] = w.proc
            self._watch(w, now)
            observe.event("worker-started", f"pool {disp.pool_id}", f"worker {w.id} started ({w.proc.name})")
        if failed is not None:  # one submission, one failure (an array refused is not 32 failures)
            lost = sum(e is not None for e in errors)
            self._failed_start(f"could not start a worker: {failed}" if len(batch) == 1 else
                               f"could not start {lost} of {len(batch)} workers: {failed}")

    def _broken_by(self, error: Exception) -> None:
        """A worker cannot run here at all (its environment differs where env_check forbids it): no
        replacement would fare better, so the pool gives up at once with ``error``, as after
        pool_start_failures failed starts."""
        if self.broken is None:
            self.broken = error
            observe.event("start-failed", f"pool {self.disp.pool_id}", str(error))
            log.error("roving pool: %s", error)
            self.disp.fail_all(error)

    def _failed_start(self, why: str) -> None:
        self._failures += 1
        observe.event("start-failed", f"pool {self.disp.pool_id}", why)
        self.start_failures.append((time.time(), why))
        del self.start_failures[:-100]
        limit = _config.current().pool_start_failures
        if self.broken is not None:  # a worker started before the pool gave up failed too
            return
        if self._failures >= limit:
            node = self.disp.node
            self.broken = PoolStartError(
                f"roving pool: {self._failures} workers in a row failed to start and none connected "
                f"(pool_start_failures={limit}); the last: {why}. Workers were to connect to this process at "
                f"{node.address} (chosen by {node.why}); their output says why they could not.")
            log.error("%s", self.broken)
            self.disp.fail_all(self.broken)
            return
        delay = min(_MAX_BACKOFF_S, 0.1 * 2 ** self._failures)
        self._next_start = time.monotonic() + delay
        log.warning("roving pool: %s; trying again in %.1f s", why, delay)

    # -- one round ---------------------------------------------------------------------------------
    def _ended(self, w: WorkerState) -> None:
        """Forget ``w`` here (the dispatcher forgets it at worker_lost)."""
        with self.lock:
            self._idle_since.pop(w.id, None)
            if self.state == RUN:
                self._members.pop(w.id, None)
        self._unwatch(w.id)

    # -- liveness, per event -----------------------------------------------------------------------
    def _watch(self, w: WorkerState, now: float) -> None:
        """Learn of ``w``'s end through its sentinel (a copy of our own, watched by roving's sentinel
        thread), and check its heartbeats once they could be late."""
        heapq.heappush(self._deadlines, (now + self._heartbeat_timeout, w.id))
        try:
            fd = os.dup(w.proc.sentinel)
        except (AttributeError, ValueError, OSError):  # no sentinel: asked each round instead
            self._polled[w.id] = w
            return
        self._sentinels[w.id] = fd
        _sentinels.watcher().watch(fd, w.proc, functools.partial(_job_ended, weakref.ref(self), w.id))

    def _unwatch(self, worker_id: int) -> None:
        self._polled.pop(worker_id, None)
        fd = self._sentinels.pop(worker_id, None)
        if fd is not None:
            _sentinels.watcher().close_fd(fd)

    def job_ended(self, worker_id: int) -> None:
        """A worker's sentinel fired (roving's sentinel thread): a round looks at it now."""
        self._ended_ids.append(worker_id)
        self.wake.set()

    def _due(self, now: float) -> List[WorkerView]:
        """The workers to look at in this round: each whose job ended, whose heartbeat deadline came, or
        that has no sentinel. A worker whose deadline came but that was heard from meanwhile gets its
        next deadline: silent for the timeout since it was last heard from, or cut off for the timeout
        since its connection broke, whichever comes first."""
        while self._ended_ids:
            wid = self._ended_ids.popleft()
            w = self.disp.worker(wid)
            if w is not None:  # asked each round until its end is known (then _ended forgets it)
                self._polled[wid] = w
        due: Dict[int, WorkerView] = {v.worker.id: v for v in self.disp.views(self._polled.values())}
        timeout = self._heartbeat_timeout
        while self._deadlines and self._deadlines[0][0] <= now:
            _, wid = heapq.heappop(self._deadlines)
            v = self.disp.view(wid)
            if v is None:  # ended meanwhile
                continue
            self.checks += 1
            if _silent(v, now, timeout) or _cut_off(v, now, timeout):
                due[wid] = v
                continue
            nxt = v.seen + timeout if v.connected else now + timeout
            if v.unreachable:
                nxt = min(nxt, v.unreachable + timeout)
            heapq.heappush(self._deadlines, (max(nxt, now + 0.01), wid))
        self.checks += len(due)
        return list(due.values())

    def _lost(self, w: WorkerState, why: str) -> None:
        self.lost += 1
        w.proc.revoke_credentials()  # a copy of them (on a machine cut off, or stolen) gets nowhere now
        observe.event("worker-lost", f"pool {self.disp.pool_id}", f"worker {w.id} ({w.proc.name}) lost: {why}",
                      pool=self.disp.pool_id, worker=w.id)

    def _abandon(self, w: WorkerState) -> None:
        """Kill ``w`` and count it as lost at once, without waiting for its job to end: a job on a machine
        cut off from the cluster may not end for minutes (or until the machine is back), and its work must
        not wait that long. A late word from it is ignored (it is gone); its job is reaped when it ends."""
        self._lost(w, "killed: no heartbeat, or cut off")
        w.proc.kill()
        self._ended(w)
        self.disp.worker_lost(w, None)
        self._abandoned.append(w.proc)

    def once(self) -> bool:
        """One round of upkeep; False once the pool is finished. Costs nothing per worker when no worker
        ended, none is due a heartbeat check and nothing changed (see _due)."""
        with self.lock:
            state = self.state
        now = time.monotonic()
        if self._abandoned:
            ended = [p for p in self._abandoned if not p.is_alive()]
            for p in ended:
                self._abandoned.remove(p)
                _process.release(p)
        for v in self._due(now):
            w = v.worker
            if w.proc.is_alive():
                silent = _silent(v, now, self._heartbeat_timeout)
                if (silent or _cut_off(v, now, self._heartbeat_timeout)) and state != TERMINATE:
                    if silent:
                        log.warning("roving pool: worker %s sent no heartbeat for %.0f s; it is killed and counts "
                                    "as lost: its work goes to other workers", w.id, now - v.seen)
                    else:
                        log.warning("roving pool: worker %s cannot be reached (its connection to the parent broke "
                                    "%.0f s ago) and has not reconnected; it is killed and counts as lost: its "
                                    "work goes to other workers", w.id, now - v.unreachable)
                    self._abandon(w)
                continue
            code = w.proc.exitcode
            end = None
            if code != 0 and state != TERMINATE:
                end = _process.end_status(w.proc)
                oom = end is not None and end.out_of_memory
                self._lost(w, f"exit code {code}" + (", killed for memory (out of memory)" if oom else ""))
            self._ended(w)
            if state != TERMINATE:
                mismatch = _process.environment_error(w.proc) if not v.connected else None
                if mismatch is not None:
                    self._broken_by(mismatch)
                elif not v.connected and code != 0 and not _process.stop_asked(w.proc):
                    self._failed_start(f"worker {w.id} exited with code {code} before it connected")
                elif v.connected:
                    self._failures = 0
            self.disp.worker_lost(w, code, end)
            _process.release(w.proc)  # its sentinel and job handle; a long-lived pool recycles many workers
        if state == TERMINATE:
            workers = self.disp.workers_now()
            for w in workers:
                _process.reap(w.proc, 1.0)
                if w.proc.is_alive():
                    w.proc.kill()
            return any(w.proc.is_alive() for w in workers)
        if self._failures and any(v.connected and not v.retiring for v in self.disp.views()):
            self._failures = 0  # a worker connected: the next failure starts the backoff afresh
        busy = self.disp.busy()
        if (state == RUN or busy) and self.min != self.max:  # also after close(), while work is left
            self._autoscale(self.disp.views(), now)
        if state == RUN or busy:
            self.start_workers()
        elif state == CLOSE:
            workers = self.disp.workers_now()
            for w in workers:
                self.disp.retire(w)
            return bool(workers)
        return True

    # -- the thread --------------------------------------------------------------------------------
    def _run(self, ref: "weakref.ref[Any]") -> None:
        """The pool's upkeep thread: a round every 0.1 s or when woken, until the pool is finished."""
        try:
            while True:
                self.wake.wait(_UPKEEP_S)
                self.wake.clear()
                if not self._hold and ref() is None:
                    self._collected()
                    return
                if not self.once():
                    return
        except Exception as exc:
            log.exception("roving pool: the upkeep thread failed")
            # nobody would deliver results any more: fail what is pending rather than hang get()
            self.disp.fail_all(f"the pool's upkeep thread failed: {exc!r}")
        finally:
            for wid in list(self._sentinels):
                self._unwatch(wid)
            self.disp.detach()
            self.runner.stop(5.0)

    def _collected(self) -> None:
        """The pool was garbage-collected: kill its workers (reaped as any child is) and fail what was
        pending."""
        for w in self.disp.workers_now():
            try:
                w.proc.kill()
            except Exception:
                pass
        self.disp.fail_all("the pool was garbage-collected before this task finished")


#: Heartbeats a second the parent takes from all of a pool's workers together, at most, as far as
#: ``pool_heartbeat_timeout`` allows (``beat_interval``).
BEATS_PER_S = 200


def beat_interval(interval: float, timeout: float, workers: int) -> float:
    """Seconds between one worker's heartbeats: ``heartbeat_interval``, longer in a large pool so that
    all of them together send the parent at most ``BEATS_PER_S`` a second (a thousand idle workers
    beating every second cost it and them a third of a core), but at least ten a ``timeout``."""
    return max(interval, min(timeout / 10, workers / BEATS_PER_S))


def _silent(v: WorkerView, now: float, timeout: float) -> bool:
    """Connected and not heard from for ``timeout`` seconds."""
    return v.connected and now - v.seen > timeout


def _cut_off(v: WorkerView, now: float, timeout: float) -> bool:
    """Its connection broke ``timeout`` seconds ago or more, and it has not said HELLO again since."""
    return bool(v.unreachable) and now - v.unreachable > timeout


def _job_ended(ref: "weakref.ref[Upkeep]", worker_id: int, proc: Any) -> None:
    """The sentinel thread's call (holding neither the upkeep nor the process)."""
    upkeep = ref()
    if upkeep is not None:
        upkeep.job_ended(worker_id)
