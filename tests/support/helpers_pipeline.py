"""Independent checks of the SkipPipe path rules, written apart from roving.pipeline.planning.plan.validate."""

from __future__ import annotations

import math

from roving.pipeline import Network, Plan, simulate
from roving.pipeline.planning.network import build_network


def small_network(regions: int, latencies_ms, bandwidths, nodes: int, memory: int = 4) -> Network:
    names = [f"r{i}" for i in range(regions)]
    links, k = [], 0
    for i in range(regions):
        for j in range(i + 1, regions):
            links.append({"a": names[i], "b": names[j], "latency_ms": latencies_ms[k % len(latencies_ms)],
                          "bandwidth": bandwidths[k % len(bandwidths)]})
            k += 1
    return build_network({"regions": names, "links": links, "bandwidth_unit": "GiB/s"}, nodes, memory=memory)


def assert_paths_valid(plan: Plan, network: Network, stages: int, skip: float, microbatches: int) -> None:
    alive = {n.name for n in network.nodes}
    visits = math.floor((1 - skip) * (stages - 1) + 0.5)
    assert len(plan.paths) == microbatches
    assert set(plan.allocation) <= alive
    assert set(plan.allocation.values()) == set(range(stages)), "every stage must be held"
    per_stage = {s: 0 for s in range(1, stages)}
    for p in plan.paths:
        assert p.origin in alive and plan.allocation[p.origin] == 0, "starts and ends at a stage-0 node"
        assert len(p.nodes) == len(p.stages) == visits, "skips exactly the fraction k"
        assert len(set(p.stages)) == len(p.stages), "each stage at most once"
        assert 0 not in p.stages
        for node, stage in zip(p.nodes, p.stages):
            assert node in alive
            assert plan.allocation[node] == stage, "the node visited holds the stage"
            per_stage[stage] += 1
        inv = sum(1 for i in range(len(p.stages)) for j in range(i + 1, len(p.stages))
                  if p.stages[i] > p.stages[j])
        assert inv <= 2, "at most 2 swaps of adjacent stages"
    if microbatches:
        assert max(per_stage.values()) - min(per_stage.values()) <= 1, "stage loads balanced"
        assert sum(per_stage.values()) == microbatches * visits


def assert_memory_respected(plan: Plan, network: Network, model) -> float:
    """Rebuild each node's in-flight count from the timeline and check it never passes its memory."""
    res = simulate(network, model, plan)
    assert not res.deadlock
    for node, events in res.timeline.items():
        changes = []
        fwd_seen = set()
        for e in events:
            if e.kind == "compute-fwd":
                changes.append((e.start, 1))
                fwd_seen.add(e.microbatch)
            elif e.kind == "compute-bwd":
                changes.append((e.end, -1))
        level = peak = 0
        for _, d in sorted(changes, key=lambda c: (c[0], c[1])):  # releases before takes at equal times
            level += d
            peak = max(peak, level)
        if node in plan.allocation:
            assert peak <= network.node(node).in_flight(plan.allocation[node], model, plan.stages)
        else:
            assert peak == 0
    return res.makespan
