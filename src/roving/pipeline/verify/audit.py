"""One round's audit while it runs (``Verifier.begin`` to ``Verifier.audit``): its computations, which were
drawn, and what is on its way (evidence asked for, rechecks, confirmations waiting for weights)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .. import protocol as m
from .checks import Check
from .tensor_id import TensorId


@dataclass
class Ask:
    """One request for evidence: the holders still to answer, what those that did showed, and what is
    done with it once every holder has answered (``then``)."""

    waiting: set[str]
    then: Callable[[dict[str, dict]], None]
    shown: dict[str, dict] = field(default_factory=dict)


@dataclass
class Rechecking:
    """A computation sent to its verifiers to recompute (none: the stage had no other replica, and the
    coordinator recomputes it at once): what each answered (``answers``: verifier -> its difference,
    None until it answers) and, once the coordinator recomputed it, its own difference (``confirmed``),
    which every answer is then held to. A confirmation waits for the weights of the node and of each
    verifier (``needs``)."""

    check: Check
    claimed: Any
    inputs: dict
    answers: dict[str, float | None] = field(default_factory=dict)
    confirming: bool = False  # the coordinator recomputes it (or did)
    mismatch: str | None = None  # the verifier whose mismatch had it do so (None: no verifier, or drawn)
    confirmed: float | None = None

    def needs(self) -> list[str]:
        return [self.check.node, *self.answers]


@dataclass
class Audit:
    """An audit of one round while it runs (``Verifier.begin`` to ``Verifier.audit``): its computations
    (a microbatch's by its number, a share's by its node), which were drawn, and what is on its way."""

    rnd: int
    plan: Any
    alloc: dict[str, int]
    by_mb: dict[int, list[Check]]
    shares: dict[str, Check]
    loads: dict[str, int] = field(default_factory=dict)  # node -> the microbatches it runs the backward of
    decided: dict[TensorId | None, float] = field(default_factory=dict)  # claimed -> the chance it was drawn with
    drawn: set[TensorId | None] = field(default_factory=set)  # those checked
    norms: list[m.Norm] = field(default_factory=list)
    flagged: set[TensorId | None] = field(default_factory=set)  # tensors screening found bad at once
    cosines: dict[str, list[float]] = field(default_factory=dict)  # node -> its share's cosines, as reported
    opposed: set[str] = field(default_factory=set)  # nodes whose share pointed away from its replicas'
    turned: set[str] = field(default_factory=set)  # nodes whose outputs' profile turned from their own
    caught: dict[str, str] = field(default_factory=dict)
    asks: dict[int, Ask] = field(default_factory=dict)  # unanswered evidence requests by number
    rechecks: dict[int, Rechecking] = field(default_factory=dict)  # by number
    confirming: list[Rechecking] = field(default_factory=list)  # confirmations waiting for weights
    weights: dict[str, tuple[int, dict]] = field(default_factory=dict)  # name -> (stage, state dict)
    weights_asked: set[str] = field(default_factory=set)
    loaded: dict[int, str] = field(default_factory=dict)  # stage -> whose weights its module holds this audit
    combined: set[tuple] = field(default_factory=set)  # the stages' replicas asked for a combined digest
    sent_rechecks: int = 0
    confirmations: int = 0
    overlapped: float = 0.0  # seconds of the audit's own work while the round ran
    cpu: float = 0.0  # the coordinator's CPU seconds of the audit's own work (its thread's)
    ending: bool = False  # the round's end (``Verifier.audit``) has begun

    def awaited(self) -> set[str]:
        """The nodes an answer is awaited from."""
        names = {v for r in self.rechecks.values() for v, d in r.answers.items() if d is None}
        names |= self.weights_asked - set(self.weights)
        for a in self.asks.values():
            names |= a.waiting
        return names

    def every(self) -> list[Check]:
        return [c for checks in self.by_mb.values() for c in checks] + list(self.shares.values())

