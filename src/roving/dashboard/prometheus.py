"""The dashboard's figures in Prometheus' text format (version 0.0.4), for ``/metrics``."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

__all__ = ["text"]

#: Pool figures whose metric is not ``roving_pool_items_<field>``.
_POOL_NAMES = {"lost": "roving_pool_workers_lost_total", "oom_kills": "roving_pool_workers_oom_killed_total",
               "memory_restarts": "roving_pool_workers_memory_restarts_total"}


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(out: List[str], name: str, kind: str, help_: str, samples: List[tuple]) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        tags = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{tags}}} {float(value)!r}" if tags else f"{name} {float(value)!r}")


def text(state: Dict[str, Any]) -> str:
    """``state`` (see :meth:`roving.dashboard.state.Views.state`) as Prometheus text."""
    out: List[str] = []
    runtime = state.get("runtime")
    if runtime:
        procs = runtime["processes"]
        by_state: Dict[str, int] = {}
        for p in procs:
            by_state[p["state"]] = by_state.get(p["state"], 0) + 1
        _family(out, "roving_processes", "gauge", "Processes of this session by state.",
                [({"state": s}, n) for s, n in sorted(by_state.items())])
        pools = runtime["pools"]
        for field, kind, help_ in (("done", "counter", "Items whose result was delivered."),
                                   ("failed", "counter", "Items that failed (task exception or worker lost)."),
                                   ("retried", "counter", "Items sent again after their worker died."),
                                   ("lost", "counter", "Workers that ended unasked."),
                                   ("oom_kills", "counter", "Workers their cluster killed for memory."),
                                   ("memory_restarts", "counter", "Workers replaced above worker_memory_limit."),
                                   ("queued", "gauge", "Items waiting for a worker."),
                                   ("running", "gauge", "Items out at workers.")):
            suffix = "_total" if kind == "counter" else ""
            _family(out, _POOL_NAMES.get(field, f"roving_pool_items_{field}{suffix}"),
                    kind, help_, [({"pool": p["id"]}, p.get(field, 0)) for p in pools])
        for field, name, help_ in (("memory", "roving_pool_worker_memory_bytes",
                                    "A worker's memory at its last heartbeat (RSS, else its cgroup's usage)."),
                                   ("peak_memory", "roving_pool_worker_peak_memory_bytes",
                                    "The largest memory a worker was seen to use."),
                                   ("memory_limit", "roving_pool_worker_memory_limit_bytes",
                                    "A worker's memory limit (its cgroup's, else what its job asked for).")):
            _family(out, name, "gauge", help_, [({"pool": p["id"], "worker": w["id"]}, w[field]) for p in pools
                                                for w in p.get("workers", []) if w.get(field) is not None])
        _family(out, "roving_pool_call_peak_memory_bytes", "gauge",
                "The largest memory a worker was seen to use while running an item of a call.",
                [({"pool": p["id"], "call": c["call"], "function": c["name"]}, c["peak_memory"]) for p in pools
                 for c in p.get("calls", []) if c.get("peak_memory") is not None])
        workers: List[tuple] = []
        for p in pools:
            counts: Dict[str, int] = {}
            for w in p.get("workers", []):
                counts[w["state"]] = counts.get(w["state"], 0) + 1
            workers += [({"pool": p["id"], "state": s}, n) for s, n in sorted(counts.items())]
        _family(out, "roving_pool_workers", "gauge", "Pool workers by state.", workers)
        kinds: Dict[str, int] = {}
        for e in runtime["events"]:
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        _family(out, "roving_events", "gauge", "Events in the dashboard's timeline, by kind.",
                [({"kind": k}, n) for k, n in sorted(kinds.items())])
    families: Dict[str, Tuple[str, List[Any]]] = {"roving_pipeline_iterations_done": ("Iterations done.", []),
                "roving_pipeline_train_loss": ("Training loss of the last iteration.", []),
                "roving_pipeline_iteration_seconds": ("Duration of the last iteration.", []),
                "roving_pipeline_predicted_seconds": ("Predicted duration of an iteration.", []),
                "roving_pipeline_nodes": ("Pipeline nodes by state.", [])}
    for i, run in enumerate(state.get("pipelines") or []):
        labels = {"run": run.get("control") or run.get("metrics") or i}
        its = run.get("iterations") or []
        last = its[-1] if its else {}
        for name, value in (("roving_pipeline_iterations_done", len(its)),
                            ("roving_pipeline_train_loss", last.get("train_loss")),
                            ("roving_pipeline_iteration_seconds", last.get("seconds")),
                            ("roving_pipeline_predicted_seconds", last.get("predicted_seconds"))):
            if value is not None:
                families[name][1].append((labels, value))
        nodes: Dict[str, int] = {}
        for n in run.get("nodes") or []:
            nodes[n["state"]] = nodes.get(n["state"], 0) + 1
        families["roving_pipeline_nodes"][1].extend(({**labels, "state": s}, c) for s, c in sorted(nodes.items()))
    if state.get("pipelines"):
        for name, (help_, samples) in families.items():
            _family(out, name, "gauge", help_, samples)
    return "\n".join(out) + "\n"
