"""The coordinator of SkipPipe training: starts one roving process per node for a run that
``runspec.prepare`` checked and planned, feeds microbatches along their planned paths, has replicas
average gradients and step, evaluates the whole model on held-out text, checkpoints, and records metrics.

An iteration: every microbatch goes to its origin (a stage-0 node) and travels its path forward, back
to the origin for the loss, and backward along the same path (``node.py``). As soon as a node has run
its last backward pass of the iteration, it sends its summed gradients to the other replicas of its
stage, and each replica averages them over the number of microbatches the stage processed (so a stage
that was skipped by some microbatches is not trained with a smaller step): one stage's averaging
overlaps the other stages' remaining work. When every stage has averaged, the coordinator clips by the
whole model's gradient norm, and every node takes an AdamW step.

Failures (``Trainer``'s doc has the details): dead nodes are found by heartbeats or their exit, the
iteration's microbatch phase is re-run under a plan made around them, slow nodes are re-planned with
their measured speed, nodes join between iterations with a live replica's weights and optimizer state,
a stage that no node holds is skipped until a node takes it over from its snapshot, and a run whose
coordinator died continues from its checkpoint (``resume``). With ``refine_budget``, each quick re-plan
is followed by a fresh plan searched in the background, taken at an iteration boundary when it is faster.

Predicted seconds come from the planner's simulator with the compute speed measured on this machine
(``calibrate``), so measured and predicted iteration times can be compared: ``predicted_seconds`` is
the microbatch phase (what the planner optimises, as the SkipPipe paper's simulator),
``predicted_with_sync_seconds`` adds the replicas' exchange of gradients (``simulate(sync_bytes=...)``).
With the local backend every node shares this machine's cores, and ``predicted_here_seconds`` is the
simulator's figure for the phase on them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue as _queue
import statistics
import threading
import time
from pathlib import Path as FilePath
from typing import Any, Callable

import torch

from . import checkpoint_file
from .background import BackgroundPlan
from .costs import PlanError
from .data import train_batches, val_batches
from .evaluate import half_of_the_stages, kept_layers, perplexity, validation_loss
from .model import Llama
from .network import slowed as slowed_network
from .node import NodeSettings, Peers, node_main, pick_device
from .plan import Plan
from .planner import plan_held, replan
from .runspec import Prepared, TrainConfig, calibrate, prepare  # noqa: F401 (re-exported: the run's surface)
from .simulate import simulate
from .stages import merge_state_dicts

log = logging.getLogger(__name__)


class NodeFailed(RuntimeError):
    """Training cannot go on: a node raised (the message carries its traceback), or failures left no
    node to hold stage 0, or an iteration failed ``max_retries`` times."""


class _Timeout(NodeFailed):
    """Nothing came from the nodes in time."""


class _Stalled(Exception):
    """A round went ``stall_after`` seconds without a message while its nodes lived: one was lost."""


class NodesLost(Exception):
    """Nodes were declared dead (their process exited, or their heartbeats stopped)."""

    def __init__(self, names: dict[str, str]) -> None:
        super().__init__(", ".join(f"{n} ({why})" for n, why in sorted(names.items())))
        self.names = names


#: a plan refined in the background replaces the plan in use only when it predicts a whole iteration
#: at least this much shorter: moving stages between nodes costs a round of weight transfers.
REFINE_GAIN = 0.03


class Trainer:
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

    Refining: a re-plan has ``replan_budget`` seconds (training waits for it), so it keeps the current
    allocation or repairs it and searches paths briefly. With ``refine_budget`` > 0, the planner then
    searches a fresh plan for the same nodes (allocation included, as before the run) for that long in
    a process of its own while training goes on (``background.BackgroundPlan``: niced, and outside the
    coordinator's interpreter); at the first iteration boundary after it is done, it replaces the
    plan in use if it predicts a whole iteration (replica averaging included) at least ``REFINE_GAIN``
    shorter, and nodes whose stage changes get its weights and optimizer state as after a re-plan. A
    refinement that a newer re-plan overtook is dropped. Recorded as a "refine" event either way.

    Joining: ``request_join`` (and join request files in ``control``, see ``roving pipeline join``)
    starts a node process on the run's backend; when it reports ready it is admitted at the next
    iteration boundary: it gets every inbox, every node gets its inbox, the planner places it
    (``replan`` with the node joined), and it receives its stage's weights and optimizer state from a
    live replica (or the latest snapshot when none holds the stage). Restarted nodes (``restart``)
    join the same way.

    Snapshots: the weights and optimizer state of one replica per stage are copied to the coordinator
    at the start and every ``snapshot_every`` iterations (and, with ``checkpoint``, written to disk
    every ``checkpoint_every``, atomically, with the metrics and the position in the data, so that
    ``resume`` continues a run whose coordinator died).
    """

    def __init__(self, prep: Prepared, progress: Callable[[dict], None] | None = None) -> None:
        import roving

        self.p, self.c = prep, prep.config
        self.progress = progress or (lambda rec: None)
        if self.c.backend:
            roving.init(backend=self.c.backend)
        self.control = roving.Queue()
        self.release = roving.Queue()
        self.beats = roving.Queue()
        self.spec = prep.spec
        from roving import config as _config

        # nodes of the local backend share this machine's cores: the prediction for this run says so
        self.shared_cores = (max(1, (os.cpu_count() or 1) // max(1, self.c.threads))
                             if _config.current().backend == "local" else 0)
        self.universe = {n.name: n for n in prep.network.nodes}  # every node ever known, by name
        self.net = prep.network.without([n for n in prep.network.names if n not in prep.plan.allocation])
        self._use_plan(prep.plan, prep.predicted_s)
        self.metrics: dict[str, Any] = {
            "config": dataclasses.asdict(self.c), "calibration": prep.calibration,
            "plan": prep.plan.to_dict(), "predicted_s": prep.predicted_s,
            "predicted_here_s": self.predicted_here_s, "predicted_with_sync_s": self.predicted_sync_s,
            "shared_cores": self.shared_cores,
            "iterations": [], "evaluations": [],
            "events": []}
        self.procs: dict[str, Any] = {}
        self.inboxes: dict[str, Any] = {}  # admitted (live) nodes
        self.incarnation: dict[str, int] = {}
        self.last_beat: dict[str, float] = {}
        self._starting: set[str] = set()  # started, not ready yet
        #: the stage whose weights each node holds now (None: a joining node, nothing useful yet)
        self.holding: dict[str, int | None] = {}
        self._ready: dict[str, tuple[int, Any]] = {}  # started nodes that reported ready, not admitted
        self._slow_counts: dict[str, int] = {}
        self._pending_failures: dict[str, str] = {}
        self._refining: BackgroundPlan | None = None  # the refinement of the latest re-plan, if any
        self._out: Peers | None = None
        self._monitor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._checked = 0.0
        self.round = -1
        self.iteration_no = 0
        self.snapshot: dict | None = None
        self._batches = train_batches(prep.corpus.train, self.c.samples, self.c.seq_len, self.c.seed)
        self._val = val_batches(prep.corpus.val, self.c.samples, self.c.seq_len, self.c.eval_batches)
        self._t0 = time.perf_counter()
        self._train_s = 0.0
        self.start_iteration = 0
        self._sync_round: int | None = None  # the round whose averaging orders went out
        self._norms: dict[int, float] = {}  # stage -> squared gradient norm, this round
        self._norm_from: set[str] = set()
        self._resume_from: dict | None = None
        if self.c.resume:
            self._resume_from = load_checkpoint(self.c.checkpoint, prep)

    def _use_plan(self, new_plan: Plan, predicted: float) -> None:
        self.plan = new_plan
        self.alloc = dict(new_plan.allocation)
        self.predicted_s = predicted
        self.predicted_here_s = (simulate(self.net, self.spec, new_plan, record=False,
                                          shared_cores=self.shared_cores).makespan
                                 if self.shared_cores else predicted)
        # the whole iteration: the microbatches and the replicas' exchange of gradients
        self.predicted_sync_s = (simulate(self.net, self.spec, new_plan, record=False,
                                          sync_bytes=self.p.gradient_bytes).makespan
                                 if self.p.gradient_bytes else math.nan)
        self._planned_busy: dict[str, float] | None = None  # per node, for _watch_speed; made on first use
        self.replicas = {s: sorted(n for n, st in self.alloc.items() if st == s) for s in range(self.c.stages)}
        counts = [0] * self.c.stages
        for path in new_plan.paths:
            counts[0] += 1
            for s in path.stages:
                counts[s] += 1
        self.stage_counts = counts

    @property
    def missing_stages(self) -> list[int]:
        return [s for s, r in self.replicas.items() if not r]

    # -- nodes -------------------------------------------------------------------------------
    def _launch(self, name: str, stage: int, index: int) -> None:
        import roving

        everyone = self.p.network.with_nodes(list(self.universe.values()))
        emulate = ({o: everyone.link(name, o) for o in self.universe if o != name}
                   if self.c.emulate_network else None)
        limit = max(1, self.universe[name].in_flight(stage, self.spec, self.c.stages))
        inc = self.incarnation[name] = self.incarnation.get(name, -1) + 1
        s = NodeSettings(name, stage, self.c.stages, self.p.model, self.c.seed, limit,
                         lr=self.c.lr, weight_decay=self.c.weight_decay, device=self.c.device,
                         bf16=self.c.bf16, threads=self.c.threads, index=index, emulate=emulate,
                         incarnation=inc, heartbeat=self.c.heartbeat)
        label = f"stage{stage}-{name}" if inc == 0 else f"{name}-restart{inc}"
        proc = roving.Process(target=node_main, args=(s, self.control, self.release, self.beats),
                              name=label, daemon=True)
        proc.start()
        self.procs[name] = proc
        self._starting.add(name)
        self.holding[name] = stage if inc == 0 and self._resume_from is None else None

    def start(self) -> None:
        """Start every node of the plan and wait for them. Nodes not ready after ``start_wait``
        seconds (jobs a busy cluster keeps pending) are planned around when the ready ones can hold
        every stage; they join when they start. NodeFailed when a node fails to start, or when too few
        are ready within ``timeout``."""
        for index, (name, stage) in enumerate(sorted(self.alloc.items())):
            self._launch(name, stage, index)
        t0 = time.monotonic()
        while self._starting:
            waited = time.monotonic() - t0
            if waited > self.c.start_wait and len({self.alloc[n] for n in self._ready}) == self.c.stages:
                break
            if waited > self.c.timeout:
                raise NodeFailed(f"node(s) {', '.join(sorted(self._starting))} not ready within {self.c.timeout:g} s")
            try:
                self._recv("ready", timeout=0.5, check=False)
            except _Timeout:
                pass
        late = sorted(self._starting)
        for name in late:  # its initial weights will be stale when it joins
            self.holding[name] = None
        self._out = Peers("coordinator", {}, None)
        for name in sorted(self._ready):
            inc, inbox = self._ready.pop(name)
            self.inboxes[name] = inbox
            self._out.add(name, inbox)
            self.last_beat[name] = time.monotonic()
        for name in self.inboxes:
            self._put(name, ("peers", self.inboxes))
        self._monitor = threading.Thread(target=self._watch_beats, name="roving-heartbeats", daemon=True)
        self._monitor.start()
        if late:
            log.warning("starting without node(s) %s (not ready after %g s): they join when they start",
                        ", ".join(late), self.c.start_wait)
            self._replan(failed={n: "not started yet" for n in late}, why="start")
        if self._resume_from is not None:
            ck = self._resume_from
            self._load_stages(ck["stages"], dict(self.alloc))
            self.start_iteration = ck["iteration"]
            for key in ("iterations", "evaluations", "events"):
                self.metrics[key] = list(ck["metrics"].get(key, []))
            self._train_s = ck["metrics"].get("train_seconds_total", 0.0)
            for _ in range(ck["iteration"] * len(self.plan.paths)):  # the same data as if never stopped
                next(self._batches)
            self._event("resumed", iteration=ck["iteration"], checkpoint=self.c.checkpoint)
            self.snapshot = {"iteration": ck["iteration"], "stages": ck["stages"]}
        else:
            self.snapshot = self.take_snapshot(0)
        if self.c.control:
            FilePath(self.c.control).mkdir(parents=True, exist_ok=True)
            self._write_status()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        """Stop the nodes in two phases (see ``StageNode._shut_down``); kills any that do not stop.
        After a start that failed part-way (some nodes never reported ready, so the coordinator has no
        inbox to tell them to stop, and none has its peers), the started nodes are killed at once."""
        self._stopping.set()
        self._stop_refining()
        live = sorted(self.inboxes)
        for name, proc in self.procs.items():  # started nodes that were never admitted: kill them
            if (self._out is None or name not in self.inboxes) and proc.is_alive():
                proc.kill()
        if self._out is not None:
            try:
                for name in live:
                    self._put(name, ("stop", live))
                waiting = set(live)
                deadline = time.monotonic() + 30.0
                while waiting and time.monotonic() < deadline:
                    try:
                        msg = self.control.get(timeout=0.5)
                    except _queue.Empty:
                        waiting = {n for n in waiting if self.procs[n].is_alive()}
                        continue
                    if msg[0] == "stopped":
                        waiting.discard(msg[1])
                self._out.confirm(live, timeout=10.0)
                for _ in live:
                    self.release.put(None)
            except Exception as exc:  # a node that failed is killed below
                log.warning("nodes did not stop cleanly: %s", exc)
        for proc in self.procs.values():
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        # no thread of ours may be inside the transport when the interpreter exits
        if self._out is not None:
            self._out.close()
        if self._monitor is not None:
            self._monitor.join(timeout=2)

    def __enter__(self) -> "Trainer":
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

    def _put(self, name: str, msg: tuple) -> None:
        """To a node's inbox, from a sender thread per node: a node that died never blocks us."""
        self._out.put(name, msg)

    # -- failure detection -------------------------------------------------------------------
    def _watch_beats(self) -> None:
        while not self._stopping.is_set():
            try:
                _, name, inc = self.beats.get(timeout=0.5)
            except _queue.Empty:
                continue
            except Exception:  # the queue closes as the coordinator exits
                return
            if self.incarnation.get(name) == inc:
                self.last_beat[name] = time.monotonic()

    def _lost(self) -> dict[str, str]:
        """Admitted nodes that are dead now, with why; forgets started nodes whose process exited."""
        now = time.monotonic()
        dead = {}
        for name in self.inboxes:
            proc = self.procs[name]
            quiet = now - self.last_beat.get(name, now)
            if not proc.is_alive():
                dead[name] = f"its process exited with code {proc.exitcode}"
            elif self.c.dead_after > 0 and quiet > self.c.dead_after:
                dead[name] = f"no heartbeat for {quiet:.1f} s"
        for name in sorted(self._starting | set(self._ready)):
            proc = self.procs[name]
            if not proc.is_alive():
                log.warning("node %s exited before it joined (exit code %s)", name, proc.exitcode)
                self._event("join-failed", nodes=[name], why=f"exit code {proc.exitcode}")
                self._starting.discard(name)
                self._ready.pop(name, None)
        return dead

    def _check(self, force: bool = False) -> None:
        """Raise NodesLost (after fencing them off) if admitted nodes died; at most every 0.1 s."""
        now = time.monotonic()
        if not force and now - self._checked < 0.1:
            return
        self._checked = now
        dead = self._lost()
        if dead:
            self._drop(dead)
            raise NodesLost(dead)

    def _drop(self, dead: dict[str, str]) -> None:
        """Fence dead nodes off: kill what is left of them, stop sending to them, tell the others."""
        for name, why in dead.items():
            log.warning("node %s declared dead: %s", name, why)
            proc = self.procs.get(name)
            if proc is not None and proc.is_alive():
                proc.kill()
            self.inboxes.pop(name, None)
            self.last_beat.pop(name, None)
        self._out.forget(list(dead))
        for name in self.inboxes:
            self._put(name, ("forget", list(dead)))
        self._event("dead", nodes=sorted(dead), why=dead)
        self._pending_failures.update(dead)
        if self.c.restart:
            for name in dead:
                self.request_join(name)

    def _recv(self, kind: str | tuple[str, ...], timeout: float | None = None, rnd: int | None = None,
              names: set[str] | None = None, check: bool = True) -> tuple:
        """The next ``kind`` message (or one of the kinds) from the nodes (of round ``rnd``, from one
        of ``names``).
        Raises NodesLost when an admitted node dies meanwhile (with ``check``), NodeFailed when a node
        raised or nothing came within ``timeout``. Other nodes' "ready" messages are kept for joining;
        messages of earlier rounds and of nodes declared dead are dropped."""
        timeout = self.c.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if check:
                self._check()
            try:
                msg = self.control.get(timeout=0.1)
            except _queue.Empty:
                if not check:
                    dead = [n for n in self._starting if not self.procs[n].is_alive()]
                    if dead:
                        raise NodeFailed(f"node(s) {', '.join(dead)} exited while the coordinator waited "
                                         f"for {kind!r}")
                if time.monotonic() > deadline:
                    raise _Timeout(f"no {kind!r} message from the nodes within {timeout:g} s")
                continue
            k = msg[0]
            if k == "error":
                raise NodeFailed(f"node {msg[1]} failed:\n{msg[2]}")
            if k == "ready":
                _, name, inc, inbox = msg
                if self.incarnation.get(name) == inc and name in self._starting:
                    self._starting.discard(name)
                    self._ready[name] = (inc, inbox)
                if kind == "ready":
                    return msg
                continue
            kinds = (kind,) if isinstance(kind, str) else kind
            if k in ("done", "norm", "stepped") and (k not in kinds or (rnd is not None and msg[1] != rnd)):
                continue  # left from an aborted round
            sender = msg[2] if k in ("norm", "stepped") else (msg[1] if k != "done" else None)
            if sender is not None and sender not in self.inboxes:
                continue  # from a node declared dead
            if k not in kinds or (names is not None and sender not in names):
                raise NodeFailed(f"unexpected message {k!r} while waiting for {kind!r}")
            return msg

    # -- joining -------------------------------------------------------------------------------
    def request_join(self, name: str | None = None, region: str | None = None) -> str:
        """Start a node process that joins the run when it is ready (at an iteration boundary). A
        ``name`` the run knew (a node that died) restarts that node; a new name (or none: one is
        made up) adds a node in ``region`` (default: the regions in turn), with the run's compute
        speed and memory. Returns the node's name. Raises PlanError for a live name or unknown region."""
        if name is not None and (name in self.inboxes or (name in self.procs and self.procs[name].is_alive())):
            raise PlanError(f"node {name} is already running")
        if name is None or name not in self.universe:
            regions = sorted({r for pair in self.p.network.links for r in pair} |
                             {n.region for n in self.universe.values()})
            if region is None:
                region = regions[len(self.universe) % len(regions)]
            elif region not in regions:
                raise PlanError(f"unknown region {region!r}; the network has {', '.join(regions)}")
            if name is None:
                k = len(self.universe)
                while f"n{k:02d}" in self.universe:
                    k += 1
                name = f"n{k:02d}"
            template = next(iter(self.universe.values()))
            self.universe[name] = dataclasses.replace(template, name=name, region=region)
        index = sorted(self.universe).index(name)
        self._launch(name, 0, index)
        self.holding[name] = None
        self._event("join-requested", nodes=[name])
        return name

    def join(self, names: list[str | None], timeout: float = 60.0) -> list[str]:
        """Start nodes (``request_join``), wait until they are ready and admit them now, between
        iterations; returns their names. NodeFailed if one does not get ready within ``timeout``."""
        started = [self.request_join(n) for n in names]
        deadline = time.monotonic() + timeout
        while any(n not in self._ready for n in started):
            if time.monotonic() > deadline:
                raise NodeFailed(f"node(s) {', '.join(n for n in started if n not in self._ready)} not ready "
                                 f"within {timeout:g} s")
            try:
                self._recv("ready", timeout=max(0.1, deadline - time.monotonic()), check=False)
            except NodeFailed:
                gone = [n for n in started if n not in self._ready and not self.procs[n].is_alive()]
                if gone:
                    raise NodeFailed(f"joining node(s) {', '.join(gone)} exited before they were ready") from None
        try:
            self._check(force=True)
            self._admit()
        except NodesLost:
            pass  # re-planned around (and the joined nodes given their weights) at the next boundary
        return started

    def _admit(self) -> None:
        """Admit nodes that reported ready: peers both ways, a place in the plan, their weights."""
        joined = sorted(self._ready)
        if not joined:
            return
        for name in joined:
            _, inbox = self._ready.pop(name)
            everyone = self.p.network.with_nodes(list(self.universe.values()))
            for other in self.inboxes:
                link = everyone.link(other, name) if self.c.emulate_network else None
                self._put(other, ("peer", name, inbox, link))
            self.inboxes[name] = inbox
            self._out.add(name, inbox)
            self.last_beat[name] = time.monotonic()
            self._put(name, ("peers", self.inboxes))
        self._replan(joined=joined, why="joined")

    def _control_requests(self) -> None:
        """Join requests written by ``roving pipeline join`` into the control folder."""
        folder = FilePath(self.c.control)
        for req in sorted(folder.glob("join-*.json")):
            answer: dict[str, Any]
            try:
                doc = json.loads(req.read_text())
                names = [self.request_join(doc.get("name"), doc.get("region")) for _ in range(int(doc.get("count", 1)))]
                answer = {"started": names}
            except (PlanError, ValueError, TypeError) as exc:
                answer = {"error": str(exc)}
            tmp = req.with_suffix(".tmp")
            tmp.write_text(json.dumps(answer))
            tmp.replace(req.with_suffix(".done"))
            req.unlink(missing_ok=True)

    def _write_status(self) -> None:
        folder = FilePath(self.c.control)
        last = self.metrics["iterations"][-1] if self.metrics["iterations"] else {}
        status = {"iterations_done": len(self.metrics["iterations"]) and last["iteration"] + 1,
                  "iterations": self.c.iterations, "nodes": dict(sorted(self.alloc.items())),
                  "missing_stages": self.missing_stages, "starting": sorted(self._starting | set(self._ready)),
                  "train_loss": last.get("train_loss"), "iteration_seconds": last.get("seconds"),
                  "refining": self._refining is not None,
                  "recent_events": [{k: e[k] for k in ("event", "iteration", "adopted", "error") if k in e}
                                    | {"nodes": e.get("nodes")} for e in self.metrics["events"][-5:]]}
        tmp = folder / "status.tmp"
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(folder / "status.json")

    # -- re-planning and moving weights ----------------------------------------------------------
    def _replan(self, failed: dict[str, str] | None = None, slowed: dict[str, float] | None = None,
                joined: list[str] = (), why: str = "") -> None:
        """A new plan for the live nodes; nodes whose stage changes get its weights and optimizer
        state (from a live replica that keeps the stage, else from the latest snapshot)."""
        failed = dict(failed or {})
        t0 = time.perf_counter()
        live_net = self.net.without([n for n in failed if n in self.net.names])
        if slowed:
            live_net = slowed_network(live_net, slowed)
        joined_nodes = [self.universe[n] for n in joined]
        new_plan = None
        if not self.missing_stages:
            try:
                new_plan, net = replan(self.plan, self.net, self.spec, failed=[n for n in failed if n in self.net.names],
                                       slowed_by=slowed, joined=joined_nodes, budget_s=self.c.replan_budget,
                                       seed=self.c.seed, sync_bytes=self.p.plan_sync_bytes,
                                       max_evals=self.c.replan_evals or None)
            except PlanError as exc:
                log.info("re-plan with every stage held failed (%s): paths will skip the lost stages", exc)
        if new_plan is None:
            net = live_net.with_nodes(list(live_net.nodes) + joined_nodes) if joined_nodes else live_net
            alloc = {n: s for n, s in self.alloc.items() if n not in failed}
            for name in joined:  # a stage no node holds first, else where replicas are busiest
                held = [s for s in range(self.c.stages) if s in alloc.values()]
                want = [s for s in range(self.c.stages) if s not in held
                        and self.universe[name].can_hold(s, self.spec, self.c.stages)]
                if not want:
                    want = sorted(held, key=lambda s: -self.stage_counts[s] / max(1, list(alloc.values()).count(s)))
                alloc[name] = want[0]
            try:
                new_plan = plan_held(net, self.spec, alloc, self.c.stages, self.p.plan.skip,
                                     len(self.plan.paths), budget_s=self.c.replan_budget, seed=self.c.seed,
                                     max_evals=self.c.replan_evals or None)
            except PlanError as exc:
                raise NodeFailed(f"training cannot go on: {exc}") from None
        predicted = simulate(net, self.spec, new_plan, record=False).makespan
        self.net = net
        self._use_plan(new_plan, predicted)
        moved = {n: s for n, s in self.alloc.items() if self.holding.get(n) != s}
        sources = self._move_weights(moved)
        self._event("replan", why=why, failed=sorted(failed), slowed=slowed or {}, joined=list(joined),
                    moved=moved, weights_from=sources, missing_stages=self.missing_stages,
                    predicted_s=predicted, planner_seconds=time.perf_counter() - t0,
                    path_evaluations=new_plan.stats.get("path_evaluations"),
                    allocation=dict(sorted(self.alloc.items())))
        self._start_refining()

    def _start_refining(self) -> None:
        """Search a fresh plan for the live nodes in the background (see the class doc, Refining); a
        refinement still running for an earlier re-plan is stopped."""
        self._stop_refining()
        if self.c.refine_budget <= 0 or self.c.schedule != "skippipe" or self.missing_stages:
            return
        try:
            self._refining = BackgroundPlan(self.net, self.spec, self.c.stages, self.p.plan.skip,
                                            len(self.plan.paths), budget_s=self.c.refine_budget, seed=self.c.seed,
                                            sync_bytes=self.p.plan_sync_bytes,
                                            max_evals=self.c.planner_evals or None)
        except Exception as exc:  # no process or no temporary file: training goes on with the re-plan
            log.warning("could not start refining the plan, the plan in use stays: %s", exc)
            self._event("refine", adopted=False, error=f"{type(exc).__name__}: {exc}")

    def _stop_refining(self) -> None:
        if self._refining is not None:
            self._refining.cancel()
            self._refining = None

    def _take_refined(self) -> None:
        """At an iteration boundary: the background plan replaces the plan in use if it is done and
        faster by ``REFINE_GAIN``."""
        job = self._refining
        if job is None or not job.done():
            return
        self._refining = None
        try:
            new_plan = job.result()
        except (PlanError, RuntimeError) as exc:
            log.warning("refining the plan failed, the plan in use stays: %s", exc)
            self._event("refine", adopted=False, error=f"{type(exc).__name__}: {exc}")
            return

        def whole(p: Plan) -> float:
            return simulate(self.net, self.spec, p, record=False, sync_bytes=self.p.plan_sync_bytes).makespan

        now, refined = whole(self.plan), whole(new_plan)
        adopted = refined < now * (1.0 - REFINE_GAIN)
        moved: dict[str, int] = {}
        sources: dict[int, str] = {}
        if adopted:
            self._use_plan(new_plan, simulate(self.net, self.spec, new_plan, record=False).makespan)
            moved = {n: s for n, s in self.alloc.items() if self.holding.get(n) != s}
            sources = self._move_weights(moved)
        self._event("refine", adopted=adopted, iteration_s_before=now, iteration_s_refined=refined,
                    moved=moved, weights_from=sources, predicted_s=self.predicted_s,
                    planner_seconds=new_plan.stats.get("planner_seconds"),
                    allocation=dict(sorted(self.alloc.items())))

    def _move_weights(self, moved: dict[str, int]) -> dict[int, str]:
        """Load each moved node's new stage from a live node that held it (else from the latest
        snapshot); returns where each stage's weights came from."""
        if not moved:
            return {}
        states: dict[int, tuple] = {}
        sources: dict[int, str] = {}
        # Every export happens before any load, so a node that moves away from a stage can still be
        # the source of that stage's weights (a replica that keeps the stage is preferred).
        for stage in sorted(set(moved.values())):
            keepers = sorted((n for n, s in self.holding.items() if s == stage and n in self.inboxes),
                             key=lambda n: (self.alloc.get(n) != stage, n))
            for keeper in keepers:  # the next one if it dies before it answers
                got = self._ask(("export",), "exported", [keeper])
                if keeper in got:
                    _, _, _, params, opt = got[keeper]
                    states[stage], sources[stage] = (params, opt), keeper
                    break
            else:
                snap = self.snapshot["stages"][stage]
                states[stage] = (snap["params"], snap["optimizer"])
                sources[stage] = f"snapshot of iteration {snap['iteration']}"
                self._event("takeover", stage=stage, nodes=sorted(n for n, s in moved.items() if s == stage),
                            snapshot_iteration=snap["iteration"])
        self._load_stages({s: {"params": p, "optimizer": o} for s, (p, o) in states.items()}, moved)
        return sources

    def _load_stages(self, stages: dict[int, dict], targets: dict[str, int]) -> None:
        """Each target node loads its stage's weights and optimizer state; ``holding`` follows. A target
        that is dead already, or dies meanwhile, is left out: it is re-planned around at the next
        attempt's boundary (two nodes of one lost machine are often declared dead one after the other,
        the second while the first one's re-plan moves weights)."""
        waiting = {name for name in targets if name in self.inboxes}
        for name in sorted(waiting):
            stage = targets[name]
            limit = max(1, self.net.node(name).in_flight(stage, self.spec, self.c.stages))
            st = stages[stage]
            self._put(name, ("load", stage, limit, st["params"], st["optimizer"]))
        while waiting:
            try:
                _, name, stage = self._recv("loaded", names=waiting)
            except NodesLost as exc:
                waiting -= set(exc.names)
                continue
            waiting.discard(name)
            self.holding[name] = stage

    def _ask(self, request: tuple, kind: str, names: list[str]) -> dict[str, tuple]:
        """Send ``request`` to ``names`` and collect their ``kind`` answers; nodes that die meanwhile
        are left out (and re-planned around at the next iteration boundary)."""
        waiting = {n for n in names if n in self.inboxes}
        for n in sorted(waiting):
            self._put(n, request)
        out: dict[str, tuple] = {}
        while waiting:
            try:
                msg = self._recv(kind, names=waiting)
            except NodesLost as exc:
                waiting -= set(exc.names)
                continue
            out[msg[1]] = msg
            waiting.discard(msg[1])
        return out

    def _ask_each_stage(self, request: tuple, kind: str) -> dict[str, tuple]:
        """``request`` to one live node holding each stage; another replica when one dies."""
        out: dict[str, tuple] = {}
        covered: set[int] = set()
        while True:
            holders: dict[int, str] = {}
            for n in sorted(self.inboxes):
                st = self.holding.get(n)
                if st is not None and st not in covered and st not in holders:
                    holders[st] = n
            if not holders:
                return out
            got = self._ask(request, kind, list(holders.values()))
            out.update(got)
            covered |= {st for st, n in holders.items() if n in got}

    def take_snapshot(self, it: int) -> dict:
        """Weights and optimizer state of one replica of each held stage (stages no node holds keep
        their last snapshot)."""
        got = self._ask_each_stage(("export",), "exported")
        stages = dict(self.snapshot["stages"]) if self.snapshot else {}
        for _, _, stage, params, opt in got.values():
            stages[stage] = {"params": params, "optimizer": opt, "iteration": it}
        return {"iteration": it, "stages": stages}

    def _event(self, kind: str, **fields: Any) -> None:
        rec = {"event": kind, "iteration": self.iteration_no, "time_s": time.perf_counter() - self._t0, **fields}
        self.metrics["events"].append(rec)
        self.progress({**rec, "event": "fault", "kind": kind})

    # -- one iteration -----------------------------------------------------------------------
    def lr_at(self, it: int) -> float:
        c = self.c
        if it < c.warmup:
            return c.lr * (it + 1) / c.warmup
        frac = (it - c.warmup) / max(1, c.iterations - c.warmup)
        return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))

    def throttle(self, name: str, factor: float) -> None:
        """Fault injection for tests and benchmarks: node ``name`` computes ``factor`` times slower."""
        self._put(name, ("throttle", factor))

    def kill(self, names: list[str]) -> None:
        """Fault injection for tests and benchmarks: kill -9 the processes of ``names``."""
        for n in names:
            self.procs[n].kill()

    def _boundary(self) -> None:
        """Between attempts: failures noticed while stepping, join requests, nodes that are ready."""
        if self._pending_failures:
            failed, self._pending_failures = self._pending_failures, {}
            self._replan(failed=failed, why="failure")
        if self.c.control:
            self._control_requests()
        self._admit()
        self._take_refined()

    def iteration(self, it: int) -> dict:
        """One whole iteration: microbatches along their paths, replica averaging, clipping, AdamW;
        through failures (see the class doc)."""
        self.iteration_no = it
        t_start = time.perf_counter()
        self._wall0 = time.time()
        batches = [next(self._batches) for _ in self.plan.paths]
        lost_s = 0.0
        aborted = False
        for attempt in range(self.c.max_retries + 1):
            t0 = None
            try:
                if aborted:  # re-plan around what was lost (more may be lost meanwhile: retried)
                    self._abort()
                    aborted = False
                self._check(force=True)
                self._boundary()
                rnd = self.round + 1
                t0 = time.perf_counter()
                losses = self.run_microbatches(rnd, batches)
                t_compute = time.perf_counter() - t0
                norm = self.synchronize(rnd)
                break
            except NodesLost as exc:
                if t0 is not None:
                    lost_s += time.perf_counter() - t0
                aborted = True
                self._event("aborted", attempt=attempt, lost=sorted(exc.names), seconds_lost=lost_s)
            except _Stalled as exc:
                lost_s += time.perf_counter() - t0
                aborted = True
                log.warning("iteration %d: the round stalled (%s); it is run again", it, exc)
                self._event("stalled", attempt=attempt, why=str(exc), seconds_lost=lost_s)
        else:
            raise NodeFailed(f"iteration {it} failed {self.c.max_retries + 1} times; giving up")
        coef = min(1.0, self.c.clip / (norm + 1e-6)) if self.c.clip > 0 else 1.0
        lr = self.lr_at(it)
        stats = self.step(rnd, coef, lr)
        seconds = time.perf_counter() - t_start
        self._train_s += seconds
        rec = {"iteration": it, "train_loss": sum(losses) / len(losses), "seconds": seconds,
               "compute_seconds": t_compute, "sync_seconds": seconds - t_compute - lost_s,
               "seconds_lost": lost_s, "attempts": attempt + 1,
               "predicted_seconds": self.predicted_s, "predicted_here_seconds": self.predicted_here_s,
               "predicted_with_sync_seconds": self.predicted_sync_s,
               "grad_norm": norm, "lr": lr,
               "train_seconds_total": self._train_s, "nodes": len(self.alloc),
               "missing_stages": self.missing_stages,
               "peak_in_flight": max(s["peak_in_flight"] for s in stats.values()),
               "processed": {n: s["processed"] for n, s in sorted(stats.items())},
               "node_compute_seconds": {n: s["compute_s"] for n, s in sorted(stats.items())}}
        self.last_trace = {n: [(k, mb, a - self._wall0, b - self._wall0) for k, mb, a, b in s["trace"]]
                           for n, s in stats.items()}
        self.metrics["iterations"].append(rec)
        done, c = it + 1, self.c
        if c.checkpoint and ((c.checkpoint_every and done % c.checkpoint_every == 0) or done == c.iterations):
            self.checkpoint(done)
        elif c.snapshot_every and done % c.snapshot_every == 0:
            self.snapshot = self.take_snapshot(done)
        try:
            self._watch_speed(stats)
        except NodesLost:
            pass  # re-planned around at the next boundary
        return rec

    def _abort(self) -> None:
        """Give up the current round on every live node (drop its work and gradients), then re-plan
        around the nodes that were lost, if any."""
        for name in self.inboxes:
            self._put(name, ("abort", self.round))
        failed, self._pending_failures = self._pending_failures, {}
        if failed:  # else the round stalled: the same plan runs it again
            self._replan(failed=failed, why="failure")

    def run_microbatches(self, rnd: int, batches: list | None = None) -> list[float]:
        """Send every microbatch of the plan to its origin, and every node its averaging order; wait
        until all microbatches are done; their losses. A stage's replicas average their gradients as
        soon as each has run its last backward pass of the round, while other stages still work; the
        norms that arrive meanwhile are kept for ``synchronize``."""
        self.round = max(self.round, rnd)
        plan = self.plan
        order = plan.priority or list(range(len(plan.paths)))
        rank = {mb: r for r, mb in enumerate(order)}
        if batches is None:
            batches = [next(self._batches) for _ in plan.paths]
        for mb in order:
            path = plan.paths[mb]
            tokens, targets = batches[mb]
            self._put(path.origin, ("mb", rnd, mb, rank[mb], tokens, targets, path))
        self._order_sync(rnd, plan.backward_counts())
        losses: dict[int, float] = {}
        while len(losses) < len(plan.paths):
            msg = self._round_recv(("done", "norm"), rnd)
            if msg[0] == "norm":
                self._norms.setdefault(msg[3], msg[4])
                self._norm_from.add(msg[2])
                continue
            losses[msg[2]] = msg[3]
        return [losses[mb] for mb in range(len(plan.paths))]

    def _round_recv(self, kind: str | tuple[str, ...], rnd: int) -> tuple:
        """The next ``kind`` message of round ``rnd``; raises _Stalled after ``stall_after`` seconds
        (at least twice the predicted iteration) without one; dead nodes raise NodesLost first (they
        are checked every 0.1 s meanwhile)."""
        if not self.c.stall_after:
            return self._recv(kind, rnd=rnd)
        # Never shorter than twice the round the plan predicts here: a slow round is not a stalled one.
        predicted = self.predicted_here_s if math.isfinite(self.predicted_here_s) else 0.0
        try:
            return self._recv(kind, timeout=max(self.c.stall_after, 2 * predicted), rnd=rnd)
        except _Timeout as exc:
            raise _Stalled(str(exc)) from None

    def _order_sync(self, rnd: int, expect: dict[str, int] | None) -> None:
        self._sync_round, self._norms, self._norm_from = rnd, {}, set()
        for name, s in self.alloc.items():
            self._put(name, ("sync", rnd, self.replicas[s], self.stage_counts[s],
                             None if expect is None else expect.get(name, 0)))

    def synchronize(self, rnd: int) -> float:
        """Replicas average their gradients over the microbatches their stage processed; returns the
        whole model's gradient norm (waits for the stages still averaging)."""
        if self._sync_round != rnd:
            self._order_sync(rnd, None)
        while not set(self.alloc) <= self._norm_from:
            _, _, name, stage, v = self._round_recv("norm", rnd)
            self._norms.setdefault(stage, v)
            self._norm_from.add(name)
        return math.sqrt(sum(self._norms.values()))

    def step(self, rnd: int, coef: float, lr: float) -> dict[str, dict]:
        """Every node scales its gradients by ``coef`` and steps; returns each node's statistics. A
        node that dies now is not waited for (the others step all the same); the plan is remade at
        the next boundary."""
        for name in self.inboxes:
            self._put(name, ("step", rnd, coef, lr))
        stats: dict[str, dict] = {}
        while set(self.inboxes) - set(stats):
            try:
                _, _, name, st = self._recv("stepped", rnd=rnd)
                stats[name] = st
            except NodesLost:
                pass  # _drop recorded them for the next boundary
        return stats

    def _watch_speed(self, stats: dict[str, dict]) -> None:
        """Mark nodes much slower than the plan expects, and re-plan with their measured speed."""
        if self.c.slow_factor <= 0 or self.missing_stages:
            return
        if self._planned_busy is None:
            self._planned_busy = dict.fromkeys(self.alloc, 0.0)
            for name, events in simulate(self.net, self.spec, self.plan).timeline.items():
                self._planned_busy[name] = sum(e.end - e.start for e in events if e.kind.startswith("compute"))
        busy = self._planned_busy
        top = max(busy.values(), default=0.0)
        ratios = {n: stats[n]["compute_s"] / busy[n] for n in stats
                  if n in busy and busy[n] >= 0.1 * top > 0}
        if len(ratios) < 3:
            return
        typical = statistics.median(ratios.values())
        slow = {}
        for n, r in ratios.items():
            if r > self.c.slow_factor * typical:
                self._slow_counts[n] = self._slow_counts.get(n, 0) + 1
                if self._slow_counts[n] >= self.c.slow_iterations:
                    slow[n] = r / typical
            else:
                self._slow_counts.pop(n, None)
        if slow:
            for n in slow:
                self._slow_counts.pop(n, None)
            self._event("slow", nodes=sorted(slow), factor={n: round(f, 2) for n, f in slow.items()})
            self._replan(slowed=slow, why="slow")

    # -- evaluation and checkpoints ------------------------------------------------------------
    def stage_states(self, all_replicas: bool = False, grads: bool = False) -> dict[str, tuple[int, dict]]:
        """Weights (or, with ``grads``, gradients) of one replica per held stage, or of every node:
        name -> (stage, {parameter name: tensor})."""
        request = ("grads",) if grads else ("state",)
        if all_replicas:
            got = self._ask(request, "state", sorted(self.alloc))
        else:
            got = self._ask_each_stage(request, "state")
        return {name: (msg[2], msg[3]) for name, msg in got.items()}

    def full_model(self) -> Llama:
        """The whole model: one replica of each held stage; a stage no node holds from its snapshot."""
        states = self.stage_states()
        parts = [sd for _, sd in states.values()]
        held = {stage for stage, _ in states.values()}
        for s in range(self.c.stages):
            if s not in held:
                parts.append(self.snapshot["stages"][s]["params"])
        model = Llama(self.p.model)
        model.load_state_dict(merge_state_dicts(parts))
        return model

    @torch.no_grad()
    def evaluate(self, it: int) -> dict:
        """Validation loss and perplexity of the whole model (one replica of each stage, merged), on
        the coordinator's device; and the loss with half of the stages after 0 dropped
        (``evaluate.half_of_the_stages``)."""
        device = torch.device(pick_device(self.c.device))
        model = self.full_model().to(device).eval()
        val = validation_loss(model, self._val, bf16=self.c.bf16)
        drop = half_of_the_stages(self.c.stages)
        dropped = validation_loss(model, self._val, kept_layers(model, self.c.stages, drop), bf16=self.c.bf16)
        rec = {"iteration": it, "val_loss": val, "perplexity": perplexity(val),
               "val_loss_half_stages_dropped": dropped, "dropped_stages": drop,
               "train_seconds_total": self._train_s}
        self.metrics["evaluations"].append(rec)
        return rec

    def checkpoint(self, it: int) -> None:
        """Write the run to ``checkpoint`` atomically: the whole model, each stage's weights and
        optimizer state, the metrics so far (enough for ``resume``)."""
        self.snapshot = self.take_snapshot(it)
        parts = [st["params"] for st in self.snapshot["stages"].values()]
        metrics = {k: self.metrics[k] for k in ("iterations", "evaluations", "events")}
        metrics["train_seconds_total"] = self._train_s
        checkpoint_file.save({"format": 2, "model": merge_state_dicts(parts),
                              "model_config": dataclasses.asdict(self.p.model), "config": dataclasses.asdict(self.c),
                              "iteration": it, "stages": self.snapshot["stages"], "metrics": metrics},
                             self.c.checkpoint)

    def train(self) -> dict:
        """Run every iteration (from where a resumed run stopped); evaluate every ``eval_every`` and at
        the end; snapshot and checkpoint as configured. Returns the metrics."""
        c = self.c
        if self.start_iteration == 0:
            self.progress({"event": "evaluation", **self.evaluate(0)})
        for it in range(self.start_iteration, c.iterations):
            self.progress({"event": "iteration", **self.iteration(it)})
            done = it + 1
            if done % c.eval_every == 0 or done == c.iterations:
                self.progress({"event": "evaluation", **self.evaluate(done)})
            if c.control:
                self._write_status()
        if c.metrics:
            write_metrics(self.metrics, c.metrics)
        if c.plot:
            plot_losses({"run": self.metrics}, c.plot)
        return self.metrics


