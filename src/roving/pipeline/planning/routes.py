"""The route search: which stages each microbatch visits, in which order and on which replicas, for
an allocation that is given (``SearchContext``).

``build_routes`` makes routes greedily, ``improve_routes`` searches them with the simulator as judge
(``score_routes``), ``repair_routes`` mends a plan's routes after nodes left. The planner
(``planner``) chooses the allocations these run on; the rules every route keeps are in ``plan``.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from typing import Callable, Sequence

from .allocate import node_cost_matrix
from .costs import ModelSpec, stage_costs
from ..errors import PlanError
from .network import Network
from .plan import DEFAULT_ROUTE_RULE, MAX_SWAPS, Plan, Route, check_route_rule, route_allowed, stage_quotas
from .simulate import simulate


#: with replica synchronisation judged, the weight of the microbatch phase beside the whole iteration
#: in the search's score: when the slowest stage's averaging sets the makespan, moves that shorten the
#: phase would otherwise score the same, and the search would drift on that plateau.
PHASE_WEIGHT = 0.25
#: in the path search, ties of the makespan are broken by the mean finish of the latest ``TAIL`` share
#: of the microbatches (1: all of them): a move that lets other microbatches end sooner makes room for
#: the last one, where the makespan alone would see a plateau.
TAIL = 1.0


class Tally:
    """Simulator evaluations made so far (``n``), shared by the search contexts of one planning call."""

    def __init__(self) -> None:
        self.n = 0


class SearchContext:
    """Precomputed costs for one network, model and allocation: each node's transfer costs
    (``allocate.node_cost_matrix``) and compute per microbatch, and each stage's replicas; the route
    rule every route made here keeps (``plan.ROUTE_RULES``), judged on ``rule_stages[s]`` for each
    stage s of this context (by default s itself: ``plan_held`` plans the held stages as stages
    0, 1, ... and names them by their real numbers here); ``tally`` counts the simulator evaluations
    made through it (pass one ``Tally`` to several contexts to count them together). Raises
    PlanError when a stage has no node, or a node given in MB cannot hold its stage."""

    def __init__(self, network: Network, model: ModelSpec, allocation: dict[str, int], stages: int,
                 cost: dict | None = None, sync_bytes: Sequence[float] | None = None,
                 route_rule: str = DEFAULT_ROUTE_RULE, tally: Tally | None = None,
                 rule_stages: Sequence[int] | None = None) -> None:
        self.network, self.model, self.stages = network, model, stages
        self.sync_bytes = sync_bytes  # judge by the whole iteration, replica synchronisation included
        self.route_rule = check_route_rule(route_rule)
        self.rule_stages = list(rule_stages) if rule_stages is not None else list(range(stages))
        self.tally = tally if tally is not None else Tally()
        self.allocation = allocation
        self.cost = cost if cost is not None else node_cost_matrix(network, model)
        self.replicas: list[list[str]] = [[] for _ in range(stages)]
        for n in network.names:
            if n in allocation:
                self.replicas[allocation[n]].append(n)
        for s, r in enumerate(self.replicas):
            if not r:
                raise PlanError(f"no node holds stage {s}; every stage needs at least one node")
        self.work = {}
        for n in allocation:
            node = network.node(n)
            c = stage_costs(model, stages, node.speed)
            s = allocation[n]
            if node.memory_mb is not None and not node.can_hold(s, model, stages):
                raise PlanError(f"node {n} ({node.memory_mb:g} MB) cannot hold stage {s}: its memory does not "
                                "fit the stage's weights and one microbatch")
            self.work[n] = c.forward[s] + c.backward[s] + (c.loss if s == 0 else 0.0)

    def allows(self, stages: Sequence[int]) -> bool:
        """Whether a route visiting ``stages`` (this context's numbers) in that order keeps the rule."""
        return route_allowed([self.rule_stages[s] for s in stages], self.route_rule)

    def best_replica(self, stage: int, before: str, after: str, rng: random.Random | None = None) -> str:
        cands = self.replicas[stage]
        if rng is not None:
            return rng.choice(cands)
        return min(cands, key=lambda n: (self.cost[before, n] + self.cost[n, after], n))


def build_routes(ctx: SearchContext, microbatches: int, visits: int, allow_swaps: bool = True,
                 rng: random.Random | None = None, noise: float = 0.0) -> list[Route]:
    """Greedy, collision-aware construction: microbatch by microbatch, a dynamic program picks which
    stages to visit and on which replicas, minimising transfer time plus penalties that grow with the
    load already put on each node and link, under the per-stage quotas."""
    s_count = ctx.stages
    quotas = stage_quotas(microbatches, s_count, visits)
    total_work = sum(quotas[s] * ctx.work[ctx.replicas[s][0]] for s in range(1, s_count))
    total_work += microbatches * ctx.work[ctx.replicas[0][0]]
    est = max(total_work / len(ctx.allocation), 1e-9)
    mean_w = total_work / max(1, microbatches * (visits + 1))
    load: dict[str, float] = defaultdict(float)
    link_load: dict[tuple[str, str], float] = defaultdict(float)
    cost = ctx.cost
    zeros = ctx.replicas[0]

    def jitter() -> float:
        return 1.0 + noise * rng.random() if (rng is not None and noise) else 1.0

    def priced(a: str, b: str) -> float:
        return (cost[a, b] * (1 + 2 * link_load[a, b] / est) + cost[b, a] * (1 + 2 * link_load[b, a] / est)) * jitter()

    # without noise an edge's price changes only when a route puts load on its link: kept until then
    # (pricing them afresh for every microbatch took most of a plan's time at 200 nodes)
    kept: dict[tuple[str, str], float] = {}

    def edge(a: str, b: str) -> float:
        if noise and rng is not None:
            return priced(a, b)
        v = kept.get((a, b))
        if v is None:
            v = kept[a, b] = priced(a, b)
        return v

    def node_cost(n: str) -> float:
        return ctx.work[n] * (1 + 2 * load[n] / est) * jitter()

    paths = []
    for mb in range(microbatches):
        remaining = microbatches - mb
        origin = min(zeros, key=lambda o: (load[o] + ctx.work[o], zeros.index(o)))
        forced = [s for s in range(1, s_count) if quotas[s] == remaining]
        allowed = [s for s in range(1, s_count) if quotas[s] > 0]
        press = {s: mean_w * (1 - quotas[s] / remaining) for s in allowed}
        nodes = _cheapest_visits(ctx, origin, visits, forced, allowed, press, edge, node_cost)
        if allow_swaps:
            nodes = _improve_by_swaps(nodes, origin, edge, ctx)
        stages_seq = tuple(ctx.allocation[n] for n in nodes)
        for n in nodes:
            quotas[ctx.allocation[n]] -= 1
            load[n] += ctx.work[n]
        load[origin] += ctx.work[origin]
        hops = [origin, *nodes, origin]
        for a, b in zip(hops, hops[1:]):
            link_load[a, b] += cost[a, b]
            link_load[b, a] += cost[b, a]
            kept.pop((a, b), None)
            kept.pop((b, a), None)
        paths.append(Route(origin, tuple(nodes), stages_seq))
    return paths


def _cheapest_visits(ctx: SearchContext, origin: str, visits: int, forced: list[int], allowed: list[int],
                     press: dict[int, float], edge: Callable[[str, str], float],
                     node_cost: Callable[[str], float]) -> list[str]:
    """``build_routes``' dynamic program for one microbatch from ``origin``: the ``visits`` nodes, in
    increasing stage order over the ``allowed`` stages and through every ``forced`` one, that minimise
    the edges' and the nodes' costs (with each stage's quota pressure ``press``)."""
    # dp[(count, node)] = (cost, previous key); reached[stage][count]: the keys of that count reached at a
    # node of that stage, in the order they were made (the order ties are broken in). Each edge into a
    # node is costed once for all counts (``edge`` costs the same within one microbatch's program):
    # with 16 stages of a dozen replicas, costing it again for every count took most of the planner's
    # time at 100 nodes and more.
    dp: dict[tuple[int, str], tuple[float, tuple[int, str] | None]] = {}
    reached: dict[int, list[list[tuple[int, str]]]] = {}
    by_stage: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for i, s in enumerate(allowed):
        lo = max((f for f in forced if f < s), default=0)  # cannot jump over a forced stage
        reached[s] = [[] for _ in range(visits + 1)]
        # a count that the allowed stages after s cannot bring up to ``visits`` ends no route
        least = max(1, visits - (len(allowed) - 1 - i))
        # nor does a jump over more allowed stages than a route may skip
        spare = len(allowed) - visits
        earlier = [ps for j, ps in enumerate(allowed[:i]) if ps >= max(lo, 1) and i - j - 1 <= spare]
        for n in _candidates(ctx.replicas[s], origin, edge, node_cost):
            here = node_cost(n) + press[s]
            into: dict[str, float] = {}
            for c in range(least, visits + 1):
                best: tuple[float, tuple[int, str] | None] | None = None
                if c == 1 and lo == 0:
                    best = (edge(origin, n) + here, None)
                else:
                    for ps in earlier:
                        for key in reached[ps][c - 1]:
                            e = into.get(key[1])
                            if e is None:
                                e = into[key[1]] = edge(key[1], n)
                            v = dp[key][0] + e + here
                            if best is None or v < best[0]:
                                best = (v, key)
                if best is not None:
                    dp[(c, n)] = best
                    reached[s][c].append((c, n))
                    by_stage[s].append((c, n))
    last_forced = max(forced, default=0)
    end: tuple[float, tuple[int, str]] | None = None
    for s in allowed:
        if s < last_forced:
            continue
        for key in by_stage.get(s, ()):
            if key[0] == visits:
                v = dp[key][0] + edge(key[1], origin)
                if end is None or v < end[0]:
                    end = (v, key)
    assert end is not None, "quotas always leave a feasible stage set"
    nodes: list[str] = []
    at: tuple[int, str] | None = end[1]
    while at is not None:
        nodes.append(at[1])
        at = dp[at][1]
    nodes.reverse()
    return nodes


#: replicas of a stage beyond which ``_cheapest_visits`` weighs only some of them (``_candidates``).
CANDIDATES = 8


def _candidates(replicas: list[str], origin: str, edge: Callable[[str, str], float],
                node_cost: Callable[[str], float]) -> list[str]:
    """The replicas of a stage that one microbatch's program weighs: all of them up to ``CANDIDATES``;
    beyond, the half least loaded and the half nearest its origin (there and back), in their order. The
    program's time grows with the square of the replicas a stage has: with 200 nodes on 16 stages,
    weighing all of them cost seconds per microbatch, and a far and busy replica is seldom the best."""
    if len(replicas) <= CANDIDATES:
        return replicas
    half = CANDIDATES // 2
    least = sorted(replicas, key=node_cost)[:half]
    near = sorted(replicas, key=lambda n: edge(origin, n) + edge(n, origin))
    chosen = set(least) | set([n for n in near if n not in least][:CANDIDATES - len(least)])
    return [n for n in replicas if n in chosen]


def _tour_cost(origin: str, nodes: Sequence[str], edge: Callable[[str, str], float]) -> float:
    hops = [origin, *nodes, origin]
    return sum(edge(a, b) for a, b in zip(hops, hops[1:]))


def _improve_by_swaps(nodes: list[str], origin: str, edge: Callable[[str, str], float],
                      ctx: SearchContext) -> list[str]:
    """``nodes`` with up to ``MAX_SWAPS`` swaps of neighbouring positions, each the one that shortens
    the tour most, among those whose stage order keeps the route rule (``ctx.allows``)."""
    current, cur_cost = list(nodes), _tour_cost(origin, nodes, edge)
    for _ in range(MAX_SWAPS):
        best = None
        for i in range(len(current) - 1):
            cand = list(current)
            cand[i], cand[i + 1] = cand[i + 1], cand[i]
            if not ctx.allows([ctx.allocation[n] for n in cand]):
                continue
            c = _tour_cost(origin, cand, edge)
            if c < cur_cost - 1e-9 and (best is None or c < best[0]):
                best = (c, cand)
        if best is None:
            break
        cur_cost, current = best
    return current


def score_routes(ctx: SearchContext, paths: list[Route], priority: list[int] | None, skip: float) -> float:
    """The search's score: the simulated makespan (with ``ctx.sync_bytes``: the whole iteration plus
    ``PHASE_WEIGHT`` times the microbatch phase)."""
    return _judged(ctx, paths, priority, skip)[0]


def _judged(ctx: SearchContext, paths: list[Route], priority: list[int] | None,
            skip: float) -> tuple[float, float]:
    """``score_routes`` and the ``_tail`` of the finish times (the search's tie-break; infinite, as the
    makespan, for a plan that deadlocks)."""
    plan = Plan(ctx.stages, skip, ctx.allocation, paths, priority, route_rule=ctx.route_rule)
    ctx.tally.n += 1
    res = simulate(ctx.network, ctx.model, plan, record=False, sync_bytes=ctx.sync_bytes)
    if res.deadlock:
        return res.makespan, math.inf
    if ctx.sync_bytes is None:
        return res.makespan, _tail(res.finish)
    return res.makespan + PHASE_WEIGHT * max(res.finish, default=0.0), _tail(res.finish)


def _tail(finish: list[float]) -> float:
    """Secondary score on the plateaus of the makespan: the mean of the latest ``TAIL`` share of the
    finish times (a move that lets the other late microbatches end sooner makes room for the last)."""
    k = max(1, int(len(finish) * TAIL))
    return sum(sorted(finish, reverse=True)[:k]) / k


def _accepts(score: float, tail: float, cur_score: float, cur_tail: float) -> bool:
    """The path search's rule for a candidate against the current plan: a lower makespan, or the same
    makespan with a mean finish (``_tail``) no later; ties of both are taken, to cross plateaus. A
    deadlocked candidate (infinite makespan and tail) is taken only while the current plan deadlocks too."""
    return score < cur_score or (score == cur_score and tail <= cur_tail)


def improve_routes(ctx: SearchContext, paths: list[Route], skip: float, deadline: float, rng: random.Random,
                   allow_swaps: bool = True, priority: list[int] | None = None,
                   max_evals: int | None = None,
                   on_best: Callable[[float], None] | None = None) -> tuple[list[Route], list[int], float, int]:
    """Anytime local search over paths with the simulator as judge: move a microbatch to another
    replica or origin, exchange a visited and a skipped stage between two microbatches (keeps the
    stage loads), toggle a swap, or reorder priorities, each move taken by ``_accepts`` (ties of the
    makespan broken by the mean finish, ``TAIL``; a deadlocked plan never replaces one that does not
    deadlock). Stops at ``deadline`` or after ``max_evals`` simulator
    evaluations (at least 1: the first judges ``paths`` as given), whichever comes first; for a given
    ``rng`` state and evaluation count the result is deterministic. ``on_best(makespan)`` is told of
    each new best (it does not change the search).
    Returns (paths, priority, makespan, evaluations), the evaluations counting that first one."""
    cur = list(paths)
    prio = list(priority) if priority else list(range(len(paths)))
    cur_score, cur_tail = _judged(ctx, cur, prio, skip)
    best, best_prio, best_score = list(cur), list(prio), cur_score
    evals = 1
    n_mb = len(cur)
    while time.perf_counter() < deadline and n_mb and (max_evals is None or evals < max_evals):
        proposed = _propose(ctx, list(cur), prio, rng.randrange(n_mb), rng, allow_swaps)
        if proposed is None:
            continue
        cand, cand_prio = proposed
        score, tail = _judged(ctx, cand, cand_prio, skip)
        evals += 1
        if _accepts(score, tail, cur_score, cur_tail):
            cur, prio, cur_score, cur_tail = cand, cand_prio, score, tail
            if score < best_score:
                best, best_prio, best_score = list(cand), list(cand_prio), score
                if on_best is not None:
                    on_best(score)
    return best, best_prio, best_score, evals


def _propose(ctx: SearchContext, cand: list[Route], prio: list[int], mb: int, rng: random.Random,
             allow_swaps: bool) -> tuple[list[Route], list[int]] | None:
    """One random move of ``improve_routes`` on microbatch ``mb`` of ``cand`` (a copy of the current
    paths, changed in place) or on the priorities: (paths, priority), or None when the move drawn
    cannot be made here."""
    p = cand[mb]
    zeros = ctx.replicas[0]
    move = rng.random()
    if move < 0.35:
        i = rng.randrange(len(p.nodes))
        reps = ctx.replicas[p.stages[i]]
        if len(reps) < 2:
            return None
        nodes = list(p.nodes)
        nodes[i] = rng.choice([r for r in reps if r != nodes[i]])
        cand[mb] = Route(p.origin, tuple(nodes), p.stages)
    elif move < 0.5:
        if len(zeros) < 2:
            return None
        cand[mb] = Route(rng.choice([z for z in zeros if z != p.origin]), p.nodes, p.stages)
    elif move < 0.75:
        skipped = [s for s in range(1, ctx.stages) if s not in p.stages]
        if not skipped:
            return None
        s_out, s_in = rng.choice(p.stages), rng.choice(skipped)
        partners = [j for j, q in enumerate(cand) if s_in in q.stages and s_out not in q.stages]
        if not partners:
            return None
        j = rng.choice(partners)
        cand[mb] = _exchange(ctx, p, s_out, s_in, rng)
        cand[j] = _exchange(ctx, cand[j], s_in, s_out, rng)
    elif move < 0.85:
        if not allow_swaps or len(p.nodes) < 2:
            return None
        i = rng.randrange(len(p.nodes) - 1)
        nodes = list(p.nodes)
        nodes[i], nodes[i + 1] = nodes[i + 1], nodes[i]
        stages_seq = tuple(ctx.allocation[n] for n in nodes)
        if not ctx.allows(stages_seq):
            return None
        cand[mb] = Route(p.origin, tuple(nodes), stages_seq)
    else:
        prio, n = list(prio), len(cand)
        i, j = rng.randrange(n), rng.randrange(n)
        prio[i], prio[j] = prio[j], prio[i]
    return cand, prio


def _exchange(ctx: SearchContext, p: Route, s_out: int, s_in: int, rng: random.Random) -> Route:
    """``p`` with stage ``s_out`` replaced by ``s_in`` (re-sorted, so any swaps are dropped)."""
    kept = {s: n for n, s in zip(p.nodes, p.stages) if s != s_out}
    order = sorted([*kept, s_in])
    i = order.index(s_in)
    before = kept[order[i - 1]] if i > 0 else p.origin
    after = kept[order[i + 1]] if i + 1 < len(order) else p.origin
    kept[s_in] = ctx.best_replica(s_in, before, after, rng if rng.random() < 0.3 else None)
    return Route(p.origin, tuple(kept[s] for s in order), tuple(order))


def repair_routes(ctx: SearchContext, paths: Sequence[Route]) -> list[Route]:
    """``paths`` with every node that no longer holds its stage replaced, each stage set kept.

    Orphaned microbatches go to the live origin that would finish its share soonest: the origins are
    filled evenly (an origin holds each of its microbatches for the whole round trip, so one with more
    than its share pays a whole extra round), and among the least loaded the one nearest to the
    microbatch's path. A replaced node is the replica that adds the least transfer time, plus its
    compute for each microbatch it already carries beyond its fair share (so a survivor next to a fast
    link is not buried under every orphan)."""
    alloc, cost = ctx.allocation, ctx.cost
    use: dict[str, int] = defaultdict(int)
    for p in paths:
        for n in (p.origin, *p.nodes):
            if n in alloc:
                use[n] += 1
    zeros = ctx.replicas[0]
    fair_origin = math.ceil(len(paths) / len(zeros))
    visits_of = [0] * ctx.stages
    for p in paths:
        for s in p.stages:
            visits_of[s] += 1
    fair = {n: visits_of[alloc[n]] / len(ctx.replicas[alloc[n]]) for n in alloc if alloc[n] != 0}
    origin_use: defaultdict[str, int] = defaultdict(int)
    for p in paths:
        if alloc.get(p.origin) == 0:
            origin_use[p.origin] += 1

    def pick_replica(stage: int, before: str, after: str) -> str:
        return min(ctx.replicas[stage], key=lambda r: (
            cost[before, r] + cost[r, after] + ctx.work[r] * max(0.0, use[r] + 1 - fair[r]), r))

    out = []
    for p in paths:
        nodes = list(p.nodes)
        for i, (n, s) in enumerate(zip(p.nodes, p.stages)):
            if alloc.get(n) != s:
                nodes[i] = ""
        origin = p.origin
        if alloc.get(origin) != 0:
            first = next((n for n in nodes if n), None)
            last = next((n for n in reversed(nodes) if n), None)
            origin = min(zeros, key=lambda z: (
                origin_use[z] >= fair_origin, origin_use[z] if origin_use[z] >= fair_origin else 0,
                (cost[z, first] if first else 0.0) + (cost[last, z] if last else 0.0), z))
            origin_use[origin] += 1
        for i, s in enumerate(p.stages):
            if not nodes[i]:
                before = nodes[i - 1] if i else origin
                after = next((n for n in nodes[i + 1:] if n), origin)
                nodes[i] = pick_replica(s, before, after)
                use[nodes[i]] += 1
        out.append(Route(origin, tuple(nodes), p.stages))
    return out
