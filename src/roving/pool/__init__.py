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
* Liveness: a worker's job ending (its process sentinel), and heartbeats over the transport: a worker
  silent for ``HEARTBEAT_TIMEOUT_S`` while its job runs is killed and counts as lost.
* Every ``get``/``next``/``wait`` takes a timeout; ``get`` raises :class:`multiprocessing.TimeoutError`.
* Arguments and the function are pickled in the calling thread: one that cannot be pickled fails the
  call's result (``apply_async``, ``map_async``) or raises at once (``imap``).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from .. import config as _config
from ..process import Process, cpu_count
from ..transport.serialize import SerializationError
from . import _protocol as P
from . import _worker
from ._dispatch import Dispatcher, WorkerState, register, unregister
from ._results import (ApplyResult, AsyncResult, CallbackRunner, IMapIterator, IMapUnorderedIterator,
                       MapResult, WorkerLostError)

__all__ = ["Pool", "AsyncResult", "ApplyResult", "MapResult", "IMapIterator", "IMapUnorderedIterator",
           "WorkerLostError"]

log = logging.getLogger(__name__)

RUN, CLOSE, TERMINATE = "RUN", "CLOSE", "TERMINATE"
_UPKEEP_S = 0.1
_MAX_BACKOFF_S = 10.0
#: A connected worker silent this long (no heartbeat, though its job runs) is killed and its work
#: redone elsewhere. Generous: a task holding the GIL in C code for long delays heartbeats.
HEARTBEAT_TIMEOUT_S = 30.0
_pool_ids = itertools.count(1)


