"""Pool: :class:`multiprocessing.pool.Pool` whose workers are roving processes, and which survives them.

Workers pull work: each asks the parent for a unit of work when it has none (and, once its tasks have
proved short, for the next one while it runs the current), so no task waits at a busy worker while
another is idle, and a worker that joins late gets work at once. The parent's side runs on its node's
I/O thread and on one upkeep thread of the pool; callbacks run on a third thread; never in the caller's.

Guarantees:

* A task that raises fails with that exception, its remote traceback attached as ``__cause__``
  (:class:`multiprocessing.pool.RemoteTraceback`), as in multiprocessing; it is not retried and the worker
  lives on. A result that cannot be pickled fails its task with ``MaybeEncodingError``.
* A worker that ends (killed, crashed, its job lost) costs only the items whose results had not reached
  the parent: they run again on other workers, each result is delivered exactly once and ``map``/``imap``
  keep input order. A replacement starts. An item that was running on ``max_task_retries`` workers that
  died fails with :class:`WorkerLostError`; it is never retried endlessly.
* :meth:`Pool.resize` grows or shrinks a running pool; a worker that leaves first runs what it holds.
* ``Pool(processes=(min, max))`` scales itself: while work waits and no worker is free it starts workers
  (up to ``max``); a worker idle for ``idle_timeout`` seconds leaves (down to ``min``). A worker that
  fails to start (its job refused, or it exits before connecting) is logged with the reason, counted in
  :attr:`Pool.start_failures`, and started again after a backoff that doubles up to 10 s; after
  ``pool_start_failures`` (default 5) such failures in a row with no worker connecting, the pool gives up:
  pending results and later calls raise :class:`PoolStartError`, naming the address workers were to reach.
* Resources: each worker is a job asking the backend for ``Pool(resources={"cpu": .., "memory": ..,
  "gpu": ..})`` or, when the pool was given none, for what the task function declares with
  :func:`meta`; what neither says comes from the configuration (``cpu``, ``memory``, ``gpu``). The
  workers of a pool all have one shape: a function declaring more than they have reshapes a pool without
  ``resources=`` (its workers leave after running what they hold, new ones start), and is a ValueError
  for a pool whose ``resources=`` do not cover it.
* Liveness: a worker's job ending (its process sentinel), and heartbeats over the transport: a worker
  silent for the ``pool_heartbeat_timeout`` option's seconds (default 30) while its job runs is killed
  and counts as lost. A worker whose connection to the parent breaks while both live (a network drop)
  reconnects when it next talks (at once when idle) and says HELLO again; the parent puts the units it
  held back in line (results lost with the connection are computed again; none counts twice). One that
  cannot be reached and has not reconnected within ``pool_heartbeat_timeout`` is killed and counts as lost.
* Every ``get``/``next``/``wait`` takes a timeout; ``get`` raises :class:`multiprocessing.TimeoutError`.
* Arguments and the function are pickled in the calling thread: one that cannot be pickled fails the
  call's result (``apply_async``, ``map_async``) or raises at once (``imap``). A plain function is pickled
  once per pool (the first time it is given) and workers keep it, so later calls send only its id; a
  function defined in ``__main__`` therefore carries the values of the globals it uses as they were then.
* ``map``, ``starmap``, ``imap`` and ``imap_unordered`` take ``progress=True``: a bar on stderr with the
  items done of the total, the rate and the time left, redrawn as results arrive.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from .. import config as _config
from ..backends import Resources
from ..process import Process, cpu_count
from ..transport import timeouts
from ..transport.serialize import SerializationError
from . import _protocol as P
from . import _worker
from ._dispatch import Dispatcher, WorkerState, register, unregister
from ._progress import Progress
from ._results import (ApplyResult, AsyncResult, CallbackRunner, IMapIterator, IMapUnorderedIterator,
                       MapResult, WorkerLostError)

__all__ = ["Pool", "AsyncResult", "ApplyResult", "MapResult", "IMapIterator", "IMapUnorderedIterator",
           "WorkerLostError", "PoolStartError", "meta", "Progress"]

log = logging.getLogger(__name__)



class PoolStartError(OSError):
    """Workers failed to start ``pool_start_failures`` times in a row with none connecting (their
    machines cannot reach this one, or their jobs are refused): the pool gives up; pending results and
    every later call raise it. The message has the last reason and the address workers were to reach."""


RUN, CLOSE, TERMINATE = "RUN", "CLOSE", "TERMINATE"
_UPKEEP_S = 0.1
_MAX_BACKOFF_S = 10.0
_pool_ids = itertools.count(1)
_RESOURCE_KEYS = ("cpu", "memory", "gpu")


def meta(*, cpu: Optional[float] = None, memory: Optional[Any] = None,
         gpu: Optional[int] = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare what a worker running the decorated function needs: ``cpu``, ``memory`` (bytes or a
    string like ``"2G"``), ``gpu``. A pool it is given to asks the backend for workers of that shape
    (see :class:`Pool`); what is left out comes from the configuration. ValueError for a bad value."""
    want = _resources({"cpu": cpu, "memory": memory, "gpu": gpu}, "roving.meta()")

    def mark(func: Callable[..., Any]) -> Callable[..., Any]:
        func.__roving_meta__ = want
        return func

    return mark


