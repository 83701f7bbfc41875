"""What an audit checks (``verifier``, the module doc): the computations of a round whose outputs another
process received (``round_checks``), each a ``Check`` of the tensors it needs (``Source``: a kept tensor of
a holder, or the coordinator's own value)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from .evidence import difference
from .tensor_id import Kind, TensorId


@dataclass(frozen=True)
class Source:
    """Where a check's tensor comes from: the kept tensor ``key`` of node ``holder``, or ``value`` (the
    coordinator's own: tokens, targets)."""

    holder: str = ""
    key: TensorId | None = None
    value: Any = None


@dataclass
class Check:
    """One computation to check: by ``node`` holding ``stage``, of ``kind`` (``evidence.KINDS``; or what
    else a node is held to: ``tensor_id.Kind``), for
    microbatch ``mb`` (-1: a share) at ``hop`` (a visit's: the hop of the activations it received); its
    output ``claimed`` (a visit's forward output; ``also``: its backward output) and its ``inputs`` (by the
    name ``evidence.recompute`` reads; a share's ``visits`` are a list of such dicts)."""

    node: str
    stage: int
    kind: Kind
    mb: int
    hop: int
    claimed: Source
    inputs: dict = field(default_factory=dict)
    visits: list = field(default_factory=list)
    also: Source | None = None

    def outputs(self) -> tuple[Source, ...]:
        """The tensors it sent that the check compares (one; a visit's two)."""
        return (self.claimed,) if self.also is None else (self.claimed, self.also)

    def sources(self) -> Iterable[Source]:
        yield from self.outputs()
        yield from self.inputs.values()
        for v in self.visits:
            yield from v.values()

    def describe(self) -> dict:
        return {"computation": self.kind, "stage": self.stage, "mb": self.mb, "hop": self.hop}




def round_checks(rnd: int, plan: Any, alloc: dict[str, int], batches: list) -> list[Check]:
    """Every computation of round ``rnd`` run on ``plan`` by the nodes of ``alloc`` on ``batches`` whose output
    another process received (``verifier``, the module doc)."""
    out: list[Check] = []
    visits: dict[str, list[dict]] = {}
    for mb, route in enumerate(plan.paths):
        tokens, targets = batches[mb]
        out += route_checks(rnd, mb, route, tokens, targets, visits)
    replicas: dict[int, list[str]] = {}
    for name, stage in sorted(alloc.items()):
        replicas.setdefault(stage, []).append(name)
    for name, stage in sorted(alloc.items()):
        others = [r for r in replicas[stage] if r != name]
        if others:  # a share is sent only to other replicas (zeros by one that ran no microbatch)
            out.append(Check(name, stage, Kind.SHARE, -1, -1, Source(others[0], TensorId(rnd, "share", -1, -1, name)),
                             visits=visits.get(name, [])))
    return out


def route_checks(rnd: int, mb: int, route: Any, tokens: torch.Tensor, targets: torch.Tensor,
                 visits: dict[str, list[dict]]) -> list[Check]:
    """The checks of microbatch ``mb``'s computations along ``route`` in round ``rnd``; adds what each node's share was
    computed from to ``visits`` (node -> its visits' inputs)."""
    o, nodes, n = route.origin, route.nodes, len(route.nodes)
    if not n:
        visits.setdefault(o, []).append({"tokens": Source(value=tokens), "targets": Source(value=targets)})
        return []

    def fwd(h: int) -> TensorId:  # the activations sent at hop h, as their receiver keeps them
        return TensorId(rnd, "activation", mb, h, o if h == 0 else nodes[h - 1])

    def bwd(h: int) -> TensorId:  # the gradients sent at hop h
        return TensorId(rnd, "gradient", mb, h, o if h == n - 1 else nodes[h + 1])

    def at(h: int) -> str:  # who receives hop h
        return nodes[h] if 0 <= h < n else o

    out = [Check(o, 0, Kind.FIRST, mb, 0, Source(at(0), fwd(0)), {"tokens": Source(value=tokens)})]
    for h, x in enumerate(nodes):  # it got fwd(h) and bwd(h); it sent fwd(h + 1) and bwd(h - 1)
        out.append(Check(x, route.stages[h], Kind.VISIT, mb, h, Source(at(h + 1), fwd(h + 1)),
                         {"x": Source(x, fwd(h)), "g": Source(x, bwd(h))}, also=Source(at(h - 1), bwd(h - 1))))
    out.append(Check(o, 0, Kind.LOSS, mb, n - 1, Source(at(n - 1), bwd(n - 1)),
                     {"a": Source(o, fwd(n)), "targets": Source(value=targets)}))
    visits.setdefault(o, []).append({"tokens": Source(value=tokens), "targets": Source(value=targets),
                                     "a": Source(o, fwd(n)), "g": Source(o, bwd(-1))})
    for h, x in enumerate(nodes):
        visits.setdefault(x, []).append({"x": Source(x, fwd(h)), "g": Source(x, bwd(h))})
    return out


def what_differs(c: Check, claimed: Any, want: Any, tolerance: float) -> str:
    """Which of a check's computations differ beyond ``tolerance`` (a visit's forward, backward, or both)."""
    if c.kind != Kind.VISIT or not isinstance(want, tuple):
        return c.kind
    parts = ("forward", "backward")
    bad = [p for p, g, w in zip(parts, claimed if isinstance(claimed, tuple) else (None, None), want)
           if difference(g, w) > tolerance]
    return " and ".join(bad or parts)


def tensors_of(inputs: dict) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in inputs.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, list):
            for d in v:
                out.extend(t for t in d.values() if isinstance(t, torch.Tensor))
    return out

