"""The coordinator of SkipPipe training: starts one roving process per node for a run that
``runspec.prepare`` checked and planned, feeds microbatches along their planned paths, has replicas
average gradients and step, evaluates the whole model on held-out text, checkpoints, and records metrics.

An iteration: every microbatch goes to its origin (a stage-0 node) and travels its path forward, back
to the origin for the loss, and backward along the same path (``stage_process.py``). As soon as a node has run
its last backward pass of the iteration, it sends its summed gradients to the other replicas of its
stage, and each replica averages them over the number of microbatches the stage processed (so a stage
that was skipped by some microbatches is not trained with a smaller step): one stage's averaging
overlaps the other stages' remaining work. When every stage has averaged, the coordinator clips by the
whole model's gradient norm, and every node takes an AdamW step.

Failures, slow nodes, joining, lost stages, resuming and refining: ``Trainer``'s doc.

Predicted seconds come from the planner's simulator with the compute speed measured on this machine
(``calibrate``), so measured and predicted iteration times can be compared: ``predicted_seconds`` is
the microbatch phase (what the planner optimises, as the SkipPipe paper's simulator),
``predicted_with_sync_seconds`` adds the replicas' exchange of gradients (``simulate.predict``).
With the local backend every node shares this machine's cores, and ``predicted_here_seconds`` is the
simulator's figure for the phase on them.

The objects: ``roster.Roster`` (the stage processes, their inboxes and heartbeats, joining; it reports
the lost and never plans), ``weights.Weights`` (snapshots, checkpoints, resuming, moving weights),
``recovery.StageRecovery`` (a lost stage's weights), ``control.ControlFolder`` (the files a run shows
itself through), ``protocol`` (the messages), and ``Trainer`` here: the iteration loop and its policy
(evaluation, checkpoints), with the plan in use and its re-planning and refining in
``replanning.Replanning`` and one round's messages in ``rounds.Rounds``. The trainer is the one object
that holds the others; they never call each other through it (``Weights.gather`` hands the stages that
no process holds to the trainer, which asks the recovery policy and gives its answer to ``Weights.move``).
"""


from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

import torch

from ...transport.session import current as current_session
from .. import protocol as m
from ..planning.background import Refinement
from ..runtime.control import EVALUATIONS, EVENTS, ITERATIONS, ControlFolder
from .data import train_batches, val_batches
from ..runtime.door import Door, Invitations
from ..errors import NodeFailed, NodesLost, PlanError, RoundStalled
from .evaluate import evaluate_model
from ..faults import FailureSchedule
from ..runtime.recovery import StageRecovery
from .report import plot_losses, write_metrics
from ..runtime.roster import Roster
from .runspec import Prepared, TrainConfig, calibrate, prepare  # re-exported: the run's surface
from ..runtime.slowness import SlowNodes
from ..runtime.stalls import Stalls
from ..runtime.stage_process import pick_device
from ..dispatch import Dispatch
from ..verify.verifier import Verifier
from ..runtime.weights import Weights, load_checkpoint
from .replanning import REFINE_GAIN, Replanning
from .rounds import Rounds

log = logging.getLogger(__name__)

__all__ = ["NodeFailed", "NodesLost", "REFINE_GAIN", "Trainer", "TrainConfig", "calibrate", "load_checkpoint",
           "plot_losses", "prepare", "run", "write_metrics"]


