"""One round of training's messages: the microbatches sent to their origins, the replicas' averaging
orders, the losses, gradient norms and steps that come back through the control inbox's ``Dispatch``.

``Rounds`` is the part of ``trainer.Trainer`` that sends a round and reads its replies; what it reads
(``_losses``, ``_norms``, ``_norm_from``, ``_stepped``) is the round's alone and reset when the next
begins. The plan it sends along is the plan in use (``replanning.Replanning``).
"""
from __future__ import annotations

import math
from typing import Callable, Collection, Iterator

from .. import protocol as m
from ..dispatch import Dispatch
from ..errors import NodesLost, NoMessage, RoundStalled
from ..planning.plan import Plan
from ..planning.simulate import Prediction
from ..runtime.recovery import StageRecovery
from ..runtime.roster import Roster
from ..verify.verifier import Verifier
from .runspec import TrainConfig


class Rounds:
    """Sends a round's microbatches, orders its averaging and steps, and reads what the nodes answer."""

    config: TrainConfig
    roster: Roster
    dispatch: Dispatch
    verifier: Verifier
    recovery: StageRecovery
    plan: Plan
    prediction: Prediction
    alloc: dict[str, int]
    replicas: dict[int, list[str]]
    stage_counts: list[int]
    #: the latest round sent (``run_microbatches``)
    round: int
    _batches: Iterator[tuple]
    _done_mbs: Collection[int]  # the microbatches of the round in flight that are done
    _sync_round: int | None  # the round whose averaging orders went out
    _norms: dict[int, float]  # stage -> squared gradient norm, this round
    _norm_from: set[str]
    _losses: dict[int, float]  # microbatch -> its loss, this round
    _stepped: dict[str, m.Stepped]  # name -> its Stepped, this step

    def run_microbatches(self, rnd: int, batches: list | None = None) -> list[float]:
        """Send every microbatch of the plan to its origin, and every node its averaging order; wait
        until all microbatches are done; their losses. A stage's replicas average their gradients as
        soon as each has run its last backward pass of the round, while other stages still work; the
        norms that arrive meanwhile are kept for ``synchronize``."""
        self.round = max(self.round, rnd)
        plan = self.plan
        order = plan.priority or list(range(len(plan.paths)))
        if batches is None:
            batches = [next(self._batches) for _ in plan.paths]
        verifier = self.verifier
        verifier.begin(rnd, plan, self.alloc, batches)
        for mb in order:
            path = plan.paths[mb]
            tokens, targets = batches[mb]
            self.roster.put(path.origin, m.Microbatch(rnd, mb, tokens, targets, path))
        self._losses = {}
        self._order_sync(rnd, plan.backward_counts())
        self._done_mbs = self._losses.keys()  # what a stalled round's accounts are read against (``stalls``)
        self._read_round(lambda: len(self._losses) >= len(plan.paths), rnd)
        return [self._losses[mb] for mb in range(len(plan.paths))]

    def _take_done(self, msg: m.Message) -> None:
        assert isinstance(msg, m.Done)
        self._losses[msg.mb] = msg.loss
        self.verifier.finished(msg.round, msg.mb)  # its computations' checks start while the others run

    def _take_norm(self, msg: m.Message) -> None:
        assert isinstance(msg, m.Norm)
        self._norms.setdefault(msg.stage, msg.sq_norm)
        self._norm_from.add(msg.sender)
        self.verifier.note(msg)

    def _read_round(self, done: Callable[[], bool], rnd: int) -> None:
        """Dispatch round ``rnd``'s messages until ``done()``; raises RoundStalled after ``stall_after``
        seconds (at least twice the predicted iteration) without one; dead nodes raise NodesLost first
        (they are checked every 0.1 s meanwhile)."""
        if not self.config.stall_after:
            self.dispatch.until(done, rnd)
            return
        # Never shorter than twice the round the plan predicts here: a slow round is not a stalled one.
        here = self.prediction.here_s
        predicted = here if math.isfinite(here) else 0.0
        try:
            self.dispatch.until(done, rnd, timeout=max(self.config.stall_after, 2 * predicted))
        except NoMessage as exc:
            raise RoundStalled(str(exc)) from None

    def _order_sync(self, rnd: int, expect: dict[str, int] | None) -> None:
        self._sync_round, self._norms, self._norm_from = rnd, {}, set()
        combined = {s: self.verifier.combined_asked(rnd, r) for s, r in self.replicas.items() if r}
        for name, s in self.alloc.items():
            self.roster.put(name, m.SyncOrder(rnd, self.replicas[s], self.stage_counts[s],
                                              None if expect is None else expect.get(name, 0), combined[s]))

    def synchronize(self, rnd: int) -> float:
        """Replicas average their gradients over the microbatches their stage processed; returns the
        whole model's gradient norm (waits for the stages still averaging)."""
        if self._sync_round != rnd:
            self._order_sync(rnd, None)
        self._read_round(lambda: set(self.alloc) <= self._norm_from, rnd)
        return math.sqrt(sum(self._norms.values()))

    def step(self, rnd: int, coef: float, lr: float) -> dict[str, dict]:
        """Every node scales its gradients by ``coef`` and steps; returns each node's statistics. A
        node that dies now is not waited for (the others step all the same); the plan is remade at
        the next boundary. With verification on, the replicas' weights are compared (``Verifier.stepped``)
        before anything reads them: a replica caught stepping to other weights is excluded now, and
        planned around at the next boundary, as a node lost."""
        for name in self.roster.inboxes:
            self.roster.put(name, m.Step(rnd, coef, self.recovery.lr(self.roster.holding.get(name), lr)))
        self._stepped = {}
        while set(self.roster.inboxes) - set(self._stepped):
            try:
                self.dispatch.until(lambda: set(self.roster.inboxes) <= set(self._stepped), rnd)
            except NodesLost:
                pass  # _drop recorded them for the next boundary
        got = self._stepped
        caught = self.verifier.stepped(rnd, self.alloc, {n: s.weights for n, s in got.items()},
                                       {n: s.platform for n, s in got.items()})
        if caught:
            self.roster.exclude(caught)
        return {n: s.stats for n, s in got.items()}

    def _take_stepped(self, msg: m.Message) -> None:
        assert isinstance(msg, m.Stepped)
        self._stepped[msg.sender] = msg
        self.recovery.observe(self.roster.holding.get(msg.sender), msg.grad_norm)

