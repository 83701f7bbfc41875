"""A plan's plain data: which node holds which stage, and one route per microbatch.

The rules a plan keeps (SkipPipe): a microbatch starts and ends at a stage-0 node, visits ``visits`` of
the other stages (``visits_per_microbatch``: ``round((1 - skip) * (stages - 1))``), each at most once,
in increasing stage order except for at most ``MAX_SWAPS`` swaps, each a stage that falls one stage
number behind the furthest stage reached before it (SkipPipe's rule, ``route_rule = "skippipe"``: after
stages 1, 3 the route may visit 2, not 1; (2, 1, 4, 3) is allowed, (3, 1, 2) and (5, 1, 4) are not). A
plan made under the looser rule ``"inversions"`` (asked for by name: ``plan(route_rule="inversions")``,
``pipeline plan --route-rule inversions``) may instead have any visited stage sequence with at most
``MAX_SWAPS`` inversions, whatever the distance (so (3, 1, 2) and (5, 1, 4) too); every route of
SkipPipe's rule keeps it (each of its swaps is one inversion). Every stage besides 0 is visited by
``microbatches * visits / (stages - 1)`` microbatches, give or take one (``stage_quotas``; load balance
keeps training unbiased). ``validate`` names every rule a plan breaks.

This module holds no search: the simulator, the stage processes and the trainer read plans through it
without importing the planner (``planner``, ``routes``, ``baselines``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from .costs import ModelSpec
from ..errors import PlanError
from .network import Network

#: the most swaps a route may make (SkipPipe's rule: stages one behind the furthest reached; the
#: "inversions" rule: inversions of its stage sequence).
MAX_SWAPS = 2
#: the route rules a plan can be made under (see the module's text); the first is the default.
ROUTE_RULES = ("skippipe", "inversions")
DEFAULT_ROUTE_RULE = "skippipe"


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


@dataclass(frozen=True)
class Route:
    """One microbatch's route: its stage-0 origin, then the nodes it visits and their stages, in order."""

    origin: str
    nodes: tuple[str, ...]
    stages: tuple[int, ...]

    @property
    def swaps(self) -> int:
        return inversions(self.stages)


@dataclass
class Plan:
    """An allocation (node -> stage; nodes not in it stay idle) and one route per microbatch
    (``paths``, the name the plan's JSON form keeps). ``priority`` lists microbatch ids from most to
    least urgent for the simulator's tie-breaks."""

    stages: int
    skip: float
    allocation: dict[str, int]
    paths: list[Route]
    priority: list[int] | None = None
    #: the simulator's makespan for this plan when the planner made it, in seconds.
    predicted_s: float = math.nan
    stats: dict = field(default_factory=dict)
    #: the rule its routes keep (``ROUTE_RULES``); a re-plan keeps it.
    route_rule: str = DEFAULT_ROUTE_RULE

    def backward_counts(self) -> dict[str, int]:
        """Backward passes each node runs in one iteration (an origin one per microbatch it sends,
        a node one per visit); nodes of the allocation that no route uses count 0."""
        out = dict.fromkeys(self.allocation, 0)
        for p in self.paths:
            out[p.origin] = out.get(p.origin, 0) + 1
            for n in p.nodes:
                out[n] = out.get(n, 0) + 1
        return out

    def stage_visits(self) -> list[int]:
        """Microbatches that pass each stage in one iteration: every microbatch passes stage 0 (at its
        origin), and stage s > 0 once per route that visits it."""
        counts = [0] * self.stages
        for p in self.paths:
            counts[0] += 1
            for s in p.stages:
                counts[s] += 1
        return counts

    def to_dict(self) -> dict:
        """The plan as JSON-ready data (what ``pipeline plan --json`` and the run summary write)."""
        return {
            "stages": self.stages,
            "skip": self.skip,
            "allocation": dict(sorted(self.allocation.items())),
            "paths": [
                {"microbatch": i, "origin": p.origin, "nodes": list(p.nodes), "stages": list(p.stages)}
                for i, p in enumerate(self.paths)
            ],
            "priority": list(self.priority) if self.priority else list(range(len(self.paths))),
            "route_rule": self.route_rule,
        }


