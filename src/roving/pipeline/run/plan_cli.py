"""`roving pipeline plan` and `roving pipeline simulate`: plan a skip-pipeline iteration and compare it with
the baselines; judge a plan already made (this planner's JSON or a SkipPipe ``schedule.json``) by the
simulator."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeAlias

from ..errors import PipelineError, PlanError
from ..planning.baselines import full_pipeline, random_skip
from ..planning.costs import DEFAULT_MODEL, MODEL_PRESETS, model_preset
from ..planning.network import build_network
from ..planning.plan import DEFAULT_ROUTE_RULE, ROUTE_RULES, plan_from_dict
from ..planning.planner import check_inputs, plan, replan
from ..planning.simulate import SimResult, simulate
from ..planning.skippipe_schedule import VARIANTS, read_schedule, schedule_network, schedule_plan
from ..presets import PLAN_PRESETS
from .outputs import check_output

#: what ``add_subparsers()`` returns, which each ``add_*_parser`` adds its commands to (typeshed's name)
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: device memory per node when neither --memory nor --memory-microbatches is given: a 24 GiB GPU
#: (RTX 3090/4090, A10G), the commodity cards decentralised training runs on.
DEFAULT_MEMORY_MB = 24576


def add_plan_parsers(sub: Subparsers) -> None:
    """Register `pipeline plan` and `pipeline simulate` on the pipeline subparsers object."""
    p = sub.add_parser("plan", help="plan allocation and microbatch paths; compare with baselines")
    p.add_argument("--preset", choices=sorted(PLAN_PRESETS), default=None,
                   help="one of SkipPipe's settings: its network, nodes and their regions, stages, skip, "
                        "microbatches, memory (3 microbatches in flight) and model; flags given beside it win")
    p.add_argument("--network", default=None, help="preset (gcp12, aws10) or a network JSON file (required "
                                                    "without --preset)")
    p.add_argument("--nodes", default=None,
                   help="number of nodes (placed on regions round-robin) or a JSON file of nodes (required "
                        "without --preset)")
    p.add_argument("--stages", type=int, default=None, help="(required without --preset)")
    p.add_argument("--skip", type=float, default=None,
                   help="fraction of stages each microbatch skips (required without --preset)")
    p.add_argument("--microbatches", type=int, default=None, help="per iteration (default: 2 x nodes)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--memory", type=float, default=None, metavar="MB",
                     help="device memory per node in MB (MiB, 2^20 bytes). A node must fit the weights, "
                          "gradients and Adam state (16 bytes/parameter) of the stage it holds (stage 0 also "
                          "the embedding, head and fp32 logits of one microbatch) plus the stored "
                          "activations of each microbatch in flight (34 bytes x tokens x hidden per layer); "
                          "what is left after the weights sets how many microbatches it holds in flight. "
                          "Too little for some stage is an error. A nodes file may give memory_mb per node. "
                          f"Default: {DEFAULT_MEMORY_MB} (a 24 GiB GPU)")
    mem.add_argument("--memory-microbatches", type=int, default=None, metavar="N",
                     help="instead of --memory: every node holds N microbatches in flight whatever its stage "
                          "and weights are not counted (the SkipPipe paper states memory this way, N = 3)")
    p.add_argument("--model", default=None, choices=sorted(MODEL_PRESETS),
                   help=f"model preset (default {DEFAULT_MODEL})")
    p.add_argument("--route-rule", choices=ROUTE_RULES, default=DEFAULT_ROUTE_RULE,
                   help="the order a microbatch may visit its stages in: skippipe (SkipPipe's rule, the default: "
                        "a stage at most one stage number behind the furthest reached, at most two such swaps) "
                        "or inversions (looser: any order with at most two inversions, e.g. 3,1,2 or 5,1,4)")
    p.add_argument("--fail", default="", help="comma-separated nodes that fail: re-plan without them")
    p.add_argument("--budget", type=float, default=10.0, help="planner time budget in seconds")
    p.add_argument("--evals", type=int, default=None, metavar="N",
                   help="share SkipPipe's search out by N simulator evaluations instead of seconds, and stop "
                        "the baselines' searches after N evaluations each (DT-FM's: of its cost model): the same "
                        "plan and baselines on any machine and under any load (--budget then only caps them)")
    p.add_argument("--skippipe-schedule", default=None, metavar="FILE",
                   help="a SkipPipe schedule.json: plan on its nodes (its locations, on --network), stages, "
                        "microbatches and memory, and judge its routes (--variant) beside this planner's")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="ca",
                   help="which of the schedule's routes (default ca, SkipPipe's collision-aware ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, dest="json_out", help="where to write the plan")
    p.add_argument("--gantt", default=None, help="draw each node's timeline to this PNG")
    p.set_defaults(handler=run_plan)
    add_simulate_parser(sub)


def add_simulate_parser(sub: Subparsers) -> None:
    """Register `pipeline simulate`: one plan's predicted iteration time."""
    s = sub.add_parser("simulate", help="predict the iteration time of a plan already made: one written by "
                                        "`pipeline plan --json`, or a SkipPipe schedule.json")
    s.add_argument("plan_file", metavar="PLAN", help="a plan JSON file, or a SkipPipe schedule.json")
    s.add_argument("--network", default=None,
                   help="preset or network file (default: the plan's own network when it is a preset; gcp12 "
                        "for a SkipPipe schedule, whose locations are gcp12's regions)")
    s.add_argument("--variant", choices=sorted(VARIANTS), default="ca", help="a SkipPipe schedule's routes")
    s.add_argument("--model", default=None, choices=sorted(MODEL_PRESETS),
                   help="model preset (default: the plan's own, else llama-1.5b-skippipe for a SkipPipe "
                        f"schedule, else {DEFAULT_MODEL})")
    s.add_argument("--no-link-sharing", dest="link_sharing", action="store_false",
                   help="overlapping transfers on a link each get its whole bandwidth (as SkipPipe's simulator)")
    s.set_defaults(handler=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    """`roving pipeline simulate`: read the plan, build its network, print its predicted iteration time."""
    try:
        net, model, the_plan, what = _simulate_inputs(args)
        res = simulate(net, model, the_plan, record=False, link_sharing=args.link_sharing)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shared = "shared links" if args.link_sharing else "no link sharing"
    if math.isinf(res.makespan):
        print(f"{what}: deadlocks under the nodes' memory ({shared})")
        return 1
    print(f"{what}: {res.makespan:.2f} s per iteration ({len(the_plan.paths)} microbatches on "
          f"{len(the_plan.allocation)} nodes, {the_plan.stages} stages; {shared})")
    return 0


def _simulate_inputs(args: argparse.Namespace) -> tuple:
    """`pipeline simulate`'s network, model, plan and a name for it; PlanError on bad input."""
    try:
        doc = json.loads(Path(args.plan_file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read plan {args.plan_file}: {exc}") from None
    if isinstance(doc, dict) and "partitions" in doc:  # a SkipPipe schedule.json
        sched = read_schedule(doc)
        net = schedule_network(sched, args.network or "gcp12")
        the_plan = schedule_plan(sched, net, args.variant)
        return net, model_preset(args.model or "llama-1.5b-skippipe"), the_plan, f"SkipPipe {args.variant} schedule"
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise PlanError(f"{args.plan_file}: neither a plan written by `roving pipeline plan --json` (no nodes) "
                        "nor a SkipPipe schedule.json (no partitions)")
    network = args.network or doc.get("network")
    nodes = [{k: v for k, v in n.items() if k in ("name", "region", "speed", "memory_mb") and v is not None}
             | ({"memory": n["memory_microbatches"]} if n.get("memory_microbatches") is not None else {})
             for n in doc["nodes"] if isinstance(n, dict)]
    net = build_network(str(network), nodes)
    the_plan = plan_from_dict(doc)
    return net, model_preset(args.model or doc.get("model") or DEFAULT_MODEL), the_plan, "plan"


def run_plan(args: argparse.Namespace) -> int:
    """`roving pipeline plan`: plan, judge the baselines on the same network, optionally re-plan
    without failed nodes; write the JSON, print the iteration times, draw the Gantt chart."""
    try:
        net, model, m, failed, imported = _plan_inputs(args)
        bound = f"{args.evals:,} simulations, at most {args.budget:g} s" if args.evals else f"{args.budget:g} s"
        note(f"planning {m} microbatches on {len(net.nodes)} nodes, {args.stages} stages, skip {args.skip:g} "
              f"({bound})" + (f"; then again without {','.join(failed)}" if failed else ""))
        t0 = time.perf_counter()
        best = plan(net, model, args.stages, args.skip, m, budget_s=args.budget, seed=args.seed,
                    max_evals=args.evals, route_rule=args.route_rule, progress=_plan_progress("skippipe"))
        planner_s = time.perf_counter() - t0
        out = {
            "preset": args.preset,
            "network": net.name,
            "model": args.model,
            # in_flight: microbatches the node holds in flight for the stage the plan gives it
            "nodes": [{"name": n.name, "region": n.region, "speed": n.speed, "memory_mb": n.memory_mb,
                       "memory_microbatches": None if n.memory_mb is not None else n.memory,
                       "in_flight": n.in_flight(best.allocation[n.name], model, args.stages)
                       if n.name in best.allocation else None}
                      for n in net.nodes],
            "microbatches": m,
            **best.to_dict(),
            "iteration_time_s": {"skippipe": best.predicted_s, **_baseline_times(args, net, model, m, best)},
            "planner_seconds": planner_s,
        }
        if imported is not None:  # SkipPipe's own plan, judged by the same simulator
            out["iteration_time_s"]["skippipe_schedule"] = simulate(net, model, imported, record=False).makespan
            out["skippipe_schedule"] = {"file": args.skippipe_schedule, "variant": args.variant, **imported.to_dict()}
        shown, shown_net = best, net
        if failed:
            new, new_net = replan(best, net, model, failed=failed, seed=args.seed)
            out["replan"] = {"failed": failed, **new.to_dict(), "iteration_time_s": new.predicted_s,
                             "planner_seconds": new.stats["planner_seconds"]}
            shown, shown_net = new, new_net
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.json_out).write_text(json.dumps(out, indent=1))
    _print_times(out, planner_s, failed)
    if args.gantt:
        draw_gantt(simulate(shown_net, model, shown), args.gantt, shown.allocation)
        print(f"timeline drawn to {args.gantt}")
    return 0


def _plan_inputs(args: argparse.Namespace) -> tuple:
    """`pipeline plan`'s network, model, microbatches, failed nodes and the SkipPipe schedule's plan (or
    None), checked (PlanError otherwise)."""
    imported = None
    if args.skippipe_schedule:
        sched = read_schedule(args.skippipe_schedule)
        net = schedule_network(sched, args.network or "gcp12")
        imported = schedule_plan(sched, net, args.variant)
        args.network, args.nodes = args.network or "gcp12", str(len(net.nodes))
        args.stages, args.skip = args.stages or imported.stages, imported.skip if args.skip is None else args.skip
        args.microbatches = args.microbatches or len(imported.paths)
        args.model = args.model or "llama-1.5b-skippipe"
    regions = _apply_preset(args)
    check_output(args.json_out, "--json")
    if args.gantt:
        check_output(args.gantt, "--gantt")
    nodes = int(args.nodes) if args.nodes.isdigit() else args.nodes
    if isinstance(nodes, str) and not Path(nodes).is_file():
        raise PlanError(f"--nodes {nodes!r} is neither a number nor a file")
    if imported is not None:
        pass  # the schedule's nodes: its locations, its memory
    elif args.memory_microbatches is not None:
        net = build_network(args.network, nodes, memory=args.memory_microbatches, regions=regions)
    else:
        mb = DEFAULT_MEMORY_MB if args.memory is None else args.memory
        net = build_network(args.network, nodes, memory_mb=mb, regions=regions)
    model = model_preset(args.model)
    m = args.microbatches or 2 * len(net.nodes)
    failed = [f for f in args.fail.split(",") if f]
    for f in failed:
        net.node(f)
    if args.evals is not None and args.evals < 1:
        raise PlanError(f"--evals must be a positive count of simulator evaluations, got {args.evals}")
    check_inputs(net, model, args.stages, args.skip, m)  # bad input: the error alone on stderr
    return net, model, m, failed, imported


def _apply_preset(args: argparse.Namespace) -> list[str] | None:
    """Fill the settings not given on the command line from ``--preset`` (``presets.PLAN_PRESETS``); the
    regions its nodes go to in turn, when its network and node count are the ones used (else None).
    PlanError naming a required setting that neither gives."""
    preset = PLAN_PRESETS[args.preset] if args.preset else {}
    ours = args.network in (None, preset.get("network")) and args.nodes is None
    for name in ("network", "nodes", "stages", "skip", "microbatches", "model"):
        if getattr(args, name) is None and name in preset:
            setattr(args, name, str(preset[name]) if name == "nodes" else preset[name])
    if args.memory is None and args.memory_microbatches is None:
        args.memory_microbatches = preset.get("memory_microbatches")
    if args.model is None:
        args.model = DEFAULT_MODEL
    missing = [f"--{name}" for name in ("network", "nodes", "stages", "skip") if getattr(args, name) is None]
    if missing:
        raise PlanError(f"pipeline plan needs {', '.join(missing)} (or --preset, one of "
                        f"{', '.join(sorted(PLAN_PRESETS))})")
    return preset.get("regions") if ours else None


def _baseline_times(args: argparse.Namespace, net: Any, model: Any, m: int, best: Any) -> dict:
    """The baselines' predicted iteration times on ``net`` (None: the baseline put a stage on a node
    whose memory cannot hold it; DT-FM ignores memory), each with half of ``--budget``."""
    base_budget = args.budget / 2
    base_bound = (f"{args.evals:,} evaluations, at most {base_budget:g} s" if args.evals
                  else f"{base_budget:g} s")
    note(f"baselines: full_pipeline (DT-FM's allocation search, {base_bound}), "
          f"full_pipeline_planned (this planner with skip 0), random_skip")
    full = full_pipeline(net, model, args.stages, m, budget_s=base_budget, seed=args.seed,
                         max_evals=args.evals)
    if full.stats["capped"]:
        note(f"full_pipeline: DT-FM's search stopped at {base_budget:g} s after "
              f"{full.stats['evaluations']:,} of {args.evals:,} evaluations: its figure may differ on "
              "another machine (raise --budget)")
    planned = plan(net, model, args.stages, 0.0, m, budget_s=base_budget, seed=args.seed,
                   max_evals=args.evals, route_rule=args.route_rule)
    rand = random_skip(net, model, best.allocation, args.stages, args.skip, m, seed=args.seed)
    return {"full_pipeline": full.predicted_s if full.stats.get("memory_ok", True) else None,
            "full_pipeline_planned": planned.predicted_s, "random_skip": rand.predicted_s}


def _print_times(out: dict, planner_s: float, failed: list[str]) -> None:
    times = out["iteration_time_s"]
    for k, v in times.items():
        if v is None:
            print(f"{k:>22}: cannot run (puts a stage on a node without the memory for it)")
        elif times["full_pipeline"] is None:
            print(f"{k:>22}: {v:8.2f} s")
        else:
            print(f"{k:>22}: {v:8.2f} s  ({v / times['full_pipeline']:.2f}x full_pipeline)")
    print(f"{'planner':>22}: {planner_s:8.2f} s")
    if failed:
        print(f"{'after failing ' + ','.join(failed):>22}: {out['replan']['iteration_time_s']:8.2f} s "
              f"(re-planned in {out['replan']['planner_seconds']:.2f} s)")


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _plan_progress(what: str) -> Callable[..., None]:
    """A ``plan(progress=...)`` that tells stderr how the search goes: each phase as it ends, better
    plans of the last phase at most once a second, and the result."""
    last = [-1.0]

    def show(ev: dict) -> None:
        phase, best, at = ev["phase"], ev["best_s"], ev["elapsed_s"]
        if phase == "paths":
            if at - last[0] < 1.0:
                return
            text = f"path search: {best:.2f} s per iteration"
        elif phase == "allocation":
            text = (f"allocations searched: {ev['candidates']} go to the race, the best {best:.2f} s "
                    "per iteration with quick paths")
        elif phase == "race":
            text = f"race round {ev['round']} of {ev['rounds']} ({ev['contenders']} allocations): best {best:.2f} s"
        else:
            text = f"done: {best:.2f} s per iteration ({ev['evaluations']:,} simulations)"
        last[0] = at
        note(f"{what} [{at:5.1f} s] {text}")

    return show


def draw_gantt(result: SimResult, out_png: str, stages: dict[str, int] | None = None) -> None:
    """Each node's timeline as one row: forward, backward/loss compute (each task outlined and, where
    it is wide enough, labelled with its microbatch), sends (thin bar) and idle; ``stages`` (node ->
    stage) adds each node's stage to its row label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"compute-fwd": "tab:blue", "compute-bwd": "tab:orange", "compute-loss": "tab:red",
              "idle": "0.92", "send": "tab:green", "sync": "tab:purple"}
    names = sorted(result.timeline)
    span = result.makespan if result.makespan > 0 and result.makespan != float("inf") else 1.0
    fig, ax = plt.subplots(figsize=(14, 0.4 * len(names) + 1.5))
    for row, name in enumerate(names):
        for e in result.timeline[name]:
            thin = e.kind in ("send", "sync")
            task = e.kind.startswith("compute")
            ax.barh(row + (0.3 if thin else 0), e.end - e.start, left=e.start, height=0.15 if thin else 0.6,
                    color=colors[e.kind], alpha=0.6 if thin else 1.0,
                    edgecolor="white" if task else "none", linewidth=0.6 if task else 0)
            if task and e.microbatch >= 0 and e.end - e.start >= 0.012 * span:
                ax.text((e.start + e.end) / 2, row, str(e.microbatch), ha="center", va="center",
                        fontsize=6, color="white")
    labels = [f"{n} (stage {stages[n]})" if stages and n in stages else n for n in names]
    ax.set_yticks(range(len(names)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"iteration timeline, makespan {result.makespan:.2f} s")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.4 * len(names) + 1.5)),
              ncol=len(colors), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
