"""What the runtime publishes about itself, for the dashboard (:mod:`roving.dashboard`) and ``/metrics``.

A small in-process registry: the processes of this session (one record each, kept after they end), the
pools (each a snapshot function, held weakly), the recent output lines of each process, and a timeline of
events (worker started, lost, retried, resize, autoscale, task exceptions with their tracebacks). It
imports nothing of roving, so every layer may publish into it.

Guarantees: publishing never blocks on I/O and never raises; it is an append to a bounded buffer (or a
dictionary update) under one short lock. Readers (:func:`snapshot`) get copies, taken under that lock, so
a slow reader never holds a publisher up for longer than the copy. Everything is bounded: the latest
:data:`MAX_EVENTS` events, :data:`MAX_LINES` lines per process, :data:`MAX_PROCESSES` process records.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional

__all__ = ["event", "process_started", "process_ended", "output_lines", "lines_of", "track_pool", "task_failed",
           "snapshot", "events_since", "MAX_EVENTS", "MAX_LINES", "MAX_PROCESSES", "MAX_TASK_FAILURES"]

MAX_EVENTS = 2000
MAX_LINES = 200
MAX_PROCESSES = 2000
#: A pool lists (with tracebacks) its first this many failed items; the rest are counted only.
MAX_TASK_FAILURES = 100

_lock = threading.Lock()
_seq = itertools.count(1)
_events: Deque[Dict[str, Any]] = collections.deque(maxlen=MAX_EVENTS)
_processes: "collections.OrderedDict[str, Dict[str, Any]]" = collections.OrderedDict()
_lines: Dict[str, Deque[str]] = {}
#: pool id -> [read function, its last figures]; a pool that is gone is shown with its last figures
_pools: Dict[int, List[Any]] = {}
MAX_POOLS = 50
_t0 = time.time()


def event(kind: str, source: str, text: str, **data: object) -> None:
    """Add an event to the timeline: ``kind`` (e.g. ``worker-lost``), where (``pool 1``), what happened."""
    rec = {"kind": kind, "source": source, "text": text, "time": time.time(), **data}
    with _lock:
        rec["seq"] = next(_seq)
        _events.append(rec)


def process_started(key: str, name: str, backend: str, job_id: str, resources: Mapping[str, object],
                    host: str = "") -> None:
    """A process of this session was started as job ``job_id`` of ``backend`` (``key``: its uid), on
    ``host`` where that is known at once (the local backend: this machine)."""
    rec = {"name": name, "backend": backend, "host": host, "job": job_id, "resources": resources, "state": "running",
           "started": time.time(), "ended": None, "exitcode": None, "cause": ""}
    with _lock:
        _processes[key] = rec
        while len(_processes) > MAX_PROCESSES:
            old, gone = _processes.popitem(last=False)
            _lines.pop(gone["name"], None)


def process_ended(key: str, exitcode: Optional[int], cause: str = "") -> None:
    """The process ``key`` ended with ``exitcode`` (``-N``: killed by signal N)."""
    if not cause and exitcode is not None:
        cause = "exited normally" if exitcode == 0 else (
            f"killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}")
    with _lock:
        rec = _processes.get(key)
        if rec is not None and rec["ended"] is None:
            rec.update(state="finished" if exitcode == 0 else "failed", ended=time.time(), exitcode=exitcode,
                       cause=cause)


def output_lines(name: str, lines: List[str]) -> None:
    """Recent output lines of the process named ``name`` (the latest :data:`MAX_LINES` are kept)."""
    with _lock:
        buf = _lines.get(name)
        if buf is None:
            buf = _lines[name] = collections.deque(maxlen=MAX_LINES)
        buf.extend(lines)


def lines_of(name: str) -> List[str]:
    """The latest output lines kept of the process named ``name`` (a copy; empty when none)."""
    with _lock:
        return list(_lines.get(name, ()))


def track_pool(pool_id: int, owner: object, snap: Callable[[], Dict[str, object]]) -> None:
    """Show pool ``pool_id`` while ``owner`` lives: ``snap()`` returns its figures (a dict, taken under
    the pool's own lock; called by readers only, never on the pool's hot path). Both are held weakly
    (``snap`` may be a bound method): the registry keeps no pool alive."""
    ref = weakref.ref(owner)
    method = weakref.WeakMethod(snap) if hasattr(snap, "__self__") else (lambda: snap)

    def read() -> Optional[Dict[str, Any]]:
        fn = method()
        return fn() if ref() is not None and fn is not None else None

    with _lock:
        _pools[pool_id] = [read, None]
        while len(_pools) > MAX_POOLS:
            del _pools[next(iter(_pools))]


def task_failed(pool_id: int, func: str, index: int, exc: BaseException) -> None:
    """A task of pool ``pool_id`` raised ``exc``: an event with its traceback (formatted here: the pool
    calls this for its first :data:`MAX_TASK_FAILURES` failed items only)."""
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        cause = exc.__cause__  # a worker's remote traceback travels as the cause (multiprocessing's way)
        if cause is not None and not tb.strip().endswith(str(cause)):
            tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)) + tb
    except Exception:  # never let a strange exception break publishing
        tb = repr(exc)
    event("task-failed", f"pool {pool_id}", f"item {index} of {func} raised {type(exc).__name__}: {exc}",
          pool=pool_id, traceback=tb)


def events_since(seq: int) -> List[Dict[str, Any]]:
    """Events with a sequence number above ``seq`` (copies), oldest first."""
    with _lock:
        return [dict(e) for e in _events if e["seq"] > seq]


def snapshot() -> Dict[str, Any]:
    """Everything published, as plain data (copies): processes (with their recent output), pools, events."""
    with _lock:
        procs = [dict(rec, output=list(_lines.get(rec["name"], ()))) for rec in _processes.values()]
        pools = list(_pools.items())
        events = [dict(e) for e in _events]
    out_pools = []
    for pool_id, entry in pools:
        read, last = entry
        figures = None
        if read is not None:
            try:
                figures = read()
            except Exception as exc:  # a pool being torn down: show what went wrong rather than nothing
                figures = {"error": repr(exc)}
        if figures is None:  # the pool is gone: its last figures, its workers ended
            if last is None:
                continue
            entry[0] = None
            figures = dict(last, state="gone", workers=[])
        else:
            entry[1] = figures
        out_pools.append({"id": pool_id, **figures})
    return {"time": time.time(), "since": _t0, "processes": procs, "pools": out_pools, "events": events}