class Trainer(Replanning, Rounds):
    """Runs a prepared plan on roving processes, through node failures. Use as a context manager
    (stops the nodes).

    Failures: every node sends heartbeats from a thread of its own; a node whose process exits, or
    whose heartbeats stop for ``dead_after`` seconds, is declared dead and killed (so a node that was
    only unreachable cannot come back with stale work). The iteration's microbatch phase is aborted
    on every node and run again, with the same data, under a plan made from the current one without
    the dead nodes (``planner.replan``): its stage's replica group shrinks, or, when it was the last
    replica, a spare replica of another stage takes the stage over from the latest snapshot of it;
    with no spare, paths skip the stage (``planner.plan_held``) until a node joins and takes it over.
    Gradients of the aborted attempt are dropped, so no microbatch counts twice. A node that dies
    while the others step is simply not waited for. A node much slower than the plan expects (its
    busy time over the simulator's, against the median node, above ``slow_factor`` for
    ``slow_iterations`` iterations) is marked slow and the plan is remade with its speed measured.
    A round that goes ``stall_after`` seconds (at least twice the iteration the plan predicts here)
    without any message while every node lives has lost one (a network drop between two nodes: the
    sender's next message goes over a new connection, but the lost one is gone): it is aborted and
    run again on the same plan, as one of ``max_retries``.

    Refining: a re-plan has ``replan_budget`` seconds (training waits for it); with ``refine_budget``
    > 0 a fresh plan is then searched in the background and taken when it is ``REFINE_GAIN`` faster
    (``background.Refinement`` has the details).

    Joining: see ``roster`` (starting and admitting) and ``weights`` (the weights a joining node gets).

    Snapshots and checkpoints: see ``weights``.

    A stage that no live process holds any more is recovered by the policy ``stage_recovery``
    (``recovery``: snapshot, skip for good, CheckFree's neighbour average, or auto), recorded as a
    "recovery" event with its inputs; ``fail_rate`` / ``fail_at`` kill stages whole at iteration
    starts (``kill_stage``) to test it.
    """

    def __init__(self, prep: Prepared, progress: Callable[[dict], None] | None = None) -> None:
        import roving
        from roving import config as roving_config

        cfg = self.config = prep.config
        self.prepared, self.spec = prep, prep.spec
        self.progress = progress or (lambda rec: None)
        #: where the run shows itself (``--control``); a NullControlFolder without one
        self.control = ControlFolder.of(cfg.control)
        if cfg.backend:
            roving.init(backend=cfg.backend)
        if roving_config.current().backend == "local" and not roving_config.current().local_preload:
            # every node imports torch: forked from a starter that did so once, each starts in
            # milliseconds instead of seconds of CPU (``local_preload``; roving.backends.local.starter)
            roving.init(local_preload=("roving.pipeline.runtime.stage_process",))
        # nodes of the local backend share this machine's cores: the prediction for this run says so
        self.shared_cores = (max(1, (os.cpu_count() or 1) // max(1, cfg.threads))
                             if roving_config.current().backend == "local" else 0)
        self.iteration_no = 0
        self._t0 = time.perf_counter()
        self.roster = Roster(prep, self._event)
        #: the one reader of the control inbox: the round's messages go to their type's handler, here or
        #: in the verifier, whoever waits when they come
        self.dispatch = Dispatch(self.roster)
        self.dispatch.on(m.Done, self._take_done)
        self.dispatch.on(m.Norm, self._take_norm)
        self.dispatch.on(m.Stepped, self._take_stepped)
        #: the checks of what the nodes send and export (``[verify]``; does nothing with mode = "off")
        self.verifier = Verifier(cfg, prep.model, self.roster, self._event, self.dispatch)
        self.weights = Weights(prep, self.roster, self._event, self.verifier)
        self.stalls = Stalls(self.roster, self.dispatch, self._limit, self._event)
        self.recovery = StageRecovery(cfg, prep.model, self.weights, self._event, self._done)
        self.failures = FailureSchedule(cfg.stages, cfg.seed, cfg.fail_rate, cfg.fail_hour_iterations, cfg.fail_at)
        self.net = prep.network.without([n for n in prep.network.names if n not in prep.plan.allocation])
        self._use_plan(prep.plan, self._predict(prep.plan))
        self.metrics: dict[str, Any] = {
            "config": dataclasses.asdict(cfg), "calibration": prep.calibration,
            "plan": prep.plan.to_dict(), "predicted_s": prep.predicted_s,
            "predicted_here_s": self.prediction.here_s, "predicted_with_sync_s": self.prediction.with_sync_s,
            "shared_cores": self.shared_cores, "iterations": [], "evaluations": [], "events": []}
        self._slow = SlowNodes(cfg.slow_factor, cfg.slow_iterations)
        #: the refinement of the latest re-plan (see the class doc, Refining)
        self.refining = Refinement(cfg.refine_budget, cfg.seed, prep.plan_sync_bytes, cfg.planner_evals or None)
        self.round = -1
        self._done_mbs = ()
        self._batches = train_batches(prep.corpus.train, cfg.samples, cfg.seq_len, cfg.seed)
        self._val = val_batches(prep.corpus.val, cfg.samples, cfg.seq_len, cfg.eval_batches)
        self._train_s = 0.0
        self.start_iteration = 0
        self._sync_round = None
        self._norms, self._norm_from, self._losses, self._stepped = {}, set(), {}, {}
        self._resume_from = load_checkpoint(cfg.checkpoint, prep) if cfg.resume else None
        #: the open door (``[run] open_join``), opened by ``start``
        self.door: Door | None = None

    # -- starting and stopping ---------------------------------------------------------------
    def start(self) -> None:
        """Start every node of the plan and wait for them. Nodes not ready after ``start_wait``
        seconds (jobs a busy cluster keeps pending) are planned around when the ready ones can hold
        every stage; they join when they start. NodeFailed when a node fails to start, or when too few
        are ready within ``timeout``."""
        cfg, roster = self.config, self.roster
        for index, (name, stage) in enumerate(sorted(self.alloc.items())):
            roster.launch(name, stage, index, fresh=self._resume_from is None)
        roster.wait_started(self.alloc, cfg.stages, cfg.start_wait, cfg.timeout)
        if self._resume_from is None:  # each holds its stage's initial weights: their exports are checked
            self.verifier.started(dict(roster.holding))
        late = roster.open()
        if late:
            log.warning("starting without node(s) %s (not ready after %g s): they join when they start",
                        ", ".join(late), cfg.start_wait)
        # planned around: the late, and those that will not come (exited while starting, or caught)
        absent = {n: roster.excluded.get(n, "not started yet" if n in late else "exited while starting")
                  for n in self.alloc if n not in roster.inboxes}
        if absent:
            self._replan(failed=absent, why="start")
        if self._resume_from is not None:
            self._resume(self._resume_from)
        else:
            self.weights.take_snapshot(0)
        self.control.create()
        if cfg.open_join:
            self._open_door(cfg.open_join)
        self._write_status()
        self._t0 = time.perf_counter()

    def _open_door(self, where: str) -> None:
        """Listen at ``where`` (HOST:PORT) for nodes that come with an invitation (``door``)."""
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit():
            raise PlanError(f"open_join: {where!r} is not HOST:PORT")
        credentials = current_session().credentials
        self.door = Door(host, int(port), credentials, Invitations(credentials.ca_pem))
        self._event("door-open", address=self.door.address)
        log.info("the open door listens at %s", self.door.address)

    def invite(self, ttl: float | None = None, revoke: str | None = None) -> dict:
        """An invitation through the open door (valid ``ttl`` seconds, default an hour), or the
        revocation of invitation ``revoke``: what ``roving pipeline invite`` prints. PlanError without a
        door."""
        if self.door is None:
            raise PlanError("this run has no open door (start it with --open-join HOST:PORT)")
        if revoke is not None:
            if not self.door.invitations.revoke(str(revoke)):
                raise PlanError(f"no open invitation {revoke!r}")
            return {"revoked": revoke}
        inv_id, token = self.door.invitations.create(3600.0 if ttl is None else ttl)
        return {"id": inv_id, "token": token, "door": self.door.address}

    def _resume(self, ck: dict) -> None:
        """Continue from checkpoint ``ck``: its weights, iteration, metrics and place in the data."""
        self.weights.load(ck["stages"], dict(self.alloc), self._limit)
        self.start_iteration = ck["iteration"]
        for key in ("iterations", "evaluations", "events"):
            self.metrics[key] = list(ck["metrics"].get(key, []))
        self._train_s = ck["metrics"].get("train_seconds_total", 0.0)
        for _ in range(ck["iteration"] * len(self.plan.paths)):  # the same data as if never stopped
            next(self._batches)
        self._event("resumed", iteration=ck["iteration"], checkpoint=self.config.checkpoint)
        self.weights.resume_from(ck)

    def stop(self) -> None:
        """Stop the nodes (``Roster.stop``) and any refinement still searching."""
        self.refining.cancel()
        if self.door is not None:
            self.door.close()
        self.roster.stop()

    def __enter__(self) -> Trainer:
        try:
            self.start()
        except BaseException:
            # __exit__ does not run when __enter__ raises: without this, the nodes already started
            # would wait for their peers forever
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- joining -------------------------------------------------------------------------------
    def join(self, names: list[str | None], timeout: float = 60.0) -> list[str]:
        """Start nodes (``Roster.request_join``), wait until they are ready and admit them now, between
        iterations; returns their names. NodeFailed if one does not get ready within ``timeout``."""
        started = [self.roster.request_join(n) for n in names]
        self.roster.wait_ready(started, timeout)
        try:
            self.roster.check(force=True)
            self._admit()
        except NodesLost:
            pass  # re-planned around (and the joined nodes given their weights) at the next boundary
        return started

    def _write_status(self) -> None:
        self.control.write_status(self.metrics, self.config.iterations, self.alloc, self.missing_stages,
                                  sorted(self.roster.starting | set(self.roster.ready)), self.refining.searching)

    # -- what is recorded (re-planning: ``replanning.Replanning``; a round's messages: ``rounds.Rounds``) --
    def _done(self) -> int:
        """Iterations done (recorded) so far."""
        its = self.metrics["iterations"]
        return its[-1]["iteration"] + 1 if its else 0

    def _event(self, kind: str, **fields: Any) -> None:
        """Record an event of ``kind``: in the metrics, the control folder and the progress callback."""
        rec = {"event": kind, "iteration": self.iteration_no, "time_s": time.perf_counter() - self._t0, **fields}
        self.metrics["events"].append(rec)
        self.control.record(EVENTS, rec)
        self.progress({**rec, "event": "fault", "kind": kind})

    # -- one iteration -----------------------------------------------------------------------
    def throttle(self, name: str, factor: float) -> None:
        """Fault injection for tests and benchmarks: node ``name`` computes ``factor`` times slower."""
        self.roster.put(name, m.Throttle(factor))

    def _boundary(self) -> None:
        """Between attempts: failures noticed while stepping, join requests, nodes that are ready."""
        failed = self.roster.take_lost()
        if failed:
            self._replan(failed=failed, why="failure")
        if self.stalls.refresh(self.round):  # links broken long ago mended: who they kept out comes back
            _, back = self.stalls.take_change()
            self._replan(joined=sorted(n for n in back if n in self.roster.inboxes), why="links mended")
        self.control.serve_join_requests(self.roster.request_join)
        self.control.serve_invite_requests(self.invite)
        if self.door is not None:
            self.door.serve(self.roster.enroll)
        self._admit()
        self._take_refined()

    def iteration(self, it: int) -> dict:
        """One whole iteration: microbatches along their paths, replica averaging, clipping, AdamW;
        through failures (see the class doc). Returns its record (``_record``)."""
        self.iteration_no = it
        for stage in self.failures.at(it):
            if stage not in self.recovery.dropped:
                self.kill_stage(stage)
        t_start = time.perf_counter()
        self._wall0 = time.time()
        batches = [next(self._batches) for _ in self.plan.paths]
        rnd, losses, norm, attempts, t_compute, lost_s = self._microbatch_phase(it, batches)
        cfg = self.config
        coef = min(1.0, cfg.clip / (norm + 1e-6)) if cfg.clip > 0 else 1.0
        lr = cfg.lr_at(it)
        stats = self.step(rnd, coef, lr)
        seconds = time.perf_counter() - t_start
        self._train_s += seconds
        rec = self._record(it, stats, losses=losses, seconds=seconds, compute=t_compute, lost=lost_s,
                           attempts=attempts, norm=norm, lr=lr)
        done = it + 1
        if cfg.checkpoint and ((cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.iterations):
            self.checkpoint(done)
        elif cfg.snapshot_every and done % cfg.snapshot_every == 0:
            self.weights.take_snapshot(done)
        try:
            self._watch_speed(stats)
        except NodesLost:
            pass  # re-planned around at the next boundary
        return rec

    def _microbatch_phase(self, it: int, batches: list) -> tuple[int, list[float], float, int, float, float]:
        """Run the round's microbatches and averaging, again after each abort (a node lost, or the round
        stalled), up to ``max_retries`` times; returns (round, losses, gradient norm, attempts, seconds
        of the successful attempt's microbatches, seconds lost to aborted ones)."""
        lost_s = 0.0
        aborted = False
        for attempt in range(self.config.max_retries + 1):
            t0 = None
            try:
                if aborted:  # re-plan around what was lost (more may be lost meanwhile: retried)
                    self._abort()
                    aborted = False
                self.roster.check(force=True)
                self._boundary()
                rnd = self.round + 1
                t0 = time.perf_counter()
                losses = self.run_microbatches(rnd, batches)
                t_compute = time.perf_counter() - t0
                norm = self.synchronize(rnd)
                caught = self.verifier.audit(rnd, norm)
                if caught:  # out for good; the round runs again without them, so nothing of theirs is kept
                    raise NodesLost(caught, caught=caught)
                return rnd, losses, norm, attempt + 1, t_compute, lost_s
            except NodesLost as exc:
                self._exclude_caught(exc.caught)
                if t0 is not None:
                    lost_s += time.perf_counter() - t0
                aborted = True
                self._event("aborted", attempt=attempt, lost=sorted(exc.names), seconds_lost=lost_s)
            except RoundStalled as exc:
                self._exclude_caught(self.stalls.account(self.round, self.plan, self._done_mbs))
                if t0 is not None:
                    lost_s += time.perf_counter() - t0
                aborted = True
                log.warning("iteration %d: the round stalled (%s); it is run again", it, exc)
                self._event("stalled", attempt=attempt, why=str(exc), seconds_lost=lost_s)
        raise NodeFailed(f"iteration {it} failed {self.config.max_retries + 1} times; giving up")

    def _exclude_caught(self, caught: dict[str, str]) -> None:
        """The round is given up: the nodes its audit caught, so far or at its end (``caught``), are out
        for good whatever ended it."""
        caught = {**self.verifier.abandon(), **caught}
        if caught:
            self.roster.exclude(caught)

    def _record(self, it: int, stats: dict[str, dict], *, losses: list[float], seconds: float, compute: float,
                lost: float, attempts: int, norm: float, lr: float) -> dict:
        """The record of iteration ``it`` (in the metrics, the control folder and the dashboard's plan
        file); keeps the nodes' traces as ``last_trace``."""
        p = self.prediction
        rec = {"iteration": it, "train_loss": sum(losses) / len(losses), "seconds": seconds,
               "compute_seconds": compute, "sync_seconds": seconds - compute - lost,
               "seconds_lost": lost, "attempts": attempts,
               "predicted_seconds": p.iteration_s, "predicted_here_seconds": p.here_s,
               "predicted_with_sync_seconds": p.with_sync_s,
               "grad_norm": norm, "lr": lr,
               "train_seconds_total": self._train_s, "nodes": len(self.alloc),
               "missing_stages": self.missing_stages,
               "stage_grad_norms": dict(sorted(self.recovery.grad_norms.items())),
               "peak_in_flight": max(s["peak_in_flight"] for s in stats.values()),
               "processed": {n: s["processed"] for n, s in sorted(stats.items())},
               "node_compute_seconds": {n: s["compute_s"] for n, s in sorted(stats.items())}}
        if self.verifier.on:
            # what verification cost: the audit's figures, and the nodes' own CPU seconds of it by part
            # (``evidence.Evidence.cpu``), summed over the nodes
            parts: dict[str, float] = {}
            for s in stats.values():
                for part, sec in s.get("verify_cpu_s", {}).items():
                    parts[part] = parts.get(part, 0.0) + sec
            rec["verify"] = dict(self.verifier.last, node_cpu_seconds=dict(sorted(parts.items())))
        self.last_trace = {n: [(k, mb, a - self._wall0, b - self._wall0) for k, mb, a, b in s["trace"]]
                           for n, s in stats.items()}
        self.metrics["iterations"].append(rec)
        self.control.record(ITERATIONS, rec)
        self.control.write_plan(it, self.plan, self.net, self.spec, self.shared_cores, self.last_trace)
        return rec

    def _abort(self) -> None:
        """Give up the current round on every live node (drop its work and gradients), then re-plan
        around the nodes that were lost, if any."""
        for name in self.roster.inboxes:
            self.roster.put(name, m.Abort(self.round))
        failed = self.roster.take_lost()
        benched, back = self.stalls.take_change()
        for name in benched:  # what it holds is stale once the others step without it: loaded on its return
            self.roster.holding[name] = None
        if failed or benched or back:  # else the round stalled and nobody's account showed why: the same plan
            self._replan(failed={**{n: "benched: a broken link (stalls)" for n in benched if n in self.alloc},
                                 **failed},
                         joined=sorted(n for n in back if n in self.roster.inboxes),
                         why="failure" if failed else "stall")

    # -- evaluation and checkpoints ------------------------------------------------------------
    def stage_states(self, all_replicas: bool = False, grads: bool = False) -> dict[str, tuple[int, dict]]:
        """Weights (or, with ``grads``, gradients) of one replica per stage of the plan in use, or of
        every node: name -> (stage, {parameter name: tensor}) (``Weights.stage_states``)."""
        return self.weights.stage_states(self.alloc, all_replicas=all_replicas, grads=grads)

    def evaluate(self, it: int) -> dict:
        """Validation loss and perplexity of the whole model (one replica of each stage, merged), on
        the coordinator's device; and the loss with half of the stages after 0 dropped
        (``evaluate.half_of_the_stages``)."""
        cfg = self.config
        model = self.weights.full_model(self.alloc).to(torch.device(pick_device(cfg.device)))
        # stages skipped for good are left out of the model evaluated, as the paths leave them out
        rec = {"iteration": it, **evaluate_model(model, self._val, cfg.stages, self.recovery.dropped, cfg.bf16),
               "train_seconds_total": self._train_s}
        self.metrics["evaluations"].append(rec)
        self.control.record(EVALUATIONS, rec)
        return rec

    def checkpoint(self, it: int) -> None:
        """Write the run to ``checkpoint`` atomically: the whole model, each stage's weights and
        optimizer state, the metrics so far (enough for ``resume``)."""
        metrics = {k: self.metrics[k] for k in ("iterations", "evaluations", "events")}
        metrics["train_seconds_total"] = self._train_s
        self.weights.checkpoint(it, metrics)
        # for the dashboard's timeline only (not an event of the metrics)
        self.control.record(EVENTS, {"event": "checkpoint", "iteration": it, "time_s": time.perf_counter() - self._t0,
                                     "path": self.config.checkpoint})

    def train(self) -> dict:
        """Run every iteration (from where a resumed run stopped); evaluate every ``eval_every`` and at
        the end; snapshot and checkpoint as configured. Returns the metrics."""
        c = self.config
        if self.start_iteration == 0:
            self.progress({"event": "evaluation", **self.evaluate(0)})
        for it in range(self.start_iteration, c.iterations):
            self.progress({"event": "iteration", **self.iteration(it)})
            done = it + 1
            if done % c.eval_every == 0 or done == c.iterations:
                self.progress({"event": "evaluation", **self.evaluate(done)})
            self._write_status()
        if c.metrics:
            write_metrics(self.metrics, c.metrics)
        if c.plot:
            plot_losses({"run": self.metrics}, c.plot)
        return self.metrics


def run(config: TrainConfig, progress: Callable[[dict], None] | None = None) -> dict:
    """Check, plan and run ``config``; returns the metrics."""
    prep = prepare(config)
    with Trainer(prep, progress) as trainer:
        return trainer.train()
