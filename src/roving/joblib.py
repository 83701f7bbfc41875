"""A joblib backend, ``"roving"``: ``joblib.Parallel`` (and through it scikit-learn's ``n_jobs``) on roving
processes of the configured backend, surviving workers that die.

    import roving.joblib                                  # registers the backend
    with joblib.parallel_config(backend="roving", n_jobs=8):
        GridSearchCV(model, grid, n_jobs=8).fit(X, y)

Importing this module registers the backend with joblib (``joblib.parallel_backend("roving")`` works
too). It runs joblib's batches on a :class:`roving.futures.Executor`, so:

* Each worker's OpenMP/BLAS thread pools are capped as loky caps them (``inner_max_num_threads``, else
  this machine's CPUs divided by ``n_jobs``), so that the workers do not oversubscribe the cores.
* ``n_jobs`` is the number of workers (``-1``: the CPUs the backend offers, ``-2``: one fewer, ...);
  ``n_jobs=1`` runs in this process, as joblib's own backends do.
* Batches are sized by joblib's auto-batching (a batch should take 0.2–2 s); ``return_as="generator"``
  and ``"generator_unordered"`` and ``Parallel(timeout=...)`` work.
* A worker that dies costs only its unfinished batches: they run again on other workers (up to
  ``max_task_retries``, then :class:`roving.WorkerLostError` ends the call).
* When a batch raises, joblib aborts the call: the batches not yet handed to a worker are cancelled; those
  already running finish on their workers and their results are dropped (the workers are kept).
* The workers are kept between calls (as loky's are) while ``n_jobs`` and the options stay the same and
  roving's configuration is unchanged; :func:`shutdown` stops them, and they stop at interpreter exit.

Options for the executor go through joblib's backend parameters:
``parallel_config(backend="roving", max_task_retries=5, resources={"memory": "4G"})``; loky's
``max_memory_per_child`` (or ``worker_memory_limit``) and ``max_memory_kills`` as for :class:`roving.Pool`.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Set, Tuple

import joblib
from joblib.parallel import AutoBatchingMixin, FallbackToBackend, ParallelBackendBase, SequentialBackend

from . import config as _config
from .futures import Executor
from .process import cpu_count

__all__ = ["RovingBackend", "shutdown"]

log = logging.getLogger(__name__)

_OPTIONS = ("max_task_retries", "resources", "max_tasks_per_child", "worker_memory_limit", "max_memory_per_child",
            "max_memory_kills")

_lock = threading.Lock()
_shared: Optional[Tuple[Tuple[Any, ...], Executor]] = None  # (what it was made for, the executor)


def _limit_threads(env: Tuple[Tuple[str, str], ...]) -> None:
    """A worker's initializer: cap the thread pools of OpenMP, BLAS and the like, as loky's workers do
    (set before numpy is imported; through threadpoolctl if it already is)."""
    import os
    import sys

    os.environ.update(env)
    if "numpy" in sys.modules:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return
        threadpool_limits(int(dict(env).get("OMP_NUM_THREADS", "1")))


def _executor(n_jobs: int, options: dict) -> Executor:
    """The executor kept between calls, made anew when ``n_jobs``, the options or roving's configuration
    changed (the old one finishes what it runs, then its workers leave)."""
    global _shared
    key = (n_jobs, repr(sorted(options.items())), _config.current())
    with _lock:
        if _shared is not None:
            made_for, ex = _shared
            if made_for[:2] == key[:2] and made_for[2] is key[2] and ex.usable:
                return ex
            ex.shutdown(wait=False, cancel_futures=True)
        ex = Executor(n_jobs, **{k: v for k, v in options.items() if k != "env"},
                      initializer=_limit_threads, initargs=(options["env"],))
        _shared = (key, ex)
        return ex


def shutdown(wait: bool = True) -> None:
    """Stop the workers kept between ``Parallel`` calls (the next call starts new ones)."""
    global _shared
    with _lock:
        shared, _shared = _shared, None
    if shared is not None:
        shared[1].shutdown(wait=wait, cancel_futures=True)


class RovingBackend(AutoBatchingMixin, ParallelBackendBase):
    """joblib's ParallelBackendBase on a roving Executor; see the module docstring."""

    supports_retrieve_callback = True  # results are taken in the futures' callbacks
    supports_inner_max_num_threads = True  # parallel_config(inner_max_num_threads=N): N threads a worker
    uses_threads = False
    supports_sharedmem = False
    default_n_jobs = 1

    def __init__(self, nesting_level: Optional[int] = None, inner_max_num_threads: Optional[int] = None,
                 **backend_kwargs: object) -> None:
        unknown = set(backend_kwargs) - set(_OPTIONS)
        if unknown:
            raise ValueError(f"the roving joblib backend does not take {sorted(unknown)}; it takes "
                             f"{', '.join(_OPTIONS)}")
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads,
                         **backend_kwargs)
        self._ex: Optional[Executor] = None
        self._futures: Set[Future] = set()
        self._futures_lock = threading.Lock()

    def effective_n_jobs(self, n_jobs: Optional[int]) -> int:
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if n_jobs < 0:
            return max(cpu_count() + 1 + n_jobs, 1)
        return n_jobs

    def configure(self, n_jobs: int = 1, parallel: Optional[joblib.Parallel] = None, prefer: Optional[str] = None,
                  require: Optional[str] = None, **backend_kwargs: object) -> int:
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        # Parallel passes its memmapping options (max_nbytes, mmap_mode, temp_folder) and verbose to every
        # backend; roving moves arrays by pickle, so those have no meaning here.
        merged = {**self.backend_kwargs, **backend_kwargs}
        options = {k: v for k, v in merged.items() if k in _OPTIONS}
        # as loky: each worker's OpenMP/BLAS threads default to this machine's CPUs / n_jobs
        options["env"] = tuple(sorted(self._prepare_worker_env(n_jobs).items()))
        self._ex = _executor(n_jobs, options)
        self.parallel = parallel
        return n_jobs

    def submit(self, func: Callable[[], object], callback: Optional[Callable[[Future], object]] = None) -> Future:
        assert self._ex is not None, "submit() before configure()"  # joblib configures first
        future = self._ex.submit(func)
        with self._futures_lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)
        if callback is not None:
            future.add_done_callback(callback)
        return future

    def _forget(self, future: Future) -> None:
        with self._futures_lock:
            self._futures.discard(future)

    def retrieve_result_callback(self, future: Future) -> object:
        return future.result()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """A batch failed: cancel the batches not yet handed to a worker. The workers are kept (a call
        already running finishes there, its result dropped), so the backend is ready either way."""
        with self._futures_lock:
            futures = list(self._futures)
        cancelled = sum(f.cancel() for f in futures)
        log.debug("roving joblib backend: %d pending batch(es) cancelled", cancelled)

    def terminate(self) -> None:
        """The end of a Parallel call: the workers are kept for the next one (see :func:`shutdown`)."""
        self._ex = None
        self.reset_batch_stats()


joblib.register_parallel_backend("roving", RovingBackend)