def _resources(given: Any, where: str) -> Dict[str, Any]:
    """Checked resource overrides, without the ones left out (None)."""
    if isinstance(given, Resources):
        given = {"cpu": given.cpu, "memory": given.memory, "gpu": given.gpu}
    unknown = set(given) - set(_RESOURCE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown resources {sorted(unknown)}; use cpu, memory, gpu")
    out = {k: v for k, v in given.items() if v is not None}
    try:
        if "cpu" in out and not float(out["cpu"]) > 0:
            raise ValueError("cpu must be positive")
        if "memory" in out:
            _config.parse_memory(out["memory"])
        if "gpu" in out and (int(out["gpu"]) != out["gpu"] or out["gpu"] < 0):
            raise ValueError("gpu must be a whole number, 0 or more")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: bad resources {given!r}: {exc}") from None
    return out


def _covers(have: Dict[str, Any], need: Dict[str, Any]) -> bool:
    """Whether a worker with resources ``have`` can run a function that asks for ``need``."""
    cfg = _config.current()
    base = {"cpu": cfg.cpu, "memory": cfg.memory, "gpu": cfg.gpu}
    full = {**base, **have}
    for key, value in need.items():
        got = full[key]
        if key == "memory":  # none asked: the cluster's default, which may be less
            if got is None or _config.parse_memory(got) < _config.parse_memory(value):
                return False
        elif got < value:
            return False
    return True


def _meta_of(func: Any) -> Optional[Dict[str, Any]]:
    return getattr(func, "__roving_meta__", None) or getattr(getattr(func, "func", None), "__roving_meta__",
                                                           None)


class Pool:
    """A pool of worker processes; see :class:`multiprocessing.pool.Pool` and the module docstring.

    ``processes`` defaults to the CPUs the backend offers; a pair ``(min, max)`` makes the pool scale
    itself between the two, leaving workers idle for ``idle_timeout`` seconds. ``max_task_retries``
    bounds how many dead workers one item may cost before it fails with :class:`WorkerLostError`.
    ``resources`` (a dict of ``cpu``, ``memory``, ``gpu``, or a :class:`roving.backends.Resources`) is
    what each worker's job asks the backend for.

    A running pool that is garbage-collected without close() or terminate() gives multiprocessing's
    ``ResourceWarning`` and its workers are killed; a closed one finishes its work first.
    """

    def __init__(self, processes: Union[None, int, Tuple[int, int]] = None,
                 initializer: Optional[Callable[..., Any]] = None,
                 initargs: Iterable[Any] = (), maxtasksperchild: Optional[int] = None,
                 context: Any = None, *, max_task_retries: int = 3, resources: Any = None,
                 idle_timeout: float = 10.0) -> None:
        if processes is None:
            processes = cpu_count() or 1
        if isinstance(processes, (tuple, list)):
            if len(processes) != 2 or not 0 <= processes[0] <= processes[1] or processes[1] < 1:
                raise ValueError(f"processes=(min, max) needs 0 <= min <= max and max >= 1, not {processes!r}")
            self._min, self._max = int(processes[0]), int(processes[1])
            processes = self._min
        elif processes < 1:
            raise ValueError("Number of processes must be at least 1")
        else:
            self._min = self._max = processes
        if idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive")
        if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_task_retries < 1:
            raise ValueError("max_task_retries must be at least 1")
        self._shape = _resources(resources, "Pool(resources=...)") if resources is not None else {}
        self._fixed_shape = resources is not None
        self._idle_timeout = idle_timeout
        self._idle_since: Dict[int, float] = {}
        self._heartbeat_timeout = _config.current().pool_heartbeat_timeout
        #: Workers that could not start, as (time.time(), reason); the latest 100.
        self.start_failures: List[Tuple[float, str]] = []
        self._initializer, self._initargs = initializer, tuple(initargs)
        self._maxtasks = maxtasksperchild
        self._size = processes
        self._state = RUN
        self._runner = CallbackRunner()
        self._disp = Dispatcher(next(_pool_ids), max_task_retries)
        register(self._disp)
        self._worker_ids = itertools.count(1)
        self._workers: Dict[int, WorkerState] = {}
        #: multiprocessing's ``_pool``: workers leave it when they end while the pool runs (replaced or
        #: retired); after close()/terminate() the workers of the end stay in it, ended.
        self._members: Dict[int, Process] = {}
        self._lock = threading.RLock()  # guards _workers, _size, _state
        self._failures = 0
        self._abandoned: List[Process] = []  # killed workers whose jobs have not ended yet
        #: Set when workers failed to start pool_start_failures times in a row: every call raises it.
        self._broken: Optional[PoolStartError] = None
        self._next_start = 0.0
        self._wake = threading.Event()
        # The upkeep thread and the finalizer hold the pool weakly: a running pool nobody references any
        # more is collected, warned about (__del__) and its workers killed, as multiprocessing's is.
        self._finalizer = weakref.finalize(self, self._wake.set)  # the upkeep thread then cleans up
        self._finalizer.atexit = False
        self._start_workers()
        self._hold: List[Pool] = []
        self._upkeep = threading.Thread(target=_maintain, args=(weakref.ref(self), self._hold, self._wake,
                                                                  self._disp, self._runner, self._workers,
                                                                  self._lock),
                                        name="roving-pool", daemon=True)
        self._upkeep.start()

    # -- the multiprocessing API ---------------------------------------------------------------
    def apply(self, func: Callable[..., Any], args: Sequence[Any] = (), kwds: Optional[dict] = None) -> Any:
        """``func(*args, **kwds)`` in a worker; blocks until done."""
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func: Callable[..., Any], args: Sequence[Any] = (), kwds: Optional[dict] = None,
                    callback: Optional[Callable[[Any], Any]] = None,
                    error_callback: Optional[Callable[[BaseException], Any]] = None) -> AsyncResult:
        self._check_running()
        self._fit(func)
        result = AsyncResult(self._runner, callback, error_callback)
        result._pool = self  # until it is complete, as multiprocessing's results do
        self._submit(result, func, P.APPLY, ((args if type(args) is tuple else tuple(args), kwds or {}),), 1,
                     inline=True)
        return result

    def map(self, func: Callable[[Any], Any], iterable: Iterable[Any],
            chunksize: Optional[int] = None, *, progress: bool = False) -> List[Any]:
        """``[func(x) for x in iterable]`` across the workers, in order; blocks until done.
        ``progress=True``: a progress bar on stderr (see the module docstring)."""
        result = self._map_async(func, iterable, P.MAP, chunksize, progress=progress)
        try:
            return result.get()
        finally:
            if result._progress is not None:
                result._progress.join(1.0)

    def map_async(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: Optional[int] = None,
                  callback: Optional[Callable] = None, error_callback: Optional[Callable] = None) -> MapResult:
        return self._map_async(func, iterable, P.MAP, chunksize, callback, error_callback)

    def starmap(self, func: Callable[..., Any], iterable: Iterable[Sequence[Any]],
                chunksize: Optional[int] = None, *, progress: bool = False) -> List[Any]:
        """``[func(*args) for args in iterable]``; blocks until done."""
        result = self._map_async(func, iterable, P.STAR, chunksize, progress=progress)
        try:
            return result.get()
        finally:
            if result._progress is not None:
                result._progress.join(1.0)

    def starmap_async(self, func: Callable[..., Any], iterable: Iterable[Sequence[Any]],
                      chunksize: Optional[int] = None, callback: Optional[Callable] = None,
                      error_callback: Optional[Callable] = None) -> MapResult:
        return self._map_async(func, iterable, P.STAR, chunksize, callback, error_callback)

    def imap(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int = 1, *,
             progress: bool = False) -> IMapIterator:
        """Results in input order as they come. An iterator is read by a thread of the pool, as the
        caller iterates; an item that cannot be pickled fails that position and ends the reading.
        ``progress=True``: a bar on stderr counting the results that arrived (the total once known)."""
        return self._imap(IMapIterator, func, iterable, chunksize, progress)

    def imap_unordered(self, func: Callable[[Any], Any], iterable: Iterable[Any],
                       chunksize: int = 1, *, progress: bool = False) -> IMapIterator:
        """Results in the order they finish."""
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize, progress)

    def close(self) -> None:
        """Accept no more work; workers leave once everything submitted is done."""
        with self._lock:
            if self._state == RUN:
                self._state = CLOSE
        self._keep_until_done()
        self._wake.set()

    def terminate(self) -> None:
        """Stop the workers now; results not yet delivered fail with RuntimeError."""
        with self._lock:
            self._state = TERMINATE
            workers = list(self._workers.values())
        self._keep_until_done()
        for w in workers:
            try:
                w.proc.kill()
            except Exception:
                pass
        self._disp.fail_all("the pool was terminated before this task finished")
        self._wake.set()

    def _keep_until_done(self) -> None:
        """Closed or terminated on purpose: the upkeep thread holds the pool until its work is done, so
        dropping it then neither warns nor kills its workers."""
        self._finalizer.detach()
        with self._lock:
            if not self._hold:
                self._hold.append(self)

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the workers to exit after close() or terminate() (up to ``timeout`` seconds)."""
        if self._state == RUN:
            raise ValueError("Pool is still running")
        self._upkeep.join(timeouts.limit(timeout))

    def resize(self, processes: int) -> None:
        """Grow or shrink the pool to ``processes`` workers without losing work.

        Shrinking retires idle workers first, then busy ones, which leave after running what they hold.
        """
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        self._check_running()
        with self._lock:
            self._min = self._max = processes
            self._size = processes
            live = [w for w in self._workers.values() if not w.retiring]
            extra = len(live) - processes
            if extra > 0:
                live.sort(key=lambda w: (len(w.units) > 0, w.ident is not None))
                for w in live[:extra]:
                    self._disp.retire(w)
        self._wake.set()

    @property
    def _pool(self) -> List[Process]:
        """The worker processes, with multiprocessing's meaning: those running now (a replaced worker
        leaves the list, its replacement joins it); after close()/terminate() and join(), the pool's last
        workers, each with ``is_alive()`` False."""
        with self._lock:
            return [self._members[wid] for wid in sorted(self._members)]

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # _warn is bound at definition: at interpreter exit the warnings module may be gone already
        if getattr(self, "_state", None) == RUN:
            _warn(f"unclosed running multiprocessing pool {self!r}", ResourceWarning, source=self)

    @property
    def processes(self) -> int:
        """How many workers the pool keeps now (what resize() last set, or autoscaling chose)."""
        return self._size

    def __enter__(self) -> "Pool":
        self._check_running()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()

    def __repr__(self) -> str:
        return f"<roving.Pool state={self._state} pool_size={self._size}>"

    def __reduce__(self) -> Any:
        raise NotImplementedError("pool objects cannot be passed between processes or pickled")

    # -- submitting ----------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._state != RUN:
            raise ValueError("Pool not running")

    def _fit(self, func: Any) -> None:
        """Give the workers the shape ``func`` declares with :func:`meta` (see the module docstring)."""
        need = _meta_of(func)
        if not need or need == self._shape or _covers(self._shape, need):
            return
        if self._fixed_shape:
            name = getattr(func, "__qualname__", repr(func))
            raise ValueError(f"{name} asks for {need} (roving.meta) but this pool's workers have "
                             f"{self._shape} (Pool(resources=...)): give it a pool whose resources "
                             f"cover it")
        with self._lock:
            if _covers(self._shape, need):
                return
            log.info("roving pool: %s asks for workers with %s; the pool's workers are replaced",
                     getattr(func, "__qualname__", func), need)
            self._shape = dict(need)
            for w in list(self._workers.values()):
                self._disp.retire(w)
        self._wake.set()

    def _submit(self, result: Any, func: Callable[..., Any], mode: int, items: Sequence[Any],
                chunksize: int, inline: bool = False) -> None:
        try:
            self._disp.submit(result, func, mode, items, chunksize, inline)
        except SerializationError as exc:
            if isinstance(result, IMapIterator):
                raise
            result._complete(False, exc)

    def _map_async(self, func: Callable[..., Any], iterable: Iterable[Any], mode: int,
                   chunksize: Optional[int], callback: Optional[Callable] = None,
                   error_callback: Optional[Callable] = None, progress: bool = False) -> MapResult:
        self._check_running()
        self._fit(func)
        items = iterable if isinstance(iterable, (list, tuple)) else list(iterable)
        if chunksize is None:
            chunksize, extra = divmod(len(items), max(self._size, self._max) * 4)
            if extra:
                chunksize += 1
        result = MapResult(self._runner, len(items), callback, error_callback)
        if not result.ready():
            result._pool = self  # until it is complete, as multiprocessing's results do
        if progress:
            result._progress = self._progress_bar(func, len(items))
        self._submit(result, func, mode, items, chunksize)
        return result

    @staticmethod
    def _progress_bar(func: Any, total: Optional[int]) -> Progress:
        bar = Progress(total, getattr(func, "__qualname__", None) or type(func).__qualname__)
        if total == 0:
            bar.finish()
        return bar

    def _imap(self, kind: type, func: Callable[..., Any], iterable: Iterable[Any],
              chunksize: int, progress: bool = False) -> IMapIterator:
        self._check_running()
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        self._fit(func)
        if isinstance(iterable, (list, tuple, range)):
            result = kind(len(iterable))
            result._pool = self  # until it is complete, as multiprocessing's results do
            if progress:
                result._progress = self._progress_bar(func, len(iterable))
            self._submit(result, func, P.MAP, iterable, chunksize)
            return result
        result = kind(None)
        result._pool = self  # until it is complete, as multiprocessing's results do
        if progress:
            result._progress = self._progress_bar(func, None)
        job = self._disp.open_job(result, func, P.MAP)
        threading.Thread(target=self._feed, args=(job, result, iter(iterable), chunksize),
                         name="roving-pool-feeder", daemon=True).start()
        return result

    def _feed(self, job: Any, result: IMapIterator, items: Iterator[Any], chunksize: int) -> None:
        """Read an imap's iterator in chunks and queue them; the iterator's length is known at its end."""
        count = 0
        try:
            while self._state != TERMINATE:
                chunk = list(itertools.islice(items, chunksize))
                if not chunk:
                    break
                self._disp.add_items(job, count, chunk)
                count += len(chunk)
        except Exception as exc:  # the iterable raised, or an item cannot be pickled
            result._set_run(count, False, [exc])
            count += 1
        finally:
            result._set_length(count)
            self._disp.close_job(job)

    # -- worker upkeep (the pool's thread) -----------------------------------------------------
    def _start_workers(self) -> None:
        if self._broken is not None:
            return
        with self._lock:
            live = sum(1 for w in self._workers.values() if not w.retiring)
            want = self._size - live
        now = time.monotonic()
        if want <= 0 or now < self._next_start:
            return
        node = self._disp.node
        cfg = _config.current()
        for _ in range(want):
            worker_id = next(self._worker_ids)
            proc = Process(target=_worker.serve, name=f"PoolWorker-{self._disp.pool_id}-{worker_id}",
                           args=(node.address, self._disp.pool_id, worker_id, self._initializer,
                                 self._initargs, self._maxtasks, cfg.connect_timeout), daemon=True,
                           resources=self._shape)
            w = WorkerState(worker_id, proc)
            try:
                proc.start()
            except SerializationError:
                raise
            except Exception as exc:
                self._failed_start(f"could not start a worker: {exc}")
                return
            with self._lock:
                self._workers[worker_id] = w
                self._members[worker_id] = proc
            self._disp.add_worker(w)

    def _failed_start(self, why: str) -> None:
        self._failures += 1
        self.start_failures.append((time.time(), why))
        del self.start_failures[:-100]
        limit = _config.current().pool_start_failures
        if self._broken is not None:  # a worker started before the pool gave up failed too
            return
        if self._failures >= limit:
            node = self._disp.node
            self._broken = PoolStartError(
                f"roving pool: {self._failures} workers in a row failed to start and none connected "
                f"(pool_start_failures={limit}); the last: {why}. Workers were to connect to this process at "
                f"{node.address} (chosen by {node.why}); their output says why they could not.")
            log.error("%s", self._broken)
            self._disp.fail_all(self._broken)
            return
        delay = min(_MAX_BACKOFF_S, 0.1 * 2 ** self._failures)
        self._next_start = time.monotonic() + delay
        log.warning("roving pool: %s; trying again in %.1f s", why, delay)

    def _autoscale(self, workers: List[WorkerState], now: float) -> None:
        """Between ``min`` and ``max`` workers: grow while work waits and no worker is free, shrink by
        workers idle for ``idle_timeout`` seconds."""
        waiting, free = self._disp.backlog()
        live = [w for w in workers if not w.retiring]
        starting = sum(1 for w in live if w.ident is None)
        with self._lock:
            if waiting and not free and self._size < self._max:
                grow = min(self._max - self._size, max(0, waiting - starting))
                if grow:
                    log.info("roving pool: %d unit(s) of work waiting; %d more worker(s)", waiting, grow)
                    self._size += grow
                return
            for w in live:
                if w.units or w.ident is None:
                    self._idle_since.pop(w.id, None)
                else:
                    self._idle_since.setdefault(w.id, now)
            idle = sorted((since, wid) for wid, since in self._idle_since.items()
                          if now - since >= self._idle_timeout)
            extra = min(len(idle), len(live) - self._min)
            for _, wid in idle[:max(0, extra)]:
                w = self._workers.get(wid)
                if w is not None:
                    self._idle_since.pop(wid, None)
                    self._disp.retire(w)
                    self._size -= 1

    def _abandon(self, w: WorkerState) -> None:
        """Kill ``w`` and count it as lost at once, without waiting for its job to end: a job on a machine
        cut off from the cluster may not end for minutes (or until the machine is back), and its work must
        not wait that long. A late word from it is ignored (it is gone); its job is reaped when it ends."""
        w.unreachable = 0.0
        w.proc.kill()
        with self._lock:
            self._workers.pop(w.id, None)
            self._idle_since.pop(w.id, None)
            if self._state == RUN:
                self._members.pop(w.id, None)
        self._disp.worker_lost(w, None)
        self._abandoned.append(w.proc)

    def _upkeep_once(self) -> bool:
        """One round of upkeep; False once the pool is finished."""
        with self._lock:
            workers = list(self._workers.values())
            state = self._state
        now = time.monotonic()
        if self._abandoned:
            ended = [p for p in self._abandoned if not p.is_alive()]
            for p in ended:
                self._abandoned.remove(p)
                p._release()
        for w in workers:
            if w.proc.is_alive():
                silent = w.ident is not None and now - w.seen > self._heartbeat_timeout
                cut_off = w.unreachable and now - w.unreachable > self._heartbeat_timeout
                if (silent or cut_off) and state != TERMINATE:
                    if silent:
                        log.warning("roving pool: worker %s sent no heartbeat for %.0f s; it is killed and counts "
                                    "as lost: its work goes to other workers", w.id, now - w.seen)
                    else:
                        log.warning("roving pool: worker %s cannot be reached (its connection to the parent broke "
                                    "%.0f s ago) and has not reconnected; it is killed and counts as lost: its "
                                    "work goes to other workers", w.id, now - w.unreachable)
                    self._abandon(w)
                continue
            code = w.proc.exitcode
            with self._lock:
                self._workers.pop(w.id, None)
                self._idle_since.pop(w.id, None)
                if self._state == RUN:
                    self._members.pop(w.id, None)
            if state != TERMINATE:
                if w.ident is None and code != 0:
                    self._failed_start(f"worker {w.id} exited with code {code} before it connected")
                elif w.ident is not None:
                    self._failures = 0
            self._disp.worker_lost(w, code)
            w.proc._release()  # its sentinel and job handle; a long-lived pool recycles many workers
        if state == TERMINATE:
            with self._lock:
                workers = list(self._workers.values())
            for w in workers:
                w.proc._wait(1.0)
                if w.proc.is_alive():
                    w.proc.kill()
            return any(w.proc.is_alive() for w in workers)
        if self._failures and any(w.ident is not None and not w.retiring for w in workers):
            self._failures = 0  # a worker connected: the next failure starts the backoff afresh
        busy = self._disp.busy()
        if (state == RUN or busy) and self._min != self._max:  # also after close(), while work is left
            self._autoscale(workers, now)
        if state == RUN or busy:
            self._start_workers()
        elif state == CLOSE:
            with self._lock:
                workers = list(self._workers.values())
            for w in workers:
                self._disp.retire(w)
            return bool(workers)
        return True


def _maintain(ref: "weakref.ref[Pool]", hold: List["Pool"], wake: threading.Event, disp: Dispatcher,
              runner: CallbackRunner, workers: Dict[int, WorkerState], lock: threading.RLock) -> None:
    """The pool's upkeep thread. It holds a running pool only while one round of upkeep runs; one that
    was closed or terminated (put in ``hold``) until its work is done. A pool garbage-collected while it
    ran is cleaned up here (never in the thread that happened to drop the last reference, which may be
    the transport's own, holding the dispatcher's lock)."""
    try:
        while True:
            wake.wait(_UPKEEP_S)
            wake.clear()
            pool = hold[0] if hold else ref()
            if pool is None:
                _collected(workers, lock, disp)
                return
            if not pool._upkeep_once():
                return
            pool = None
    except Exception as exc:
        log.exception("roving pool: the upkeep thread failed")
        # nobody would deliver results any more: fail what is pending rather than hang get()
        disp.fail_all(f"the pool's upkeep thread failed: {exc!r}")
    finally:
        unregister(disp)
        runner.stop(5.0)


def _collected(workers: Dict[int, WorkerState], lock: threading.RLock, disp: Dispatcher) -> None:
    """A pool was garbage-collected: kill its workers (reaped as any child is) and fail what was pending."""
    with lock:
        procs = [w.proc for w in workers.values()]
    for proc in procs:
        try:
            proc.kill()
        except Exception:
            pass
    disp.fail_all("the pool was garbage-collected before this task finished")
