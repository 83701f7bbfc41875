"""The SkipPipe planner: which node holds which stage, and the routes on it (``plan``); a new plan
after nodes failed, slowed down or joined (``replan``); routes for an allocation that must stay
(``plan_held``); the stage a joining node takes (``place_joining``); and the checks every plan's input
passes first (``check_inputs``).

Memory: a node is only given a stage it can hold (its memory covers the stage's weights and one
microbatch, ``allocate.check_memory``); how many microbatches it then holds in flight is enforced by
the simulator (a forward waits for room); the planner rejects plans whose waits deadlock.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from .allocate import (
    assign,
    check_memory,
    check_sizes,
    memory_fallback,
    node_cost_matrix,
    replica_counts,
    spread_labels,
    swap_search,
    tour_order,
)
from .costs import ModelSpec
from ..errors import PlanError
from .network import Network, Node, slowed
from .plan import DEFAULT_ROUTE_RULE, Plan, Route, check_route_rule, visits_per_microbatch
from .routes import SearchContext, Tally, build_routes, improve_routes, repair_routes, score_routes
from .simulate import simulate

log = logging.getLogger(__name__)

#: allocations that race (successive halving of path searches) after the allocation search; see ``plan``.
RACE = 5
#: when memory binds, the share of the allocation search, and the places in the race, given to the
#: split with the most stage-0 nodes (see ``plan``).
ALT_SHARE = 0.4
ALT_RACE = 2
#: shares of the budget for the allocation search and for the race (the winner's path search gets the rest).
ALLOC_FRAC = 0.3
RACE_FRAC = 0.3


def check_inputs(network: Network, model: ModelSpec, stages: int, skip: float, microbatches: int) -> int:
    """Check a planning problem before any search: enough nodes for the stages, at least one
    microbatch, a skip fraction that leaves a stage to visit, and memory that can place every stage.
    Returns the stages each microbatch visits besides stage 0; raises PlanError naming what is wrong."""
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
         route_rule: str = DEFAULT_ROUTE_RULE, progress: Callable[[dict], None] | None = None) -> Plan:
    """SkipPipe plan: allocation by swap search (each candidate judged by greedy paths + simulation)
    for about 30% of ``budget_s``; the best ``RACE`` allocations then race by successive halving of
    path searches (together 30%), and the winner gets the anytime path search for the rest. When
    memory binds (an origin's share of the microbatches exceeds what it holds in flight), the split
    with the most stage-0 nodes among the candidates gets ``ALT_SHARE`` of the allocation search and
    ``ALT_RACE`` of the places in the race.
    Deterministic for a given seed and evaluation count; with a wall-clock budget the count, and so
    the result, can vary between runs on machines of different speed or load. Raises PlanError on impossible input.
    ``budget_s`` is a deadline: the plan comes back at it, or, where the first allocation's greedy paths
    (two constructions and a simulation: seconds at 200 nodes on 16 stages) take longer, right after
    them; by count, the phases that take time before the first plan stop at it too.
    ``sync_bytes`` (each stage's gradient bytes): judge plans by the whole iteration, the replicas'
    exchange of gradients included (``simulate``), so that replicas far apart cost what they cost;
    without it, by the microbatch phase alone (as the SkipPipe paper's simulator). ``max_evals``: the
    search is shared out by simulator evaluations instead (the same fractions), and ``budget_s`` only
    caps it: the plan is then the same on any machine and under any load, as long as the cap is not
    reached (``stats["capped"]`` says whether it was). Every simulation counts, so the plan is made with
    exactly ``max_evals`` of them (``stats["path_evaluations"]``), unless the cap cuts it short or
    ``max_evals`` is below the few every plan needs (one per candidate split and per racing allocation,
    about a dozen: then that many). ``route_rule``: the rule every route keeps (``plan.ROUTE_RULES``:
    SkipPipe's by default, "inversions" the looser one). ``progress(event)``, when given, hears how the
    search goes: ``{"phase": "allocation" | "race" | "paths" | "done", "elapsed_s", "best_s", ...}``
    after the allocation search, after each round of the race, at each better plan of the last path
    search, and at the end (it does not change the search)."""
    t0 = time.perf_counter()

    def report(phase: str, best_s: float, **extra: Any) -> None:
        if progress is not None:
            progress({"phase": phase, "elapsed_s": time.perf_counter() - t0, "best_s": best_s, **extra})

    visits = check_inputs(network, model, stages, skip, microbatches)
    tally = Tally()
    problem = _Problem(network, model, stages, skip, microbatches, visits, allow_swaps, sync_bytes,
                       node_cost_matrix(network, model), check_memory(network, model, stages),
                       check_route_rule(route_rule), tally, {})
    rng = random.Random(seed)
    by_count = max_evals is not None
    cap = t0 + budget_s
    # with sync_bytes, one simulation at the end reports the makespan itself (the search's score also
    # weighs the phase): it counts too
    reserve = 1 if sync_bytes is not None else 0
    # by count the plan must not depend on the clock: only the cap (``budget_s``) cuts the first phase
    searches = _searches(problem, cap if by_count else t0 + ALLOC_FRAC * budget_s)
    contenders, best_greedy = _allocation_search(problem, searches, t0, budget_s, rng, max_evals)
    report("allocation", best_greedy, candidates=len(contenders))
    winner = _race(problem, contenders, t0, budget_s, rng,
                   max_evals - reserve if max_evals is not None else None, report)
    ctx = winner.ctx
    left = max_evals - reserve - tally.n if max_evals is not None else None
    if left is None or left >= 1:
        paths, prio, score, _ = improve_routes(ctx, winner.paths, skip, cap, rng, allow_swaps,
                                               priority=winner.priority, max_evals=left,
                                               on_best=lambda v: report("paths", v))
    else:  # the count is spent: the race's best stands
        paths, prio, score = winner.paths, winner.priority or list(range(len(winner.paths))), winner.score
    if sync_bytes is not None:
        tally.n += 1
        score = simulate(network, model, Plan(stages, skip, ctx.allocation, paths, prio), record=False,
                         sync_bytes=sync_bytes).makespan
    evals = tally.n
    result = Plan(stages, skip, ctx.allocation, paths, prio, score,
                  {"planner_seconds": time.perf_counter() - t0, "path_evaluations": evals,
                   "capped": by_count and time.perf_counter() >= cap,
                   "splits": [[search.labels.count(st) for st in range(stages)] for search in searches]},
                  route_rule)
    log.info("planned %d microbatches over %d stages (skip %.2f): %.2f s per iteration",
             microbatches, stages, skip, score)
    report("done", score, evaluations=evals)
    return result


@dataclass(frozen=True)
class _Problem:
    """What ``plan`` is asked, and what it derives once: the node cost matrix (``cost``) and the stages
    each node's memory can hold (``can``); the route rule; the count of simulator evaluations
    (``tally``) and the greedy judgements made (``judged``: an allocation judged again costs nothing)."""

    network: Network
    model: ModelSpec
    stages: int
    skip: float
    microbatches: int
    visits: int
    allow_swaps: bool
    sync_bytes: Sequence[float] | None
    cost: Any
    can: dict[str, frozenset[int]]
    route_rule: str
    tally: Tally
    judged: dict[tuple[tuple[int, ...], tuple[str, ...]], float]

    def context(self, labels: list[int], slots: list[str]) -> SearchContext:
        """The search context of the allocation that gives ``slots[i]`` stage ``labels[i]``."""
        return SearchContext(self.network, self.model, dict(zip(slots, labels)), self.stages, self.cost,
                             self.sync_bytes, self.route_rule, self.tally)

    def judge(self, labels: list[int], slots: list[str]) -> float:
        """An allocation's score with greedy paths (the allocation search's judge); simulated once per
        allocation."""
        key = (tuple(labels), tuple(slots))
        hit = self.judged.get(key)
        if hit is None:
            ctx = self.context(labels, slots)
            paths = build_routes(ctx, self.microbatches, self.visits, self.allow_swaps)
            hit = self.judged[key] = score_routes(ctx, paths, None, self.skip)
        return hit


class _Search(NamedTuple):
    """One allocation search of ``plan``: a split of the stages (``labels``, one per slot) starting from
    the slots ``first``, with ``share`` of the allocation search's budget and ``places`` in the race."""

    labels: list[int]
    first: list[str]
    share: float
    places: int


@dataclass
class _Contender:
    """An allocation in ``plan``'s race: its paths and priority so far, and their score (``order``
    breaks ties: the allocation search's ranking)."""

    score: float
    order: int
    ctx: SearchContext
    paths: list[Route]
    priority: list[int] | None


def _searches(problem: _Problem, deadline: float) -> list[_Search]:
    """The allocation searches ``plan`` runs: from the best of a few candidate splits (the comment
    below), and, when memory binds, one more for the split with the most stage-0 nodes. Splits are
    judged until ``deadline`` (the first always): at 200 nodes one judgement takes seconds."""
    network, model, stages, can = problem.network, problem.model, problem.stages, problem.can
    order = tour_order(network, problem.cost)
    # Replica counts proportional to compute ignore memory: an origin holds each of its microbatches
    # for the whole round trip, so with little memory more stage-0 nodes (fewer rounds each) can beat
    # the compute-proportional split. A few candidate splits are judged before the swap search.
    # Memory: each candidate's labels are put on nodes that can hold them (``assign``: the tour order
    # where memory allows); if no candidate split fits, a split built around memory does.
    counts = replica_counts(len(network.nodes), stages, problem.skip, model)
    starts = []
    for c in _count_candidates(counts):
        lab = spread_labels(c)
        placed = assign(order, lab, can)
        if placed is not None:
            starts.append((lab, placed))
    if not starts:
        starts.append(memory_fallback(order, counts, can, stages))
    if len(starts) > 1:
        scores = [problem.judge(*starts[0])]
        for ls in starts[1:]:
            if time.perf_counter() >= deadline:
                break
            scores.append(problem.judge(*ls))
        starts = starts[:len(scores)]
        labels, start = starts[min(range(len(scores)), key=scores.__getitem__)]
    else:
        labels, start = starts[0]
    # When memory binds (an origin sends more microbatches than it can hold at once, so it runs them in
    # rounds of whole round trips), a split with more stage-0 nodes has fewer rounds per origin, which
    # greedy paths undervalue: the split with the most stage-0 nodes among the candidates then gets its
    # own share of the allocation search, and its best allocations race with the others.
    held = [network.node(n).in_flight(0, model, stages) for n in network.names if 0 in can[n]]
    more = [ls for ls in starts if ls[0].count(0) > labels.count(0)]
    if more and held and math.ceil(problem.microbatches / labels.count(0)) > min(held):
        alt = max(more, key=lambda ls: ls[0].count(0))
        return [_Search(labels, start, 1.0 - ALT_SHARE, RACE - ALT_RACE), _Search(alt[0], alt[1], ALT_SHARE, ALT_RACE)]
    return [_Search(labels, start, 1.0, RACE)]


def _allocation_search(problem: _Problem, searches: list[_Search], t0: float, budget_s: float,
                       rng: random.Random,
                       max_evals: int | None) -> tuple[list[tuple[list[int], list[str]]], float]:
    """Each search's swap search, by its share of the allocation phase; returns the allocations that
    race ((labels, slots), best first within each search) and the best allocation's makespan with
    greedy paths."""
    by_count = max_evals is not None
    cap = t0 + budget_s
    limited = any(len(c) < problem.stages for c in problem.can.values())
    contenders: list[tuple[list[int], list[str]]] = []
    best_greedy = math.inf
    alloc_end = t0 + ALLOC_FRAC * budget_s
    for k, search in enumerate(searches):
        judged: dict[tuple[str, ...], float] = {}

        def judge(slots: list[str], labs: list[int] = search.labels,
                  judged: dict[tuple[str, ...], float] = judged) -> float:
            v = problem.judge(labs, slots)
            judged.setdefault(tuple(slots), v)
            return v

        left = sum(x.share for x in searches[k:])
        deadline = cap if by_count else \
            time.perf_counter() + max(0.0, alloc_end - time.perf_counter()) * search.share / left
        swap_search(search.first, search.labels, judge, deadline, rng,
                    max_evals=max(0, int(ALLOC_FRAC * max_evals * search.share) - 1) if max_evals is not None else None,
                    ok=(lambda n, s: s in problem.can[n]) if limited else None)
        # Greedy paths judge an allocation only roughly: the allocation that is best with them is often
        # not the best once its paths are searched (on the training benchmark's network the third of the
        # list came out 20% faster than the first), and a short path search ranks them only a little
        # better. So the best few race by successive halving: each gets a path search, the faster half
        # goes on with a longer one from where it stands, and so on until one is left; it gets the rest.
        ranked = [list(sl) for sl, _ in sorted(judged.items(), key=lambda kv: kv[1])[:search.places]] or [search.first]
        contenders += [(search.labels, sl) for sl in ranked]
        best_greedy = min([best_greedy, *judged.values()])
    return contenders, best_greedy


def _race(problem: _Problem, allocations: list[tuple[list[int], list[str]]], t0: float, budget_s: float,
          rng: random.Random, max_evals: int | None, report: Callable[..., None]) -> _Contender:
    """Successive halving of path searches over ``allocations`` (``plan``'s race phase); the winner.
    ``max_evals``: the simulator evaluations of the whole plan (``problem.tally`` counts them); the race
    takes its share of them and never goes past them, beyond the one evaluation each contender's first
    paths need."""
    cap = t0 + budget_s
    skip, allow_swaps = problem.skip, problem.allow_swaps
    pool: list[_Contender] = []
    # each contender's first paths until the race's first round would end (by count: the cap), one
    # at least: on a large network each takes seconds
    entry_end = cap if max_evals is not None else t0 + (ALLOC_FRAC + RACE_FRAC / 2) * budget_s
    for i, (labs, sl) in enumerate(allocations):
        if pool and time.perf_counter() >= entry_end:
            break
        ctx = problem.context(labs, sl)
        paths = build_routes(ctx, problem.microbatches, problem.visits, allow_swaps)
        score = score_routes(ctx, paths, None, skip)
        if math.isinf(score):
            paths = build_routes(ctx, problem.microbatches, problem.visits, allow_swaps=False)
            score = score_routes(ctx, paths, None, skip)
        pool.append(_Contender(score, i, ctx, paths, None))
    rounds = max(1, math.ceil(math.log2(len(pool))))
    for r in range(rounds):
        round_end = t0 + (ALLOC_FRAC + RACE_FRAC * (r + 1) / rounds) * budget_s
        for k, member in enumerate(pool):
            count: int | None
            if max_evals is not None:  # a budget of evaluations, never past the plan's
                deadline = cap
                share = min(max(1, int(RACE_FRAC * max_evals / rounds) // len(pool)), max_evals - problem.tally.n)
                if share < 1:
                    continue
                count = share
            else:
                deadline = time.perf_counter() + max(0.0, round_end - time.perf_counter()) / (len(pool) - k)
                count = None
            member.paths, member.priority, member.score, _ = improve_routes(
                member.ctx, member.paths, skip, deadline, rng, allow_swaps, priority=member.priority, max_evals=count)
        pool.sort(key=lambda m: (m.score, m.order))
        log.debug("allocation race, round %d: %s", r, [round(m.score, 3) for m in pool])
        report("race", pool[0].score, round=r + 1, rounds=rounds, contenders=len(pool))
        pool = pool[:max(1, math.ceil(len(pool) / 2))] if r < rounds - 1 else pool[:1]
    return pool[0]


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
    the re-plan makes that many simulator evaluations in all (at least one per allocation and path set
    it starts from; ``budget_s`` then only caps it), so the same failure gives the same plan on any
    machine. The routes keep ``current``'s route rule. Returns the plan and the updated network. Raises
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
    _refill(alloc, counts, free, want, can, new_net, failed)
    rng = random.Random(seed)
    visits = visits_per_microbatch(stages, current.skip)
    candidates: list[_Contender] = []
    tally = Tally()
    for a in _replan_allocations(alloc, counts, want, current, new_net, model, can):
        ctx = SearchContext(new_net, model, a, stages, sync_bytes=sync_bytes, route_rule=current.route_rule,
                            tally=tally)
        for ps, pr in ((repair_routes(ctx, current.paths), current.priority),
                       (build_routes(ctx, len(current.paths), visits), None)):
            candidates.append(_Contender(score_routes(ctx, ps, pr, current.skip), len(candidates), ctx, ps, pr))
    best = min(candidates, key=lambda c: (c.score, c.order))
    alloc = best.ctx.allocation
    left = max(1, max_evals - tally.n) if max_evals is not None else None
    paths, prio, score, _ = improve_routes(best.ctx, best.paths, current.skip, t0 + budget_s, rng,
                                           priority=best.priority, max_evals=left)
    new_plan = Plan(stages, current.skip, alloc, paths, prio, score,
                    {"planner_seconds": time.perf_counter() - t0, "path_evaluations": tally.n,
                     "capped": max_evals is not None and tally.n < max_evals}, current.route_rule)
    return new_plan, new_net


def _refill(alloc: dict[str, int], counts: list[int], free: list[str], want: list[int] | None,
            can: dict[str, frozenset[int]], net: Network, failed: set[str]) -> None:
    """``replan``'s first step, in place: a stage left without nodes takes a free node, else the fastest
    fitting node of the stage with the most spare replicas; then the other free nodes go where the work
    per replica is highest (among the stages they can hold). PlanError when a stage cannot be held."""
    stages = len(counts)
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
                       key=lambda n: (net.node(n).speed, n))
            counts[donor] -= 1
        alloc[take] = st
        counts[st] += 1
    for n in free:  # joined nodes go where the work per replica is highest (among stages they can hold)
        st = max(sorted(can[n]), key=lambda s: ((want[s] if want else 1) / counts[s], -s))
        alloc[n] = st
        counts[st] += 1


def _replan_allocations(alloc: dict[str, int], counts: list[int], want: list[int] | None, current: Plan,
                        net: Network, model: ModelSpec, can: dict[str, frozenset[int]]) -> list[dict[str, int]]:
    """The allocations ``replan`` judges: the refilled one, and (when a fresh plan's counts are known)
    the same rebalanced toward them and a fresh allocation."""
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
        placed = assign(tour_order(net, node_cost_matrix(net, model)), labels, can)
        if placed is not None:
            allocations.append(dict(zip(placed, labels)))
    return allocations


def plan_held(network: Network, model: ModelSpec, allocation: dict[str, int], stages: int, skip: float,
              microbatches: int, *, budget_s: float = 0.5, seed: int = 0,
              max_evals: int | None = None, route_rule: str = DEFAULT_ROUTE_RULE) -> Plan:
    """Paths for an allocation that stays as it is (a running training's weights sit on its nodes).

    Stages that no node holds are left out: every path skips them, and the stages that are held keep
    the skip fraction among themselves, so training goes on with those stages missing until a node
    takes them over. The paths are planned as for a model of the held stages only (the planner's cost
    of a stage then covers the layers of the missing ones too, an overestimate); the returned plan names
    the real stages, and its ``predicted_s`` is the simulator's makespan with the real stages' costs.
    ``max_evals``: the path search's simulator evaluations (``budget_s`` then only caps it). The routes
    keep ``route_rule`` over the held stages' order. Raises PlanError when no node holds stage 0 (no
    microbatch can start)."""
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
        ctx = SearchContext(network, model, {n: virtual[s] for n, s in allocation.items()}, len(held),
                            route_rule=route_rule, rule_stages=held)
        visits = visits_per_microbatch(len(held), skip)
        vpaths = build_routes(ctx, microbatches, visits)
        if math.isinf(score_routes(ctx, vpaths, None, skip)):
            vpaths = build_routes(ctx, microbatches, visits, allow_swaps=False)
        vpaths, prio, _, evals = improve_routes(ctx, vpaths, skip, t0 + budget_s, rng, priority=None,
                                                max_evals=max_evals)
        paths = [Route(p.origin, p.nodes, tuple(held[s] for s in p.stages)) for p in vpaths]
    result = Plan(stages, skip, dict(allocation), paths, prio, math.nan,
                  {"planner_seconds": time.perf_counter() - t0, "path_evaluations": evals,
                   "held_stages": held, "missing_stages": [s for s in range(stages) if s not in virtual]},
                  route_rule)
    result.predicted_s = simulate(network, model, result, record=False).makespan
    return result


def place_joining(current: Plan, allocation: dict[str, int], joining: Sequence[Node],
                  model: ModelSpec, exclude: Iterable[int] = ()) -> dict[str, int]:
    """``allocation`` with each of ``joining`` given a stage, in order (each placement counts for the
    next): a stage no node of the allocation holds, the lowest such stage that the node's memory can
    hold; else the held stage with the most microbatches per replica in ``current``
    (``Plan.stage_visits``), the lowest on a tie. This is the rule for nodes that join while
    ``plan_held`` plans around missing stages (``replan`` places joined nodes itself). Stages in
    ``exclude`` (dropped for good) are never given. Pure: the given ``allocation`` is not changed."""
    stages = current.stages
    exclude = set(exclude)
    visits = current.stage_visits()
    alloc = dict(allocation)
    for node in joining:
        held = [s for s in range(stages) if s in alloc.values()]
        want = [s for s in range(stages)
                if s not in held and s not in exclude and node.can_hold(s, model, stages)]
        if not want:
            want = sorted(held, key=lambda s: -visits[s] / max(1, list(alloc.values()).count(s)))
        if not want:
            raise PlanError(f"joining node {node.name} cannot hold any stage and no node holds one: "
                            "give it more memory, or resume from a checkpoint")
        alloc[node.name] = want[0]
    return alloc


def replan_or_hold(current: Plan, network: Network, model: ModelSpec, *, failed: Sequence[str] = (),
                   slowed_by: dict[str, float] | None = None, joined: Sequence[Node] = (), missing: bool = False,
                   dropped: Iterable[int] = (), skip: float | None = None, budget_s: float = 0.6, seed: int = 0,
                   sync_bytes: Sequence[float] | None = None,
                   max_evals: int | None = None) -> tuple[Plan, Network]:
    """A running training's new plan for its live nodes: ``replan`` while every stage is held (no stage
    ``missing`` from ``current``, none ``dropped`` for good); else, or when ``replan`` cannot hold
    every stage, the allocation that stays (without ``failed``, the ``joined`` nodes placed by
    ``place_joining``) with paths that skip the stages no node holds (``plan_held``, with the run's
    ``skip``, by default ``current``'s). Returns the plan and its network; PlanError when not even
    that can be made. ``failed`` may name nodes that ``network`` does not hold (never started)."""
    known = [n for n in failed if n in network.names]
    if not missing and not set(dropped):
        try:
            return replan(current, network, model, failed=known, slowed_by=slowed_by, joined=joined,
                          budget_s=budget_s, seed=seed, sync_bytes=sync_bytes, max_evals=max_evals)
        except PlanError as exc:
            log.info("re-plan with every stage held failed (%s): paths will skip the lost stages", exc)
    net = network.without(known)
    if slowed_by:
        net = slowed(net, slowed_by)
    if joined:
        net = net.with_nodes(list(net.nodes) + list(joined))
    gone = set(failed)
    alloc = {n: s for n, s in current.allocation.items() if n not in gone}
    alloc = place_joining(current, alloc, joined, model, exclude=dropped)
    return plan_held(net, model, alloc, current.stages, current.skip if skip is None else skip,
                     len(current.paths), budget_s=budget_s, seed=seed, max_evals=max_evals,
                     route_rule=current.route_rule), net