def load_checkpoint(path: str, prep: Prepared) -> dict:
    """A checkpoint to resume ``prep``'s run from; PlanError when it is missing or does not match."""
    if not path:
        raise PlanError("resume needs checkpoint = the file the run wrote")
    try:
        ck = checkpoint_file.read(path)
    except FileNotFoundError:
        raise PlanError(f"cannot resume: checkpoint {path} does not exist") from None
    except checkpoint_file.CheckpointFileError as exc:
        raise PlanError(f"cannot resume: {exc}") from None
    if not isinstance(ck, dict) or ck.get("format") != 2 or "stages" not in ck:
        raise PlanError(f"cannot resume from {path}: it has no per-stage optimizer state (written by an older "
                        "roving, or not by `roving pipeline train`)")
    if ck["model_config"] != dataclasses.asdict(prep.model):
        raise PlanError(f"cannot resume from {path}: it holds another model ({ck['model_config']})")
    if ck["config"]["stages"] != prep.config.stages:
        raise PlanError(f"cannot resume from {path}: it splits the model into {ck['config']['stages']} stages, "
                        f"this run into {prep.config.stages}")
    if ck["iteration"] >= prep.config.iterations:
        raise PlanError(f"nothing to resume: {path} is at iteration {ck['iteration']} of {prep.config.iterations}")
    return ck


