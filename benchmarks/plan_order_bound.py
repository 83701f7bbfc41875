"""How much do the planner's paths lose to the simulator's service policy? An exact scheduler's answer.

    pip install ortools   # this script only; roving does not need it
    PYTHONPATH=src python benchmarks/plan_order_bound.py --network aws10 --nodes 18 --stages 4 --skip 0.25 \\
        --microbatches 36 --memory 3 --evals 2000 --solve 90 --full 19.1

The planner fixes each microbatch's path and leaves the order of the work at each node to the serving
policy (backward first, then first come, see ``simulate``). This script takes the planner's plan and
asks a constraint solver (OR-Tools CP-SAT) for the best schedule of exactly those paths when each node
may serve its waiting work in any order and may also wait on purpose: each node one task at a time,
each node's memory (microbatches in flight from the start of their forward there to the end of their
backward there), each transfer at least the link's latency plus bytes over bandwidth after the task
before it. Transfers do not share links here (the simulator's do), so the solver's lower bound is a
lower bound for every service order and every deliberate wait on these paths under the simulator's
model too; its schedule is what such an order could reach. A second figure: the planner's own path
search on the same allocation with every node's memory unlimited (what memory costs these paths).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import replace

from roving.pipeline import build_network, model_preset, plan, simulate
from roving.pipeline.planning.costs import transfer_time
from roving.pipeline.planning.routes import SearchContext, build_routes, improve_routes
from roving.pipeline.planning.simulate import Compute, microbatch_steps

TICKS = 10_000  # solver time unit: 0.1 ms; durations are rounded down, so its bound stays a bound


def solve_schedule(net, model, p, seconds: float, workers: int) -> tuple[float, float, str]:
    """(best schedule found, lower bound, solver status) for ``p``'s paths, in seconds."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    horizon = int(TICKS * 4 * (simulate(net, model, p, record=False).makespan + 1))
    on_node: dict[str, list] = {}
    held: dict[str, list] = {}
    ends = []
    for mb, steps in enumerate(microbatch_steps(net, model, p, {})):
        ready = 0
        first_fwd: dict[str, object] = {}
        for k, step in enumerate(steps):
            if isinstance(step, Compute):
                node, kind, secs = step
                start, end = m.NewIntVar(0, horizon, f"s{mb}.{k}"), m.NewIntVar(0, horizon, f"e{mb}.{k}")
                on_node.setdefault(node, []).append(
                    m.NewIntervalVar(start, int(secs * TICKS), end, f"c{mb}.{k}"))
                m.Add(start >= ready)
                first_fwd.setdefault(node, start)
                if kind == 2:  # the backward there ends what the node holds for this microbatch
                    length = m.NewIntVar(0, horizon, f"l{mb}.{k}")
                    held.setdefault(node, []).append(
                        m.NewIntervalVar(first_fwd[node], length, end, f"h{mb}.{k}"))
                ready = end
            else:  # a Send
                link = net.link(step.src, step.dst)
                arrive = m.NewIntVar(0, horizon, f"a{mb}.{k}")
                secs = transfer_time(link.latency_s, link.bandwidth_bps, model.transfer_bytes)
                m.Add(arrive >= ready + int(secs * TICKS))
                ready = arrive
        ends.append(ready)
    for intervals in on_node.values():
        m.AddNoOverlap(intervals)
    for node, intervals in held.items():
        m.AddCumulative(intervals, [1] * len(intervals), net.node(node).in_flight(p.allocation[node], model, p.stages))
    makespan = m.NewIntVar(0, horizon, "makespan")
    m.AddMaxEquality(makespan, ends)
    m.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = workers
    status = solver.Solve(m)
    found = solver.Value(makespan) / TICKS if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else math.inf
    return found, solver.BestObjectiveBound() / TICKS, solver.StatusName(status)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--network", default="aws10")
    ap.add_argument("--nodes", type=int, default=18)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--skip", type=float, default=0.25)
    ap.add_argument("--microbatches", type=int, default=36)
    ap.add_argument("--memory", type=int, default=3, help="microbatches in flight per node")
    ap.add_argument("--model", default="llama-1.5b-skippipe")
    ap.add_argument("--evals", type=int, default=2000, help="the planner's simulator evaluations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--solve", type=float, default=90.0, help="seconds for the constraint solver")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--full", type=float, default=None, help="full_pipeline's iteration time, for the ratios")
    args = ap.parse_args()
    if args.evals < 1 or args.solve <= 0:
        ap.error("--evals must be at least 1 and --solve positive")
    net = build_network(args.network, args.nodes, memory=args.memory)
    model = model_preset(args.model)
    p = plan(net, model, args.stages, args.skip, args.microbatches, budget_s=3600.0, seed=args.seed,
             max_evals=args.evals)
    splits = [list(p.allocation.values()).count(s) for s in range(args.stages)]

    def ratio(x: float) -> str:
        return f" ({x / args.full:.2f}x full_pipeline)" if args.full else ""

    print(f"planner ({args.evals} evaluations, seed {args.seed}): {p.predicted_s:.2f} s{ratio(p.predicted_s)}, "
          f"replicas per stage {splits}")
    t = time.perf_counter()
    found, bound, status = solve_schedule(net, model, p, args.solve, args.workers)
    print(f"same paths, any service order and waits (CP-SAT {status}, {time.perf_counter() - t:.0f} s): "
          f"schedule {found:.2f} s{ratio(found)}, lower bound {bound:.2f} s{ratio(bound)}")
    free = net.with_nodes([replace(n, memory=10**6, memory_mb=None) for n in net.nodes])
    ctx = SearchContext(free, model, p.allocation, args.stages)
    paths = build_routes(ctx, args.microbatches, len(p.paths[0].stages))
    _, _, best, _ = improve_routes(ctx, paths, args.skip, math.inf, random.Random(args.seed),
                                   max_evals=args.evals)
    print(f"same allocation, memory unlimited, path search ({args.evals} evaluations): {best:.2f} s{ratio(best)}")


if __name__ == "__main__":
    main()
