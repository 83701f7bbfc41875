"""How close can any SkipPipe plan come to the planner's target on a network? A contention-free best case.

    PYTHONPATH=src python benchmarks/plan_bound.py --network aws10 --nodes 18 --stages 4 --skip 0.25 \\
        --microbatches 36 --memory 3 --full 19.1

With ``s0`` stage-0 nodes, some origin sends ``ceil(M / s0)`` microbatches and holds each for its whole
round trip (memory ``m``). This script simulates that one origin with the shortest round trip the
network allows (its region and the regions its microbatches visit chosen from where the nodes are, each
microbatch given nodes of its own, so nothing else competes for them; every priority order tried) and,
beside it, the compute the other stages' visits need, spread evenly over the ``N - s0`` nodes left. Both
are relaxations (no contention between origins, perfect balance), judged by the planner's simulator;
they show where a target sits against what the network and memory allow. They are not proofs: a
greedy list schedule is not monotone, so a plan with more constraints can in rare cases finish earlier.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections import Counter

from roving.pipeline import Plan, Route, build_network, model_preset, simulate
from roving.pipeline.planning.plan import visits_per_microbatch
from roving.pipeline.planning.costs import stage_costs, transfer_time
from roving.pipeline.planning.network import Node


def cheapest_walk(net, model, visits: int) -> tuple[float, tuple[str, ...]]:
    """The regions of the cheapest closed walk origin -> v1 .. v_visits -> origin (forward and back:
    each hop twice), using no region for more nodes than it has."""
    have = Counter(n.region for n in net.nodes)
    regions = sorted(have)
    best = (math.inf, ())
    nbytes = model.transfer_bytes
    for seq in itertools.product(regions, repeat=visits + 1):
        if any(c > have[r] for r, c in Counter(seq).items()):
            continue
        hops = list(zip(seq, seq[1:] + seq[:1]))
        cost = 0.0
        for a, b in hops:
            link = net.intra if a == b else net.links.get((a, b)) or net.links[(b, a)]
            cost += 2 * transfer_time(link.latency_s, link.bandwidth_bps, nbytes)
        best = min(best, (cost, seq))
    return best


def one_origin(net, model, stages: int, visits: int, n: int, memory: int, regions: tuple[str, ...]) -> float:
    """Makespan of one origin sending ``n`` microbatches along ``regions``, each on nodes of its own,
    under its best priority order."""
    speed = net.nodes[0].speed
    nodes = [Node("o", regions[0], speed, memory)]
    alloc, paths = {"o": 0}, []
    for i in range(n):
        names = []
        for j, r in enumerate(regions[1:]):
            names.append(f"m{i}s{j + 1}")
            nodes.append(Node(names[-1], r, speed, memory))
            alloc[names[-1]] = j + 1
        paths.append(Route("o", tuple(names), tuple(range(1, visits + 1))))
    alone = net.with_nodes(nodes)
    return min(simulate(alone, model, Plan(stages, 0.0, alloc, paths, list(order)), record=False).makespan
               for order in itertools.permutations(range(n)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", default="aws10")
    ap.add_argument("--nodes", type=int, default=18)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--skip", type=float, default=0.25)
    ap.add_argument("--microbatches", type=int, default=36)
    ap.add_argument("--memory", type=int, default=3)
    ap.add_argument("--model", default="llama-1.5b-skippipe")
    ap.add_argument("--full", type=float, required=True, help="full_pipeline's iteration seconds (plan.py)")
    args = ap.parse_args()
    net = build_network(args.network, args.nodes, memory=args.memory)
    model = model_preset(args.model)
    visits = visits_per_microbatch(args.stages, args.skip)
    hop_s, regions = cheapest_walk(net, model, visits)
    c = stage_costs(model, args.stages, net.nodes[0].speed)
    visit_work = sum(c.forward[1:]) / (args.stages - 1) + sum(c.backward[1:]) / (args.stages - 1)
    print(f"cheapest round trip's regions: {' -> '.join(regions)} (transfers {hop_s:.2f} s)")
    print("| stage-0 nodes | microbatches at the busiest origin | its best case alone s "
          "| other stages' compute, evenly spread s | larger s | vs full_pipeline |")
    print("|---|---|---|---|---|---|")
    for s0 in range(args.stages - 1, args.nodes - (args.stages - 1) + 1):
        n = math.ceil(args.microbatches / s0)
        if n > 7:
            continue
        alone = one_origin(net, model, args.stages, visits, n, args.memory, regions)
        spread = args.microbatches * visits * visit_work / (args.nodes - s0)
        worst = max(alone, spread)
        print(f"| {s0} | {n} | {alone:.2f} | {spread:.2f} | {worst:.2f} | {worst / args.full:.2f}x |")


if __name__ == "__main__":
    main()
