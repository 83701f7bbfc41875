"""The plan in use and how it changes: re-planning around lost, slow and joining nodes (and stages
killed on purpose, ``kill_stage``), moving weights to the nodes whose stage changed, and taking a plan
refined in the background when it is faster.

``Replanning`` is the part of ``trainer.Trainer`` that owns the plan in use (``plan``, ``prediction``,
``net``, ``alloc``, ``replicas``, ``stage_counts``); the trainer holds the objects it calls (the roster,
weights, recovery policy, verifier and refinement), declared below.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from ..errors import NodeFailed, PlanError
from ..planning.background import Refinement
from ..planning.network import Network
from ..planning.plan import Plan
from ..planning.planner import replan_or_hold
from ..planning.simulate import Prediction, predict
from ..runtime.recovery import StageRecovery
from ..runtime.roster import Roster
from ..runtime.slowness import SlowNodes
from ..runtime.weights import StageWeights, Weights
from ..verify.verifier import Verifier
from ..planning.costs import ModelSpec
from .runspec import Prepared, TrainConfig

log = logging.getLogger(__name__)

#: a plan refined in the background replaces the plan in use only when it predicts a whole iteration
#: at least this much shorter: moving stages between nodes costs a round of weight transfers.
REFINE_GAIN = 0.03


class Replanning:
    """The plan in use, re-planned and refined (``Trainer``'s doc says when)."""

    config: TrainConfig
    prepared: Prepared
    roster: Roster
    weights: Weights
    recovery: StageRecovery
    verifier: Verifier
    refining: Refinement
    _slow: SlowNodes
    shared_cores: int
    spec: ModelSpec
    #: the plan in use, its prediction and the network of its nodes (``_use_plan``)
    plan: Plan
    prediction: Prediction
    net: Network
    #: node -> stage, stage -> its nodes, stage -> microbatches visiting it, under the plan in use
    alloc: dict[str, int]
    replicas: dict[int, list[str]]
    stage_counts: list[int]

    def _event(self, kind: str, **fields: Any) -> None:
        raise NotImplementedError  # the trainer records events

    def _predict(self, plan: Plan, net: Network | None = None) -> Prediction:
        """``simulate.predict`` for ``plan`` on ``net`` (default: the network in use), on this run's
        shared cores and with its replicas' gradient bytes: every prediction of the trainer."""
        return predict(plan, net if net is not None else self.net, self.spec, shared_cores=self.shared_cores,
                       sync_bytes=self.prepared.gradient_bytes)

    def _use_plan(self, new_plan: Plan, prediction: Prediction) -> None:
        """``new_plan`` is the plan in use from now on; ``prediction`` is its ``_predict``."""
        self.plan, self.prediction = new_plan, prediction
        self.alloc = dict(new_plan.allocation)
        self.replicas = {s: sorted(n for n, st in self.alloc.items() if st == s) for s in range(self.config.stages)}
        self.stage_counts = new_plan.stage_visits()

    @property
    def missing_stages(self) -> list[int]:
        """Stages that no node of the plan in use holds (paths skip them)."""
        return [s for s, r in self.replicas.items() if not r]

    def _limit(self, name: str, stage: int) -> int:
        """Microbatches node ``name`` may hold in flight with ``stage`` (its memory)."""
        return max(1, self.net.node(name).in_flight(stage, self.spec, self.config.stages))

    def _replan(self, failed: dict[str, str] | None = None, slowed: dict[str, float] | None = None,
                joined: Sequence[str] = (), why: str = "") -> None:
        """A new plan for the live nodes (``planner.replan_or_hold``); nodes whose stage changes get its
        weights and optimizer state (``_move_weights``). NodeFailed when no plan can be made."""
        failed = dict(failed or {})
        t0 = time.perf_counter()
        joined_nodes = [self.roster.universe[n] for n in joined]
        lost = [s for s, r in self.replicas.items() if r and all(n in failed for n in r)]
        if lost and not self.recovery.skip_lost(lost, self.replicas):
            raise NodeFailed("every node of stage 0 was lost, and stage_recovery = \"skip\" cannot skip it "
                             "(it holds the embedding, head and loss)")
        cfg = self.config
        try:
            new_plan, net = replan_or_hold(
                self.plan, self.net, self.spec, failed=list(failed), slowed_by=slowed, joined=joined_nodes,
                missing=bool(self.missing_stages), dropped=self.recovery.dropped, skip=self.prepared.plan.skip,
                budget_s=cfg.replan_budget, seed=cfg.seed, sync_bytes=self.prepared.plan_sync_bytes,
                max_evals=cfg.replan_evals or None)
        except PlanError as exc:
            raise NodeFailed(f"training cannot go on: {exc}") from None
        prediction = self._predict(new_plan, net)
        self.net = net
        self._use_plan(new_plan, prediction)
        moved, sources = self._move_weights()
        self._event("replan", why=why, failed=sorted(failed), slowed=slowed or {}, joined=list(joined),
                    moved=moved, weights_from=sources, missing_stages=self.missing_stages,
                    predicted_s=prediction.iteration_s, planner_seconds=time.perf_counter() - t0,
                    path_evaluations=new_plan.stats.get("path_evaluations"),
                    allocation=dict(sorted(self.alloc.items())))
        self._start_refining()

    def _move_weights(self) -> tuple[dict[str, int], dict[int, str]]:
        """Nodes whose stage in the plan in use is not the one they hold load it: from a live process
        that holds it (``Weights.gather``), else as the recovery policy rebuilds it, else from the
        latest snapshot (``Weights.move``). Returns the nodes moved (name -> stage) and where each
        stage's weights came from."""
        moved = {n: s for n, s in self.alloc.items() if self.roster.holding.get(n) != s}
        takeover = self.weights.gather(moved, self.alloc)  # (exports checked by what each held until now)
        self.verifier.loaded(moved)
        rebuilt: dict[int, StageWeights] = {}
        for stage, nodes in takeover.orphans.items():
            weights = self.recovery.rebuild(stage, nodes)
            if weights is not None:
                rebuilt[stage] = weights
        return moved, self.weights.move(takeover, rebuilt, self._limit)

    def _start_refining(self) -> None:
        """Search a fresh plan for the live nodes in the background (see the class doc, Refining); a
        refinement still running for an earlier re-plan is stopped."""
        self.refining.cancel()
        cfg = self.config
        if cfg.refine_budget <= 0 or cfg.schedule != "skippipe" or self.missing_stages:
            return
        try:
            self.refining.start(self.net, self.spec, cfg.stages, self.prepared.plan.skip, len(self.plan.paths))
        except Exception as exc:  # no process or no temporary file: training goes on with the re-plan
            log.warning("could not start refining the plan, the plan in use stays: %s", exc)
            self._event("refine", adopted=False, error=f"{type(exc).__name__}: {exc}")

    def _take_refined(self) -> None:
        """At an iteration boundary: the background plan replaces the plan in use if it is done and
        faster by ``REFINE_GAIN``."""
        try:
            new_plan = self.refining.take()
        except (PlanError, RuntimeError) as exc:
            log.warning("refining the plan failed, the plan in use stays: %s", exc)
            self._event("refine", adopted=False, error=f"{type(exc).__name__}: {exc}")
            return
        if new_plan is None:
            return
        # judged as the planner judged it: the whole iteration (refining runs for skippipe, whose plan
        # was searched with the replicas' gradient bytes)
        candidate = self._predict(new_plan)
        now, refined = self.prediction.whole_s, candidate.whole_s
        adopted = refined < now * (1.0 - REFINE_GAIN)
        moved: dict[str, int] = {}
        sources: dict[int, str] = {}
        if adopted:
            self._use_plan(new_plan, candidate)
            moved, sources = self._move_weights()
        self._event("refine", adopted=adopted, iteration_s_before=now, iteration_s_refined=refined,
                    moved=moved, weights_from=sources, predicted_s=self.prediction.iteration_s,
                    planner_seconds=new_plan.stats.get("planner_seconds"),
                    allocation=dict(sorted(self.alloc.items())))

    def _admit(self) -> None:
        """Admit nodes that reported ready, and place them (a re-plan gives them their weights)."""
        joined = self.roster.admit()
        if joined:
            self._replan(joined=joined, why="joined")

    def kill_stage(self, stage: int, timeout: float = 30.0) -> list[str]:
        """Fault injection: kill -9 every process of ``stage``, wait until they are declared dead, and
        re-plan at once (an iteration boundary: the stage is recovered as ``stage_recovery`` says).
        Returns the names killed."""
        names = sorted(n for n in self.replicas.get(stage, []) if n in self.roster.inboxes)
        self._event("injected", stage=stage, nodes=names)
        if not names:
            return names
        self.roster.kill(names)
        try:
            self.roster.wait_declared_dead(names, timeout)
        except NodeFailed as exc:
            raise NodeFailed(f"killed stage {stage}, but {exc}") from None
        self._replan(failed=self.roster.take_lost(), why="failure")
        return names

    def _watch_speed(self, stats: dict[str, dict]) -> None:
        """Mark nodes much slower than the plan expects, and re-plan with their measured speed."""
        if self.config.slow_factor <= 0 or self.missing_stages:
            return
        slow = self._slow.observe(self.prediction.busy_s, {n: s["compute_s"] for n, s in stats.items()})
        if slow:
            self._event("slow", nodes=sorted(slow), factor={n: round(f, 2) for n, f in slow.items()})
            self._replan(slowed=slow, why="slow")

