"""DT-FM's allocation (Yuan et al., NeurIPS 2022), the allocation of the full-pipeline baseline.

DT-FM splits the nodes into one equal-sized group per stage (a stage's data-parallel replicas) and
chains one node of every group into each pipeline. It scores an allocation by a communication cost
model, never by simulating it:

* data-parallel cost: the gradient all-reduce inside each group, ``max`` over groups and over the
  group's nodes of ``sum over its peers of 2 x (latency + stage_bytes / (group_size x bandwidth))``;
* pipeline cost: between two groups, the bottleneck of the best perfect matching of their nodes
  (the slowest pipeline decides), the activations and gradients of a pipeline's microbatches; over all
  groups, the shortest tour that visits every group once, whose order is the stage order;
* total = data-parallel cost + pipeline cost.

The tour is closed: it starts at the stage-0 group and returns to it. In DT-FM's own setting the last
stage computes the loss, so its paper's tour is open; in SkipPipe's a microbatch starts and ends at a
stage-0 node (embedding, then head and loss), and SkipPipe's code costs DT-FM's schedule with the
closed tour from the stage-0 group for that reason. An open tour leaves the return hop out of the
cost, and the search then happily chains a last stage to stage 0 over the slowest link of the network.

It searches with a memetic algorithm (GCMA: a steady-state genetic algorithm with five-point crossover
whose offspring are improved by local search before they replace the worse parent). Here the local
search is a budgeted pass of node exchanges between groups, in place of DT-FM's cyclic partitioning;
both only move a node when the cost model says the move pays. Nodes beyond ``groups x group_size``
form an idle group that the search may fill with whichever nodes serve worst.

A cost model is not the simulator: an allocation of lower cost may simulate slower. With ``judge``
(``dtfm_allocation``), every allocation that lowers the best cost seen so far is also judged (the
baseline simulates it) and the best judged one is returned, so that more search never gives a worse
baseline: a longer search with the same seed makes the same evaluations first, and judges a superset.
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable
from dataclasses import dataclass

from .allocate import stage_matching
from .costs import ModelSpec, stage_layers
from .network import Network


@dataclass
class DtfmAllocation:
    """Pipelines as node chains (``pipelines[i][s]`` holds stage s), idle nodes and the model's cost."""

    pipelines: list[list[str]]
    idle: list[str]
    cost: float
    #: cost-model evaluations the search made; True when ``budget_s`` ended it before ``max_evals``
    evaluations: int = 0
    capped: bool = False
    #: with a ``judge``: the allocations it judged (each new best cost), and its value for the one returned
    judged: int = 0
    judged_value: float = math.nan


def stage_param_bytes(model: ModelSpec, stages: int) -> list[float]:
    """Gradient bytes each stage all-reduces: about 12 x dim^2 parameters per transformer layer."""
    return [12.0 * model.dim ** 2 * n * model.bytes_per_activation for n in stage_layers(model, stages)]


class _Costs:
    def __init__(self, network: Network, model: ModelSpec, stages: int, group: int, microbatches: int):
        names = network.names
        self.lat = {(a, b): network.link(a, b).latency_s for a in names for b in names if a != b}
        self.bw = {(a, b): network.link(a, b).bandwidth_bps for a in names for b in names if a != b}
        per_pipe = microbatches / group
        act = model.transfer_bytes
        # forward activations and backward gradients of every microbatch the pipeline carries
        self.pp = {k: 2 * per_pipe * (self.lat[k] + act / self.bw[k]) for k in self.lat}
        self.dp_bytes = max(stage_param_bytes(model, stages)) / group
        self.stages, self.group = stages, group
        self._edge: dict = {}

    def dp(self, g: tuple[str, ...]) -> float:
        if len(g) < 2:
            return 0.0
        return max(sum(2 * (self.lat[a, b] + self.dp_bytes / self.bw[a, b]) for b in g if b != a) for a in g)

    def edge(self, g1: tuple[str, ...], g2: tuple[str, ...]) -> tuple[float, tuple[int, ...]]:
        """Bottleneck perfect matching of two groups: (its largest pair cost, g2's index for each of g1);
        among matchings with that bottleneck, the one of least total cost. Polynomial (see
        ``bottleneck_matching``), so groups of 10-20 nodes cost milliseconds, not factorial time."""
        key = (g1, g2)
        hit = self._edge.get(key)
        if hit is None:
            cost = [[max(self.pp[a, b], self.pp[b, a]) for b in g2] for a in g1]
            hit = self._edge[key] = bottleneck_matching(cost)
        return hit

    def tsp(self, groups: list[tuple[str, ...]]) -> tuple[float, list[int]]:
        """Shortest closed tour through all groups from group 0 (the stage-0 group) back to it (exact
        dynamic program over subsets): (its cost, the groups in tour order, group 0 first)."""
        n = len(groups)
        if n == 1:
            return 0.0, [0]
        w = [[0.0 if i == j else self.edge(groups[i], groups[j])[0] for j in range(n)] for i in range(n)]
        full = (1 << n) - 1
        dp: dict[tuple[int, int], tuple[float, int]] = {(1, 0): (0.0, -1)}
        for mask in range(1, full + 1, 2):  # every subset holds group 0, where the tour starts
            for last in range(n):
                cur = dp.get((mask, last))
                if cur is None:
                    continue
                for nxt in range(1, n):
                    if mask >> nxt & 1:
                        continue
                    key = (mask | 1 << nxt, nxt)
                    v = cur[0] + w[last][nxt]
                    if key not in dp or v < dp[key][0]:
                        dp[key] = (v, last)
        end = min(range(1, n), key=lambda i: (dp[(full, i)][0] + w[i][0], i))
        total = dp[(full, end)][0] + w[end][0]
        order, mask, node = [], full, end
        while node >= 0:
            order.append(node)
            prev = dp[(mask, node)][1]
            mask &= ~(1 << node)
            node = prev
        return total, order[::-1]

    def total(self, groups: list[tuple[str, ...]]) -> float:
        return max(self.dp(g) for g in groups) + self.tsp(groups)[0]


