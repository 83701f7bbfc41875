"""Discrete-event model of one training iteration; every plan and baseline is judged by it.

What it models, and the policy it follows:

* A microbatch's path ``origin -> n1 -> ... -> nk`` runs forward at the origin (embedding and stage 0's
  layers), forward at each visited node, returns to the origin for final norm, head and loss (forward
  and backward, one task), then runs backward in reverse order ``nk -> ... -> n1`` and ends with the
  backward of stage 0's layers at the origin.
* A node computes one task at a time and never preempts. When several tasks wait it serves backward
  work (backward and loss) before forward work, then the task that became ready first, then the
  microbatch with the higher planned priority (lower index in ``plan.priority``, else microbatch id).
* Memory: a node holds at most ``node.in_flight(stage)`` microbatches in flight (its ``memory`` count,
  or what its ``memory_mb`` leaves after the weights of the stage it holds, ``costs.stage_memory``),
  counted from the start of a microbatch's forward there until its backward there ends. A forward that would
  exceed it waits; other waiting tasks may go first. A plan whose waits form a cycle deadlocks: the result
  says so and its makespan is infinite.
* Transfers go over the directed link between two nodes. Transfers on one directed link that overlap
  share its bandwidth equally (processor sharing: n transfers each get bandwidth/n); the latency is
  added once per transfer after its bytes have gone. Sending does not occupy the sender's compute, and
  different links do not contend with each other (no shared NIC model). With ``link_sharing=False``
  every transfer has the link's whole bandwidth however many overlap (as the SkipPipe paper's own
  simulator has it): a second judge, for plans compared under both models.
* The iteration ends when the last microbatch's final backward ends. Replica synchronisation is not
  modelled unless ``sync_bytes`` gives each stage's gradient bytes (as the SkipPipe paper's simulator,
  by default it is not): then every node, as soon as it has run its last backward of the iteration,
  sends its gradients to each other replica of its stage (over the link between the two nodes, as
  any transfer), and the iteration ends when every stage's replicas have received each other's
  gradients as well.
* Processors: each node has one of its own, unless ``shared_cores`` says that all nodes share one
  machine with that many cores (a geo-distributed run emulated on one machine): then the compute
  tasks running at once share the cores equally (processor sharing: with n > cores running, each
  progresses at cores/n of its speed), so nodes that the plan runs in parallel slow each other down.

The simulation is deterministic: ties are broken by event order, which depends only on the plan.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

from .costs import ModelSpec, StageCosts, stage_costs
from ..errors import PlanError
from .network import Network
from .plan import Plan

class Work(IntEnum):
    """What a compute task does."""

    FWD = 0
    LOSS = 1  # final norm, head and loss, forward and backward, at the origin
    BWD = 2


FWD, LOSS, BWD = Work.FWD, Work.LOSS, Work.BWD
KIND_NAMES = {FWD: "compute-fwd", LOSS: "compute-loss", BWD: "compute-bwd"}
_EPS_BYTES = 1e-3


class EventKind(IntEnum):
    """What happens at a time on the simulator's event heap."""

    #: a node's compute task ended (each node on a processor of its own)
    COMPUTED = 0
    #: the transfers on a link may have sent all their bytes (stale once the link's ``version`` moved on)
    LINK = 1
    #: a microbatch arrived at its next node, or a replica's gradients at another replica
    ARRIVED = 2
    #: on a shared machine, compute tasks may have ended (stale once the processors' version moved on)
    CPU = 3


# the members, looked up once (an Enum member read through its class costs an attribute lookup)
_COMPUTED, _LINK, _ARRIVED, _CPU = EventKind.COMPUTED, EventKind.LINK, EventKind.ARRIVED, EventKind.CPU


@dataclass(frozen=True)
class Event:
    """One stretch of a node's timeline. ``kind``: compute-fwd, compute-bwd, compute-loss, send, idle,
    or sync (gradients sent to another replica of the stage; ``peer`` names it)."""

    kind: str
    start: float
    end: float
    microbatch: int = -1
    peer: str = ""


#: timeline kind of a replica's gradients on their way to another replica (``sync_bytes``).
SYNC_SEND = "sync"


@dataclass
class SimResult:
    makespan: float
    deadlock: bool
    #: per node, its events in start order (sends are on the sender's timeline).
    timeline: dict[str, list[Event]] = field(default_factory=dict)
    #: when each microbatch's last backward ended.
    finish: list[float] = field(default_factory=list)
    #: the most microbatches each node held in flight at once.
    peak_in_flight: dict[str, int] = field(default_factory=dict)
    #: with ``sync_bytes``: when each stage with two or more replicas had its gradients averaged.
    sync_end: dict[int, float] = field(default_factory=dict)


