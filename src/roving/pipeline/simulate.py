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
  counted from the start of a microbatch's forward there until its backward there ends. A forward that would exceed it waits; other
  waiting tasks may go first. A plan whose waits form a cycle deadlocks: the result says so and its
  makespan is infinite.
* Transfers go over the directed link between two nodes. Transfers on one directed link that overlap
  share its bandwidth equally (processor sharing: n transfers each get bandwidth/n); the latency is
  added once per transfer after its bytes have gone. Sending does not occupy the sender's compute, and
  different links do not contend with each other (no shared NIC model).
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

from .costs import ModelSpec, StageCosts, stage_costs
from .errors import PlanError
from .network import Network
from .plan import Plan

FWD, LOSS, BWD = 0, 1, 2
KIND_NAMES = {FWD: "compute-fwd", LOSS: "compute-loss", BWD: "compute-bwd"}
_EPS_BYTES = 1e-3


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


def microbatch_steps(network: Network, model: ModelSpec, plan: Plan, cache: dict) -> list[list[tuple]]:
    """Each microbatch's tasks in order: (0, node, kind, seconds) for compute, (1, src, dst) for sends."""
    out = []
    for path in plan.paths:
        seq: list[tuple] = []
        origin = path.origin

        def costs(name: str) -> StageCosts:
            speed = network.node(name).speed
            c = cache.get(speed)
            if c is None:
                c = cache[speed] = stage_costs(model, plan.stages, speed)
            return c

        c0 = costs(origin)
        seq.append((0, origin, FWD, c0.forward[0]))
        prev = origin
        for node, stage in zip(path.nodes, path.stages):
            seq.append((1, prev, node))
            seq.append((0, node, FWD, costs(node).forward[stage]))
            prev = node
        seq.append((1, prev, origin))
        seq.append((0, origin, LOSS, c0.loss))
        prev = origin
        for node, stage in zip(reversed(path.nodes), reversed(path.stages)):
            seq.append((1, prev, node))
            seq.append((0, node, BWD, costs(node).backward[stage]))
            prev = node
        seq.append((1, prev, origin))
        seq.append((0, origin, BWD, c0.backward[0]))
        out.append(seq)
    return out


