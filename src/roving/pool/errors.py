"""The pool's own errors: one base, :class:`PoolError`, a :class:`roving.RovingError` (so a
:class:`multiprocessing.ProcessError`, as multiprocessing's are); each is importable from :mod:`roving` and
:mod:`roving.pool` too.

A call's own exception is raised as itself, never wrapped in these; a result that cannot be pickled is
multiprocessing's ``MaybeEncodingError``; a ``get`` that times out is ``multiprocessing.TimeoutError``."""
from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool
from multiprocessing.pool import RemoteTraceback  # type: ignore[attr-defined]  # typeshed lacks it
from typing import Any, Optional, Tuple

from ..errors import RovingError

__all__ = ["PoolError", "WorkerLostError", "OutOfMemoryError", "PoolStartError", "UnloadedTraceback"]


class PoolError(RovingError):
    """The pool could not run what was given to it for a reason of its own (not the call's)."""


class WorkerLostError(PoolError, BrokenProcessPool):
    """A task was running on ``max_task_retries`` workers that died; it is not tried again. The one
    error for it, from a :class:`roving.Pool` as from roving's ``concurrent.futures`` executor: also the standard
    library's ``BrokenProcessPool``, as a ``concurrent.futures`` caller expects (for that call only: the
    pool and the executor go on)."""


class OutOfMemoryError(WorkerLostError):
    """A task ran out of memory: the workers running it were killed for memory (the kernel's OOM killer
    in their cgroup, Slurm's ``OUT_OF_MEMORY``, Docker's or a pod's ``OOMKilled``) ``max_memory_kills``
    times in a row (default 2), so it is not tried again on another worker. The message says "out of
    memory", with the peak memory seen and the limit; :attr:`peak` and :attr:`limit` hold them in bytes
    (None where not known). A :class:`WorkerLostError`, so code that catches that catches this too."""

    def __init__(self, message: str, peak: Optional[int] = None, limit: Optional[int] = None) -> None:
        super().__init__(message)
        self.peak, self.limit = peak, limit

    def __reduce__(self) -> Tuple[Any, ...]:
        return type(self), (self.args[0] if self.args else "", self.peak, self.limit)


class PoolStartError(PoolError, OSError):
    """Workers failed to start ``pool_start_failures`` times in a row with none connecting (their
    machines cannot reach this one, or their jobs are refused): the pool gives up; pending results and
    every later call raise it. The message has the last reason and the address workers were to reach.
    Also an :class:`OSError`, as it was before the pool had one base."""


class UnloadedTraceback(RemoteTraceback, RovingError):
    """The ``__cause__`` of the error of an item whose function or arguments could not be unpickled in
    the worker (the item never ran): the worker's traceback, as a RemoteTraceback is. Not raised by
    itself, so not a :class:`PoolError` (a :class:`roving.RovingError` all the same, as all of roving's are)."""
