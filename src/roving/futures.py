"""concurrent.futures on roving: :class:`Executor`, a ``ProcessPoolExecutor`` whose workers are roving
processes on the configured backend, and which survives them.

    from roving.futures import Executor          # instead of concurrent.futures.ProcessPoolExecutor
    with Executor(max_workers=8) as ex: ...

It is built on :class:`roving.Pool` (its workers, retries and resources) and hands out real
:class:`concurrent.futures.Future` objects, so ``concurrent.futures.wait``, ``as_completed``, done
callbacks and ``cancel()`` work unchanged.

Guarantees:

* A call that raises sets that exception on its future, with the remote traceback as ``__cause__`` (a
  ``concurrent.futures.process._RemoteTraceback``, as the standard library sets); it is not retried. So
  does a result that cannot be pickled in the worker: the pickling error (``TypeError``,
  ``PicklingError``, ...), as the standard library gives it.
* A worker that dies (killed, out of memory, its job lost) costs only the calls whose results had not
  reached this process: they run again on other workers, and each future gets its outcome exactly once. A
  call that was running on ``max_task_retries`` workers that died fails with :class:`WorkerLostError`, on
  its own future only: roving's one :class:`roving.WorkerLostError`, also the standard library's
  ``BrokenProcessPool``, so ``except BrokenProcessPool`` catches it. The executor stays usable: a lost
  worker does not break it.
* A call whose function or arguments cannot be unpickled in the worker fails with ``BrokenProcessPool``
  (as the standard library's, whose worker dies of it), the unpickling error as ``__cause__``; here on
  that call's future only, and the executor goes on. A result that cannot be unpickled here fails its
  call the same way.
* An ``initializer`` that raises in a worker breaks the executor, as the standard library's does: the
  futures not yet done and every later ``submit`` raise :class:`BrokenProcessPool` (the standard library's
  class), whose ``__cause__`` is the initializer's exception with its remote traceback. So does a pool
  whose workers cannot start at all (:class:`roving.PoolStartError` as the cause).
* At most ``max_workers + EXTRA_QUEUED_CALLS`` calls are handed to the pool at a time (as many as the
  standard library puts in its call queue); the others wait here, PENDING, and ``cancel()`` (or
  ``shutdown(cancel_futures=True)``) takes them back. A call handed to the pool is RUNNING, as one in the
  standard library's call queue is, and cannot be cancelled.
* ``map`` submits every call at once (as the standard library does) and yields results in input order;
  ``timeout`` counts from the call to ``map``; a result not there in time raises ``TimeoutError`` and the
  calls not yet started are cancelled, as are those after an exception.
* Done callbacks run on the pool's callback thread, never in the caller's.
* ``shutdown(wait=True)`` returns once every call is done, also when workers die meanwhile (their calls
  run elsewhere or end with WorkerLostError) and when a result cannot be unpickled here, even by a
  ``__reduce__`` that exits (BrokenProcessPool on that call).
* At interpreter exit (when the standard library's executors stop: before ``atexit`` handlers run and
  before other threads are joined) the calls submitted are finished first, then the workers are stopped;
  a ``submit`` from then on raises RuntimeError, as does one for which the pool cannot make a thread.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import logging
import multiprocessing.context
import queue
import sys
import threading
import time
import weakref
from concurrent.futures import Executor as _StdExecutor
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
# the standard library's executor sets this as a remote exception's __cause__; roving's sets it too
from concurrent.futures.process import _RemoteTraceback
from multiprocessing.pool import (  # type: ignore[attr-defined]  # (not in typeshed's stub)
    ExceptionWithTraceback, MaybeEncodingError, RemoteTraceback)
from typing import Any, Callable, Deque, Iterable, Iterator, List, Optional, Tuple, TypeVar, Union

from .backends import ResourceRequest
from .context import Context, get_context
from .pool import OutOfMemoryError, Pool, PoolStartError, Progress, UnloadedTraceback, WorkerLostError
from .process import cpu_count
from .transport import timeouts

__all__ = ["Executor", "BrokenProcessPool", "WorkerLostError", "OutOfMemoryError"]

log = logging.getLogger(__name__)

#: A call's result: what map hands back is what ``fn`` returns.
T = TypeVar("T")

#: Calls handed to the pool beyond one per worker, at most; the rest wait in the executor, cancellable.
#: The standard library's call queue holds as many (its EXTRA_QUEUED_CALLS). benchmarks/futures_window.py
#: measured what the former 16 per worker gained: bursts of no-op calls only (RESULTS.md).
EXTRA_QUEUED_CALLS = 1


_live: "weakref.WeakSet[Executor]" = weakref.WeakSet()
_exiting = False


def _init_worker(report: Any, initializer: Callable[..., Any], initargs: Tuple[Any, ...]) -> None:
    """Run the user's initializer in a worker; if it raises, tell the executor why (then the worker exits,
    as a standard library worker does)."""
    try:
        initializer(*initargs)
    except BaseException as exc:
        try:
            report.put(ExceptionWithTraceback(exc, exc.__traceback__))
        except Exception:  # the exception cannot be pickled: its text must do
            report.put(RuntimeError(f"{type(exc).__name__}: {exc}"))
        raise


def _run_chunk(fn: Callable[..., Any], chunk: List[Tuple[Any, ...]]) -> List[Any]:
    return [fn(*args) for args in chunk]


class _Call:
    """One submitted call: its future, what to hand the pool, and what the pool calls back with."""

    __slots__ = ("ex", "future", "fn", "args", "kwargs")
    # None once let go of: ex and future once the call is done, fn, args and kwargs once handed to the pool
    ex: Optional["Executor"]
    future: Optional[Future]
    fn: Optional[Callable[..., Any]]
    args: Optional[Tuple[Any, ...]]
    kwargs: Optional[dict]

    def __init__(self, ex: "Executor", future: Future, fn: Callable[..., Any], args: Tuple[Any, ...],
                 kwargs: dict) -> None:
        self.ex, self.future, self.fn, self.args, self.kwargs = ex, future, fn, args, kwargs

    # Once done, a call lets go of its executor and future: the pool may hold a finished result (and so
    # this call) a while longer, and that must not keep an executor nobody uses from being collected.
    def ok(self, value: Any) -> None:
        ex, future, self.ex, self.future = self.ex, self.future, None, None
        assert ex is not None and future is not None, "the pool calls back once per call"
        future.set_result(value)
        ex._finished()

    def failed(self, exc: BaseException) -> None:
        ex, future, self.ex, self.future = self.ex, self.future, None, None
        assert ex is not None and future is not None, "the pool calls back once per call"
        if isinstance(exc, PoolStartError):
            ex._break(exc)
        if ex._broken is not None and not isinstance(exc.__cause__, RemoteTraceback):
            exc = ex._broken_error()  # not the call's own exception: the pool stopped for the executor
        else:
            exc = _standard(exc)
        future.set_exception(exc)
        ex._finished()


def _standard(exc: BaseException) -> BaseException:
    """The pool's error for a call as the standard library's executor gives it (see the module
    docstring): its remote traceback a ``_RemoteTraceback``; a result that could not be pickled, the
    pickling error; a call that could not be unpickled in the worker (or its result here),
    BrokenProcessPool; a lost call, roving's WorkerLostError (a BrokenProcessPool too), as it is."""
    if isinstance(exc, MaybeEncodingError) and isinstance(exc.__cause__, BaseException):
        if isinstance(exc.__cause__.__cause__, RemoteTraceback):
            exc = exc.__cause__  # pickling the result failed in the worker: that error
        else:  # unpickling it failed here
            broken = BrokenProcessPool(f"the result of this call could not be unpickled here "
                                       f"({type(exc.__cause__).__name__}: {exc.__cause__})")
            broken.__cause__ = exc.__cause__
            return broken
    cause = exc.__cause__
    if isinstance(cause, RemoteTraceback):
        exc.__cause__ = _RemoteTraceback(cause.tb)
    if isinstance(cause, UnloadedTraceback):
        broken = BrokenProcessPool(f"this call's function or arguments could not be unpickled in the worker "
                                   f"({type(exc).__name__}: {exc}); the executor goes on")
        broken.__cause__ = exc
        return broken
    return exc