def simulate(network: Network, model: ModelSpec, plan: Plan, *, record: bool = True,
             shared_cores: int = 0, sync_bytes: Sequence[float] | None = None) -> SimResult:
    """Run one iteration of ``plan`` on ``network``. Pure and deterministic; never raises on a
    deadlocked plan (see ``SimResult.deadlock``). ``record=False`` skips the timeline (faster).
    ``shared_cores`` > 0: every node runs on one machine with that many cores; ``sync_bytes[s]``:
    the bytes of stage ``s``'s gradients, to model replica synchronisation (see the module doc;
    ``costs.gradient_bytes``)."""
    steps = microbatch_steps(network, model, plan, {})
    nbytes = model.transfer_bytes
    n_mb = len(steps)
    prio = list(plan.priority) if plan.priority else list(range(n_mb))
    rank = [0] * n_mb
    for r, mb in enumerate(prio):
        rank[mb] = r

    alloc = plan.allocation
    mem = {n.name: n.in_flight(alloc[n.name], model, plan.stages) if n.name in alloc else n.memory
           for n in network.nodes}
    busy = dict.fromkeys(mem, False)
    queue: dict[str, list] = {n: [] for n in mem}
    inflight = dict.fromkeys(mem, 0)
    peak = dict.fromkeys(mem, 0)
    timeline: dict[str, list[Event]] = {n: [] for n in mem} if record else {}
    step_idx = [-1] * n_mb
    finish = [math.nan] * n_mb
    # link state: [active {mb: [remaining_bytes, start]}, last_update, version, bandwidth, latency]
    links: dict[tuple[str, str], list] = {}
    heap: list = []
    counter = 0
    # shared machine: node -> [work left (seconds at full speed), start, mb, kind]; [last update, version]
    running: dict[str, list] = {}
    cpu = [0.0, 0]
    # replica synchronisation: backward passes each node has left; per stage, gradients still to arrive
    sync_left: dict[int, int] = {}
    sync_end: dict[int, float] = {}
    bwd_left: dict[str, int] = {}
    group: dict[int, list[str]] = {}
    if sync_bytes is not None:
        for n, st in alloc.items():
            if n in mem:
                group.setdefault(st, []).append(n)
        group = {st: ns for st, ns in group.items() if len(ns) > 1}
        if any(st >= len(sync_bytes) for st in group):
            raise PlanError(f"sync_bytes gives {len(sync_bytes)} stages; the plan has {plan.stages}")
        sync_left = {st: len(ns) * (len(ns) - 1) for st, ns in group.items()}
        counts = plan.backward_counts()
        bwd_left = {n: counts.get(n, 0) for ns in group.values() for n in ns}

    def push(t: float, kind: int, a, b) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(heap, (t, counter, kind, a, b))

    def try_start(node: str, t: float) -> None:
        if busy[node]:
            return
        q = queue[node]
        best = -1
        best_key = None
        full = inflight[node] >= mem[node]
        for i, item in enumerate(q):
            if item[0] == 1 and full:
                continue
            if best_key is None or item < best_key:
                best, best_key = i, item
        if best < 0:
            return
        _, _, _, mb, kind, dur = q.pop(best)
        if kind == FWD:
            inflight[node] += 1
            if inflight[node] > peak[node]:
                peak[node] = inflight[node]
        busy[node] = True
        if shared_cores:
            settle_cpu(t)
            running[node] = [dur, t, mb, kind]
            reschedule_cpu(t)
            return
        push(t + dur, 0, node, (mb, kind))
        if record:
            timeline[node].append(Event(KIND_NAMES[kind], t, t + dur, mb))

    def settle_cpu(t: float) -> None:
        if running:
            done = (t - cpu[0]) * min(1.0, shared_cores / len(running))
            for v in running.values():
                v[0] -= done
        cpu[0] = t

    def reschedule_cpu(t: float) -> None:
        cpu[1] += 1
        if running:
            least = min(v[0] for v in running.values())
            push(t + max(least, 0.0) / min(1.0, shared_cores / len(running)), 3, None, cpu[1])

    def settle(ls: list, t: float) -> None:
        active = ls[0]
        if active:
            share = (t - ls[1]) * ls[3] / len(active)
            for v in active.values():
                v[0] -= share
        ls[1] = t

    def reschedule(ls: list, key, t: float) -> None:
        ls[2] += 1
        active = ls[0]
        if active:
            least = min(v[0] for v in active.values())
            push(t + max(least, 0.0) * len(active) / ls[3], 1, key, ls[2])

    def send_bytes(key: tuple[str, str], ident, nb: float, t: float) -> None:
        ls = links.get(key)
        if ls is None:
            link = network.link(key[0], key[1])
            ls = links[key] = [{}, t, 0, link.bandwidth_bps, link.latency_s]
        settle(ls, t)
        ls[0][ident] = [nb, t]
        reschedule(ls, key, t)

    def start_sync(node: str, t: float) -> None:
        st = alloc[node]
        for peer in group[st]:
            if peer != node:
                send_bytes((node, peer), ("sync", node, peer), float(sync_bytes[st]), t)

    def backward_done(node: str, t: float) -> None:
        if node in bwd_left:
            bwd_left[node] -= 1
            if bwd_left[node] == 0:
                start_sync(node, t)

    def advance(mb: int, t: float) -> None:
        i = step_idx[mb] = step_idx[mb] + 1
        seq = steps[mb]
        if i == len(seq):
            finish[mb] = t
            return
        step = seq[i]
        if step[0] == 0:
            _, node, kind, dur = step
            queue[node].append((0 if kind != FWD else 1, t, rank[mb], mb, kind, dur))
            try_start(node, t)
        else:
            send_bytes((step[1], step[2]), mb, nbytes, t)

    for node in [n for n, left in bwd_left.items() if left == 0]:
        start_sync(node, 0.0)
    for mb in range(n_mb):
        advance(mb, 0.0)

    while heap:
        t, _, kind, a, b = heapq.heappop(heap)
        if kind == 0:  # compute done at node a
            mb, ckind = b
            busy[a] = False
            if ckind == BWD:
                inflight[a] -= 1
            advance(mb, t)
            if ckind == BWD:
                backward_done(a, t)
            try_start(a, t)
        elif kind == 1:  # a transfer on link a may have finished its bytes
            ls = links[a]
            if b != ls[2]:
                continue
            settle(ls, t)
            done = [mb for mb, v in ls[0].items() if v[0] <= _EPS_BYTES]
            for mb in done:
                start = ls[0].pop(mb)[1]
                push(t + ls[4], 2, mb, None)
                if record:
                    if isinstance(mb, tuple):
                        timeline[a[0]].append(Event(SYNC_SEND, start, t + ls[4], -1, a[1]))
                    else:
                        timeline[a[0]].append(Event("send", start, t + ls[4], mb, a[1]))
            reschedule(ls, a, t)
        elif kind == 2:  # arrival of microbatch a at the next node (or of a replica's gradients)
            if isinstance(a, tuple):
                st = alloc[a[1]]
                sync_left[st] -= 1
                if sync_left[st] == 0:
                    sync_end[st] = t
            else:
                advance(a, t)
        else:  # on a shared machine, compute tasks may have finished
            if b != cpu[1]:
                continue
            settle_cpu(t)
            finished = [n for n, v in running.items() if v[0] <= 1e-12]
            for node in finished:
                _, start, mb, ckind = running.pop(node)
                if record:
                    timeline[node].append(Event(KIND_NAMES[ckind], start, t, mb))
                busy[node] = False
                if ckind == BWD:
                    inflight[node] -= 1
                advance(mb, t)
                if ckind == BWD:
                    backward_done(node, t)
            for node in finished:
                try_start(node, t)
            reschedule_cpu(t)

    deadlock = any(math.isnan(f) for f in finish) or any(left > 0 for left in sync_left.values())
    makespan = math.inf if deadlock else max(max(finish, default=0.0), max(sync_end.values(), default=0.0))
    if record and not deadlock:
        for node, events in timeline.items():
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
    return SimResult(makespan, deadlock, timeline, finish, peak, sync_end)


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