def bottleneck_matching(cost: list[list[float]]) -> tuple[float, tuple[int, ...]]:
    """For a square cost matrix: (b, perm) where b is the least possible largest ``cost[i][perm[i]]``
    over perfect matchings, and perm, among the matchings whose entries are all at most b, one of least
    total cost. The bottleneck is a binary search over the sorted distinct costs, each step a perfect
    matching check (Kuhn's augmenting paths, ``allocate.stage_matching``) on the entries at or below
    the threshold; the tie-break is a min-sum assignment (Hungarian method) restricted to those entries."""
    n = len(cost)
    if n == 0:
        return 0.0, ()
    values = sorted({c for row in cost for c in row})

    def perfect(t: float) -> bool:
        # rows are the "stages" to place, columns the "nodes" that can take them
        can = {j: frozenset(i for i in range(n) if cost[i][j] <= t) for j in range(n)}
        return not stage_matching(can, n)[1]

    lo, hi = 0, len(values) - 1  # values[hi] always admits a perfect matching (every entry allowed)
    while lo < hi:
        mid = (lo + hi) // 2
        if perfect(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    bottleneck = values[lo]
    # entries above the bottleneck cost more than any matching of allowed entries, so never chosen
    big = 2.0 * sum(c for row in cost for c in row if c <= bottleneck) + 1.0
    perm = _min_sum_assignment([[c if c <= bottleneck else big for c in row] for row in cost])
    return bottleneck, perm


def _min_sum_assignment(cost: list[list[float]]) -> tuple[int, ...]:
    """Hungarian method with potentials, O(n^3): perm with least ``sum(cost[i][perm[i]])``."""
    n = len(cost)
    inf = float("inf")
    u, v = [0.0] * (n + 1), [0.0] * (n + 1)
    row_of = [0] * (n + 1)  # column j (1-based) -> row (1-based), 0 = free
    way = [0] * (n + 1)
    for i in range(1, n + 1):
        row_of[0] = i
        j0 = 0
        minv = [inf] * (n + 1)
        used = [False] * (n + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = row_of[j0], inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = cost[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[row_of[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if row_of[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            row_of[j0] = row_of[j1]
            j0 = j1
    perm = [0] * n
    for j in range(1, n + 1):
        perm[row_of[j] - 1] = j - 1
    return tuple(perm)


def _groups(labels: list[int], names: list[str], stages: int) -> list[tuple[str, ...]]:
    out: list[list[str]] = [[] for _ in range(stages)]
    for n, g in zip(names, labels):
        if g < stages:
            out[g].append(n)
    return [tuple(sorted(g)) for g in out]


def dtfm_allocation(network: Network, model: ModelSpec, stages: int, microbatches: int, *,
                    budget_s: float = 10.0, seed: int = 0, population: int = 50,
                    max_evals: int | None = None,
                    judge: Callable[[list[list[str]]], float] | None = None) -> DtfmAllocation:
    """DT-FM's allocation for ``nodes // stages`` pipelines, searched for about ``budget_s`` seconds.

    ``max_evals``: stop after exactly that many evaluations of DT-FM's cost model instead (at least 2,
    the first two parents; ``budget_s`` then only caps the search): the same seed and count give the
    same allocation on any machine, under any load, unless the cap cuts it short (the result's
    ``capped`` is then True).

    ``judge(pipelines)``, when given, is asked about every allocation that lowers the best cost seen so
    far, at the evaluation that finds it (lower is better: the baseline's simulated iteration time); the
    allocation returned is then the best judged one (the first of equals), not necessarily the one of
    least cost. With the same seed, a search of more evaluations makes the same evaluations first and so
    judges a superset: its allocation is never judged worse."""
    names = network.names
    group = len(names) // stages
    costs = _Costs(network, model, stages, group, microbatches)
    rng = random.Random(seed)
    sizes = [group] * stages + ([len(names) - group * stages] if len(names) > group * stages else [])
    base = [g for g, size in enumerate(sizes) for _ in range(size)]
    deadline = time.perf_counter() + budget_s

    evals = [0]
    least = [math.inf]  # the least cost seen so far
    # the best judged so far: (judge's value, cost, labels); the count of judged allocations
    kept: list = [math.inf, math.inf, None]
    judged = [0]

    def score(labels: list[int]) -> float:
        evals[0] += 1
        groups = _groups(labels, names, stages)
        value = costs.total(groups)
        if value < least[0]:
            least[0] = value
            if judge is not None:
                judged[0] += 1
                verdict = judge(_pipelines(costs, groups))
                if verdict < kept[0] or kept[2] is None:
                    kept[:] = [verdict, value, list(labels)]
        return value

    def more() -> bool:
        """Whether the search goes on: within the clock, and the evaluation count when one is given."""
        return time.perf_counter() < deadline and (max_evals is None or evals[0] < max_evals)

    pop = []
    for _ in range(population):
        labels = list(base)
        rng.shuffle(labels)
        pop.append((score(labels), labels))
        if not more() and len(pop) >= 2:
            break
    tries = 2 * len(names)
    while more():
        a, b = rng.sample(range(len(pop)), 2)
        child = list(pop[b][1])
        for point in rng.sample(range(len(names)), min(5, len(names))):
            child[point] = pop[a][1][point]
        child = _repair(child, sizes, rng)
        child, value = _local_search(child, score(child), tries, rng, score, more)
        worse = a if pop[a][0] > pop[b][0] else b
        if value < pop[worse][0]:
            pop[worse] = (value, child)
    if judge is not None:
        verdict, value, labels = kept
    else:
        verdict, (value, labels) = math.nan, min(pop, key=lambda p: p[0])
    chains = _pipelines(costs, _groups(labels, names, stages))
    idle = sorted(n for n, g in zip(names, labels) if g >= stages)
    capped = max_evals is not None and evals[0] < max_evals
    return DtfmAllocation(chains, idle, value, evals[0], capped, judged[0], verdict)


def _repair(labels: list[int], sizes: list[int], rng: random.Random) -> list[int]:
    """``labels`` (a crossover's child) with the groups over their ``sizes`` given to those under them,
    in a random order; in place."""
    have = [0] * len(sizes)
    for g in labels:
        have[g] += 1
    for i in rng.sample(range(len(labels)), len(labels)):
        g = labels[i]
        if have[g] > sizes[g]:
            to = next(h for h in range(len(sizes)) if have[h] < sizes[h])
            labels[i] = to
            have[g] -= 1
            have[to] += 1
    return labels


def _local_search(labels: list[int], value: float, tries: int, rng: random.Random,
                  score: Callable[[list[int]], float],
                  more: Callable[[], bool]) -> tuple[list[int], float]:
    """``tries`` random swaps of two nodes' groups, each kept when ``score`` improves, while ``more()``;
    in place."""
    for _ in range(tries):
        if not more():
            break
        i, j = rng.randrange(len(labels)), rng.randrange(len(labels))
        if labels[i] == labels[j]:
            continue
        labels[i], labels[j] = labels[j], labels[i]
        v = score(labels)
        if v < value:
            value = v
        else:
            labels[i], labels[j] = labels[j], labels[i]
    return labels, value


def _pipelines(costs: _Costs, groups: list[tuple[str, ...]]) -> list[list[str]]:
    """The stage groups in the order of the cheapest tour, chained into pipelines by the bottleneck
    matching between each two consecutive groups."""
    _, order = costs.tsp(groups)
    ordered = [groups[i] for i in order]
    chains = [[n] for n in ordered[0]]
    for prev, nxt in zip(ordered, ordered[1:]):
        _, match = costs.edge(prev, nxt)
        by_prev = {prev[i]: nxt[j] for i, j in enumerate(match)}
        for c in chains:
            c.append(by_prev[c[-1]])
    return chains