def write_metrics(metrics: dict, path: str) -> None:
    FilePath(path).parent.mkdir(parents=True, exist_ok=True)
    FilePath(path).write_text(json.dumps(metrics, indent=1))


def plot_losses(runs: dict[str, dict], out_png: str) -> None:
    """Train and validation loss of each run against iterations and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, m in runs.items():
        its = m["iterations"]
        line, = a.plot([r["iteration"] + 1 for r in its], [r["train_loss"] for r in its], alpha=0.35, lw=1)
        ev = m["evaluations"]
        a.plot([e["iteration"] for e in ev], [e["val_loss"] for e in ev], "o-", color=line.get_color(),
               label=f"{label} (validation)")
        b.plot([e["train_seconds_total"] for e in ev], [e["val_loss"] for e in ev], "o-",
               color=line.get_color(), label=label)
    a.set_xlabel("iteration")
    a.set_ylabel("loss (nats per byte)")
    a.set_title("train (faint) and validation loss")
    a.legend(fontsize=8)
    b.set_xlabel("training seconds (wall clock)")
    b.set_ylabel("validation loss")
    b.set_title("validation loss against time")
    b.legend(fontsize=8)
    fig.tight_layout()
    FilePath(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def run(config: TrainConfig, progress: Callable[[dict], None] | None = None) -> dict:
    """Check, plan and run ``config``; returns the metrics."""
    prep = prepare(config)
    with Trainer(prep, progress) as trainer:
        return trainer.train()