class Executor(_StdExecutor):
    """:class:`concurrent.futures.ProcessPoolExecutor` on roving processes; see the module docstring.

    ``max_workers`` defaults to the CPUs the backend offers. ``mp_context`` may be a roving or a
    multiprocessing context (every roving process starts as a fresh interpreter whatever its start
    method); as the standard library's, it defaults to roving's ``get_context()``, or its ``"spawn"``
    context with ``max_tasks_per_child``, which a ``"fork"`` context refuses (ValueError).
    ``max_tasks_per_child``: a worker leaves after that many calls and a new one takes its place.
    ``max_task_retries``: how many dead workers one call may cost before it fails with WorkerLostError.
    ``resources``: what each worker's job asks the backend for (``{"cpu": .., "memory": .., "gpu": ..}``),
    as for :class:`roving.Pool`. ``worker_memory_limit`` (or ``max_memory_per_child``, loky's name) and
    ``max_memory_kills``: as for :class:`roving.Pool` (checked there, at the first ``submit``); a call that
    ran out of memory fails with this module's :class:`OutOfMemoryError`. Workers start at the first
    ``submit``.
    """

    def __init__(self, max_workers: Optional[int] = None, *,
                 mp_context: Union[Context, multiprocessing.context.BaseContext, None] = None,
                 initializer: Optional[Callable[..., object]] = None, initargs: Iterable[object] = (),
                 max_tasks_per_child: Optional[int] = None, max_task_retries: int = 3,
                 resources: Optional[ResourceRequest] = None, worker_memory_limit: Union[int, str, None] = None,
                 max_memory_per_child: Union[int, str, None] = None, max_memory_kills: int = 2) -> None:
        if max_workers is None:
            max_workers = cpu_count() or 1
        elif not isinstance(max_workers, int) or isinstance(max_workers, bool):
            raise TypeError(f"max_workers must be an int or None, not {type(max_workers).__name__}")
        elif max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if mp_context is not None and not isinstance(mp_context, (Context, multiprocessing.context.BaseContext)):
            raise TypeError(f"mp_context must be a roving or multiprocessing context, not {mp_context!r}")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int):
                raise TypeError("max_tasks_per_child must be an integer")
            if max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
        if mp_context is None:
            mp_context = get_context("spawn" if max_tasks_per_child is not None else None)
        elif max_tasks_per_child is not None and mp_context.get_start_method(allow_none=False) == "fork":
            raise ValueError("max_tasks_per_child is incompatible with the 'fork' multiprocessing start method; "
                             "supply a different mp_context.")
        self._mp_context = mp_context
        if not isinstance(max_task_retries, int) or max_task_retries < 1:
            raise ValueError(f"max_task_retries must be an int of at least 1, not {max_task_retries!r}")
        self._max_workers = max_workers
        self._initializer, self._initargs = initializer, tuple(initargs)
        self._max_tasks_per_child = max_tasks_per_child
        self._max_task_retries = max_task_retries
        self._resources = resources  # checked by the Pool, at the first submit
        self._memory_limit, self._memory_per_child = worker_memory_limit, max_memory_per_child
        self._memory_kills = max_memory_kills  # checked by the pool, at the first submit
        self._window = max_workers + EXTRA_QUEUED_CALLS
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when nothing is outstanding
        self._pool: Optional[Pool] = None
        self._report: Any = None  # the roving Queue an initializer that fails reports on
        self._pending: Deque[_Call] = collections.deque()
        self._running = 0  # calls handed to the pool, not yet done
        self._shutdown = False
        self._broken: Optional[BrokenProcessPool] = None
        _live.add(self)

    # -- the concurrent.futures API --------------------------------------------------------------
    def submit(self, fn: Callable[..., object], /, *args: object, **kwargs: object) -> Future:
        """Schedule ``fn(*args, **kwargs)`` on a worker; returns its Future. RuntimeError after shutdown,
        BrokenProcessPool once the executor is broken (see the module docstring)."""
        return self._submit(fn, args, kwargs, 1)

    def map(self, fn: Callable[..., T], *iterables: Iterable[object], timeout: Optional[float] = None,
            chunksize: int = 1, progress: bool = False) -> Iterator[T]:
        """``fn(*args)`` for the items of ``iterables`` taken together, results in input order (see the
        module docstring). ``chunksize`` calls travel as one piece of work; ``progress=True`` draws a
        progress bar on stderr (items done of the total, rate, time left), as :meth:`roving.Pool.map`."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        end = timeouts.deadline(timeout)  # None: no end (None, inf, or beyond timeouts.LONGEST)
        calls = zip(*iterables)
        if chunksize == 1:
            futures = [self._submit(fn, args, {}, 1) for args in calls]
        else:
            futures = []
            while True:
                chunk = list(itertools.islice(calls, chunksize))
                if not chunk:
                    break
                futures.append(self._submit(_run_chunk, (fn, chunk), {}, len(chunk)))
        if progress:
            total = (len(futures) if chunksize == 1
                     else sum(f._roving_size for f in futures))  # type: ignore[attr-defined]
            bar = Progress(total, getattr(fn, "__qualname__", None) or type(fn).__qualname__)
            if total == 0:
                bar.finish()

            def count(f: Future[Any], bar: Progress = bar) -> None:
                bar.update(f._roving_size)  # type: ignore[attr-defined]

            for f in futures:
                f.add_done_callback(count)
        return _results(futures, end, chunksize > 1)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False,
                 timeout: Optional[float] = None) -> None:
        """Accept no more calls. ``cancel_futures=True`` cancels those not yet handed to the pool; the
        rest run. ``wait=True`` returns once they are done and the workers have left (waiting at most
        ``timeout`` seconds, roving's addition; the default waits as long as it takes, as the standard
        library does); ``wait=False`` returns at once and the workers leave when the work is done."""
        with self._lock:
            self._shutdown = True
            cancelled: List[_Call] = []
            if cancel_futures:
                cancelled, self._pending = list(self._pending), collections.deque()
            pool = self._pool
            idle = not self._pending and self._running == 0
            if idle:
                self._idle.notify_all()
        for call in cancelled:  # outside the lock: done callbacks run here
            future = call.future
            assert future is not None, "a call not handed to the pool is not done"
            future.cancel()
            future.set_running_or_notify_cancel()
        if pool is None:
            return
        if idle:
            pool.close()
        if not wait:
            return
        deadline = timeouts.deadline(timeout)
        if self._wait_idle(deadline):
            pool.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _wait_idle(self, deadline: Optional[float]) -> bool:
        """Wait until no call is pending or running (until ``deadline`` at most); whether it came."""
        with self._lock:
            while self._pending or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    @property
    def usable(self) -> bool:
        """Whether ``submit`` would accept a call: not shut down and not broken (roving's addition)."""
        return not self._shutdown and self._broken is None and not _exiting

    def __repr__(self) -> str:
        state = "broken" if self._broken else "shutdown" if self._shutdown else "running"
        return f"<roving.futures.Executor {state} max_workers={self._max_workers}>"

    def __reduce__(self) -> Any:
        raise TypeError("an Executor cannot be pickled or passed to another process")

    # -- submitting ----------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict, size: int) -> Future:
        future: Future[Any] = Future()
        # items it stands for (map's progress bar): roving's own attribute, on the standard library's Future
        future._roving_size = size  # type: ignore[attr-defined]
        call = _Call(self, future, fn, args, kwargs)
        with self._lock:
            if self._broken is not None:
                raise BrokenProcessPool(self._broken.args[0]) from self._broken.__cause__
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _exiting or sys.is_finalizing():
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            if self._pending or self._running >= self._window:
                self._pending.append(call)
                return future
            self._running += 1
            try:
                pool = self._pool if self._pool is not None else self._start()
            except BaseException:  # the pool could not start (bad resources, ...): the error is the caller's
                self._running -= 1
                raise
        try:
            handed = self._hand(pool, call, raising=True)
        except RuntimeError:  # no thread could be made for it (at interpreter exit): the caller's error
            self._finished()
            raise
        if not handed:
            self._finished()
        return future

    def _start(self) -> Pool:
        """The pool, started at the first call (under the lock)."""
        initializer, initargs = self._initializer, self._initargs
        if initializer is not None:
            from .queues import Queue

            self._report = Queue()
            initializer, initargs = _init_worker, (self._report, initializer, initargs)
            threading.Thread(target=_watch_init, args=(weakref.ref(self), self._report),
                             name="roving-executor-init", daemon=True).start()
        self._pool = Pool(self._max_workers, initializer, initargs, self._max_tasks_per_child,
                          max_task_retries=self._max_task_retries, resources=self._resources,
                          worker_memory_limit=self._memory_limit, max_memory_per_child=self._memory_per_child,
                          max_memory_kills=self._memory_kills)
        # an executor dropped without shutdown() lets its workers go once their work is done (it cannot be
        # collected before: every call not yet done holds it), as the standard library's does
        weakref.finalize(self, self._pool.close).atexit = False
        return self._pool

    def _hand(self, pool: Pool, call: _Call, raising: bool = False) -> bool:
        """Give one call (counted in ``_running``) to the pool; False when it is done already (it was
        cancelled meanwhile, or the pool refused it), so that the caller counts it finished. ``raising``
        (the caller is its ``submit``): a RuntimeError of the pool (no thread can be made) is raised."""
        future = call.future
        assert future is not None, "a call not handed to the pool is not done"
        if not future.set_running_or_notify_cancel():
            return False
        fn, args, kwargs = call.fn, call.args, call.kwargs
        call.fn = call.args = call.kwargs = None
        assert fn is not None and args is not None and kwargs is not None, "a call is handed to the pool once"
        try:
            pool.apply_async(fn, args, kwargs, callback=call.ok, error_callback=call.failed)
        except PoolStartError as exc:
            self._break(exc)
            future.set_exception(self._broken_error())
            return False
        except BaseException as exc:  # the pool refused it (a roving.meta the workers cannot meet), or
            future.set_exception(exc)  # no thread can be made for it
            if raising and type(exc) is RuntimeError:
                raise
            return False
        return True

    def _finished(self) -> None:
        """A call handed to the pool is done: hand it the next ones waiting; close the pool once the
        executor is shut down and nothing is left. (A loop, not recursion: thousands of cancelled calls
        may come one after another.)"""
        done = 1
        while done:
            take: List[_Call] = []
            with self._lock:
                self._running -= done
                while self._pending and self._running < self._window:
                    take.append(self._pending.popleft())
                    self._running += 1
                pool = self._pool
                idle = not self._pending and self._running == 0
                if idle:
                    self._idle.notify_all()
            done = 0
            if take:
                assert pool is not None, "calls were handed to the pool: it started"
                done = sum(1 for call in take if not self._hand(pool, call))
            if idle and self._shutdown and pool is not None:
                pool.close()

    # -- broken --------------------------------------------------------------------------------
    def _broken_error(self) -> BrokenProcessPool:
        broken = self._broken
        assert broken is not None, "called once the executor is broken"
        err = BrokenProcessPool(broken.args[0])
        err.__cause__ = broken.__cause__
        return err

    def _break(self, cause: BaseException) -> None:
        """The executor cannot run calls any more (an initializer failed, workers cannot start)."""
        with self._lock:
            if self._broken is not None:
                return
            if isinstance(cause, PoolStartError):
                what = "the workers of this executor cannot start"
            else:
                what = f"the initializer failed in a worker ({type(cause).__name__}: {cause})"
            cause = _standard(cause)
            broken = BrokenProcessPool(f"{what}; the executor is not usable any more")
            broken.__cause__ = cause
            self._broken = broken
            pending = list(self._pending)
            self._pending.clear()
            pool = self._pool
        log.error("roving executor: %s", broken)
        for call in pending:
            future = call.future
            assert future is not None, "a call not handed to the pool is not done"
            if future.set_running_or_notify_cancel():
                future.set_exception(self._broken_error())
        with self._lock:
            if self._running == 0:
                self._idle.notify_all()
        if pool is not None:
            pool.terminate()  # what was handed to it fails; failed() turns that into BrokenProcessPool


def _watch_init(ref: "weakref.ref[Executor]", report: Any) -> None:
    """Wait for word of an initializer that failed, and break the executor when it comes; ends when the
    executor is gone or shut down with nothing left to run."""
    while True:
        try:
            got = report.get(timeout=1.0)
        except queue.Empty:
            ex = ref()
            if ex is None or ex._shutdown and not ex._pending and not ex._running:
                return
            ex = None
            continue
        except (OSError, EOFError, ValueError):  # the session ends
            return
        ex = ref()
        if ex is not None:
            ex._break(got)
        return


def _results(futures: List[Future], end: Optional[float], chunked: bool) -> Iterator[Any]:
    """map's iterator: each future's result in order, each waited for until ``end`` at most; those left
    are cancelled when the iterator stops early (an exception, a timeout, or it is closed)."""
    futures.reverse()
    try:
        while futures:
            fut = futures.pop()
            try:
                value = fut.result(None if end is None else end - time.monotonic())
            finally:
                fut.cancel()
            if chunked:
                yield from value
            else:
                yield value
            del fut, value
    finally:
        for fut in futures:
            fut.cancel()


def _at_exit() -> None:
    """Finish what was submitted to executors still alive (as the standard library does), then let their
    workers go (waiting 10 s at most for each executor's workers to leave)."""
    global _exiting
    _exiting = True
    for ex in list(_live):
        try:
            ex.shutdown(wait=False)
            ex._wait_idle(None)
            if ex._pool is not None:
                ex._pool.join(10.0)
        except Exception:
            log.exception("roving executor: shutting down at exit failed")


# When the standard library's executors stop (threading's exit hooks: before atexit's, and before the
# threads still running are joined), so that a late submit raises as theirs does; atexit where that hook
# is missing.
_register = getattr(threading, "_register_atexit", atexit.register)
try:
    _register(_at_exit)
except RuntimeError:  # imported while threading shuts down already: no submit may start work now
    _exiting = True