class Compute(NamedTuple):
    """A step of a microbatch: ``work`` at ``node`` for ``seconds``."""

    node: str
    work: Work
    seconds: float


class Send(NamedTuple):
    """A step of a microbatch: its activations (or gradients) from ``src`` to ``dst``."""

    src: str
    dst: str


def microbatch_steps(network: Network, model: ModelSpec, plan: Plan, cache: dict) -> list[list[Compute | Send]]:
    """Each microbatch's steps in order (the module doc); ``cache`` keeps the stage costs by speed."""
    _new = tuple.__new__  # the NamedTuples without their Python-level __new__: this is the planner's hot path
    out = []
    for path in plan.paths:
        seq: list[Compute | Send] = []
        origin = path.origin

        def costs(name: str) -> StageCosts:
            speed = network.node(name).speed
            c = cache.get(speed)
            if c is None:
                c = cache[speed] = stage_costs(model, plan.stages, speed)
            return c

        c0 = costs(origin)
        seq.append(_new(Compute, (origin, FWD, c0.forward[0])))
        prev = origin
        for node, stage in zip(path.nodes, path.stages):
            seq.append(_new(Send, (prev, node)))
            seq.append(_new(Compute, (node, FWD, costs(node).forward[stage])))
            prev = node
        seq.append(_new(Send, (prev, origin)))
        seq.append(_new(Compute, (origin, LOSS, c0.loss)))
        prev = origin
        for node, stage in zip(reversed(path.nodes), reversed(path.stages)):
            seq.append(_new(Send, (prev, node)))
            seq.append(_new(Compute, (node, BWD, costs(node).backward[stage])))
            prev = node
        seq.append(_new(Send, (prev, origin)))
        seq.append(_new(Compute, (origin, BWD, c0.backward[0])))
        out.append(seq)
    return out


@dataclass(eq=False, slots=True)
class Transfer:
    """Bytes on their way over a link: how many are ``left`` to send, and when the transfer began."""

    left: float
    start: float


@dataclass(eq=False, slots=True)
class LinkState:
    """A directed link's transfers now (``active``, by microbatch, or ("sync", src, dst) for a replica's
    gradients), when their progress was last brought up to date (``updated``), and a ``version`` that
    every change of ``active`` moves on (a LINK event of an older version is stale)."""

    bandwidth: float
    latency: float
    updated: float
    version: int = 0
    active: dict = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class Running:
    """A compute task on the shared machine: the seconds of work ``left`` at full speed, when it
    started, its microbatch and its work."""

    left: float
    start: float
    mb: int
    work: Work


def simulate(network: Network, model: ModelSpec, plan: Plan, *, record: bool = True,
             shared_cores: int = 0, sync_bytes: Sequence[float] | None = None,
             link_sharing: bool = True) -> SimResult:
    """Run one iteration of ``plan`` on ``network``. Pure and deterministic; never raises on a
    deadlocked plan (see ``SimResult.deadlock``). ``record=False`` skips the timeline (faster).
    ``shared_cores`` > 0: every node runs on one machine with that many cores; ``sync_bytes[s]``:
    the bytes of stage ``s``'s gradients, to model replica synchronisation (see the module doc;
    ``costs.gradient_bytes``); ``link_sharing=False``: overlapping transfers on a link do not share its
    bandwidth. PlanError when ``sync_bytes`` gives fewer stages than replicated ones."""
    return Simulation(network, model, plan, record=record, shared_cores=shared_cores, sync_bytes=sync_bytes,
                      link_sharing=link_sharing).run()