class Pool:
    """A pool of worker processes; see :class:`multiprocessing.pool.Pool` and the module docstring.

    ``processes`` defaults to the CPUs the backend offers. ``max_task_retries`` bounds how many dead
    workers one item may cost before it fails with :class:`WorkerLostError`.
    """

    def __init__(self, processes: Optional[int] = None, initializer: Optional[Callable[..., Any]] = None,
                 initargs: Iterable[Any] = (), maxtasksperchild: Optional[int] = None,
                 context: Any = None, *, max_task_retries: int = 3, resources: Any = None) -> None:
        if processes is None:
            processes = cpu_count() or 1
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_task_retries < 1:
            raise ValueError("max_task_retries must be at least 1")
        if resources is not None:
            raise NotImplementedError("Pool(resources=...) is not supported yet by roving")
        self._initializer, self._initargs = initializer, tuple(initargs)
        self._maxtasks = maxtasksperchild
        self._size = processes
        self._state = RUN
        self._runner = CallbackRunner()
        self._disp = Dispatcher(next(_pool_ids), max_task_retries)
        register(self._disp)
        self._worker_ids = itertools.count(1)
        self._workers: Dict[int, WorkerState] = {}
        self._lock = threading.RLock()  # guards _workers, _size, _state
        self._failures = 0
        self._next_start = 0.0
        self._wake = threading.Event()
        self._start_workers()
        self._upkeep = threading.Thread(target=self._maintain, name="roving-pool", daemon=True)
        self._upkeep.start()

    # -- the multiprocessing API ---------------------------------------------------------------
    def apply(self, func: Callable[..., Any], args: Sequence[Any] = (), kwds: Optional[dict] = None) -> Any:
        """``func(*args, **kwds)`` in a worker; blocks until done."""
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func: Callable[..., Any], args: Sequence[Any] = (), kwds: Optional[dict] = None,
                    callback: Optional[Callable[[Any], Any]] = None,
                    error_callback: Optional[Callable[[BaseException], Any]] = None) -> AsyncResult:
        self._check_running()
        result = AsyncResult(self._runner, callback, error_callback)
        self._submit(result, func, P.APPLY, [(tuple(args), dict(kwds or {}))], 1, inline=True)
        return result

    def map(self, func: Callable[[Any], Any], iterable: Iterable[Any],
            chunksize: Optional[int] = None) -> List[Any]:
        """``[func(x) for x in iterable]`` across the workers, in order; blocks until done."""
        return self._map_async(func, iterable, P.MAP, chunksize).get()

    def map_async(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: Optional[int] = None,
                  callback: Optional[Callable] = None, error_callback: Optional[Callable] = None) -> MapResult:
        return self._map_async(func, iterable, P.MAP, chunksize, callback, error_callback)

    def starmap(self, func: Callable[..., Any], iterable: Iterable[Sequence[Any]],
                chunksize: Optional[int] = None) -> List[Any]:
        """``[func(*args) for args in iterable]``; blocks until done."""
        return self._map_async(func, iterable, P.STAR, chunksize).get()

    def starmap_async(self, func: Callable[..., Any], iterable: Iterable[Sequence[Any]],
                      chunksize: Optional[int] = None, callback: Optional[Callable] = None,
                      error_callback: Optional[Callable] = None) -> MapResult:
        return self._map_async(func, iterable, P.STAR, chunksize, callback, error_callback)

    def imap(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int = 1) -> IMapIterator:
        """Results in input order as they come. An iterator is read by a thread of the pool, as the
        caller iterates; an item that cannot be pickled fails that position and ends the reading."""
        return self._imap(IMapIterator, func, iterable, chunksize)

    def imap_unordered(self, func: Callable[[Any], Any], iterable: Iterable[Any],
                       chunksize: int = 1) -> IMapIterator:
        """Results in the order they finish."""
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize)

    def close(self) -> None:
        """Accept no more work; workers leave once everything submitted is done."""
        with self._lock:
            if self._state == RUN:
                self._state = CLOSE
        self._wake.set()

    def terminate(self) -> None:
        """Stop the workers now; results not yet delivered fail with RuntimeError."""
        with self._lock:
            self._state = TERMINATE
            workers = list(self._workers.values())
        for w in workers:
            try:
                w.proc.kill()
            except Exception:
                pass
        self._disp.fail_all("the pool was terminated before this task finished")
        self._wake.set()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the workers to exit after close() or terminate() (up to ``timeout`` seconds)."""
        if self._state == RUN:
            raise ValueError("Pool is still running")
        self._upkeep.join(timeout)

    def resize(self, processes: int) -> None:
        """Grow or shrink the pool to ``processes`` workers without losing work.

        Shrinking retires idle workers first, then busy ones, which leave after running what they hold.
        """
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        self._check_running()
        with self._lock:
            self._size = processes
            live = [w for w in self._workers.values() if not w.retiring]
            extra = len(live) - processes
            if extra > 0:
                live.sort(key=lambda w: (len(w.units) > 0, w.ident is not None))
                for w in live[:extra]:
                    self._disp.retire(w)
        self._wake.set()

    @property
    def processes(self) -> int:
        """How many workers the pool keeps (what resize() last set)."""
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
        if self._state != RUN:
            raise ValueError("Pool not running")

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
                   error_callback: Optional[Callable] = None) -> MapResult:
        self._check_running()
        items = iterable if isinstance(iterable, (list, tuple)) else list(iterable)
        if chunksize is None:
            chunksize, extra = divmod(len(items), self._size * 4)
            if extra:
                chunksize += 1
        result = MapResult(self._runner, len(items), callback, error_callback)
        self._submit(result, func, mode, items, chunksize)
        return result

    def _imap(self, kind: type, func: Callable[..., Any], iterable: Iterable[Any],
              chunksize: int) -> IMapIterator:
        self._check_running()
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        if isinstance(iterable, (list, tuple, range)):
            result = kind(len(iterable))
            self._submit(result, func, P.MAP, iterable, chunksize)
            return result
        result = kind(None)
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
                                 self._initargs, self._maxtasks, cfg.connect_timeout), daemon=True)
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
            self._disp.add_worker(w)

    def _failed_start(self, why: str) -> None:
        self._failures += 1
        delay = min(_MAX_BACKOFF_S, 0.1 * 2 ** self._failures)
        self._next_start = time.monotonic() + delay
        log.warning("roving pool: %s; trying again in %.1f s", why, delay)

    def _maintain(self) -> None:
        try:
            while True:
                self._wake.wait(_UPKEEP_S)
                self._wake.clear()
                if not self._upkeep_once():
                    return
        except Exception:
            log.exception("roving pool: the upkeep thread failed")
        finally:
            unregister(self._disp)
            self._runner.stop(5.0)

    def _upkeep_once(self) -> bool:
        """One round of upkeep; False once the pool is finished."""
        with self._lock:
            workers = list(self._workers.values())
            state = self._state
        now = time.monotonic()
        for w in workers:
            if w.proc.is_alive():
                if w.ident is not None and now - w.seen > HEARTBEAT_TIMEOUT_S and state != TERMINATE:
                    log.warning("roving pool: worker %s sent no heartbeat for %.0f s; it is killed and its "
                                "work goes to other workers", w.id, now - w.seen)
                    w.proc.kill()
                continue
            code = w.proc.exitcode
            with self._lock:
                self._workers.pop(w.id, None)
            if state != TERMINATE:
                if w.ident is None and code != 0:
                    self._failed_start(f"worker {w.id} exited with code {code} before it connected")
                elif w.ident is not None:
                    self._failures = 0
            self._disp.worker_lost(w, code)
        if state == TERMINATE:
            with self._lock:
                workers = list(self._workers.values())
            for w in workers:
                w.proc.join(1.0)
                if w.proc.is_alive():
                    w.proc.kill()
            return any(w.proc.is_alive() for w in workers)
        busy = self._disp.busy()
        if state == RUN or busy:
            self._start_workers()
        elif state == CLOSE:
            with self._lock:
                workers = list(self._workers.values())
            for w in workers:
                self._disp.retire(w)
            return bool(workers)
        return True
