"""Which node holds which stage for the SkipPipe planner: replica counts, a locality-preserving start,
and local search.

The allocation starts from a greedy nearest-neighbour tour of the nodes (neighbours in the order sit
on fast links) and is improved by a swap search judged by whatever the caller passes (in practice:
plan paths, then simulate). The full-pipeline baseline allocates as DT-FM does (``dtfm``).
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable, Sequence

from .costs import ModelSpec, PlanError, stage_layers, transfer_time
from .network import Network


def visits_per_microbatch(stages: int, skip: float) -> int:
    """How many of the stages besides stage 0 a microbatch visits when it skips a fraction ``skip``."""
    if not 0.0 <= skip < 1.0:
        raise PlanError(f"skip fraction must be in [0, 1), got {skip}")
    if stages < 2:
        raise PlanError(f"need at least 2 stages, got {stages}")
    visits = math.floor((1.0 - skip) * (stages - 1) + 0.5)
    if visits < 1:
        raise PlanError(
            f"skip {skip} with {stages} stages leaves no stage besides stage 0 to visit; "
            f"use a skip below {1 - 0.5 / (stages - 1):.2f} or more stages"
        )
    return visits


def check_sizes(network: Network, stages: int) -> None:
    if len(network.nodes) < stages:
        raise PlanError(
            f"{len(network.nodes)} nodes cannot hold {stages} stages; use at least {stages} nodes "
            "or fewer stages"
        )


def replica_counts(n_nodes: int, stages: int, skip: float, model: ModelSpec) -> list[int]:
    """Nodes per stage, proportional to each stage's share of the iteration's compute (stage 0 is
    visited by every microbatch and also runs embedding, head and loss; the others by a fraction of
    them), at least one each."""
    visits = visits_per_microbatch(stages, skip)
    if n_nodes < stages:
        raise PlanError(f"{n_nodes} nodes cannot hold {stages} stages; use at least {stages} nodes")
    layers = stage_layers(model, stages)
    work = [layers[0] + model.head_layers] + [l * visits / (stages - 1) for l in layers[1:]]
    spare = n_nodes - stages
    ideal = [w / sum(work) * n_nodes - 1 for w in work]
    counts = [1 + max(0, math.floor(x)) for x in ideal]
    while sum(counts) > n_nodes:  # floors of clipped values can overshoot only through the clip
        i = max(range(stages), key=lambda s: counts[s] - 1 - ideal[s])
        counts[i] -= 1
    order = sorted(range(stages), key=lambda s: (counts[s] - 1 - ideal[s], s))
    for i in range(n_nodes - sum(counts)):
        counts[order[i % stages]] += 1
    assert sum(counts) == n_nodes and min(counts) >= 1 and spare >= 0
    return counts


def node_cost_matrix(network: Network, model: ModelSpec) -> dict[tuple[str, str], float]:
    """Seconds to send one activation between every ordered pair of nodes, alone on the link."""
    names = network.names
    out = {}
    for a in names:
        for b in names:
            if a != b:
                link = network.link(a, b)
                out[a, b] = transfer_time(link.latency_s, link.bandwidth_bps, model.transfer_bytes)
    return out


def tour_order(network: Network, cost: dict[tuple[str, str], float]) -> list[str]:
    """Nodes in a greedy nearest-neighbour order from the best-connected node: neighbours in the order
    are cheap to send between, so consecutive stages placed along it sit on fast links."""
    names = network.names
    if len(names) == 1:
        return names
    start = min(names, key=lambda a: (sum(cost[a, b] for b in names if b != a), a))
    order, left = [start], set(names) - {start}
    while left:
        last = order[-1]
        nxt = min(left, key=lambda b: (cost[last, b], b))
        order.append(nxt)
        left.remove(nxt)
    return order


def spread_labels(counts: Sequence[int]) -> list[int]:
    """A label sequence holding stage s ``counts[s]`` times, each stage spread evenly along it."""
    n = sum(counts)
    given = [0] * len(counts)
    out = []
    for i in range(n):
        s = max(range(len(counts)), key=lambda s: (counts[s] * (i + 1) / n - given[s], -s))
        given[s] += 1
        out.append(s)
    return out


def initial_allocation(network: Network, counts: Sequence[int], cost) -> dict[str, int]:
    order = tour_order(network, cost)
    return dict(zip(order, spread_labels(counts)))


def swap_search(
    slots: list[str],
    roles: Sequence[int],
    judge: Callable[[list[str]], float],
    deadline: float,
    rng: random.Random,
    max_evals: int | None = None,
) -> tuple[list[str], float]:
    """Hill climbing over swaps of two slots with different roles, accepting ties (to cross plateaus);
    stops at ``deadline`` (time.perf_counter) or after ``max_evals``. Returns the best slots found."""
    best = list(slots)
    best_score = current_score = judge(best)
    current = list(best)
    pairs = [(i, j) for i in range(len(slots)) for j in range(i + 1, len(slots)) if roles[i] != roles[j]]
    evals = 0
    while pairs and time.perf_counter() < deadline and (max_evals is None or evals < max_evals):
        i, j = rng.choice(pairs)
        cand = list(current)
        cand[i], cand[j] = cand[j], cand[i]
        score = judge(cand)
        evals += 1
        if score <= current_score:
            current, current_score = cand, score
            if score < best_score:
                best, best_score = list(cand), score
    return best, best_score