class Simulation:
    """One iteration being simulated (``simulate``): the nodes' queues and memory, the links' transfers,
    the shared machine's tasks and the replicas' synchronisation, advanced by ``run``'s event loop. The
    event heap holds (time, order, EventKind, a, b): ``order`` breaks ties by insertion, ``a`` and ``b``
    are the event's subject (COMPUTED: node, (microbatch, work); LINK: link key, version; ARRIVED:
    microbatch or sync key, None; CPU: None, version). A node's queue holds (0 for backward work else 1,
    ready time, planned rank, microbatch, work, seconds): the order in which it serves them."""

    __slots__ = ("network", "record", "shared_cores", "steps", "nbytes", "rank", "alloc", "mem", "busy", "queue",
                 "inflight", "peak", "timeline", "step_idx", "finish", "links", "heap", "counter", "running",
                 "cpu_updated", "cpu_version", "sync_bytes", "sync_left", "sync_end", "bwd_left", "group",
                 "link_sharing")

    def __init__(self, network: Network, model: ModelSpec, plan: Plan, *, record: bool = True,
                 shared_cores: int = 0, sync_bytes: Sequence[float] | None = None,
                 link_sharing: bool = True) -> None:
        self.network, self.record, self.shared_cores = network, record, shared_cores
        self.link_sharing = link_sharing
        self.steps = microbatch_steps(network, model, plan, {})
        self.nbytes = model.transfer_bytes
        n_mb = len(self.steps)
        prio = list(plan.priority) if plan.priority else list(range(n_mb))
        self.rank = [0] * n_mb
        for r, mb in enumerate(prio):
            self.rank[mb] = r
        alloc = self.alloc = plan.allocation
        mem = self.mem = {n.name: n.in_flight(alloc[n.name], model, plan.stages) if n.name in alloc else n.memory
                          for n in network.nodes}
        self.busy = dict.fromkeys(mem, False)
        self.queue: dict[str, list] = {n: [] for n in mem}
        self.inflight = dict.fromkeys(mem, 0)
        self.peak = dict.fromkeys(mem, 0)
        self.timeline: dict[str, list[Event]] = {n: [] for n in mem} if record else {}
        self.step_idx = [-1] * n_mb
        self.finish = [math.nan] * n_mb
        self.links: dict[tuple, LinkState] = {}
        self.heap: list = []
        self.counter = 0
        # the shared machine: node -> its running task; when their progress was last brought up to
        # date, and the version of the processors' state
        self.running: dict[str, Running] = {}
        self.cpu_updated, self.cpu_version = 0.0, 0
        # replica synchronisation: backward passes each node has left; per stage, gradients still to arrive
        self.sync_bytes = sync_bytes
        self.sync_left: dict[int, int] = {}
        self.sync_end: dict[int, float] = {}
        self.bwd_left: dict[str, int] = {}
        self.group: dict[int, list[str]] = {}
        if sync_bytes is not None:
            self._plan_sync(plan, sync_bytes)

    def _plan_sync(self, plan: Plan, sync_bytes: Sequence[float]) -> None:
        group: dict[int, list[str]] = {}
        for n, st in self.alloc.items():
            if n in self.mem:
                group.setdefault(st, []).append(n)
        self.group = {st: ns for st, ns in group.items() if len(ns) > 1}
        if any(st >= len(sync_bytes) for st in self.group):
            raise PlanError(f"sync_bytes gives {len(sync_bytes)} stages; the plan has {plan.stages}")
        self.sync_left = {st: len(ns) * (len(ns) - 1) for st, ns in self.group.items()}
        counts = plan.backward_counts()
        self.bwd_left = {n: counts.get(n, 0) for ns in self.group.values() for n in ns}

    # -- the event loop ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Simulate the iteration to its end (or to a deadlock); the result."""
        for node in [n for n, left in self.bwd_left.items() if left == 0]:
            self.start_sync(node, 0.0)
        for mb in range(len(self.steps)):
            self.advance(mb, 0.0)
        heap = self.heap
        while heap:
            t, _, kind, a, b = heapq.heappop(heap)
            if kind == _COMPUTED:
                self.computed(a, b[0], b[1], t)
            elif kind == _LINK:
                self.link_event(a, b, t)
            elif kind == _ARRIVED:
                self.arrived(a, t)
            else:
                self.cpu_event(b, t)
        return self.result()

    def push(self, t: float, kind: EventKind, a: Any, b: Any) -> None:  # what a and b are depends on kind
        self.counter += 1
        heapq.heappush(self.heap, (t, self.counter, kind, a, b))

    def computed(self, node: str, mb: int, work: Work, t: float) -> None:
        """``node`` ended its task ``work`` of microbatch ``mb`` at ``t``."""
        self.busy[node] = False
        if work == BWD:
            self.inflight[node] -= 1
        self.advance(mb, t)
        if work == BWD:
            self.backward_done(node, t)
        self.try_start(node, t)

    def link_event(self, key: tuple, version: int, t: float) -> None:
        """The transfers on link ``key`` (sender, receiver[, transfer]) may have sent their bytes (unless the
        link changed since)."""
        ls = self.links[key]
        if version != ls.version:
            return
        self.settle(ls, t)
        done = [mb for mb, v in ls.active.items() if v.left <= _EPS_BYTES]
        for mb in done:
            start = ls.active.pop(mb).start
            self.push(t + ls.latency, _ARRIVED, mb, None)
            if self.record:
                if isinstance(mb, tuple):
                    self.timeline[key[0]].append(Event(SYNC_SEND, start, t + ls.latency, -1, key[1]))
                else:
                    self.timeline[key[0]].append(Event("send", start, t + ls.latency, mb, key[1]))
        self.reschedule(ls, key, t)

    def arrived(self, what: int | tuple[str, str, str], t: float) -> None:
        """Microbatch ``what`` arrived at its next node, or (a sync key) a replica's gradients."""
        if isinstance(what, tuple):
            st = self.alloc[what[1]]
            self.sync_left[st] -= 1
            if self.sync_left[st] == 0:
                self.sync_end[st] = t
        else:
            self.advance(what, t)

    def cpu_event(self, version: int, t: float) -> None:
        """On the shared machine, the tasks with no work left end (unless the processors changed since)."""
        if version != self.cpu_version:
            return
        self.settle_cpu(t)
        finished = [n for n, v in self.running.items() if v.left <= 1e-12]
        for node in finished:
            task = self.running.pop(node)
            if self.record:
                self.timeline[node].append(Event(KIND_NAMES[task.work], task.start, t, task.mb))
            self.busy[node] = False
            if task.work == BWD:
                self.inflight[node] -= 1
            self.advance(task.mb, t)
            if task.work == BWD:
                self.backward_done(node, t)
        for node in finished:
            self.try_start(node, t)
        self.reschedule_cpu(t)

    # -- compute -----------------------------------------------------------------------------------
    def try_start(self, node: str, t: float) -> None:
        """Start the task ``node`` serves next (the module doc's policy), if it is free and one may start."""
        busy = self.busy
        if busy[node]:
            return
        q = self.queue[node]
        best = -1
        best_key = None
        inflight = self.inflight
        full = inflight[node] >= self.mem[node]
        for i, item in enumerate(q):
            if item[0] == 1 and full:
                continue
            if best_key is None or item < best_key:
                best, best_key = i, item
        if best < 0:
            return
        _, _, _, mb, work, dur = q.pop(best)
        if work == FWD:
            n = inflight[node] = inflight[node] + 1
            if n > self.peak[node]:
                self.peak[node] = n
        busy[node] = True
        if self.shared_cores:
            self.settle_cpu(t)
            self.running[node] = Running(dur, t, mb, work)
            self.reschedule_cpu(t)
            return
        self.push(t + dur, _COMPUTED, node, (mb, work))
        if self.record:
            self.timeline[node].append(Event(KIND_NAMES[work], t, t + dur, mb))

    def settle_cpu(self, t: float) -> None:
        """Bring the shared machine's tasks' work left up to ``t``."""
        if self.running:
            done = (t - self.cpu_updated) * min(1.0, self.shared_cores / len(self.running))
            for v in self.running.values():
                v.left -= done
        self.cpu_updated = t

    def reschedule_cpu(self, t: float) -> None:
        self.cpu_version += 1
        if self.running:
            least = min(v.left for v in self.running.values())
            self.push(t + max(least, 0.0) / min(1.0, self.shared_cores / len(self.running)), _CPU, None,
                      self.cpu_version)

    # -- transfers ---------------------------------------------------------------------------------
    def settle(self, ls: LinkState, t: float) -> None:
        """Bring the link's transfers' bytes left up to ``t`` (its bandwidth shared equally)."""
        active = ls.active
        if active:
            share = (t - ls.updated) * ls.bandwidth / len(active)
            for v in active.values():
                v.left -= share
        ls.updated = t

    def reschedule(self, ls: LinkState, key: tuple, t: float) -> None:
        ls.version += 1
        active = ls.active
        if active:
            least = min(v.left for v in active.values())
            self.push(t + max(least, 0.0) * len(active) / ls.bandwidth, _LINK, key, ls.version)

    def send_bytes(self, key: tuple, ident: int | tuple[str, str, str], nb: float, t: float) -> None:
        if not self.link_sharing:  # a link of its own for each transfer: (sender, receiver, transfer)
            key = (key[0], key[1], ident)
        ls = self.links.get(key)
        if ls is None:
            link = self.network.link(key[0], key[1])
            ls = self.links[key] = LinkState(link.bandwidth_bps, link.latency_s, t)
        self.settle(ls, t)
        ls.active[ident] = Transfer(nb, t)
        self.reschedule(ls, key, t)

    # -- microbatches and replicas -------------------------------------------------------------------
    def start_sync(self, node: str, t: float) -> None:
        """``node`` ran its last backward: its gradients go to each other replica of its stage."""
        assert self.sync_bytes is not None, "only a simulation given sync_bytes has backward passes to count"
        st = self.alloc[node]
        for peer in self.group[st]:
            if peer != node:
                self.send_bytes((node, peer), ("sync", node, peer), float(self.sync_bytes[st]), t)

    def backward_done(self, node: str, t: float) -> None:
        if node in self.bwd_left:
            self.bwd_left[node] -= 1
            if self.bwd_left[node] == 0:
                self.start_sync(node, t)

    def advance(self, mb: int, t: float) -> None:
        """Microbatch ``mb`` goes on to its next step at ``t`` (or ends)."""
        step_idx = self.step_idx
        i = step_idx[mb] = step_idx[mb] + 1
        seq = self.steps[mb]
        if i == len(seq):
            self.finish[mb] = t
            return
        step = seq[i]
        if isinstance(step, Compute):
            node, work, dur = step
            self.queue[node].append((0 if work != FWD else 1, t, self.rank[mb], mb, work, dur))
            self.try_start(node, t)
        else:
            self.send_bytes(step, mb, self.nbytes, t)

    # -- the result ----------------------------------------------------------------------------------
    def result(self) -> SimResult:
        deadlock = any(math.isnan(f) for f in self.finish) or any(left > 0 for left in self.sync_left.values())
        makespan = (math.inf if deadlock
                    else max(max(self.finish, default=0.0), max(self.sync_end.values(), default=0.0)))
        if self.record and not deadlock:
            for events in self.timeline.values():
                _add_idle(events, makespan)
        return SimResult(makespan, deadlock, self.timeline, self.finish, self.peak, self.sync_end)


