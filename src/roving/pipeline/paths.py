"""Which stages each microbatch visits, in which order and on which nodes; the planner, re-planning and
the baselines.

Route rules (SkipPipe): a microbatch starts and ends at a stage-0 node, visits ``visits`` of the other
stages (``round((1 - skip) * (stages - 1))``), each at most once, in increasing stage order except for at
most 2 swaps of neighbouring positions (the visited stage sequence has at most 2 inversions). Every
stage besides 0 is visited by ``microbatches * visits / (stages - 1)`` microbatches, give or take one
(load balance keeps training unbiased). Memory: a node is only given a stage it can hold (its memory
covers the stage's weights and one microbatch, ``allocate.check_memory``); how many microbatches it
then holds in flight is enforced by the simulator (a forward waits for room); the planner rejects plans
whose waits deadlock.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

from .allocate import (
    assign,
    check_memory,
    check_sizes,
    memory_fallback,
    initial_allocation,
    node_cost_matrix,
    replica_counts,
    spread_labels,
    swap_search,
    tour_order,
)
from .costs import ModelSpec, PlanError, stage_costs
from .dtfm import dtfm_allocation
from .network import Network, Node, slowed
from .plan import MAX_SWAPS, Plan, Route, inversions, stage_quotas, validate, visits_per_microbatch  # noqa: F401
from .simulate import simulate

log = logging.getLogger(__name__)


class _Context:
    """Precomputed costs for one network, model and allocation."""

    def __init__(self, network: Network, model: ModelSpec, allocation: dict[str, int], stages: int,
                 cost: dict | None = None, sync_bytes: Sequence[float] | None = None) -> None:
        self.network, self.model, self.stages = network, model, stages
        self.sync_bytes = sync_bytes  # judge by the whole iteration, replica synchronisation included
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

    def best_replica(self, stage: int, before: str, after: str, rng: random.Random | None = None) -> str:
        cands = self.replicas[stage]
        if rng is not None:
            return rng.choice(cands)
        return min(cands, key=lambda n: (self.cost[before, n] + self.cost[n, after], n))


def build_paths(ctx: _Context, microbatches: int, visits: int, allow_swaps: bool = True,
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

    def edge(a: str, b: str) -> float:
        return (cost[a, b] * (1 + 2 * link_load[a, b] / est) + cost[b, a] * (1 + 2 * link_load[b, a] / est)) * jitter()

    def node_cost(n: str) -> float:
        return ctx.work[n] * (1 + 2 * load[n] / est) * jitter()

    paths = []
    for mb in range(microbatches):
        remaining = microbatches - mb
        origin = min(zeros, key=lambda o: (load[o] + ctx.work[o], zeros.index(o)))
        forced = [s for s in range(1, s_count) if quotas[s] == remaining]
        allowed = [s for s in range(1, s_count) if quotas[s] > 0]
        press = {s: mean_w * (1 - quotas[s] / remaining) for s in allowed}
        # dp[(count, node)] = (cost, previous key)
        dp: dict[tuple[int, str], tuple[float, tuple | None]] = {}
        by_stage: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for s in allowed:
            lo = max((f for f in forced if f < s), default=0)  # cannot jump over a forced stage
            for n in ctx.replicas[s]:
                here = node_cost(n) + press[s]
                for c in range(1, visits + 1):
                    best = None
                    if c == 1 and lo == 0:
                        best = (edge(origin, n) + here, None)
                    else:
                        for ps in range(max(lo, 1), s):
                            for key in by_stage.get(ps, ()):
                                if key[0] != c - 1 or key not in dp:
                                    continue
                                v = dp[key][0] + edge(key[1], n) + here
                                if best is None or v < best[0]:
                                    best = (v, key)
                    if best is not None:
                        dp[(c, n)] = best
                        by_stage[s].append((c, n))
        last_forced = max(forced, default=0)
        end = None
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
        key = end[1]
        while key is not None:
            nodes.append(key[1])
            key = dp[key][1]
        nodes.reverse()
        if allow_swaps:
            nodes = _improve_by_swaps(nodes, origin, edge, ctx.allocation)
        stages_seq = tuple(ctx.allocation[n] for n in nodes)
        for n in nodes:
            quotas[ctx.allocation[n]] -= 1
            load[n] += ctx.work[n]
        load[origin] += ctx.work[origin]
        hops = [origin, *nodes, origin]
        for a, b in zip(hops, hops[1:]):
            link_load[a, b] += cost[a, b]
            link_load[b, a] += cost[b, a]
        paths.append(Route(origin, tuple(nodes), stages_seq))
    return paths


def _tour_cost(origin: str, nodes: Sequence[str], edge) -> float:
    hops = [origin, *nodes, origin]
    return sum(edge(a, b) for a, b in zip(hops, hops[1:]))


def _improve_by_swaps(nodes: list[str], origin: str, edge, allocation) -> list[str]:
    current, cur_cost = list(nodes), _tour_cost(origin, nodes, edge)
    for _ in range(MAX_SWAPS):
        best = None
        for i in range(len(current) - 1):
            cand = list(current)
            cand[i], cand[i + 1] = cand[i + 1], cand[i]
            if inversions([allocation[n] for n in cand]) > MAX_SWAPS:
                continue
            c = _tour_cost(origin, cand, edge)
            if c < cur_cost - 1e-9 and (best is None or c < best[0]):
                best = (c, cand)
        if best is None:
            break
        cur_cost, current = best
    return current


#: allocations that race (successive halving of path searches) after the allocation search; see ``plan``.
RACE = 5
#: when memory binds, the share of the allocation search, and the places in the race, given to the
#: split with the most stage-0 nodes (see ``plan``).
ALT_SHARE = 0.4
ALT_RACE = 2
#: shares of the budget for the allocation search and for the race (the winner's path search gets the rest).
ALLOC_FRAC = 0.3
RACE_FRAC = 0.3
#: with replica synchronisation judged, the weight of the microbatch phase beside the whole iteration
#: in the search's score: when the slowest stage's averaging sets the makespan, moves that shorten the
#: phase would otherwise score the same, and the search would drift on that plateau.
PHASE_WEIGHT = 0.25
#: in the path search, ties of the makespan are broken by the mean finish of the latest ``TAIL`` share
#: of the microbatches (1: all of them): a move that lets other microbatches end sooner makes room for
#: the last one, where the makespan alone would see a plateau.
TAIL = 1.0


def _makespan(ctx: _Context, paths: list[Route], priority: list[int] | None, skip: float) -> float:
    """The search's score: the simulated makespan (with ``ctx.sync_bytes``: the whole iteration plus
    ``PHASE_WEIGHT`` times the microbatch phase)."""
    return _judged(ctx, paths, priority, skip)[0]


def _judged(ctx: _Context, paths: list[Route], priority: list[int] | None,
            skip: float) -> tuple[float, float]:
    """``_makespan`` and the ``_tail`` of the finish times (the search's tie-break; infinite, as the
    makespan, for a plan that deadlocks)."""
    plan = Plan(ctx.stages, skip, ctx.allocation, paths, priority)
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


def improve_paths(ctx: _Context, paths: list[Route], skip: float, deadline: float, rng: random.Random,
                  allow_swaps: bool = True, priority: list[int] | None = None,
                  max_evals: int | None = None,
                  on_best: Callable[[float], None] | None = None) -> tuple[list[Route], list[int], float, int]:
    """Anytime local search over paths with the simulator as judge: move a microbatch to another
    replica or origin, exchange a visited and a skipped stage between two microbatches (keeps the
    stage loads), toggle a swap, or reorder priorities, each move taken by ``_accepts`` (ties of the
    makespan broken by the mean finish, ``TAIL``; a deadlocked plan never replaces one that does not
    deadlock). Stops at ``deadline`` or after ``max_evals`` simulator
    evaluations, whichever comes first; for a given ``rng`` state and evaluation count the result is
    deterministic. ``on_best(makespan)`` is told of each new best (it does not change the search).
    Returns (paths, priority, makespan, evaluations)."""
    cur = list(paths)
    prio = list(priority) if priority else list(range(len(paths)))
    cur_score, cur_tail = _judged(ctx, cur, prio, skip)
    best, best_prio, best_score = list(cur), list(prio), cur_score
    evals = 0
    alloc = ctx.allocation
    zeros = ctx.replicas[0]
    n_mb = len(cur)
    while time.perf_counter() < deadline and n_mb and (max_evals is None or evals < max_evals):
        cand, cand_prio = list(cur), prio
        mb = rng.randrange(n_mb)
        p = cand[mb]
        move = rng.random()
        if move < 0.35:
            i = rng.randrange(len(p.nodes))
            reps = ctx.replicas[p.stages[i]]
            if len(reps) < 2:
                continue
            nodes = list(p.nodes)
            nodes[i] = rng.choice([r for r in reps if r != nodes[i]])
            cand[mb] = Route(p.origin, tuple(nodes), p.stages)
        elif move < 0.5:
            if len(zeros) < 2:
                continue
            cand[mb] = Route(rng.choice([z for z in zeros if z != p.origin]), p.nodes, p.stages)
        elif move < 0.75:
            skipped = [s for s in range(1, ctx.stages) if s not in p.stages]
            if not skipped:
                continue
            s_out, s_in = rng.choice(p.stages), rng.choice(skipped)
            partners = [j for j, q in enumerate(cand) if s_in in q.stages and s_out not in q.stages]
            if not partners:
                continue
            j = rng.choice(partners)
            cand[mb] = _exchange(ctx, p, s_out, s_in, rng)
            cand[j] = _exchange(ctx, cand[j], s_in, s_out, rng)
        elif move < 0.85:
            if not allow_swaps or len(p.nodes) < 2:
                continue
            i = rng.randrange(len(p.nodes) - 1)
            nodes = list(p.nodes)
            nodes[i], nodes[i + 1] = nodes[i + 1], nodes[i]
            stages_seq = tuple(alloc[n] for n in nodes)
            if inversions(stages_seq) > MAX_SWAPS:
                continue
            cand[mb] = Route(p.origin, tuple(nodes), stages_seq)
        else:
            cand_prio = list(prio)
            i, j = rng.randrange(n_mb), rng.randrange(n_mb)
            cand_prio[i], cand_prio[j] = cand_prio[j], cand_prio[i]
        score, tail = _judged(ctx, cand, cand_prio, skip)
        evals += 1
        if _accepts(score, tail, cur_score, cur_tail):
            cur, prio, cur_score, cur_tail = cand, cand_prio, score, tail
            if score < best_score:
                best, best_prio, best_score = list(cand), list(cand_prio), score
                if on_best is not None:
                    on_best(score)
    return best, best_prio, best_score, evals


def _exchange(ctx: _Context, p: Route, s_out: int, s_in: int, rng: random.Random) -> Route:
    """``p`` with stage ``s_out`` replaced by ``s_in`` (re-sorted, so any swaps are dropped)."""
    kept = {s: n for n, s in zip(p.nodes, p.stages) if s != s_out}
    order = sorted([*kept, s_in])
    i = order.index(s_in)
    before = kept[order[i - 1]] if i > 0 else p.origin
    after = kept[order[i + 1]] if i + 1 < len(order) else p.origin
    kept[s_in] = ctx.best_replica(s_in, before, after, rng if rng.random() < 0.3 else None)
    return Route(p.origin, tuple(kept[s] for s in order), tuple(order))


def _check_inputs(network: Network, model: ModelSpec, stages: int, skip: float, microbatches: int) -> int:
    check_sizes(network, stages)
    if microbatches < 1:
        raise PlanError(f"need at least one microbatch, got {microbatches}")
    visits = visits_per_microbatch(stages, skip)
    check_memory(network, model, stages)
    return visits


def _count_candidates(counts: list[int]) -> list[list[int]]:
    """The compute-proportional replica counts and variants with one or two nodes moved to or from
    stage 0 (taken from, or given to, the stages with the most and fewest replicas)."""
    out = [list(counts)]
    for delta in (1, 2, -1):
        c = list(counts)
        for _ in range(abs(delta)):
            others = range(1, len(c))
            if delta > 0:
                s = max(others, key=lambda s: (c[s], s))
                if c[s] <= 1:
                    break
                c[s] -= 1
                c[0] += 1
            else:
                if c[0] <= 1:
                    break
                s = min(others, key=lambda s: (c[s], s))
                c[s] += 1
                c[0] -= 1
        if c not in out:
            out.append(c)
    return out


def plan(network: Network, model: ModelSpec, stages: int, skip: float, microbatches: int, *,
         budget_s: float = 10.0, seed: int = 0, allow_swaps: bool = True,
         sync_bytes: Sequence[float] | None = None, max_evals: int | None = None,
         progress: Callable[[dict], None] | None = None) -> Plan:
    """SkipPipe plan: allocation by swap search (each candidate judged by greedy paths + simulation)
    for about 30% of ``budget_s``; the best ``RACE`` allocations then race by successive halving of
    path searches (together 30%), and the winner gets the anytime path search for the rest. When
    memory binds (an origin's share of the microbatches exceeds what it holds in flight), the split
    with the most stage-0 nodes among the candidates gets ``ALT_SHARE`` of the allocation search and
    ``ALT_RACE`` of the places in the race.
    Deterministic for a given seed and evaluation count; with a wall-clock budget the count, and so
    the result, can vary between runs on machines of different speed or load. Raises PlanError on impossible input.
    ``sync_bytes`` (each stage's gradient bytes): judge plans by the whole iteration, the replicas'
    exchange of gradients included (``simulate``), so that replicas far apart cost what they cost;
    without it, by the microbatch phase alone (as the SkipPipe paper's simulator). ``max_evals``: the
    search is shared out by simulator evaluations instead (the same fractions), and ``budget_s`` only
    caps it: the plan is then the same on any machine and under any load, as long as the cap is not
    reached (``stats["capped"]`` says whether it was). ``progress(event)``, when given, hears how the
    search goes: ``{"phase": "allocation" | "race" | "paths" | "done", "elapsed_s", "best_s", ...}``
    after the allocation search, after each round of the race, at each better plan of the last path
    search, and at the end (it does not change the search)."""
    t0 = time.perf_counter()

    def report(phase: str, best_s: float, **extra: Any) -> None:
        if progress is not None:
            progress({"phase": phase, "elapsed_s": time.perf_counter() - t0, "best_s": best_s, **extra})

    visits = _check_inputs(network, model, stages, skip, microbatches)
    can = check_memory(network, model, stages)
    rng = random.Random(seed)
    cost = node_cost_matrix(network, model)
    order = tour_order(network, cost)

    def judge_with(labels: list[int], slots: list[str]) -> float:
        ctx = _Context(network, model, dict(zip(slots, labels)), stages, cost, sync_bytes)
        return _makespan(ctx, build_paths(ctx, microbatches, visits, allow_swaps), None, skip)

    # Replica counts proportional to compute ignore memory: an origin holds each of its microbatches
    # for the whole round trip, so with little memory more stage-0 nodes (fewer rounds each) can beat
    # the compute-proportional split. A few candidate splits are judged before the swap search.
    # Memory: each candidate's labels are put on nodes that can hold them (``assign``: the tour order
    # where memory allows); if no candidate split fits, a split built around memory does.
    counts = replica_counts(len(network.nodes), stages, skip, model)
    starts = []
    for c in _count_candidates(counts):
        lab = spread_labels(c)
        placed = assign(order, lab, can)
        if placed is not None:
            starts.append((lab, placed))
    if not starts:
        starts.append(memory_fallback(order, counts, can, stages))
    labels, start = min(starts, key=lambda ls: judge_with(*ls))

    limited = any(len(c) < stages for c in can.values())
    by_count = max_evals is not None
    cap = t0 + budget_s
    # When memory binds (an origin sends more microbatches than it can hold at once, so it runs them in
    # rounds of whole round trips), a split with more stage-0 nodes has fewer rounds per origin, which
    # greedy paths undervalue: the split with the most stage-0 nodes among the candidates then gets its
    # own share of the allocation search, and its best allocations race with the others.
    held = [network.node(n).in_flight(0, model, stages) for n in network.names if 0 in can[n]]
    more = [ls for ls in starts if ls[0].count(0) > labels.count(0)]
    if more and held and math.ceil(microbatches / labels.count(0)) > min(held):
        alt = max(more, key=lambda ls: ls[0].count(0))
        searches = [(labels, start, 1.0 - ALT_SHARE, RACE - ALT_RACE), (alt[0], alt[1], ALT_SHARE, ALT_RACE)]
    else:
        searches = [(labels, start, 1.0, RACE)]
    contenders: list[tuple[list[int], list[str]]] = []
    evals = 0
    best_greedy = math.inf  # the best allocation's makespan with greedy paths
    alloc_end = t0 + ALLOC_FRAC * budget_s
    for k, (labs, first, share, take) in enumerate(searches):
        judged: dict[tuple[str, ...], float] = {}

        def judge(slots: list[str], labs=labs, judged=judged) -> float:
            v = judge_with(labs, slots)
            judged.setdefault(tuple(slots), v)
            return v

        left = sum(x[2] for x in searches[k:])
        deadline = cap if by_count else \
            time.perf_counter() + max(0.0, alloc_end - time.perf_counter()) * share / left
        swap_search(first, labs, judge, deadline, rng,
                    max_evals=int(ALLOC_FRAC * max_evals * share) if by_count else None,
                    ok=(lambda n, s: s in can[n]) if limited else None)
        # Greedy paths judge an allocation only roughly: the allocation that is best with them is often
        # not the best once its paths are searched (on the training benchmark's network the third of the
        # list came out 20% faster than the first), and a short path search ranks them only a little
        # better. So the best few race by successive halving: each gets a path search, the faster half
        # goes on with a longer one from where it stands, and so on until one is left; it gets the rest.
        ranked = [list(sl) for sl, _ in sorted(judged.items(), key=lambda kv: kv[1])[:take]] or [first]
        contenders += [(labs, sl) for sl in ranked]
        evals += len(judged)
        best_greedy = min([best_greedy, *judged.values()])
    report("allocation", best_greedy, candidates=len(contenders))
    pool = []
    for i, (labs, sl) in enumerate(contenders):
        ctx = _Context(network, model, dict(zip(sl, labs)), stages, cost, sync_bytes)
        paths = build_paths(ctx, microbatches, visits, allow_swaps)
        if math.isinf(_makespan(ctx, paths, None, skip)):
            paths = build_paths(ctx, microbatches, visits, allow_swaps=False)
        pool.append([math.inf, i, ctx, paths, None])
    rounds = max(1, math.ceil(math.log2(len(pool))))
    for r in range(rounds):
        round_end = t0 + (ALLOC_FRAC + RACE_FRAC * (r + 1) / rounds) * budget_s
        for k, member in enumerate(pool):
            if by_count:
                deadline, count = cap, max(1, int(RACE_FRAC * max_evals / rounds) // len(pool))
            else:
                deadline = time.perf_counter() + max(0.0, round_end - time.perf_counter()) / (len(pool) - k)
                count = None
            member[3], member[4], member[0], n = improve_paths(member[2], member[3], skip, deadline, rng,
                                                               allow_swaps, priority=member[4], max_evals=count)
            evals += n
        pool.sort(key=lambda m: (m[0], m[1]))
        log.debug("allocation race, round %d: %s", r, [round(m[0], 3) for m in pool])
        report("race", pool[0][0], round=r + 1, rounds=rounds, contenders=len(pool))
        pool = pool[:max(1, math.ceil(len(pool) / 2))] if r < rounds - 1 else pool[:1]
    _, _, ctx, paths, prio = pool[0]
    paths, prio, score, n = improve_paths(ctx, paths, skip, cap, rng, allow_swaps, priority=prio,
                                          max_evals=max(1, max_evals - evals) if by_count else None,
                                          on_best=lambda v: report("paths", v))
    evals += n
    if sync_bytes is not None:  # the search's score also weighs the phase: report the makespan itself
        score = simulate(network, model, Plan(stages, skip, ctx.allocation, paths, prio), record=False,
                         sync_bytes=sync_bytes).makespan
    result = Plan(stages, skip, ctx.allocation, paths, prio, score,
                  {"planner_seconds": time.perf_counter() - t0, "path_evaluations": evals,
                   "capped": by_count and time.perf_counter() >= cap,
                   "splits": [[labs.count(st) for st in range(stages)] for labs, *_ in searches]})
    log.info("planned %d microbatches over %d stages (skip %.2f): %.2f s per iteration",
             microbatches, stages, skip, score)
    report("done", score, evaluations=evals)
    return result


def _repair_paths(ctx: _Context, paths: Sequence[Route]) -> list[Route]:
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
    origin_use = defaultdict(int)
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


def _rebalanced(alloc: dict[str, int], counts: list[int], want: list[int], paths: Sequence[Route],
                can: dict[str, frozenset[int]] | None = None) -> dict[str, int]:
    """``alloc`` with nodes moved from stages above their wanted replica count to stages below it; from
    a donor stage the node carrying the fewest microbatches moves (only to a stage its memory can hold,
    ``can``; stops when no such move is left)."""
    alloc, counts = dict(alloc), list(counts)
    carried: dict[str, int] = defaultdict(int)
    for p in paths:
        for n in (p.origin, *p.nodes):
            carried[n] += 1
    while True:
        short = [s for s in range(len(counts)) if counts[s] < want[s]]
        spare = [s for s in range(len(counts)) if counts[s] > want[s]]
        if not short or not spare:
            return alloc
        moves = [(to, donor) for to in sorted(short, key=lambda s: (-want[s] / counts[s], s))
                 for donor in sorted(spare, key=lambda s: (-counts[s] / want[s], s))
                 if any(s == donor and (can is None or to in can[n]) for n, s in alloc.items())]
        if not moves:
            return alloc
        to, donor = moves[0]
        node = min((n for n, s in alloc.items() if s == donor and (can is None or to in can[n])),
                   key=lambda n: (carried[n], n))
        alloc[node] = to
        counts[donor] -= 1
        counts[to] += 1


def replan(current: Plan, network: Network, model: ModelSpec, *, failed: Iterable[str] = (),
           slowed_by: dict[str, float] | None = None, joined: Sequence[Node] = (),
           budget_s: float = 0.6, seed: int = 0,
           sync_bytes: Sequence[float] | None = None, max_evals: int | None = None) -> tuple[Plan, Network]:
    """A new plan from ``current`` after nodes failed, slowed down (factor > 1 = slower) or joined.
    Keeps each microbatch's stage set (so stage loads stay balanced) and moves only what must move;
    a stage left without nodes takes a free node (joined, or idle in ``current``), else one from the
    stage with the most spare replicas; other free nodes go where the work per replica is highest; a
    stage left with fewer replicas than a fresh plan would give it may also take nodes from stages above
    their count, when the simulator says that is faster. ``sync_bytes``: as for ``plan``. ``max_evals``:
    the path search stops after that many simulator evaluations (``budget_s`` then only caps it), so the
    same failure gives the same plan on any machine. Returns the plan and the updated network. Raises
    PlanError if a stage cannot be held."""
    t0 = time.perf_counter()
    failed = set(failed)
    for f in failed:
        network.node(f)
    new_net = network.without(failed)
    if slowed_by:
        new_net = slowed(new_net, slowed_by)
    if joined:
        new_net = new_net.with_nodes(list(new_net.nodes) + list(joined))
    stages = current.stages
    can = check_memory(new_net, model, stages)
    alloc = {n: s for n, s in current.allocation.items() if n not in failed}
    # every live node without a stage: joined nodes and nodes the current plan left idle
    free = [n for n in new_net.names if n not in alloc]
    counts = [sum(1 for s in alloc.values() if s == st) for st in range(stages)]
    # what each stage should have, by the same rule as a fresh plan
    want = replica_counts(len(alloc) + len(free), stages, current.skip, model) \
        if len(alloc) + len(free) >= stages else None
    for st in range(stages):
        if counts[st]:
            continue
        fits = [n for n in free if st in can[n]]
        if fits:
            take = fits[0]
            free.remove(take)
        else:
            donors = [s for s in range(stages) if counts[s] > 1
                      and any(v == s and st in can[n] for n, v in alloc.items())]
            if not donors:
                raise PlanError(
                    f"stage {st} lost all its nodes ({', '.join(sorted(failed))} failed) and no other "
                    "stage has a spare replica with the memory to hold it; add nodes or plan with fewer stages"
                )
            donor = max(donors, key=lambda s: (counts[s] - (want[s] if want else 0), counts[s], -s))
            take = max((n for n, s in alloc.items() if s == donor and st in can[n]),
                       key=lambda n: (new_net.node(n).speed, n))
            counts[donor] -= 1
        alloc[take] = st
        counts[st] += 1
    for n in free:  # joined nodes go where the work per replica is highest (among stages they can hold)
        st = max(sorted(can[n]), key=lambda s: ((want[s] if want else 1) / counts[s], -s))
        alloc[n] = st
        counts[st] += 1
    rng = random.Random(seed)
    visits = visits_per_microbatch(stages, current.skip)
    # Each stage keeps its visit quota (load balance), so a stage that lost replicas loads its survivors
    # with the lost ones' share: one replica left of two does twice the work and sets the iteration
    # time. Moving nodes over from stages above their fair count undoes that; the simulator decides
    # whether the moves pay for themselves.
    allocations = [alloc]
    if want:
        moved = _rebalanced(alloc, counts, want, current.paths, can)
        if moved != alloc:
            allocations.append(moved)
        # and a fresh allocation (more weights move, but the survivors may be far better used)
        labels = spread_labels(want)
        placed = assign(tour_order(new_net, node_cost_matrix(new_net, model)), labels, can)
        if placed is not None:
            allocations.append(dict(zip(placed, labels)))
    candidates = []
    for a in allocations:
        ctx = _Context(new_net, model, a, stages, sync_bytes=sync_bytes)
        for ps, pr in ((_repair_paths(ctx, current.paths), current.priority),
                       (build_paths(ctx, len(current.paths), visits), None)):
            candidates.append((_makespan(ctx, ps, pr, current.skip), len(candidates), ctx, ps, pr))
    _, _, ctx, paths, prio = min(candidates, key=lambda c: c[:2])
    alloc = ctx.allocation
    paths, prio, score, evals = improve_paths(ctx, paths, current.skip, t0 + budget_s, rng, priority=prio,
                                              max_evals=max_evals)
    new_plan = Plan(stages, current.skip, alloc, paths, prio, score,
                    {"planner_seconds": time.perf_counter() - t0, "path_evaluations": evals,
                     "capped": max_evals is not None and evals < max_evals})
    return new_plan, new_net


def plan_held(network: Network, model: ModelSpec, allocation: dict[str, int], stages: int, skip: float,
              microbatches: int, *, budget_s: float = 0.5, seed: int = 0,
              max_evals: int | None = None) -> Plan:
    """Paths for an allocation that stays as it is (a running training's weights sit on its nodes).

    Stages that no node holds are left out: every path skips them, and the stages that are held keep
    the skip fraction among themselves, so training goes on with those stages missing until a node
    takes them over. The paths are planned as for a model of the held stages only (the planner's cost
    of a stage then covers the layers of the missing ones too, an overestimate); the returned plan names
    the real stages, and its ``predicted_s`` is the simulator's makespan with the real stages' costs.
    ``max_evals``: as for ``replan``. Raises PlanError when no node holds stage 0 (no microbatch can
    start)."""
    t0 = time.perf_counter()
    held = sorted(set(allocation.values()))
    if not held or held[0] != 0:
        raise PlanError("no node holds stage 0 (embedding, head and loss): no microbatch can start; add a "
                        "node, or resume from a checkpoint")
    names = set(network.names)
    missing = [n for n in allocation if n not in names]
    if missing:
        raise PlanError(f"allocation names nodes not in the network: {', '.join(sorted(missing))}")
    if microbatches < 1:
        raise PlanError(f"need at least one microbatch, got {microbatches}")
    virtual = {s: i for i, s in enumerate(held)}
    rng = random.Random(seed)
    prio: list[int] | None = None
    evals = 0
    if len(held) == 1:  # only stage 0 is left: every microbatch stays at its origin
        zeros = sorted(allocation)
        paths = [Route(zeros[i % len(zeros)], (), ()) for i in range(microbatches)]
    else:
        ctx = _Context(network, model, {n: virtual[s] for n, s in allocation.items()}, len(held))
        visits = visits_per_microbatch(len(held), skip)
        vpaths = build_paths(ctx, microbatches, visits)
        if math.isinf(_makespan(ctx, vpaths, None, skip)):
            vpaths = build_paths(ctx, microbatches, visits, allow_swaps=False)
        vpaths, prio, _, evals = improve_paths(ctx, vpaths, skip, t0 + budget_s, rng, priority=None,
                                               max_evals=max_evals)
        paths = [Route(p.origin, p.nodes, tuple(held[s] for s in p.stages)) for p in vpaths]
    result = Plan(stages, skip, dict(allocation), paths, prio, math.nan,
                  {"planner_seconds": time.perf_counter() - t0, "path_evaluations": evals,
                   "held_stages": held, "missing_stages": [s for s in range(stages) if s not in virtual]})
    result.predicted_s = simulate(network, model, result, record=False).makespan
    return result


# ---- baselines, judged by the same simulator ----

def full_pipeline(network: Network, model: ModelSpec, stages: int, microbatches: int, *,
                  budget_s: float = 5.0, seed: int = 0, max_evals: int | None = None) -> Plan:
    """The paper's baseline: DT-FM's allocation (``nodes // stages`` fixed full pipelines chosen by
    DT-FM's communication cost model and evolutionary search, see ``dtfm``), no stage skipped, the
    microbatches split evenly across the pipelines (pipeline i carries microbatches i, i+p, ...).
    Nodes left over stay idle. The simulator only measures the result; it never steers the search.
    Like DT-FM it ignores per-node memory: with nodes of different memory it may put a stage on a node
    that cannot hold it, and the result's ``predicted_s`` is then infinite (``stats["memory_ok"]``
    False). ``max_evals``: DT-FM's search stops after that many evaluations of its cost model
    (``budget_s`` then only caps it; ``stats["capped"]`` says whether it did), so that the baseline is the
    same on any machine, under any load."""
    _check_inputs(network, model, stages, 0.0, microbatches)
    t0 = time.perf_counter()
    found = dtfm_allocation(network, model, stages, microbatches, budget_s=budget_s, seed=seed,
                            max_evals=max_evals)
    chains = found.pipelines
    alloc = {n: pos for c in chains for pos, n in enumerate(c)}
    paths = [Route(c[0], tuple(c[1:]), tuple(range(1, stages)))
             for c in (chains[m % len(chains)] for m in range(microbatches))]
    result = Plan(stages, 0.0, alloc, paths)
    result.predicted_s = simulate(network, model, result, record=False).makespan
    result.stats = {"planner_seconds": time.perf_counter() - t0, "dtfm_cost": found.cost,
                    "idle": found.idle, "evaluations": found.evaluations, "capped": found.capped,
                    "memory_ok": all(network.node(n).can_hold(s, model, stages) for n, s in alloc.items())}
    return result


def random_skip(network: Network, model: ModelSpec, allocation: dict[str, int], stages: int,
                skip: float, microbatches: int, *, seed: int = 0) -> Plan:
    """Random valid paths on a given allocation: origins spread evenly, a random stage set that meets
    the stage quotas, a random replica per stage, increasing stage order (no swaps)."""
    visits = _check_inputs(network, model, stages, skip, microbatches)
    rng = random.Random(seed)
    ctx = _Context(network, model, allocation, stages)
    quotas = stage_quotas(microbatches, stages, visits)
    zeros = list(ctx.replicas[0])
    rng.shuffle(zeros)
    paths = []
    for mb in range(microbatches):
        remaining = microbatches - mb
        forced = [s for s in range(1, stages) if quotas[s] == remaining]
        optional = [s for s in range(1, stages) if 0 < quotas[s] < remaining]
        chosen = sorted(forced + rng.sample(optional, visits - len(forced)))
        for s in chosen:
            quotas[s] -= 1
        nodes = tuple(rng.choice(ctx.replicas[s]) for s in chosen)
        paths.append(Route(zeros[mb % len(zeros)], nodes, tuple(chosen)))
    result = Plan(stages, skip, dict(allocation), paths)
    result.predicted_s = _makespan(ctx, paths, None, skip)
    return result
