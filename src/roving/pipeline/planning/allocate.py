"""Which node holds which stage for the SkipPipe planner: replica counts, a locality-preserving start,
and local search.

The allocation starts from a greedy nearest-neighbour tour of the nodes (neighbours in the order sit
on fast links) and is improved by a swap search judged by whatever the caller passes (in practice:
plan paths, then simulate). The full-pipeline baseline allocates as DT-FM does (``dtfm``).

Memory: a node given in MB can hold a stage only if its memory covers the stage's weights and training
state plus one microbatch's activations (``costs.stage_memory``); stage 0, with the embedding, head and
loss workspace, needs the most. ``check_memory`` says which node can hold which stage and rejects
networks where no allocation can place every stage; ``assign`` and the swap search only produce
allocations that respect it. Among allocations that do, the simulator (which gives each node the
microbatches in flight its memory leaves for its stage) decides.
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable, Sequence, TypeVar

from .costs import ModelSpec, stage_layers, stage_memory, transfer_time
from ..errors import PlanError
from .network import Network
from .plan import visits_per_microbatch


def check_sizes(network: Network, stages: int) -> None:
    """PlanError unless the network has a node for every stage."""
    if len(network.nodes) < stages:
        raise PlanError(
            f"{len(network.nodes)} nodes cannot hold {stages} stages; use at least {stages} nodes "
            "or fewer stages"
        )


def holdable(network: Network, model: ModelSpec, stages: int) -> dict[str, frozenset[int]]:
    """For each node, the stages it can hold (its memory fits the stage and one microbatch)."""
    return {n.name: frozenset(s for s in range(stages) if n.can_hold(s, model, stages)) for n in network.nodes}


def _model_name(model: ModelSpec) -> str:
    return model.name or "the model"


def _need(model: ModelSpec, stages: int, s: int) -> str:
    m = stage_memory(model, stages)[s]
    what = "weights, gradients, optimizer state and loss workspace" if s == 0 else \
        "weights, gradients and optimizer state"
    return (f"needs {m.needs_mb(1):.0f} MB: {m.static_bytes / 2**20:.0f} MB of {what} plus "
            f"{m.per_microbatch_bytes / 2**20:.0f} MB of activations for one microbatch")


#: A node as stage_matching sees it: its name, or its index (dtfm's cost matrix)
_Node = TypeVar("_Node", str, int)


def stage_matching(can: dict[_Node, frozenset[int]], stages: int) -> tuple[dict[int, _Node], list[int], list[_Node]]:
    """A distinct node for every stage it can (Kuhn's augmenting paths). Returns (stage -> node, and
    when some stage is left out: a set of stages and the only nodes that can hold any of them, fewer
    than the stages; else two empty lists)."""
    owner: dict[_Node, int] = {}
    names = list(can)
    for s in range(stages):
        seen_nodes: set[_Node] = set()
        seen_stages: list[int] = []

        def grab(st: int) -> bool:
            seen_stages.append(st)
            for n in names:
                if st in can[n] and n not in seen_nodes:
                    seen_nodes.add(n)
                    if n not in owner or grab(owner[n]):
                        owner[n] = st
                        return True
            return False

        if not grab(s):
            return {st: n for n, st in owner.items()}, sorted(set(seen_stages)), sorted(seen_nodes)
    return {st: n for n, st in owner.items()}, [], []


def check_memory(network: Network, model: ModelSpec, stages: int) -> dict[str, frozenset[int]]:
    """Which node can hold which stage (``holdable``); PlanError, saying what is wrong and what to do,
    if a node can hold no stage or no allocation can place every stage on a node that can hold it."""
    can = holdable(network, model, stages)
    name = _model_name(model)
    sizes = {n.memory_mb for n in network.nodes}
    uniform = len(sizes) == 1 and None not in sizes
    for s in range(stages):
        if not any(s in c for c in can.values()):
            if uniform:
                raise PlanError(
                    f"memory {next(iter(sizes)):g} MB per node cannot hold stage {s} of {name} in {stages} "
                    f"stages ({_need(model, stages, s)}): use more memory, more stages, or a smaller model")
            biggest = max((n.memory_mb for n in network.nodes if n.memory_mb is not None), default=0.0)
            raise PlanError(
                f"no node can hold stage {s} of {name} in {stages} stages ({_need(model, stages, s)}; the "
                f"largest node has {biggest:g} MB): use more memory, more stages, or a smaller model")
    for n in network.nodes:
        if not can[n.name]:
            least = min(stage_memory(model, stages), key=lambda m: m.needs_mb(1))
            raise PlanError(
                f"node {n.name} with {n.memory_mb:g} MB cannot hold any stage of {name} in {stages} stages "
                f"(the smallest needs {least.needs_mb(1):.0f} MB for weights and one microbatch): give it "
                "more memory, use more stages, or leave it out")
    # (fewer nodes than stages is reported by the callers, whatever the memory)
    _, short_stages, only = stage_matching(can, stages) if len(can) >= stages else (None, [], [])
    if short_stages:
        raise PlanError(
            f"memory too small to place every stage: stages {', '.join(map(str, short_stages))} of {name} "
            f"can only be held by nodes {', '.join(only) or '(none)'} ({len(only)} nodes for "
            f"{len(short_stages)} stages): give more nodes more memory, use more stages, or a smaller model")
    return can


def assign(order: Sequence[str], labels: Sequence[int], can: dict[str, frozenset[int]]) -> list[str] | None:
    """Nodes for the label slots (slot i holds stage ``labels[i]``) such that every node can hold its
    stage, keeping node ``order[i]`` on slot i wherever possible (with no memory limit, exactly
    ``order``). None if no such assignment exists."""
    n = len(labels)
    node_at: list[str | None] = [None] * n
    by_label: dict[int, list[int]] = {}
    for i, lab in enumerate(labels):
        by_label.setdefault(lab, []).append(i)
    for u_index, u in enumerate(order):
        seen: set[int] = set()

        def place(v: str, pref: int | None) -> bool:
            cands = ([pref] if pref is not None and labels[pref] in can[v] else []) + \
                [i for lab in sorted(can[v]) for i in by_label.get(lab, ())]
            for i in cands:
                if i in seen:
                    continue
                seen.add(i)
                held = node_at[i]
                if held is None or place(held, None):
                    node_at[i] = v
                    return True
            return False

        if not place(u, u_index if u_index < n else None):
            return None
    if any(x is None for x in node_at):
        return None
    return [x for x in node_at if x is not None]


def memory_fallback(order: Sequence[str], counts: Sequence[int], can: dict[str, frozenset[int]],
                    stages: int) -> tuple[list[int], list[str]]:
    """A feasible allocation near ``counts`` when none with those counts exists: one node per stage
    (a matching), then every other node, in ``order``, to the stage it can hold that is furthest below
    its count. Returns (labels, slots). Assumes ``check_memory`` passed."""
    owner, short, _ = stage_matching(can, stages)
    assert not short
    have = [1] * stages
    alloc = {n: s for s, n in owner.items()}
    for n in order:
        if n in alloc:
            continue
        s = max(can[n], key=lambda s: (counts[s] - have[s], -s))
        alloc[n] = s
        have[s] += 1
    slots = list(order)
    return [alloc[n] for n in slots], slots


def replica_counts(n_nodes: int, stages: int, skip: float, model: ModelSpec) -> list[int]:
    """Nodes per stage, proportional to each stage's share of the iteration's compute (stage 0 is
    visited by every microbatch and also runs embedding, head and loss; the others by a fraction of
    them), at least one each."""
    visits = visits_per_microbatch(stages, skip)
    if n_nodes < stages:
        raise PlanError(f"{n_nodes} nodes cannot hold {stages} stages; use at least {stages} nodes")
    layers = stage_layers(model, stages)
    work = [layers[0] + model.head_layers] + [n * visits / (stages - 1) for n in layers[1:]]
    spare = n_nodes - stages
    ideal = [w / sum(work) * n_nodes - 1 for w in work]
    counts = [1 + max(0, math.floor(x)) for x in ideal]
    while sum(counts) > n_nodes:  # floors of clipped values can overshoot only through the clip
        i = max((s for s in range(stages) if counts[s] > 1), key=lambda s: counts[s] - 1 - ideal[s])
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


def swap_search(
    slots: list[str],
    roles: Sequence[int],
    judge: Callable[[list[str]], float],
    deadline: float,
    rng: random.Random,
    max_evals: int | None = None,
    ok: Callable[[str, int], bool] | None = None,
) -> tuple[list[str], float]:
    """Hill climbing over swaps of two slots with different roles, accepting ties (to cross plateaus);
    stops at ``deadline`` (time.perf_counter) or after ``max_evals``. ``ok(node, role)`` (if given)
    rejects swaps that put a node on a role it cannot take (memory). Returns the best slots found and
    their score; ``judge`` is called once for ``slots`` and once per evaluated swap."""
    best = list(slots)
    best_score = current_score = judge(best)
    current = list(best)
    pairs = [(i, j) for i in range(len(slots)) for j in range(i + 1, len(slots)) if roles[i] != roles[j]]
    evals = 0
    while pairs and time.perf_counter() < deadline and (max_evals is None or evals < max_evals):
        i, j = rng.choice(pairs)
        cand = list(current)
        cand[i], cand[j] = cand[j], cand[i]
        if ok is not None and not (ok(cand[i], roles[i]) and ok(cand[j], roles[j])):
            continue
        score = judge(cand)
        evals += 1
        if score <= current_score:
            current, current_score = cand, score
            if score < best_score:
                best, best_score = list(cand), score
    return best, best_score