def _add_idle(events: list[Event], makespan: float) -> None:
    """Sort a node's ``events`` and add its idle stretches between compute tasks (up to ``makespan``)."""
    events.sort(key=lambda e: (e.start, e.end))
    idle, last = [], 0.0
    for e in events:
        if e.kind.startswith("compute"):
            if e.start > last + 1e-12:
                idle.append(Event("idle", last, e.start))
            last = max(last, e.end)
    if makespan > last + 1e-12:
        idle.append(Event("idle", last, makespan))
    events.extend(idle)
    events.sort(key=lambda e: (e.start, e.end))


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one iteration of a plan, as a running training keeps it."""

    #: the microbatch phase, each node on a processor of its own (``simulate(...).makespan``); infinite
    #: when the plan deadlocks.
    iteration_s: float
    #: the same with every node sharing ``shared_cores`` cores of one machine; ``iteration_s`` without.
    here_s: float
    #: the whole iteration, the replicas' exchange of gradients included; NaN without ``sync_bytes``.
    with_sync_s: float
    #: per node of the plan's allocation, the compute seconds the plan gives it (0.0 for a node no
    #: route uses), from the ``iteration_s`` simulation.
    busy_s: dict[str, float]
    deadlock: bool

    @property
    def whole_s(self) -> float:
        """The iteration as judged with the replicas' exchange when it was asked for, else the
        microbatch phase (what the planner's ``sync_bytes`` choice compares plans by)."""
        return self.iteration_s if math.isnan(self.with_sync_s) else self.with_sync_s


def predict(plan: Plan, network: Network, model: ModelSpec, *, shared_cores: int = 0,
            sync_bytes: Sequence[float] | None = None) -> Prediction:
    """The predictions a training run keeps for the plan it runs: one simulation of the microbatch
    phase (which also gives each node's planned compute), one more with ``shared_cores`` > 0 (every
    node on one machine with that many cores), one more with ``sync_bytes`` (each stage's gradient
    bytes, when given and not empty). Pure and deterministic, like ``simulate``; never raises on a
    deadlocked plan."""
    res = simulate(network, model, plan)
    busy = dict.fromkeys(plan.allocation, 0.0)
    for name, events in res.timeline.items():
        busy[name] = sum(e.end - e.start for e in events if e.kind.startswith("compute"))
    here = (simulate(network, model, plan, record=False, shared_cores=shared_cores).makespan
            if shared_cores else res.makespan)
    with_sync = (simulate(network, model, plan, record=False, sync_bytes=sync_bytes).makespan
                 if sync_bytes else math.nan)
    return Prediction(res.makespan, here, with_sync, busy, res.deadlock)