def plan_from_dict(doc: Any) -> Plan:
    """The plan ``Plan.to_dict`` wrote (what ``pipeline plan --json`` writes); PlanError naming the field
    that is missing or of the wrong shape."""
    try:
        alloc = {str(n): int(s) for n, s in doc["allocation"].items()}
        paths = [Route(str(p["origin"]), tuple(str(n) for n in p["nodes"]), tuple(int(s) for s in p["stages"]))
                 for p in doc["paths"]]
        stages, skip = int(doc["stages"]), float(doc["skip"])
        priority = [int(i) for i in doc["priority"]] if doc.get("priority") else None
        rule = check_route_rule(str(doc.get("route_rule", DEFAULT_ROUTE_RULE)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PlanError(f"not a plan as `roving pipeline plan --json` writes it (stages, skip, allocation, "
                        f"paths of origin, nodes and stages): {type(exc).__name__} {exc}") from None
    return Plan(stages, skip, alloc, paths, priority, route_rule=rule)


def inversions(seq: Sequence[int]) -> int:
    """Pairs out of increasing order in ``seq`` (a route's swaps)."""
    return sum(1 for i in range(len(seq)) for j in range(i + 1, len(seq)) if seq[i] > seq[j])


def check_route_rule(rule: str) -> str:
    """``rule`` when it is one of ``ROUTE_RULES``; PlanError naming them otherwise."""
    if rule not in ROUTE_RULES:
        raise PlanError(f"route rule must be one of {', '.join(ROUTE_RULES)}, got {rule!r}")
    return rule


def route_problem(stages: Sequence[int], rule: str = DEFAULT_ROUTE_RULE) -> str | None:
    """What is wrong with a route's visited stage sequence ``stages`` under ``rule`` (None: nothing).
    Only the order is judged here (``validate`` checks the rest)."""
    if check_route_rule(rule) == "inversions":
        n = inversions(stages)
        return f"{n} swaps, at most {MAX_SWAPS} allowed" if n > MAX_SWAPS else None
    furthest, swaps = 0, 0
    for s in stages:
        if s < furthest:
            if furthest - s > 1:
                return (f"stage {s} after stage {furthest}: a stage may fall at most one stage behind the "
                        "furthest reached")
            swaps += 1
        furthest = max(furthest, s)
    return f"{swaps} swaps, at most {MAX_SWAPS} allowed" if swaps > MAX_SWAPS else None


def route_allowed(stages: Sequence[int], rule: str = DEFAULT_ROUTE_RULE) -> bool:
    """Whether a route's visited stage sequence keeps ``rule`` (``route_problem`` finds nothing)."""
    return route_problem(stages, rule) is None


def stage_quotas(microbatches: int, stages: int, visits: int) -> list[int]:
    """Visits each stage gets (index 0 unused): equal shares, differing by at most one."""
    base, extra = divmod(microbatches * visits, stages - 1)
    return [0] + [base + (1 if s <= extra else 0) for s in range(1, stages)]


def validate(plan: Plan, network: Network, visits: int | None = None, model: ModelSpec | None = None) -> list[str]:
    """Every rule a plan breaks, as sentences (empty when valid); a route's order is judged by the
    plan's ``route_rule``. With ``model``, also that every node can hold its stage in its memory."""
    problems = []
    names = set(network.names)
    s_count = plan.stages
    visits = visits_per_microbatch(s_count, plan.skip) if visits is None else visits
    per_stage = [0] * s_count
    if model is not None:
        for n, s in sorted(plan.allocation.items()):
            if n in names and 0 <= s < s_count and not network.node(n).can_hold(s, model, s_count):
                problems.append(f"node {n} cannot hold stage {s} (its memory does not fit the stage's weights "
                                "and one microbatch)")
    for i, p in enumerate(plan.paths):
        where = f"microbatch {i}"
        if p.origin not in names or plan.allocation.get(p.origin) != 0:
            problems.append(f"{where}: origin {p.origin} is not a live stage-0 node")
        if len(p.nodes) != len(p.stages) or len(p.stages) != visits:
            problems.append(f"{where}: visits {len(p.stages)} stages, expected {visits}")
        if len(set(p.stages)) != len(p.stages) or 0 in p.stages:
            problems.append(f"{where}: visits a stage twice or revisits stage 0")
        wrong = route_problem(p.stages, plan.route_rule)
        if wrong is not None:
            problems.append(f"{where}: {wrong} (route rule {plan.route_rule})")
        for n, s in zip(p.nodes, p.stages):
            if n not in names or plan.allocation.get(n) != s:
                problems.append(f"{where}: node {n} does not hold stage {s}")
            if 0 < s < s_count:
                per_stage[s] += 1
    if plan.paths and max(per_stage[1:]) - min(per_stage[1:]) > 1:
        problems.append(f"stage loads {per_stage[1:]} differ by more than one microbatch")
    return problems
