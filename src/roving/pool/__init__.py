"""Pool: :class:`multiprocessing.pool.Pool` whose workers are roving processes, and which survives them.

Workers pull work: each asks the parent for a unit of work when it has none (and, once its tasks have
proved short, for the next one while it runs the current), so no task waits at a busy worker while
another is idle, and a worker that joins late gets work at once. The parent's side runs on its node's
I/O thread and on one upkeep thread of the pool; callbacks run on a third thread; never in the caller's.

Guarantees:

* A task that raises fails with that exception, its remote traceback attached as ``__cause__``
  (:class:`multiprocessing.pool.RemoteTraceback`), as in multiprocessing; it is not retried and the worker
  lives on. A result that cannot be pickled fails its task with ``MaybeEncodingError``, whose
  ``__cause__`` is the pickling error (with the worker's traceback). An item whose function or arguments
  cannot be unpickled in the worker fails with that error, its ``__cause__`` an
  :class:`UnloadedTraceback` (a RemoteTraceback): the item never ran.
* A worker that ends (killed, crashed, its job lost) costs only the items whose results had not reached
  the parent: they run again on other workers, each result is delivered exactly once and ``map``/``imap``
  keep input order. A replacement starts. An item that was running on ``max_task_retries`` workers that
  died fails with :class:`WorkerLostError`; it is never retried endlessly.
* Memory (:mod:`roving.pool._memory`): workers report their memory with their heartbeats; the pool's
  figures (dashboard, ``/metrics``) show each worker's and each call's peak. A worker above
  ``worker_memory_limit`` (loky's ``max_memory_per_child``) after a task is replaced before it takes
  another. A worker killed for memory (its cgroup's OOM kill on the local backend, Slurm's
  ``OUT_OF_MEMORY``, Docker's or a pod's ``OOMKilled``) is reported so; an item whose workers were killed
  for memory ``max_memory_kills`` times in a row (default 2) fails with :class:`OutOfMemoryError`, whose
  message says "out of memory", with the peak memory seen and the limit, rather than kill more workers.
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
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from .. import backends
from .. import config as _config
from ..process import Process, cpu_count
from ..transport import timeouts
from ..transport.serialize import SerializationError
from . import _protocol as P
from . import _results, _shape
from ._dispatch import Dispatcher
from ._progress import Progress
from ._results import (ApplyResult, AsyncResult, CallbackRunner, IMapIterator, IMapUnorderedIterator,
                       MapResult, UnloadedTraceback)
from ._rerun import rerun
from ._shape import meta, meta_of
from .errors import OutOfMemoryError, PoolError, PoolStartError, WorkerLostError
from ._upkeep import CLOSE, RUN, TERMINATE, Upkeep  # noqa: F401  (CLOSE: multiprocessing.pool has the three)


#: A call's argument (S) and result (T): what map and apply hand back is what ``func`` returns.
S = TypeVar("S")
T = TypeVar("T")

__all__ = ["Pool", "AsyncResult", "ApplyResult", "MapResult", "IMapIterator", "IMapUnorderedIterator",
           "PoolError", "WorkerLostError", "OutOfMemoryError", "PoolStartError", "UnloadedTraceback", "meta",
           "Progress", "rerun"]

_pool_ids = itertools.count(1)


class Pool:
    """A pool of worker processes; see :class:`multiprocessing.pool.Pool` and the module docstring.

    ``processes`` defaults to the CPUs the backend offers; a pair ``(min, max)`` makes the pool scale
    itself between the two, leaving workers idle for ``idle_timeout`` seconds. ``max_task_retries``
    bounds how many dead workers one item may cost before it fails with :class:`WorkerLostError`.
    ``resources`` (a dict of ``cpu``, ``memory``, ``gpu``, or a :class:`roving.backends.Resources`) is
    what each worker's job asks the backend for. ``worker_memory_limit`` (or ``max_memory_per_child``;
    bytes, or a size such as ``"2G"``): a worker whose resident set is above it after a task is replaced.
    ``max_memory_kills``: how many workers in a row an item may see killed for memory before it fails
    with :class:`OutOfMemoryError`.

    A running pool that is garbage-collected without close() or terminate() gives multiprocessing's
    ``ResourceWarning`` and its workers are killed; a closed one finishes its work first.

    Inside: the dispatcher (:mod:`._dispatch`) holds the work and the one registry of workers; the
    upkeep (:mod:`._upkeep`) starts, scales and watches the workers; result objects
    (:mod:`._results`) are written only through that module's writer functions, which the dispatcher
    calls (and the pool, for a call that could not be queued at all). The pool checks and submits calls.
    """

    def __init__(self, processes: Union[None, int, Tuple[int, int]] = None,
                 initializer: Optional[Callable[..., Any]] = None,
                 initargs: Iterable[Any] = (), maxtasksperchild: Optional[int] = None,
                 context: object = None, *, max_task_retries: int = 3,
                 resources: Optional[backends.ResourceRequest] = None,
                 idle_timeout: float = 10.0, worker_memory_limit: Union[int, str, None] = None,
                 max_memory_per_child: Union[int, str, None] = None, max_memory_kills: int = 2) -> None:
        if processes is None:
            processes = cpu_count() or 1
        if isinstance(processes, (tuple, list)):
            if len(processes) != 2 or not 0 <= processes[0] <= processes[1] or processes[1] < 1:
                raise ValueError(f"processes=(min, max) needs 0 <= min <= max and max >= 1, not {processes!r}")
            low, high = int(processes[0]), int(processes[1])
            processes = low
        elif processes < 1:
            raise ValueError("Number of processes must be at least 1")
        else:
            low = high = processes
        if idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive")
        if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_task_retries < 1:
            raise ValueError("max_task_retries must be at least 1")
        memory_limit = _memory_limit(worker_memory_limit, max_memory_per_child)
        if not isinstance(max_memory_kills, int) or max_memory_kills < 1:
            raise ValueError(f"max_memory_kills must be an int of at least 1, not {max_memory_kills!r}")
        shape = _shape.resources(resources, "Pool(resources=...)") if resources is not None else {}
        self._fixed_shape = resources is not None
        self._runner = CallbackRunner()
        self._disp = Dispatcher(next(_pool_ids), max_task_retries, max_memory_kills)
        self._disp.attach()
        self._upkeep = Upkeep(self._disp, self._runner, processes, low, high, idle_timeout=idle_timeout,
                              shape=shape, initializer=initializer, initargs=tuple(initargs),
                              maxtasks=maxtasksperchild, memory_limit=memory_limit)
        #: Workers that could not start, as (time.time(), reason); the latest 100.
        self.start_failures: List[Tuple[float, str]] = self._upkeep.start_failures
        # The upkeep thread holds the pool weakly: a running pool nobody references any more is
        # collected, warned about (__del__) and its workers killed, as multiprocessing's is.
        self._finalizer = weakref.finalize(self, self._upkeep.wake.set)  # the upkeep thread then cleans up
        self._finalizer.atexit = False
        self._upkeep.start_workers()
        self._upkeep.start(self)

    # -- the multiprocessing API ---------------------------------------------------------------
    def apply(self, func: Callable[..., T], args: Sequence[object] = (),
              kwds: Optional[Mapping[str, object]] = None) -> T:
        """``func(*args, **kwds)`` in a worker; blocks until done."""
        return self.apply_async(func, args, None if kwds is None else dict(kwds)).get()

    def apply_async(self, func: Callable[..., Any], args: Sequence[Any] = (), kwds: Optional[dict] = None,
                    callback: Optional[Callable[[Any], Any]] = None,
                    error_callback: Optional[Callable[[BaseException], Any]] = None) -> AsyncResult:
        self._check_running()
        self._fit(func)
        # the result holds the pool until it is complete, as multiprocessing's results do
        result = AsyncResult(self._runner, callback, error_callback, pool=self)
        self._submit(result, func, P.APPLY, ((args if type(args) is tuple else tuple(args), kwds or {}),), 1,
                     inline=True)
        return result

    def map(self, func: Callable[[S], T], iterable: Iterable[S],
            chunksize: Optional[int] = None, *, progress: bool = False) -> List[T]:
        """``[func(x) for x in iterable]`` across the workers, in order; blocks until done.
        ``progress=True``: a progress bar on stderr (see the module docstring)."""
        return self._map(func, iterable, P.MAP, chunksize, progress)

    def map_async(self, func: Callable[[S], object], iterable: Iterable[S], chunksize: Optional[int] = None,
                  callback: Optional[Callable] = None, error_callback: Optional[Callable] = None) -> MapResult:
        return self._start_map(func, iterable, P.MAP, chunksize, callback, error_callback)[0]

    def starmap(self, func: Callable[..., T], iterable: Iterable[Sequence[object]],
                chunksize: Optional[int] = None, *, progress: bool = False) -> List[T]:
        """``[func(*args) for args in iterable]``; blocks until done."""
        return self._map(func, iterable, P.STAR, chunksize, progress)

    def starmap_async(self, func: Callable[..., object], iterable: Iterable[Sequence[object]],
                      chunksize: Optional[int] = None, callback: Optional[Callable] = None,
                      error_callback: Optional[Callable] = None) -> MapResult:
        return self._start_map(func, iterable, P.STAR, chunksize, callback, error_callback)[0]

    def imap(self, func: Callable[[S], object], iterable: Iterable[S], chunksize: int = 1, *,
             progress: bool = False) -> IMapIterator:
        """Results in input order as they come. An iterator is read by a thread of the pool, as the
        caller iterates; an item that cannot be pickled fails that position and ends the reading.
        ``progress=True``: a bar on stderr counting the results that arrived (the total once known)."""
        return self._imap(IMapIterator, func, iterable, chunksize, progress)

    def imap_unordered(self, func: Callable[[S], object], iterable: Iterable[S],
                       chunksize: int = 1, *, progress: bool = False) -> IMapIterator:
        """Results in the order they finish."""
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize, progress)

    def close(self) -> None:
        """Accept no more work; workers leave once everything submitted is done."""
        self._finalizer.detach()  # closed on purpose: dropping the pool now neither warns nor kills
        self._upkeep.close(self)

    def terminate(self) -> None:
        """Stop the workers now; results not yet delivered fail with RuntimeError."""
        self._finalizer.detach()
        self._upkeep.terminate(self)

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
        self._upkeep.resize(processes)

    @property
    def _pool(self) -> List[Process]:
        """The worker processes, with multiprocessing's meaning: those running now (a replaced worker
        leaves the list, its replacement joins it); after close()/terminate() and join(), the pool's last
        workers, each with ``is_alive()`` False."""
        return self._upkeep.members()

    @property
    def _workers(self) -> dict:
        """The workers the dispatcher has registered now, by worker id (a snapshot; for tests)."""
        return {w.id: w for w in self._disp.workers_now()}

    @property
    def _state(self) -> str:
        """multiprocessing's ``_state`` (RUN, CLOSE, TERMINATE); its tests set it, so it can be set."""
        return self._upkeep.state

    @_state.setter
    def _state(self, state: str) -> None:
        self._upkeep.state = state

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # _warn is bound at definition: at interpreter exit the warnings module may be gone already
        if getattr(self, "_state", None) == RUN:
            _warn(f"unclosed running multiprocessing pool {self!r}", ResourceWarning, source=self)

    @property
    def processes(self) -> int:
        """How many workers the pool keeps now (what resize() last set, or autoscaling chose)."""
        return self._upkeep.size

    def __enter__(self) -> "Pool":
        self._check_running()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()

    def __repr__(self) -> str:
        return f"<roving.Pool state={self._state} pool_size={self._upkeep.size}>"

    def __reduce__(self) -> Any:
        raise NotImplementedError("pool objects cannot be passed between processes or pickled")

    # -- submitting ----------------------------------------------------------------------------
    def _check_running(self) -> None:
        upkeep = self._upkeep
        if upkeep.broken is not None:
            raise upkeep.broken
        if upkeep.state != RUN:
            raise ValueError("Pool not running")

    def _fit(self, func: Any) -> None:
        """Give the workers the shape ``func`` declares with :func:`meta` (see the module docstring)."""
        need = meta_of(func)
        if not need:
            return
        shape = self._upkeep.shape
        if need == shape or _shape.covers(shape, need):
            return
        if self._fixed_shape:
            name = getattr(func, "__qualname__", repr(func))
            raise ValueError(f"{name} asks for {need} (roving.meta) but this pool's workers have "
                             f"{shape} (Pool(resources=...)): give it a pool whose resources "
                             f"cover it")
        self._upkeep.reshape(need, func)

    def _submit(self, result: Any, func: Callable[..., Any], mode: int, items: Sequence[Any],
                chunksize: int, inline: bool = False) -> None:
        try:
            self._disp.submit(result, func, mode, items, chunksize, inline)
        except SerializationError as exc:
            if isinstance(result, IMapIterator):
                raise
            _results.fail(result, exc)

    def _map(self, func: Callable[..., Any], iterable: Iterable[Any], mode: int, chunksize: Optional[int],
             progress: bool) -> List[Any]:
        """map and starmap: the result, once every item is in; the progress bar's last line is written."""
        result, bar = self._start_map(func, iterable, mode, chunksize, progress=progress)
        try:
            return result.get()
        finally:
            if bar is not None:
                bar.join(1.0)

    def _start_map(self, func: Callable[..., Any], iterable: Iterable[Any], mode: int,
                   chunksize: Optional[int], callback: Optional[Callable] = None,
                   error_callback: Optional[Callable] = None,
                   progress: bool = False) -> Tuple[MapResult, Optional[Progress]]:
        self._check_running()
        self._fit(func)
        items = iterable if isinstance(iterable, (list, tuple)) else list(iterable)
        if chunksize is None:
            chunksize, extra = divmod(len(items), max(self._upkeep.size, self._upkeep.max) * 4)
            if extra:
                chunksize += 1
        bar = self._progress_bar(func, len(items)) if progress else None
        # the result holds the pool until it is complete, as multiprocessing's results do
        result = MapResult(self._runner, len(items), callback, error_callback, pool=self, progress=bar)
        self._submit(result, func, mode, items, chunksize)
        return result, bar

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
        # the result holds the pool until it is complete, as multiprocessing's results do
        if isinstance(iterable, (list, tuple, range)):
            bar = self._progress_bar(func, len(iterable)) if progress else None
            result = kind(len(iterable), pool=self, progress=bar)
            self._submit(result, func, P.MAP, iterable, chunksize)
            return result
        result = kind(None, pool=self, progress=self._progress_bar(func, None) if progress else None)
        call = self._disp.open_call(result, func, P.MAP)
        threading.Thread(target=self._feed, args=(call, iter(iterable), chunksize),
                         name="roving-pool-feeder", daemon=True).start()
        return result

    def _feed(self, call: Any, items: Iterator[Any], chunksize: int) -> None:
        """Read an imap's iterator in chunks and queue them; the iterator's length is known at its end."""
        count = 0
        error: Optional[BaseException] = None
        try:
            while self._upkeep.state != TERMINATE:
                chunk = list(itertools.islice(items, chunksize))
                if not chunk:
                    break
                self._disp.add_items(call, count, chunk)
                count += len(chunk)
        except Exception as exc:  # the iterable raised, or an item cannot be pickled
            error = exc
        finally:
            self._disp.close_call(call, count, error)


def _memory_limit(worker_memory_limit: Any, max_memory_per_child: Any) -> Optional[int]:
    """Bytes of ``worker_memory_limit`` or its other name ``max_memory_per_child`` (None: neither);
    ValueError for both, or for a size that is not one."""
    if worker_memory_limit is not None and max_memory_per_child is not None:
        raise ValueError("give worker_memory_limit or max_memory_per_child (the same option), not both")
    given, name = ((worker_memory_limit, "worker_memory_limit") if worker_memory_limit is not None
                   else (max_memory_per_child, "max_memory_per_child"))
    if given is None:
        return None
    try:
        return _config.parse_memory(given)
    except ValueError as exc:
        raise ValueError(f"{name}={given!r} is not a memory size ({exc}): write bytes or a size such as "
                         "\"2G\" or \"512M\"") from None
