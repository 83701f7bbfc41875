"""What the dashboard shows, read when a browser asks: the runtime (:mod:`roving.observe`) with each
pool's throughput over time, and pipeline trainings (:mod:`roving.dashboard.pipeline_view`)."""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

from .. import observe
from .pipeline_view import PipelineWatch

__all__ = ["Views"]

_SAMPLES = 600  # throughput points per pool (10 minutes at one a second)
_PAGE_EVENTS = 500
_PAGE_LINES = 40


class Views:
    """The views of one dashboard: the runtime of this process (``runtime``), and the pipeline runs added
    with :meth:`watch_pipeline`. Thread-safe."""

    def __init__(self, runtime: bool = True) -> None:
        self.runtime = runtime
        self._lock = threading.Lock()
        self._pipelines: List[PipelineWatch] = []
        self._done: Dict[int, Deque[Tuple[float, int]]] = {}  # pool id -> (time, items done) samples

    def watch_pipeline(self, control: Optional[str] = None, metrics: Optional[str] = None) -> PipelineWatch:
        """Show the training whose control folder is ``control`` (live) and/or whose metrics file is
        ``metrics`` (a finished run)."""
        watch = PipelineWatch(control, metrics)
        with self._lock:
            self._pipelines.append(watch)
        return watch

    def _throughput(self, pools: List[Dict[str, Any]], now: float) -> None:
        """Add a sample of each pool's done count; each pool gets ``throughput``: [[t, items/s], ...]."""
        with self._lock:
            for pool in pools:
                samples = self._done.setdefault(pool["id"], collections.deque(maxlen=_SAMPLES))
                done = pool.get("done", 0) + pool.get("failed", 0)
                if not samples or now - samples[-1][0] >= 0.5:
                    samples.append((now, done))
                pts = list(samples)
                pool["throughput"] = [[round(b[0], 3), round((b[1] - a[1]) / (b[0] - a[0]), 3)]
                                      for a, b in zip(pts, pts[1:]) if b[0] > a[0]]

    def state(self) -> Dict[str, Any]:
        """Everything the page shows, as plain data."""
        now = time.time()
        out: Dict[str, Any] = {"time": now, "runtime": None, "pipelines": []}
        if self.runtime:
            snap = observe.snapshot()
            self._throughput(snap["pools"], now)
            # what the page shows, no more: the latest events, the latest lines of each process
            snap["events"] = snap["events"][-_PAGE_EVENTS:]
            for proc in snap["processes"]:
                proc["output"] = proc["output"][-_PAGE_LINES:]
            out["runtime"] = snap
        with self._lock:
            pipelines = list(self._pipelines)
        out["pipelines"] = [p.read() for p in pipelines]
        return out
