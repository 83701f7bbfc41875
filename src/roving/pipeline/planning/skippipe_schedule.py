"""SkipPipe's ``schedule.json``, read as a roving plan, so that its plans are simulated and trained here.

The file its planner writes (and the one its repository ships) is a JSON object; the fields read:

- ``locations``: each node's region, node ``i`` being the i-th entry (roving names it ``n{i:02d}``);
- ``partitions``: the stages, each a list of node numbers (stage 0 first: the origins);
- ``memory``: microbatches a node holds in flight;
- ``ours-sends``: microbatches each stage-0 node sends an iteration;
- the routes, one field a variant (``VARIANTS``): an object whose values are routes, each an object
  node -> the node it sends to next, from the origin on (``{"0": 14, "14": 6, "6": 12}``: origin 0, then
  14, 6 and 12, and back to 0). With one route per origin (keys ``0`` .. origins-1, in the order of
  ``partitions[0]``) every microbatch of an origin takes it; with ``memory`` routes per origin,
  microbatch ``j`` of origin ``o`` takes route ``o * memory + j % memory`` (as SkipPipe's trainer reads
  them).

Its other fields (its cost matrix ``delays``, its simulator's times) are not read: roving's network and
simulator judge the plan. Whatever does not fit raises PlanError naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .network import Network, build_network
from .plan import Plan, Route, route_allowed, visits_per_microbatch

#: the route variants a schedule holds: name -> its field ("ca": SkipPipe's collision-aware routes).
VARIANTS = {"ca": "ca-paths", "non-ca": "non-ca-paths", "random": "random-paths"}


@dataclass(frozen=True)
class SkipPipeSchedule:
    """What roving reads of a ``schedule.json`` (the module doc): node ``i``'s region ``locations[i]``,
    the stages' node numbers, the memory, each origin's microbatches (``sends``) and, for each variant
    present, its routes as node numbers (origin first)."""

    locations: tuple[str, ...]
    partitions: tuple[tuple[int, ...], ...]
    memory: int
    sends: int
    routes: dict[str, tuple[tuple[int, ...], ...]]

    @property
    def microbatches(self) -> int:
        return self.sends * len(self.partitions[0])


def _need(cond: bool, field: str, what: str) -> None:
    if not cond:
        raise PlanError(f"schedule.json: {field} {what}")


def _count(doc: dict, field: str) -> int:
    v = doc.get(field)
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer() and v >= 1,
          field, f"must be a whole number >= 1, got {v!r}")
    return int(v)  # type: ignore[arg-type]  # checked just above


def read_schedule(source: str | Path | Any) -> SkipPipeSchedule:
    """A schedule from a ``schedule.json`` path or its parsed JSON; PlanError naming the field (or the
    file) that is missing or of the wrong shape."""
    doc: Any = source
    if isinstance(source, (str, Path)):
        try:
            doc = json.loads(Path(source).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"cannot read SkipPipe schedule {source}: {exc}") from None
    _need(isinstance(doc, dict), "the file", "must be a JSON object")
    locations = doc.get("locations")
    _need(isinstance(locations, list) and bool(locations) and all(isinstance(r, str) for r in locations),
          "locations", "must be a list of region names, one a node")
    parts = doc.get("partitions")
    _need(isinstance(parts, list) and len(parts) >= 2 and all(isinstance(p, list) and p for p in parts),
          "partitions", "must be a list of at least 2 stages, each a non-empty list of node numbers")
    seen: dict[int, int] = {}
    for s, p in enumerate(parts):
        for k, n in enumerate(p):
            _need(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < len(locations),
                  f"partitions[{s}][{k}]", f"must be a node number below {len(locations)} (locations' "
                  f"length), got {n!r}")
            _need(n not in seen, f"partitions[{s}][{k}]", f"puts node {n} in stage {s}, but it is in stage "
                  f"{seen.get(n)} already")
            seen[n] = s
    memory, sends = _count(doc, "memory"), _count(doc, "ours-sends")
    routes = {v: _routes(doc[f], f, parts, seen, memory) for v, f in VARIANTS.items() if f in doc}
    _need(bool(routes), "the routes", f"are missing: give at least one of {', '.join(VARIANTS.values())}")
    return SkipPipeSchedule(tuple(locations), tuple(tuple(p) for p in parts), memory, sends, routes)


def _routes(raw: Any, field: str, parts: list, stage_of: dict[int, int], memory: int) -> tuple:
    """The routes of one variant's field, as node numbers from the origin on, in key order."""
    origins = parts[0]
    _need(isinstance(raw, dict) and len(raw) in (len(origins), len(origins) * memory), field,
          f"must be an object of {len(origins)} routes (one an origin) or {len(origins) * memory} "
          f"(memory {memory} an origin), got {len(raw) if isinstance(raw, dict) else type(raw).__name__}")
    per = len(raw) // len(origins)
    out = []
    for i in range(len(raw)):
        where = f"{field}[{i}]"
        hops = raw.get(str(i))
        _need(isinstance(hops, dict) and bool(hops), where, "must be an object node -> next node")
        try:
            nxt = {int(k): int(v) for k, v in hops.items()}
        except (TypeError, ValueError):
            raise PlanError(f"schedule.json: {where} must map node numbers to node numbers") from None
        origin = origins[i // per]
        _need(origin in nxt, where, f"must start at node {origin} (partitions[0][{i // per}])")
        seq, node = [origin], origin
        while node in nxt:
            node = nxt[node]
            _need(node not in seq, where, f"visits node {node} twice")
            _need(node in stage_of and stage_of[node] > 0, where, f"sends to node {node}, which holds "
                  f"{'no stage' if node not in stage_of else 'stage 0'}")
            seq.append(node)
        _need(len(seq) == len(nxt) + 1, where, "has hops that do not follow on from its origin")
        out.append(tuple(seq))
    return tuple(out)


def schedule_network(schedule: SkipPipeSchedule, network: str | dict = "gcp12", speed: float | None = None) -> Network:
    """The schedule's nodes on ``network`` (a preset, file or dict): node ``i`` is ``n{i:02d}`` in region
    ``locations[i]``, holding ``memory`` microbatches in flight, of ``speed`` (seconds per sample per layer;
    None: the network's default). PlanError naming the location that is not one of the network's regions."""
    base = build_network(network, 1)
    regions = {r for pair in base.links for r in pair} | {base.nodes[0].region}
    for i, r in enumerate(schedule.locations):
        _need(r in regions, f"locations[{i}]", f"is region {r!r}, which network {base.name} does not have "
              f"(it has {', '.join(sorted(regions))})")
    # round-robin over the locations themselves puts node i in locations[i]
    return build_network(network, len(schedule.locations), memory=schedule.memory,
                         regions=list(schedule.locations), **({"speed": speed} if speed is not None else {}))


def schedule_plan(schedule: SkipPipeSchedule, network: Network, variant: str = "ca") -> Plan:
    """The schedule's allocation and the routes of ``variant`` (``VARIANTS``) as a plan on ``network``
    (``schedule_network``'s, or one with the same node names): every origin's ``sends`` microbatches,
    in origin order. Its skip is the one whose visits the routes make; its route rule SkipPipe's where
    every route keeps it, else "inversions". PlanError when the variant is missing, a node is not in the
    network, or the routes do not all visit the same number of stages."""
    field = VARIANTS.get(variant)
    _need(field is not None, "variant", f"{variant!r} is not one of {', '.join(VARIANTS)}")
    _need(variant in schedule.routes, str(field), "is missing from the schedule")
    name = {i: f"n{i:02d}" for i in range(len(schedule.locations))}
    names = set(network.names)
    alloc = {}
    for s, p in enumerate(schedule.partitions):
        for n in p:
            _need(name[n] in names, f"partitions[{s}]", f"names node {n}, but the network has no node "
                  f"{name[n]} ({len(network.nodes)} nodes)")
            alloc[name[n]] = s
    stages = len(schedule.partitions)
    routes = schedule.routes[variant]
    lengths = {len(r) - 1 for r in routes}
    _need(len(lengths) == 1, str(field), f"routes visit different numbers of stages ({sorted(lengths)}); "
          "a plan's routes all visit the same number")
    visits = lengths.pop()
    skip = round(1.0 - visits / (stages - 1), 9)
    if visits_per_microbatch(stages, skip) != visits:  # a rounding edge: nudge into the visit count's band
        skip = round(1.0 - (visits - 0.25) / (stages - 1), 9)
    per = len(routes) // len(schedule.partitions[0])
    paths = []
    for o in range(len(schedule.partitions[0])):
        for j in range(schedule.sends):
            seq = routes[o * per + (j % per if per > 1 else 0)]
            nodes = tuple(name[n] for n in seq[1:])
            paths.append(Route(name[seq[0]], nodes, tuple(alloc[n] for n in nodes)))
    rule = "skippipe" if all(route_allowed(p.stages, "skippipe") for p in paths) else "inversions"
    return Plan(stages, skip, alloc, paths, None, math.nan, {"imported": str(field)}, rule)
