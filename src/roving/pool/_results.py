"""What a caller holds for work it gave the pool: AsyncResult, MapResult and the imap iterators.

This module is the one writer of their outcomes: :func:`deliver` (items finished, from the dispatcher,
mostly on the node's I/O thread), :func:`fail` (a call that could not be queued at all) and
:func:`set_length` (an imap's iterable read to its end); nothing else sets a result's state. Callbacks
run on the pool's callback thread (never the I/O thread), before ``get()`` returns, as in
`multiprocessing`. The errors a result can raise that are the pool's own are in :mod:`.errors`; here is
what a worker sends for an item that could not be loaded there (:func:`unloaded`) or whose result could
not be pickled (:func:`unencodable`).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from multiprocessing import TimeoutError
from multiprocessing.pool import ExceptionWithTraceback, MaybeEncodingError  # type: ignore[attr-defined]
from typing import Any, Callable, Dict, List, Optional

from ..transport import timeouts
from ..transport.serialize import SerializationError, dumps
from .errors import PoolStartError, UnloadedTraceback, WorkerLostError

log = logging.getLogger(__name__)

__all__ = ["AsyncResult", "ApplyResult", "MapResult", "IMapIterator", "IMapUnorderedIterator",
           "WorkerLostError", "PoolStartError", "UnloadedTraceback", "deliver", "fail", "set_length",
           "unloaded", "unencodable"]


# -- what a worker sends for an item that failed outside the task ------------------------------
class _WithCause:
    """Pickles as ``error``, rebuilt with ``cause`` as its ``__cause__`` (which pickle drops)."""

    def __init__(self, error: BaseException, cause: Optional[BaseException]) -> None:
        self.error, self.cause = error, cause

    def __reduce__(self) -> Any:
        return _with_cause, (self.error, self.cause)


def _with_cause(error: BaseException, cause: Optional[BaseException]) -> BaseException:
    error.__cause__ = cause
    return error


def unloaded(exc: BaseException) -> Any:
    """Worker side: what to send for an item whose function or arguments raised ``exc`` while they were
    unpickled: the parent gets ``exc`` with the worker's traceback as an :class:`UnloadedTraceback`."""
    return _WithCause(exc, UnloadedTraceback(ExceptionWithTraceback(exc, exc.__traceback__).tb))


def unencodable(exc: BaseException, value: Any) -> Any:
    """Worker side: what to send for a result ``value`` that pickling refused with ``exc``: the parent
    gets multiprocessing's MaybeEncodingError, whose ``__cause__`` is ``exc`` (itself with the worker's
    traceback as ``__cause__``), or none when ``exc`` cannot be pickled either."""
    cause: Any = ExceptionWithTraceback(exc, exc.__traceback__)
    try:
        dumps(cause)
    except SerializationError:
        cause = None
    return _WithCause(MaybeEncodingError(exc, value), cause)


# -- the one writer of outcomes ---------------------------------------------------------------

def deliver(result: Any, index: int, ok: bool, values: List[Any]) -> None:
    """Items ``index``, ``index + 1``, ... of ``result`` finished with the same outcome (``ok``: their
    values; else each value is the exception the item raised). The dispatcher delivers each item once."""
    result._set_run(index, ok, values)


def fail(result: "AsyncResult", exc: BaseException) -> None:
    """``result`` (of apply_async, map_async) fails as a whole with ``exc``: its call could not be queued."""
    result._complete(False, exc)


def set_length(result: "IMapIterator", length: int) -> None:
    """An imap over an iterator: the iterator ended after ``length`` items."""
    result._set_length(length)


