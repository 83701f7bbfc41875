"""What the dispatcher's state reads as, for the pool's upkeep and :mod:`roving.observe`: its workers now,
snapshots of them, how many live or wait, and the pool's figures. Each is taken under the dispatcher's
lock, at one moment; none changes anything.

:class:`Snapshots` is that part of :class:`roving.pool._dispatch.Dispatcher`.
"""
from __future__ import annotations

import threading
from typing import Any, Deque, Dict, Iterable, List, Optional, Tuple

from ._memory import CallPeaks
from ._work import Call, Unit, WorkerState, WorkerView
from ._work import view as snapshot


class Snapshots:
    """Reads of the dispatcher's state under its lock (a mixin of ``Dispatcher``, whose state it reads:
    declared here, set by ``Dispatcher.__init__``)."""

    lock: threading.Lock
    workers: Dict[int, WorkerState]
    by_ident: Dict[bytes, WorkerState]
    pending: Deque[Unit]
    suspects: Deque[Unit]
    calls: Dict[int, Call]
    _retiring: int
    call_peaks: CallPeaks
    done: int
    failed: int
    retried: int
    handed_back: int
    ended_early: int
    oom_kills: int
    memory_restarts: int
    pool_id: int

    def workers_now(self) -> List[WorkerState]:
        """The pool's workers now: started and not yet ended (a snapshot)."""
        with self.lock:
            return list(self.workers.values())

    def views(self, workers: Optional[Iterable[WorkerState]] = None) -> List[WorkerView]:
        """Snapshots of ``workers`` (None: the pool's workers now), all taken at one moment."""
        with self.lock:
            return [snapshot(w) for w in (self.workers.values() if workers is None else workers)]

    def view(self, worker_id: int) -> Optional[WorkerView]:
        """A snapshot of worker ``worker_id``; None once it ended (or was never added)."""
        with self.lock:
            w = self.workers.get(worker_id)
            return None if w is None else snapshot(w)

    def live(self) -> int:
        """How many of the pool's workers are not retiring (without looking at each)."""
        with self.lock:
            return len(self.workers) - self._retiring

    def starting(self) -> int:
        """How many of the pool's workers have been started and not yet connected (looks at each)."""
        with self.lock:
            return sum(1 for w in self.workers.values() if w.ident is None and not w.retiring and not w.gone)

    def worker(self, worker_id: int) -> Optional[WorkerState]:
        with self.lock:
            return self.workers.get(worker_id)

    def remembered(self) -> Tuple[int, int]:
        """(workers in the table, connection identities mapped to workers): both only of live workers."""
        with self.lock:
            return len(self.workers), len(self.by_ident)

    def backlog(self) -> Tuple[int, int]:
        """(units of work waiting for a worker, connected workers holding none)."""
        with self.lock:
            free = sum(1 for w in self.workers.values() if w.ident is not None and not w.units
                       and not w.retiring)
            return len(self.pending) + len(self.suspects), free

    def figures(self) -> Dict[str, Any]:
        """This pool's figures now, for :mod:`roving.observe`: items queued (waiting for a worker), out
        at workers, done, failed, retried; each worker's state (starting, idle, busy, retiring)."""
        with self.lock:
            queued = sum(len(u.offsets) if u.offsets is not None else u.chunk.n
                         for q in (self.pending, self.suspects) for u in q)
            workers = [{"id": w.id, "name": w.proc.name, "items": sum(u.left for u in w.units.values()),
                        "state": "retiring" if w.retiring else "starting" if w.ident is None
                        else "busy" if w.units else "idle", **w.memory.figures()} for w in self.workers.values()]
            calls = self.call_peaks.figures([{"call": c.id, "name": c.name, "peak_memory": c.peak}
                                             for c in self.calls.values() if c.peak is not None])
            return {"queued": queued, "running": sum(w["items"] for w in workers), "done": self.done,
                    "failed": self.failed, "retried": self.retried, "handed_back": self.handed_back,
                    "ended_early": self.ended_early, "oom_kills": self.oom_kills,
                    "memory_restarts": self.memory_restarts, "workers": workers, "calls": calls}

    def busy(self) -> bool:
        with self.lock:
            return bool(self.calls)
