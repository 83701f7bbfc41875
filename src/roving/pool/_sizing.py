"""How many workers a pool keeps, and of what shape: resizing on request, autoscaling between ``min`` and
``max`` by the work waiting and the workers idle, and replacing the workers when a call asks for another
shape.

:class:`Sizing` is that part of :class:`roving.pool._upkeep.Upkeep`; it changes ``size``, ``min``,
``max`` and ``shape`` under the upkeep's lock, and asks the dispatcher to retire the workers it no longer
needs (they run what they hold first).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List

from .. import observe
from ._dispatch import Dispatcher
from ._shape import covers
from ._work import WorkerView

log = logging.getLogger(__name__)


class Sizing:
    """A pool's size and shape (a mixin of ``Upkeep``, whose state it shares: declared here, set by
    ``Upkeep.__init__``)."""

    disp: Dispatcher
    lock: threading.RLock
    wake: threading.Event
    size: int
    min: int
    max: int
    shape: Dict[str, Any]
    _idle_since: Dict[int, float]
    _idle_timeout: float

    def resize(self, processes: int) -> None:
        """Keep ``processes`` workers from now on; shrinking retires idle workers first, then busy ones."""
        observe.event("resize", f"pool {self.disp.pool_id}", f"resized to {processes} worker(s)")
        with self.lock:
            self.min = self.max = processes
            self.size = processes
            live = [v for v in self.disp.views() if not v.retiring]
            extra = len(live) - processes
            if extra > 0:
                live.sort(key=lambda v: (v.busy, v.connected))
                for v in live[:extra]:
                    self.disp.retire(v.worker)
        self.wake.set()

    def reshape(self, need: Dict[str, Any], func: Any) -> None:
        """Workers of shape ``need`` from now on (``func`` asked for it): the present ones are retired
        (they run what they hold first) and replaced, unless the shape covers ``need`` meanwhile."""
        with self.lock:
            if covers(self.shape, need):
                return
            log.info("roving pool: %s asks for workers with %s; the pool's workers are replaced",
                     getattr(func, "__qualname__", func), need)
            self.shape = dict(need)
            for w in self.disp.workers_now():
                self.disp.retire(w)
        self.wake.set()

    def _autoscale(self, workers: List[WorkerView], now: float) -> None:
        """Between ``min`` and ``max`` workers: grow while work waits and no worker is free, shrink by
        workers idle for ``idle_timeout`` seconds."""
        waiting, free = self.disp.backlog()
        live = [v for v in workers if not v.retiring]
        starting = sum(1 for v in live if not v.connected)
        with self.lock:
            if waiting and not free and self.size < self.max:
                grow = min(self.max - self.size, max(0, waiting - starting))
                if grow:
                    log.info("roving pool: %d unit(s) of work waiting; %d more worker(s)", waiting, grow)
                    observe.event("autoscale", f"pool {self.disp.pool_id}", f"{waiting} unit(s) waiting: "
                                  f"{grow} more worker(s), {self.size + grow} in all")
                    self.size += grow
                return
            for v in live:
                if v.busy or not v.connected:
                    self._idle_since.pop(v.worker.id, None)
                else:
                    self._idle_since.setdefault(v.worker.id, now)
            idle = sorted((since, wid) for wid, since in self._idle_since.items()
                          if now - since >= self._idle_timeout)
            extra = min(len(idle), len(live) - self.min)
            for _, wid in idle[:max(0, extra)]:
                w = self.disp.worker(wid)
                if w is not None:
                    self._idle_since.pop(wid, None)
                    self.disp.retire(w)
                    self.size -= 1
                    observe.event("autoscale", f"pool {self.disp.pool_id}", f"worker {wid} idle: retired, "
                                  f"{self.size} left")

