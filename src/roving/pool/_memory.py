"""Memory in a pool: what each worker reports of its memory with its heartbeats, the peaks the parent keeps
per worker and per call, a worker's own check between tasks against ``worker_memory_limit``, and the
error of an item whose workers were killed for memory.

Guarantees:

* Each worker's heartbeat carries its memory (:func:`roving.backends.memory.sample`: RSS and peak RSS;
  its cgroup's usage, limit and peak where it is in one). The parent keeps, per worker, the last reading,
  the largest peak seen and the limit (the cgroup's, else what the worker's job asked for), and per call
  the largest peak seen while one of its items ran; the pool's figures (:mod:`roving.observe`, the
  dashboard, ``/metrics``) show them. A figure comes with a heartbeat: memory used between two heartbeats
  (``heartbeat_interval``) may be missed unless the kernel's peak (VmHWM, the cgroup's) kept it.
* ``worker_memory_limit``: a worker whose resident set is above it after a task (checked again after a
  garbage collection) takes no more work: it says BYE with its size, the parent starts a replacement,
  nothing is retried (the task was done). A task that grows past it is not stopped while it runs.
* A worker whose job the cluster ended for memory (:attr:`roving.backends.JobStatus.out_of_memory`) is
  reported as such; the item it was running fails with :class:`OutOfMemoryError` once its workers were
  killed for memory ``max_memory_kills`` times in a row (a death of another kind between two ends the
  run), instead of killing more of them.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
from typing import Any, Deque, Dict, List, Optional

from ..backends.memory import MemorySample, describe, rss
from .errors import OutOfMemoryError

#: Calls whose peak memory the pool's figures keep once they are done (the latest).
FINISHED_CALLS_KEPT = 20


class WorkerMemory:
    """What the parent knows of one worker's memory (under the dispatcher's lock)."""

    __slots__ = ("last", "peak", "limit", "asked")

    def __init__(self, asked: Optional[int] = None) -> None:
        self.last: Optional[MemorySample] = None
        self.peak: Optional[int] = None
        self.limit: Optional[int] = None  # its cgroup's, from its heartbeats
        self.asked = asked  # what its job asked the backend for

    def seen(self, sample: MemorySample) -> Optional[int]:
        """Keep ``sample``; its peak (None if it has none)."""
        self.last = sample
        peak = sample.peak()
        if peak is not None and (self.peak is None or peak > self.peak):
            self.peak = peak
        if sample.cgroup_limit is not None:
            self.limit = sample.cgroup_limit
        return peak

    def ended(self, peak: Optional[int]) -> None:
        """Its job ended having used at most ``peak`` bytes, as its cluster kept it (None: not kept)."""
        if peak is not None and (self.peak is None or peak > self.peak):
            self.peak = peak

    def the_limit(self) -> Optional[int]:
        """The limit it ran under: its cgroup's, else what its job asked for."""
        return self.limit if self.limit is not None else self.asked

    def figures(self) -> Dict[str, Any]:
        last = self.last
        now = None if last is None else last.rss if last.rss is not None else last.cgroup_usage
        return {"memory": now, "peak_memory": self.peak, "memory_limit": self.the_limit()}


@dataclasses.dataclass
class Kills:
    """One item's deaths for memory: how many in a row, the largest peak and the limit seen."""

    in_row: int = 0
    peak: Optional[int] = None
    limit: Optional[int] = None

    def add(self, worker: WorkerMemory) -> None:
        self.in_row += 1
        if worker.peak is not None and (self.peak is None or worker.peak > self.peak):
            self.peak = worker.peak
        self.limit = worker.the_limit() if worker.the_limit() is not None else self.limit


def out_of_memory(item: str, kills: Kills, max_kills: int) -> OutOfMemoryError:
    """The error of ``item`` (``"item 3 of f"``) whose workers were killed for memory ``kills.in_row``
    times in a row."""
    return OutOfMemoryError(
        f"{item} ran out of memory: the {kills.in_row} pool worker(s) running it in a row were killed for "
        f"memory (peak memory seen {describe(kills.peak)}, limit {describe(kills.limit)}); it is not tried "
        f"again (max_memory_kills={max_kills}). Give the workers more memory (Pool(resources={{'memory': "
        "...}), the memory option) or make the task use less.", kills.peak, kills.limit)


def death_words(oom: bool, worker: WorkerMemory, exitcode: Optional[int]) -> str:
    """How a worker died, for logs and events: ``exit code -9, out of memory (peak 1.2 GiB, limit 1 GiB)``."""
    words = f"exit code {exitcode}"
    if oom:
        words += (f", killed for memory: out of memory (peak memory seen {describe(worker.peak)}, "
                  f"limit {describe(worker.the_limit())})")
    return words


class CallPeaks:
    """The largest memory seen per call: of the calls running (on their ``_Call``) and of the latest
    finished ones (kept here)."""

    def __init__(self) -> None:
        self.finished: Deque[Dict[str, Any]] = collections.deque(maxlen=FINISHED_CALLS_KEPT)

    def done(self, call_id: int, name: str, peak: Optional[int]) -> None:
        if peak is not None:
            self.finished.append({"call": call_id, "name": name, "peak_memory": peak})

    def figures(self, running: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        return [*self.finished, *running]


class MemoryWatch:
    """A worker's check of its own size between tasks against ``limit`` bytes (None: no check)."""

    def __init__(self, limit: Optional[int]) -> None:
        self.limit = limit

    def over(self) -> Optional[int]:
        """The worker's resident set when it is above the limit even after a garbage collection, else
        None."""
        if self.limit is None:
            return None
        size = rss()
        if size is None or size <= self.limit:
            return None
        gc.collect()
        size = rss()
        return size if size is not None and size > self.limit else None
