"""The pool's own errors: one base, :class:`PoolError`, a :class:`multiprocessing.ProcessError` (roving's
top base, as it is multiprocessing's); each is importable from :mod:`roving` and :mod:`roving.pool` too.

A call's own exception is raised as itself, never wrapped in these; a result that cannot be pickled is
multiprocessing's ``MaybeEncodingError``; a ``get`` that times out is ``multiprocessing.TimeoutError``."""
from __future__ import annotations

from multiprocessing import ProcessError

__all__ = ["PoolError", "WorkerLostError", "PoolStartError"]


class PoolError(ProcessError):
    """The pool could not run what was given to it for a reason of its own (not the call's)."""


class WorkerLostError(PoolError):
    """A task was running on ``max_task_retries`` workers that died; it is not tried again."""


class PoolStartError(PoolError, OSError):
    """Workers failed to start ``pool_start_failures`` times in a row with none connecting (their
    machines cannot reach this one, or their jobs are refused): the pool gives up; pending results and
    every later call raise it. The message has the last reason and the address workers were to reach.
    Also an :class:`OSError`, as it was before the pool had one base."""
