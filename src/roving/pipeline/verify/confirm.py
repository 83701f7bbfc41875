"""Confirmations (``verifier``, the module doc, 3.): the coordinator recomputes a check itself, with the
weights the node shows (which must be those it reported after its latest step), where a verifier found a
difference above the tolerance, or drawn where every verifier passed it (always for a node opposed or
turned in the round); then every verifier's answer is held to it: a "false mismatch" frames the node, a
"false match" passes a wrong computation (an accomplice), either caught."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import protocol as m
from . import receipts
from .audit import Audit, Rechecking
from .checks import Check, what_differs
from .evidence import difference, recompute
from .findings import Findings, finite
from .settings import Settings
from .tensor_id import Kind
from ..stages import Stage


class Confirmations:
    """The coordinator's own recomputations of an audit's rechecks, and the answers held to them. ``held``:
    what each node reported holding after its latest step (``replicas.Replicas.held``), name -> (stage,
    digest)."""

    def __init__(self, settings: Settings, findings: Findings, roster: Any, model: Any,
                 held: dict[str, tuple[int, bytes]]) -> None:
        self.settings, self.findings, self.roster, self.model, self.held = settings, findings, roster, model, held
        self.device = torch.device("cpu")
        self._modules: dict[int, Stage] = {}  # one a stage, built once a run, loaded with the weights to confirm

    def take(self, a: Audit, msg: m.WeightsShown) -> None:
        """A node's weights, shown for ``a``'s confirmations (once each, and only where they were asked)."""
        if msg.sender in a.weights_asked and msg.sender not in a.weights:
            a.weights[msg.sender] = (msg.stage, msg.tensors)

    def rate(self, a: Audit, c: Check) -> float:
        """The chance that a recheck of ``c`` that every verifier passed is confirmed all the same:
        ``confirm_rate``, and 1 for a node opposed or turned this round (its verifiers may be all of its
        stage's other replicas, in league with it)."""
        return 1.0 if c.node in a.opposed or c.node in a.turned else self.settings.confirm_rate

    def flagged(self, a: Audit) -> None:
        """The round's end: the rechecks that every verifier passed before their node was found opposed or
        turned (at the round's end) are confirmed now, as those answered after it are (``rate``)."""
        for r in list(a.rechecks.values()):
            if (r.check.node in a.opposed or r.check.node in a.turned) and not r.confirming and \
                    r.answers and None not in r.answers.values():
                self.request(a, r)

    def request(self, a: Audit, k: Rechecking) -> None:
        """``k`` waits for the weights it needs (asked for once an audit: they do not change before the
        step)."""
        k.confirming = True
        a.confirming.append(k)
        for n in k.needs():
            if n not in a.weights_asked:
                a.weights_asked.add(n)
                self.roster.put(n, m.ShowWeights(a.rnd))

    def ready(self, a: Audit) -> None:
        """Run the confirmations whose weights came (a verifier caught meanwhile is not waited for). One of
        a node caught meanwhile still runs where verifiers answered it: their answers are held to it (an
        accomplice is not let off because its colluder was caught by another check first)."""
        waiting = []
        for k in list(a.confirming):
            node = k.check.node
            if node in a.caught and not k.answers:
                continue
            if node in a.weights and all(n in a.weights or n in a.caught for n in k.answers):
                a.confirmations += 1
                self.confirm(a, k)
            else:
                waiting.append(k)
        a.confirming = waiting

    def confirm(self, a: Audit, r: Rechecking) -> None:
        """The coordinator recomputes ``r`` itself, with the weights the node shows (those it reported
        after its latest step, or it is caught for them): its own difference above ``tolerance`` has the
        node caught. Then each verifier's answer is held to it (``hold``)."""
        c = r.check
        mine = a.weights[c.node]
        if mine[0] != c.stage:
            self.findings.catch(a.caught, c.node, c.kind, c, reason=f"did not show its weights of stage {c.stage}")
            return
        moved = set()  # those that show other weights than they reported: nothing is judged by them
        for n in (n for n in r.needs() if n in a.weights):
            held = self.held.get(n)
            if held is not None and held[0] == c.stage and a.weights[n][0] == c.stage and \
                    receipts.weights_digest(a.weights[n][1]) != held[1]:
                moved.add(n)
                self.findings.catch(a.caught, n, "weights", c, reason=f"showed other weights of stage {c.stage} than "
                            "it reported after its latest step")
        if c.node in moved:
            return
        stage = self._modules.get(c.stage)
        if stage is None:  # built once a run (building initialises every weight); loaded once a node an audit
            stage = Stage(self.model, c.stage, self.settings.stages, seed=self.settings.seed).to(self.device)
            self._modules[c.stage] = stage
        if a.loaded.get(c.stage) != c.node:  # recompute leaves the weights as loaded
            stage.load_state_dict(mine[1])
            a.loaded[c.stage] = c.node
        want = recompute(stage, c.kind, r.inputs, self.device, self.settings.bf16)
        own = r.confirmed = difference(r.claimed, want)
        if own > self.settings.tolerance:
            what = "share of the round" if c.kind == Kind.SHARE else \
                f"{what_differs(c, r.claimed, want, self.settings.tolerance)} of microbatch {c.mb}"
            verb = "differ" if " and " in what else "differs"
            reported = r.answers[r.mismatch] if r.mismatch else None
            self.findings.catch(a.caught, c.node, c.kind, c, reason=f"its {what} {verb} from the recomputation by "
                        f"{own:.3g} (tolerance {self.settings.tolerance:g})", verifier=r.mismatch or "coordinator",
                        difference=finite(reported) if reported is not None else None,
                        confirmed_difference=finite(own), tolerance=self.settings.tolerance)
        for v in r.answers:
            self.hold(a, r, v)

    def hold(self, a: Audit, r: Rechecking, verifier: str) -> None:
        """Hold ``verifier``'s answer to ``r`` (if any yet) to the coordinator's own recomputation: with the
        same weights as the node's, an honest verifier's difference ``d`` is within the tolerance ``t`` of
        the coordinator's ``own`` (both recomputations are within ``t`` of each other, relatively: so ``d
        >= (own - t) / (1 + t)``). A mismatch reported where ``own`` is within the tolerance is a "false
        mismatch" (framing the node); a match reported where ``own`` is beyond that bound a "false match"
        (passing a wrong computation: an accomplice). A verifier whose weights differ from the node's is
        a dispute (either may have stepped wrong: the weights check is for that); NaN (it could not
        recompute) is not judged."""
        c, d, own = r.check, r.answers.get(verifier), r.confirmed
        if d is None or own is None or math.isnan(d) or verifier in a.caught or c.node not in a.weights:
            return
        t = self.settings.tolerance
        false_mismatch = d > t and own <= t
        false_match = d <= t and not own <= t and d < (own - t) / (1 + t)
        if not (false_mismatch or false_match):
            return
        # (its weights came before the confirmation ran, which waited for every verifier not caught)
        if not equal_weights(a.weights[c.node][1], a.weights[verifier][1]):
            self.findings.dispute([c.node, verifier], "the weights of two replicas of a stage differ", **c.describe())
            return
        evidence = {"verifier": verifier, "difference": d, "confirmed_difference": finite(own), "tolerance": t}
        if false_mismatch:
            self.findings.catch(a.caught, verifier, "false mismatch", c, reason=f"reported that {c.node}'s {c.kind} "
                        f"differs by {d:.3g}; the coordinator's recomputation differs by {own:.3g}", **evidence)
        else:
            self.findings.catch(a.caught, verifier, "false match", c, reason=f"reported that {c.node}'s {c.kind} "
                        f"matches (difference {d:.3g}); the coordinator's recomputation differs by {own:.3g}",
                        **evidence)

def equal_weights(a: dict, b: dict) -> bool:
    """Whether two state dicts hold bitwise equal tensors by the same names."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
