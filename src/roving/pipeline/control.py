"""A training run's control folder (``pipeline train --control DIR``): join requests come in as
``join-*.json`` files (written by ``roving pipeline join``), each answered by a ``.done`` file, and the
run's status goes out as ``status.json`` (read by ``roving pipeline status``). Files are replaced
atomically, so a reader never sees half of one. For the dashboard (``roving pipeline dashboard``) the run
also appends each iteration, evaluation and event as one JSON line to ``iterations.jsonl``,
``evaluations.jsonl`` and ``events.jsonl`` (a reader skips a line being written), and replaces
``plan.json``: the plan's predicted timeline beside the last iteration's measured one."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from .errors import PlanError
from .simulate import simulate


def serve_join_requests(folder: str, request_join: Callable[[str | None, str | None], str]) -> None:
    """Answer every join request in ``folder``: ``request_join(name, region)`` once per node asked for
    (``count``); the answer names the nodes started, or the error (a PlanError, or a malformed
    request)."""
    for req in sorted(Path(folder).glob("join-*.json")):
        answer: dict[str, Any]
        try:
            doc = json.loads(req.read_text())
            names = [request_join(doc.get("name"), doc.get("region")) for _ in range(int(doc.get("count", 1)))]
            answer = {"started": names}
        except (PlanError, ValueError, TypeError) as exc:
            answer = {"error": str(exc)}
        tmp = req.with_suffix(".tmp")
        tmp.write_text(json.dumps(answer))
        tmp.replace(req.with_suffix(".done"))
        req.unlink(missing_ok=True)


def append_record(folder: str, name: str, rec: dict) -> None:
    """Append ``rec`` to ``folder/name`` as one JSON line (values JSON cannot hold as text)."""
    Path(folder).mkdir(parents=True, exist_ok=True)  # an event may come before the run's first status
    with open(Path(folder) / name, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


class PlanWriter:
    """``plan.json`` in ``folder``, for the dashboard: for each node, the simulator's timeline of the plan
    in use on the run's cores (``predicted``, computed once per plan) beside the last iteration's
    measured one (``measured``), each entry [kind, microbatch, start s, end s] from the iteration's
    start; the nodes' regions. Written at most once a second."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._written = 0.0
        self._plan: Any = None
        self._predicted: dict = {}

    def write(self, iteration: int, plan: Any, net: Any, spec: Any, shared_cores: int, trace: dict) -> None:
        now = time.monotonic()
        if now - self._written < 1.0:
            return
        self._written = now
        if self._plan is not plan:
            timeline = simulate(net, spec, plan, shared_cores=shared_cores).timeline
            self._predicted = {n: [[e.kind, e.microbatch, round(e.start, 5), round(e.end, 5)] for e in events
                                   if e.kind != "idle"] for n, events in timeline.items()}
            self._plan = plan
        doc = {"iteration": iteration, "predicted": self._predicted,
               "measured": {n: [[k, mb, round(a, 5), round(b, 5)] for k, mb, a, b in t] for n, t in trace.items()},
               "regions": {n: net.node(n).region for n in plan.allocation if n in net.names}}
        tmp = Path(self.folder) / "plan.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(Path(self.folder) / "plan.json")


#: what a "recovery" event (``trainer.Trainer._recover``) shows in status.json besides its kind.
_RECOVERY = ("stage", "policy", "chosen", "why", "neighbours", "grad_norms", "shares", "snapshot_iteration",
             "snapshot_age", "lr_factor")


def write_status(folder: str, metrics: dict, iterations: int, alloc: dict[str, int], missing_stages: list[int],
                 starting: list[str], refining: bool) -> None:
    """``status.json`` in ``folder``: iterations done (of ``iterations``), the nodes and their stages,
    stages no node holds, nodes starting, the last iteration's loss and seconds, whether a fresh plan
    is being searched, the five latest events (from ``metrics``; a "recovery" event with its choice and
    inputs, ``_RECOVERY``)."""
    last = metrics["iterations"][-1] if metrics["iterations"] else {}
    status = {"iterations_done": len(metrics["iterations"]) and last["iteration"] + 1,
              "iterations": iterations, "nodes": dict(sorted(alloc.items())),
              "missing_stages": missing_stages, "starting": starting,
              "train_loss": last.get("train_loss"), "iteration_seconds": last.get("seconds"),
              "refining": refining,
              "recent_events": [{k: e[k] for k in ("event", "iteration", "adopted", "error") + _RECOVERY if k in e}
                                | {"nodes": e.get("nodes")} for e in metrics["events"][-5:]]}
    tmp = Path(folder) / "status.tmp"
    tmp.write_text(json.dumps(status, indent=1))
    tmp.replace(Path(folder) / "status.json")
