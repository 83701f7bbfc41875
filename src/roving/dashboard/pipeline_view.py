"""A pipeline training as the dashboard shows it, read from the files the trainer writes.

A live run (``roving pipeline train --control DIR``) writes its control folder
(``pipeline.control.ControlFolder``, which owns the file names and is read through here): the status at
every iteration (nodes and their stages, the last loss and iteration time, recent events) and the
iterations, evaluations and events it appends (one JSON object a line). A finished run has its
metrics file (``--metrics``: iterations, evaluations, events). This reader takes whatever of these exists;
where only ``status.json`` exists it keeps what it saw of it, so the curves grow from the moment it
watches. Nothing here writes to the run's folder.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable, Dict, List, Optional, Set

from ..pipeline.runtime.control import EVALUATIONS, EVENTS, ITERATIONS, PLAN, STATUS, ControlFolder

__all__ = ["PipelineWatch"]

_KEEP = 5000  # iterations and events kept from status.json polls


def _json(read: Callable[[], Any]) -> Optional[Any]:
    """What ``read()`` returns; None when the file is not there yet, or is being replaced."""
    try:
        return read()
    except (OSError, ValueError):
        return None


def _read_file(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


class PipelineWatch:
    """One training: its control folder (live) and/or metrics file (finished)."""

    def __init__(self, control: Optional[str], metrics: Optional[str]) -> None:
        if not control and not metrics:
            raise ValueError("a pipeline view needs a control folder (--control) or a metrics file (--metrics)")
        self.control, self.metrics = control, metrics
        self._lock = threading.Lock()
        self._seen_iterations: Dict[int, Dict[str, Any]] = {}
        self._seen_events: List[Dict[str, Any]] = []
        self._dead: Dict[str, Any] = {}

    def _from_status(self, status: Dict[str, Any]) -> None:
        done = status.get("iterations_done") or 0
        if done and status.get("train_loss") is not None and done - 1 not in self._seen_iterations:
            self._seen_iterations[done - 1] = {"iteration": done - 1, "train_loss": status["train_loss"],
                                               "seconds": status.get("iteration_seconds")}
            if len(self._seen_iterations) > _KEEP:
                del self._seen_iterations[min(self._seen_iterations)]
        for ev in status.get("recent_events") or []:
            if ev not in self._seen_events[-50:]:
                self._seen_events.append(ev)
        del self._seen_events[:-_KEEP]

    def read(self) -> Dict[str, Any]:
        """The run now: status, nodes (name, stage, host, state), iterations, evaluations, events, plan."""
        status: Dict[str, Any] = {}
        iterations: Optional[List[Dict[str, Any]]] = None
        events: Optional[List[Dict[str, Any]]] = None
        evaluations: List[Dict[str, Any]] = []
        plan = None
        if self.control:
            folder = ControlFolder(self.control)
            status = _json(lambda: folder.read_json(STATUS)) or {}
            iterations = folder.read_lines(ITERATIONS)
            events = folder.read_lines(EVENTS)
            evaluations = folder.read_lines(EVALUATIONS) or []
            plan = _json(lambda: folder.read_json(PLAN))
        if self.metrics:
            metrics = self.metrics
            done = _json(lambda: _read_file(metrics))
            if isinstance(done, dict):
                iterations = iterations or done.get("iterations")
                events = events or done.get("events")
                evaluations = evaluations or done.get("evaluations") or []
        with self._lock:
            if status:
                self._from_status(status)
            if iterations is None:
                iterations = [self._seen_iterations[k] for k in sorted(self._seen_iterations)]
            else:  # a resumed run appends again the iterations after its checkpoint: the latest counts
                latest = {r.get("iteration"): r for r in iterations}
                iterations = [latest[k] for k in sorted(latest, key=lambda k: (k is None, k or 0))]
            if events is None:
                events = list(self._seen_events)
        return {"control": self.control, "metrics": self.metrics, "status": status,
                "nodes": _nodes(status, events, plan), "iterations": iterations, "events": events,
                "evaluations": evaluations, "plan": plan,
                "finished": bool(status) and status.get("iterations_done") == status.get("iterations")
                or (not status and bool(iterations))}


def _nodes(status: Dict[str, Any], events: List[Dict[str, Any]],
           plan: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each node: its stage, region (where the status or plan says), and alive / slow / dead / joining."""
    alloc = status.get("nodes") or {}
    hosts = (status.get("regions") or (plan or {}).get("regions") or {})
    dead: Set[str] = set()
    slow: Set[str] = set()
    excluded: Set[str] = set()
    stage_of = dict(alloc)
    for ev in events:
        kind, names = ev.get("event"), ev.get("nodes") or []
        if kind == "dead":
            dead.update(names)
            slow.difference_update(names)
        elif kind == "slow":
            slow.update(names)
        elif kind == "caught":  # verification caught it computing wrong: out for good
            excluded.add(str(ev.get("node")))
        elif kind == "replan":  # nodes that joined (again) are alive from then on
            dead.difference_update(ev.get("joined") or [])
            for name, stage in (ev.get("allocation") or {}).items():
                stage_of.setdefault(name, stage)
    for name, node in (status.get("node_states") or {}).items():  # the trainer's own word, where it says
        stage_of.setdefault(name, node.get("stage"))
    out = []
    starting = set(status.get("starting") or [])
    for name in sorted(set(stage_of) | dead | starting | excluded - {None}):
        state = ("excluded" if name in excluded else "joining" if name in starting else "dead" if name in dead
                 else "slow" if name in slow else "alive")
        out.append({"name": name, "stage": stage_of.get(name), "host": hosts.get(name, ""), "state": state})
    return out
