"""A training run's control folder (``pipeline train --control DIR``): join requests come in as
``join-*.json`` files (written by ``roving pipeline join``), each answered by a ``.done`` file, and the
run's status goes out as ``status.json`` (read by ``roving pipeline status``). Files are replaced
atomically, so a reader never sees half of one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from .costs import PlanError


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
