"""Which computations are checked, and their rechecks (``verifier``, the module doc: Which computations,
2.): each drawn as it is done (``decide``: all in mode "full", ``verify_rate`` in "spot", at least
``SUSPECT_RATE`` for a suspect's or an opposed or turned node's), its evidence asked for and judged
(``gather``), then sent to ``verifiers`` replicas of its stage chosen at random to recompute (``recheck``);
their answers (``answered``) go to a confirmation (``confirm``) where one differs."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import protocol as m
from .audit import Audit, Rechecking
from .checks import Check, tensors_of
from .confirm import Confirmations
from .findings import Findings
from .gather import Gather
from .settings import Settings
from .tensor_id import Kind

#: the least chance that a suspect's computation is checked in mode "spot".
SUSPECT_RATE = 0.25


class Sampling:
    """Draws an audit's computations and runs their rechecks."""

    def __init__(self, settings: Settings, findings: Findings, roster: Any, gather: Gather,
                 confirm: Confirmations) -> None:
        self.settings, self.findings, self.roster = settings, findings, roster
        self.gather, self.confirm = gather, confirm
        self._check_id = 0

    def take(self, a: Audit, msg: m.Rechecked) -> None:
        """A verifier's answer to a recheck of ``a`` (once each verifier asked; another's is ignored)."""
        r = a.rechecks.get(msg.check)
        if r is not None and msg.sender in r.answers and r.answers[msg.sender] is None:
            self.answered(a, r, msg.sender, msg.difference)

    def decide(self, a: Audit, checks: list[Check]) -> None:
        """Draw each of ``checks`` not drawn for yet; examine those drawn."""
        drawn = []
        for c in checks:
            if c.claimed.key not in a.decided:
                a.decided[c.claimed.key] = rate = self.rate(a, c)
                if self.settings.rng.random() < rate:
                    drawn.append(c)
        self.examine(a, drawn)

    def rate(self, a: Audit, c: Check) -> float:
        """The chance that ``c`` is checked: all in mode "full", none in "screen"; in "spot"
        ``verify_rate``, and at least ``SUSPECT_RATE`` for a suspect's, or an opposed node's this round."""
        if self.settings.mode != "spot":
            return 1.0 if self.settings.mode == "full" else 0.0
        flagged = c.node in self.findings.suspects or c.node in a.opposed or c.node in a.turned
        return max(self.settings.rate, SUSPECT_RATE) if flagged else self.settings.rate

    def redraw(self, a: Audit, c: Check) -> bool:
        """The round's end draw of ``c``, not drawn so far: at its rate if it was not decided yet; if it was,
        at a lower rate than its node has now (named a suspect, or opposed, at the round's end), with the
        chance that makes up the difference: so a suspect's computations of the round that named it are
        checked at the suspect's rate too (``before + (1 - before) * extra == rate``)."""
        rate, before = self.rate(a, c), a.decided.get(c.claimed.key)
        if before is None:
            return self.settings.rng.random() < rate
        return rate > before and self.settings.rng.random() < (rate - before) / (1.0 - before)

    def examine(self, a: Audit, checks: list[Check]) -> None:
        """Check each of ``checks`` (of nodes not caught): their evidence asked for, then judged."""
        checks = [c for c in checks if c.node not in a.caught]
        if not checks:
            return
        a.drawn.update(c.claimed.key for c in checks)
        wanted: dict[str, set] = {}
        for c in checks:
            for src in c.sources():
                if src.holder:
                    wanted.setdefault(src.holder, set()).add(src.key)
        self.gather.ask(a, wanted, lambda shown: self._judge(a, checks, shown))

    def _judge(self, a: Audit, checks: list[Check], shown: dict[str, dict]) -> None:
        """Each check's evidence, then (modes "spot" and "full") its recheck; in mode "screen", non-finite
        values computed from finite inputs are their sender's fault."""
        for c in checks:
            if c.node in a.caught:
                continue
            tensors = self.gather.evidence(c, shown, a.caught)
            if tensors is None:
                continue
            claimed, inputs = tensors
            if self.settings.mode == "screen":
                if _non_finite_from_finite(c.kind, claimed, inputs):
                    self.findings.catch(a.caught, c.node, "non-finite", c,
                                        reason="sent non-finite values computed from finite inputs")
                continue
            self._recheck(a, c, claimed, inputs)

    def _recheck(self, a: Audit, c: Check, claimed: Any, inputs: dict) -> None:
        """Have ``verifiers`` replicas of ``c``'s stage (as many as it has others; one for a share),
        chosen at random, recompute it; with none, the coordinator does (a confirmation)."""
        others = [n for n, s in a.alloc.items() if s == c.stage and n != c.node and n in self.roster.inboxes
                  and n not in a.caught]
        if not others:
            self.confirm.request(a, Rechecking(c, claimed, inputs))
            return
        count = 1 if c.kind == Kind.SHARE else self.settings.verifiers
        chosen = self.settings.rng.sample(sorted(others), min(count, len(others)))
        self._check_id += 1
        a.rechecks[self._check_id] = Rechecking(c, claimed, inputs, {v: None for v in chosen})
        for v in chosen:
            a.sent_rechecks += 1
            self.roster.put(v, m.Recheck(a.rnd, self._check_id, c.stage, c.kind, inputs, claimed))

    def answered(self, a: Audit, r: Rechecking, verifier: str, d: Any) -> None:
        """``verifier``'s answer ``d`` to ``r``: a difference above the tolerance has the coordinator
        confirm it (once a recheck), every answer is held to the confirmation once there is one; an
        answer that is not a difference has its sender caught (only it could have sent it)."""
        if isinstance(d, bool) or not isinstance(d, (int, float)):
            r.answers[verifier] = math.nan
            self.findings.catch(a.caught, verifier, "report", r.check,
                                reason=f"answered a recheck of {r.check.node}'s {r.check.kind} with "
                                f"{type(d).__name__}, not a difference")
            return
        r.answers[verifier] = float(d)
        if d <= self.settings.tolerance:
            self.findings.totals["max_difference"] = max(self.findings.totals["max_difference"], d)
        if r.confirmed is not None:
            self.confirm.hold(a, r, verifier)
        elif r.confirming:
            return
        elif not d <= self.settings.tolerance:
            r.mismatch = verifier
            self.confirm.request(a, r)
        elif None not in r.answers.values() and self.settings.rng.random() < self.confirm.rate(a, r.check):
            self.confirm.request(a, r)  # every verifier passed it: confirmed anyway, drawn after their answers


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _non_finite_from_finite(kind: Kind, claimed: Any, inputs: dict) -> bool:
    """Whether a computation's output is non-finite although what it was computed from is finite (its
    maker's fault, in mode "screen"). A visit's two outputs are judged apart, each against what it
    depends on: its forward output against ``x`` alone, its backward output against ``x`` and ``g``.
    Judged together, a node whose forward output was made NaN was excused by the NaN gradient that came
    back for it (the loss of a NaN activation is NaN): nobody was caught, the NaN reached the step, and
    in the next round honest nodes, their weights NaN by then, were blamed."""
    if kind == Kind.VISIT:
        forward, backward = claimed
        return (not _all_finite([forward]) and _all_finite([inputs["x"]])) or (
            not _all_finite([backward]) and _all_finite([inputs["x"], inputs["g"]]))
    outputs = list(claimed) if isinstance(claimed, tuple) else [claimed]
    return not _all_finite(outputs) and _all_finite(tensors_of(inputs))