class CallbackRunner:
    """One thread that runs result callbacks in completion order."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread unless it runs; RuntimeError when no thread can be made (at interpreter
        exit). Called where a result with callbacks is made, in the caller's thread, so that such an
        error reaches the caller instead of the thread that delivers the result."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    thread = threading.Thread(target=self._run, name="roving-pool-callbacks", daemon=True)
                    thread.start()
                    self._thread = thread

    def submit(self, fn: Callable[[], None]) -> None:
        self.start()
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            fn()
            del fn  # not kept while waiting: the last result (its value, its callbacks) can be collected

    def stop(self, timeout: float) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)


class AsyncResult:
    """The result of :meth:`Pool.apply_async`; see :class:`multiprocessing.pool.AsyncResult`."""

    _progress: Any = None  # a Progress bar counting this result's items (map with progress=True)
    #: The pool, held until this result is complete, as multiprocessing's results hold theirs: a pool
    #: nobody else references lives until its pending results are in.
    _pool: Any = None

    def __init__(self, runner: CallbackRunner, callback: Optional[Callable[[Any], Any]] = None,
                 error_callback: Optional[Callable[[BaseException], Any]] = None, *, pool: Any = None,
                 progress: Any = None) -> None:
        self._pool, self._progress = pool, progress
        self._runner = runner
        self._callback, self._error_callback = callback, error_callback
        if callback is not None or error_callback is not None:
            runner.start()
        self._event = threading.Event()
        self._success: Optional[bool] = None
        self._value: Any = None

    def ready(self) -> bool:
        return self._event.is_set()

    def successful(self) -> bool:
        """Whether the call returned without raising. ValueError if it has not finished."""
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return bool(self._success)

    def wait(self, timeout: Optional[float] = None) -> None:
        self._event.wait(timeouts.limit(timeout))

    def rerun_locally(self, pdb: bool = False) -> Any:
        """Run the call that failed again in this process, with the very function and pickled arguments
        its worker got, so that a debugger stops in it (``pdb=True``: under pdb); see
        :func:`roving.debug.rerun`. ValueError when it has not failed."""
        from ._rerun import rerun

        return rerun(self, pdb=pdb)

    def get(self, timeout: Optional[float] = None) -> Any:
        """The value, or the task's exception raised here (its remote traceback as ``__cause__``).

        Raises multiprocessing.TimeoutError if it is not ready within ``timeout`` seconds.
        """
        self.wait(timeout)
        if not self.ready():
            raise TimeoutError
        if self._success:
            return self._value
        raise self._value

    # -- written through deliver() and fail() only --------------------------------------------
    def _set(self, index: int, ok: bool, value: Any) -> None:
        self._complete(ok, value)

    def _set_run(self, index: int, ok: bool, values: List[Any]) -> None:
        """Items ``index``, ``index + 1``, ... finished with the same outcome."""
        for i, value in enumerate(values):
            self._set(index + i, ok, value)

    def _complete(self, ok: bool, value: Any) -> None:
        if self._success is not None:
            return
        self._success, self._value = ok, value
        self._pool = None
        if self._progress is not None:
            self._progress.finish()
        if (self._callback if ok else self._error_callback) is None:
            self._event.set()
        else:
            self._runner.submit(self._finish)

    def _finish(self) -> None:
        fn = self._callback if self._success else self._error_callback
        assert fn is not None, "submitted only when there is a callback"
        try:
            fn(self._value)
        except Exception:
            log.exception("roving pool: a result callback raised")
        finally:
            self._event.set()


ApplyResult = AsyncResult


class MapResult(AsyncResult):
    """The result of :meth:`Pool.map_async`: a list in input order, or the first item's error."""

    def __init__(self, runner: CallbackRunner, length: int, callback: Optional[Callable] = None,
                 error_callback: Optional[Callable] = None, *, pool: Any = None, progress: Any = None) -> None:
        super().__init__(runner, callback, error_callback, pool=pool, progress=progress)
        self._values: List[Any] = [None] * length
        self._left = length
        if length == 0:
            self._complete(True, [])

    def _set(self, index: int, ok: bool, value: Any) -> None:
        self._set_run(index, ok, [value])

    def _set_run(self, index: int, ok: bool, values: List[Any]) -> None:
        if self._progress is not None:
            self._progress.update(len(values))
        if not ok:
            self._complete(False, values[0])
            return
        self._values[index:index + len(values)] = values
        self._left -= len(values)
        if self._left == 0:
            self._complete(True, self._values)


class IMapIterator:
    """Results of :meth:`Pool.imap` in input order; ``next(timeout)`` raises TimeoutError."""

    _progress: Any = None
    _pool: Any = None  # held until every result is in (see AsyncResult._pool)

    def __init__(self, length: Optional[int], *, pool: Any = None, progress: Any = None) -> None:
        self._pool, self._progress = pool, progress
        self._received = 0
        self._cond = threading.Condition(threading.Lock())
        self._length = length  # None until the iterable has been read to its end
        self._ready: Dict[int, tuple] = {}
        self._next = 0

    def __iter__(self) -> "IMapIterator":
        return self

    def _take(self) -> Optional[tuple]:
        return self._ready.pop(self._next, None)

    def next(self, timeout: Optional[float] = None) -> Any:
        """The next result; multiprocessing.TimeoutError if none is ready within ``timeout`` seconds."""
        deadline = timeouts.deadline(timeout)
        with self._cond:
            while True:
                if self._length is not None and self._next >= self._length:
                    raise StopIteration
                got = self._take()
                if got is not None:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0 or not self._cond.wait(left):
                    raise TimeoutError
            self._next += 1
        ok, value = got
        if ok:
            return value
        raise value

    __next__ = next

    # -- written through deliver() and set_length() only ---------------------------------------
    def _set_length(self, length: int) -> None:
        with self._cond:
            self._length = length
            self._cond.notify_all()
            self._let_go_when_done()
        if self._progress is not None:
            self._progress.set_total(length)

    def _set_run(self, index: int, ok: bool, values: List[Any]) -> None:
        if self._progress is not None:
            self._progress.update(len(values))
        with self._cond:
            for i, value in enumerate(values):
                self._ready[index + i] = (ok, value)
            self._received += len(values)
            self._cond.notify()
            self._let_go_when_done()

    def _let_go_when_done(self) -> None:
        if self._length is not None and self._received >= self._length:
            self._pool = None


class IMapUnorderedIterator(IMapIterator):
    """Results of :meth:`Pool.imap_unordered`, in the order they finish."""

    def __init__(self, length: Optional[int], *, pool: Any = None, progress: Any = None) -> None:
        super().__init__(length, pool=pool, progress=progress)
        self._done: "collections.deque[tuple]" = collections.deque()

    def _take(self) -> Optional[tuple]:
        return self._done.popleft() if self._done else None

    def _set_run(self, index: int, ok: bool, values: List[Any]) -> None:
        if self._progress is not None:
            self._progress.update(len(values))
        with self._cond:
            self._done.extend((ok, value) for value in values)
            self._received += len(values)
            self._cond.notify()
            self._let_go_when_done()
