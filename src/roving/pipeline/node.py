"""A stage node: a roving process that holds one stage and serves microbatches along their paths.

Protocol (tuples over roving queues; each node reads its own ``inbox``, a Queue it creates, so peers'
puts go straight to it over the transport and tensors travel as out-of-band frames, without copies).
``rnd`` names one attempt at an iteration's microbatch phase: when a node fails, the coordinator aborts
the round and runs the iteration again under a new plan with a new round number.

coordinator -> node
  ("peers", {name: inbox})                          everyone's inbox, after all are ready / on joining
  ("peer", name, inbox, link) / ("forget", [names]) a node joined (``link``: the emulated link to it,
                                                    or None) / nodes died: stop sending to them
  ("mb", rnd, mb, rank, tokens, targets, path)      to the microbatch's origin (a stage-0 node)
  ("sync", rnd, replicas, count, expect)            average gradients with ``replicas`` (sorted names
                                                    of this stage's nodes), over ``count`` microbatches,
                                                    as soon as this node has run ``expect`` backward
                                                    passes in the round (sent with the round's
                                                    microbatches, so a stage's replicas average while
                                                    other stages still work; None: at once)
  ("step", rnd, clip_coef, lr)                      scale gradients, AdamW step
  ("abort", rnd)                                    drop all work of the round and its gradients
  ("export",)                                       send this stage's weights and optimizer state
  ("load", stage, in_flight, params, optimizer)     hold ``stage`` from now on, with these weights
                                                    and optimizer state (a joining node, a node
                                                    taking over a stage, a resumed run)
  ("state",) / ("grads",)                           send this stage's weights / gradients
  ("throttle", factor)                              fault injection: compute ``factor`` times slower
  ("stop", [live names])
node -> node
  ("fwd", rnd, mb, hop, h, path)  activations; ``hop`` is the receiver's index in ``path.nodes``, or
                                  ``len(path.nodes)`` when they return to the origin for the loss
  ("bwd", rnd, mb, hop, g, path)  gradients; ``hop`` = -1 when they reach the origin
  ("grad", rnd, name, flat)       a replica's summed gradients
node -> coordinator (``control``)
  ("ready", name, incarnation, inbox) ("done", rnd, mb, loss) ("norm", rnd, name, stage, sq_norm)
  ("stepped", rnd, name, stats) ("state", name, stage, state_dict) ("exported", name, stage, params,
  optimizer) ("loaded", name, stage) ("stopped", name) ("error", name, traceback)
node -> coordinator (``beats``, from a thread of its own): ("beat", name, incarnation) every
``heartbeat`` seconds, so that a node that stops answering is found even while it computes.

Rounds: a node works on one round at a time. A message of a newer round than the node's means the
coordinator gave up the current one (the explicit abort may still be on its way): the node drops the
old round's work and gradients first. Messages of older rounds, and of a round aborted, are dropped
(a message can arrive after the abort of its round). So a re-run never mixes
with what was left of the aborted attempt, whatever order messages from different senders arrive in.

Sends to peers go through one sender thread per destination: a peer that died while a message to it
was in flight holds up only its own thread, never the node's loop or its sends to live peers.

Serving policy, as the simulator's: backward work (backward and loss) before forward work, then the
task that arrived first (the coordinator hands microbatches to their origins in the plan's priority
order, so microbatches ready together are served in that order). At most ``in_flight`` microbatches
are held (from the start of their forward here to the end of their backward here); a forward that would
exceed it waits.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .model import LlamaConfig
from .network import Link
from .plan import Route
from .stages import Stage

log = logging.getLogger(__name__)

#: serving classes: backward work (a backward, or the loss that starts one) before forward work.
BACKWARD_WORK, FORWARD_WORK = 0, 1
_WORK = ("mb", "fwd", "bwd", "grad", "sync", "step")


@dataclass(frozen=True)
class NodeSettings:
    """What a node needs besides its stage: plain values, pickled into the process."""

    name: str
    stage: int
    stages: int
    model: LlamaConfig
    seed: int
    in_flight: int
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    device: str = "cpu"
    bf16: bool = False
    threads: int = 1
    #: this node's position among the nodes (picks its GPU when several share a machine).
    index: int = 0
    #: destination node -> link, when the network is emulated (None: send at once).
    emulate: dict[str, Link] | None = None
    #: how many times a node of this name was started before (a restarted node is a new incarnation).
    incarnation: int = 0
    #: seconds between heartbeats (0: none).
    heartbeat: float = 0.5


def pick_device(want: str = "auto", index: int = 0) -> str:
    """``auto``: a CUDA device when there is one (node ``index`` takes device ``index`` modulo their
    count, so nodes sharing a machine spread over its GPUs), else the CPU."""
    if want == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{index % torch.cuda.device_count()}"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {want!r} asked for, but this node has no CUDA device")
    return want


class _Sender:
    """One destination's outgoing messages, sent in order from a thread of their own."""

    def __init__(self, dst: str, q: Any) -> None:
        self.dst, self.q = dst, q
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.thread = threading.Thread(target=self._run, name=f"roving-send-{dst}", daemon=True)
        self.thread.start()

    def push(self, fn: Callable[[Any], None]) -> None:
        with self._cond:
            if not self._closed:
                self._items.append(fn)
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                fn = self._items.popleft()
            try:
                fn(self.q)
            except Exception:  # a dead peer: the coordinator finds out by its heartbeats
                log.warning("send to %s failed", self.dst, exc_info=True)

    def confirm(self, timeout: float) -> bool:
        """True when everything pushed so far has reached the destination (a round trip from this
        sender's own connection, after the messages before it), within ``timeout`` seconds."""
        done = threading.Event()

        def ping(q: Any) -> None:
            q.qsize()
            done.set()

        self.push(ping)
        return done.wait(timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify()


class Peers:
    """Sends to other nodes' inboxes, each through its own sender thread: directly, or held back by
    the link emulator."""

    def __init__(self, me: str, inboxes: dict[str, Any], emulate: dict[str, Link] | None) -> None:
        self.me = me
        self.senders: dict[str, _Sender] = {}
        self.emulator = None
        if emulate:
            from .emulate import LinkEmulator

            self.emulator = LinkEmulator(emulate)
        for name, q in inboxes.items():
            self.add(name, q)

    def add(self, name: str, q: Any, link: Link | None = None) -> None:
        if name == self.me:
            return
        if self.emulator is not None and link is not None:
            self.emulator.add_link(name, link)
        old = self.senders.pop(name, None)
        if old is not None:
            old.close()
        self.senders[name] = _Sender(name, q)

    def forget(self, names: list[str]) -> None:
        """Stop sending to ``names`` (declared dead); exit will not wait for them to answer."""
        from roving.transport.endpoint import abandon

        for name in names:
            sender = self.senders.pop(name, None)
            if sender is not None:
                sender.close()
                abandon(getattr(sender.q, "_address", ""))

    def put(self, dst: str, msg: tuple) -> None:
        """Send ``msg`` to ``dst`` at once (no emulated link); nothing when ``dst`` was forgotten."""
        sender = self.senders.get(dst)
        if sender is not None:
            sender.push(lambda q: q.put(msg))

    def send(self, dst: str, msg: tuple, payload: torch.Tensor) -> None:
        sender = self.senders.get(dst)
        if sender is None:  # a peer declared dead: the round is being aborted
            return

        def put(q: Any) -> None:
            q.put(msg)

        if self.emulator is None or not self.emulator.has_link(dst):
            sender.push(put)
        else:
            self.emulator.send(dst, payload.numel() * payload.element_size(), lambda: sender.push(put))

    def confirm(self, live: list[str], timeout: float = 20.0) -> None:
        """Make sure everything sent to the live peers has arrived (the transport confirms per
        connection, and each sender thread has its own)."""
        if self.emulator is not None:
            self.emulator.drain(timeout)
            self.emulator.close()
        for name in live:
            sender = self.senders.get(name)
            if sender is not None and not sender.confirm(timeout):
                log.warning("%s: sends to %s not confirmed within %g s", self.me, name, timeout)
        self.close()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the sender threads and wait for them (bounded: one stuck on a dead peer is left),
        so that none is inside the transport when the process exits."""
        senders, self.senders = list(self.senders.values()), {}
        for sender in senders:
            sender.close()
        deadline = time.monotonic() + timeout
        for sender in senders:
            sender.thread.join(max(0.0, deadline - time.monotonic()))


class StageNode:
    def __init__(self, s: NodeSettings, inbox: Any, control: Any, release: Any, beats: Any = None) -> None:
        self.s, self.inbox, self.control, self.release, self.beats = s, inbox, control, release, beats
        self.name = s.name
        self.device = torch.device(pick_device(s.device, s.index))
        torch.manual_seed(s.seed)
        self.peers: Peers | None = None
        self.round = -1
        self.aborted = -1  # the latest round given up: its messages are dropped
        self.throttle = 1.0
        self._hold(s.stage, s.in_flight)
        self.stats: dict[str, Any] = {"processed": 0, "compute_s": 0.0, "peak_in_flight": 0, "trace": []}

    def _hold(self, stage: int, in_flight: int) -> None:
        """Build the modules and optimizer of ``stage`` (initial weights from the seed)."""
        self.stage_index, self.in_flight = stage, in_flight
        self.stage = Stage(self.s.model, stage, self.s.stages, seed=self.s.seed).to(self.device)
        self.params = [p for p in self.stage.parameters()]
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.params, lr=self.s.lr, weight_decay=self.s.weight_decay,
                                     betas=self.s.betas, **fused)
        self._clear_round()

    def _clear_round(self) -> None:
        self.pending: list[tuple] = []  # (class, arrival, kind, message)
        self.arrivals = 0
        self.stash: dict[tuple[int, int], tuple] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.sync_order: dict[int, tuple[list[str], int, int | None]] = {}
        self.backwards = 0  # backward passes run in the current round
        self._losses: dict[tuple[int, int], float] = {}
        self.opt.zero_grad(set_to_none=True)

    # -- helpers -----------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.s.bf16)

    def _in(self, t: torch.Tensor, grad: bool = False) -> torch.Tensor:
        t = t.to(self.device, non_blocking=True)
        return t.requires_grad_(True) if grad else t

    @staticmethod
    def _out(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous()

    def _beat(self) -> None:
        while not self._leaving.is_set():
            self.beats.put(("beat", self.name, self.s.incarnation))
            self._leaving.wait(self.s.heartbeat)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        self._leaving = threading.Event()
        beating = None
        if self.beats is not None and self.s.heartbeat > 0:
            beating = threading.Thread(target=self._beat, name="roving-heartbeat", daemon=True)
            beating.start()
        self.control.put(("ready", self.name, self.s.incarnation, self.inbox))
        while True:
            task = self._next_task()
            if task is None:
                msg = self.inbox.get()
                if msg[0] == "stop":
                    break
                self._accept(msg)
                continue
            t0 = time.perf_counter()
            self._serve(*task)
            t1 = time.perf_counter()
            if self.throttle > 1.0:  # fault injection: a node slowed down by other work
                time.sleep((t1 - t0) * (self.throttle - 1.0))
                t1 = time.perf_counter()
            self.stats["compute_s"] += t1 - t0
            # wall-clock spans of the work done (one clock for every process on a machine)
            self.stats["trace"].append((task[0], task[1][2], time.time() - (t1 - t0), time.time()))
        self._leaving.set()
        if beating is not None:
            beating.join(timeout=5)
        self._shut_down(msg[1] if len(msg) > 1 else None)

    def _shut_down(self, live: list[str] | None) -> None:
        """Leave without stranding anyone: every send to a live peer is confirmed (a round trip to each
        inbox) while all nodes are still up, and the process exits only when the coordinator releases
        it, so no exiting process waits on a peer that has gone."""
        if self.peers is not None:
            self.peers.confirm([n for n in (live if live is not None else self.peers.senders) if n != self.name])
        self.control.put(("stopped", self.name))
        self.release.get(timeout=60)

    def _current(self, rnd: int) -> bool:
        """Whether a message of round ``rnd`` is to be handled (see the module doc, Rounds)."""
        if rnd < self.round or rnd <= self.aborted:
            return False
        if rnd > self.round:
            if self.stash or self.pending or self.grads or self.sync_order:
                self._clear_round()
            self.round = rnd
            self.backwards = 0
        return True

    def _accept(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in _WORK and not self._current(msg[1]):
            return
        if kind in ("mb", "fwd", "bwd"):
            if kind == "fwd" and msg[3] < len(msg[5].nodes) or kind == "mb":
                cls = FORWARD_WORK
            else:  # a backward, or activations back at the origin for the loss
                cls = BACKWARD_WORK
            self.arrivals += 1
            self.pending.append((cls, self.arrivals, kind, msg))
        elif kind == "peers":
            if self.peers is None:
                self.peers = Peers(self.name, msg[1], self.s.emulate)
            else:
                for name, q in msg[1].items():
                    self.peers.add(name, q)
        elif kind == "peer":
            self.peers.add(msg[1], msg[2], msg[3] if len(msg) > 3 else None)
        elif kind == "forget":
            self.peers.forget(msg[1])
        elif kind == "abort":
            if msg[1] >= self.round:
                self._clear_round()
                self.round = msg[1]
            self.aborted = max(self.aborted, msg[1])
        elif kind == "sync":
            self.sync_order[msg[1]] = (msg[2], msg[3], msg[4] if len(msg) > 4 else None)
            self._try_sync(msg[1])
        elif kind == "grad":
            self.grads.setdefault(msg[1], {})[msg[2]] = msg[3]
            self._try_sync(msg[1])
        elif kind == "step":
            self._step(msg[1], msg[2], msg[3])
        elif kind == "export":
            params = {k: v.detach().to("cpu") for k, v in self.stage.state_dict().items()}
            self.control.put(("exported", self.name, self.stage_index, params, _to_cpu(self.opt.state_dict())))
        elif kind == "load":
            _, stage, in_flight, params, opt_state = msg
            if stage != self.stage_index:
                self._hold(stage, in_flight)
            self.in_flight = in_flight
            self.stage.load_state_dict(params)
            if opt_state is not None:
                self.opt.load_state_dict(opt_state)
            self._clear_round()
            self.control.put(("loaded", self.name, stage))
        elif kind == "state":
            sd = {k: v.detach().to("cpu") for k, v in self.stage.state_dict().items()}
            self.control.put(("state", self.name, self.stage_index, sd))
        elif kind == "grads":  # for checks: the gradients as they are now
            sd = {n: p.grad.detach().to("cpu") for n, p in self.stage.named_parameters() if p.grad is not None}
            self.control.put(("state", self.name, self.stage_index, sd))
        elif kind == "throttle":
            self.throttle = float(msg[1])
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _next_task(self):
        best = None
        room = len(self.stash) < self.in_flight
        for i, item in enumerate(self.pending):
            # a new forward here needs room; a forward at the origin that returns for the loss does not
            if item[0] == FORWARD_WORK and not room:
                continue
            if best is None or item[:2] < self.pending[best][:2]:
                best = i
        if best is None:
            return None
        item = self.pending.pop(best)
        return item[2], item[3]

    def _serve(self, kind: str, msg: tuple) -> None:
        if kind == "mb":
            _, rnd, mb, _, tokens, targets, path = msg
            with self._autocast():
                h = self.stage(self.stage.embed(self._in(tokens)))
            self.stash[rnd, mb] = (None, h, self._in(targets))
            self._track()
            self._forward_on(rnd, mb, 0, h, path)
        elif kind == "fwd":
            _, rnd, mb, hop, h_in, path = msg
            if hop == len(path.nodes):  # back at the origin: final norm, head and loss
                x = self._in(h_in, grad=True)
                _, _, targets = self.stash[rnd, mb]
                with self._autocast():
                    loss = self.stage.loss(x, targets)
                loss.backward()
                self._backward_on(rnd, mb, hop - 1, x.grad, path, loss=float(loss.detach()))
                return
            x = self._in(h_in, grad=True)
            with self._autocast():
                y = self.stage(x)
            self.stash[rnd, mb] = (x, y, None)
            self._track()
            self._forward_on(rnd, mb, hop + 1, y, path)
        else:  # bwd
            _, rnd, mb, hop, g, path = msg
            x, y, _ = self.stash.pop((rnd, mb))
            y.backward(self._in(g))
            self.stats["processed"] += 1
            self.backwards += 1
            if hop == -1:
                self.control.put(("done", rnd, mb, self._losses.pop((rnd, mb))))
            else:
                self._backward_on(rnd, mb, hop - 1, x.grad, path)
            self._try_sync(rnd)  # after the send: the next node's work does not wait for the averaging

    def _track(self) -> None:
        self.stats["peak_in_flight"] = max(self.stats["peak_in_flight"], len(self.stash))

    def _forward_on(self, rnd: int, mb: int, hop: int, h: torch.Tensor, path: Route) -> None:
        """Send activations to the node at ``hop`` of the path (the origin when past the end)."""
        out = self._out(h)
        if hop == len(path.nodes):
            if not path.nodes:  # a path that visits no other stage: the loss runs here at once
                self._accept(("fwd", rnd, mb, hop, out, path))
                return
            dst = path.origin
        else:
            dst = path.nodes[hop]
        self.peers.send(dst, ("fwd", rnd, mb, hop, out, path), out)

    def _backward_on(self, rnd: int, mb: int, hop: int, g: torch.Tensor, path: Route,
                     loss: float | None = None) -> None:
        if loss is not None:
            self._losses[rnd, mb] = loss
        out = self._out(g)
        if hop == -1 and not path.nodes:
            self._accept(("bwd", rnd, mb, -1, out, path))
            return
        dst = path.origin if hop == -1 else path.nodes[hop]
        self.peers.send(dst, ("bwd", rnd, mb, hop, out, path), out)

    # -- replica averaging and the optimizer step ----------------------------------------------
    def _flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                          for p in self.params])

    def _try_sync(self, rnd: int) -> None:
        """Send this replica's gradients to the other replicas once its backward passes of the round
        are all done; average once every replica's have arrived (then report the squared norm)."""
        if rnd not in self.sync_order:
            return
        replicas, count, expect = self.sync_order[rnd]
        got = self.grads.setdefault(rnd, {})
        if self.name not in got:
            if expect is not None and self.backwards < expect:
                return
            mine = self._flat_grads()
            got[self.name] = mine
            out = self._out(mine)
            for r in replicas:
                if r != self.name:
                    self.peers.send(r, ("grad", rnd, self.name, out), out)
        if any(r not in got for r in replicas):
            return
        # Every replica adds the same tensors in the same order: the results are bitwise equal.
        total = torch.zeros_like(got[self.name])
        for r in replicas:
            total += got[r].to(self.device)
        total /= max(count, 1)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
        del self.grads[rnd], self.sync_order[rnd]
        self.control.put(("norm", rnd, self.name, self.stage_index, float(total.pow(2).sum())))

    def _step(self, rnd: int, coef: float, lr: float) -> None:
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        stats = dict(self.stats)
        self.stats.update(processed=0, compute_s=0.0, peak_in_flight=0, trace=[])
        self.control.put(("stepped", rnd, self.name, stats))


def _to_cpu(obj: Any) -> Any:
    """An optimizer state dict with its tensors on the CPU (to travel and to be saved)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def node_main(settings: NodeSettings, control: Any, release: Any, beats: Any = None) -> None:
    """The target of a node's roving Process."""
    import roving

    torch.set_num_threads(settings.threads)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    try:
        inbox = roving.Queue()
        StageNode(settings, inbox, control, release, beats).run()
    except BaseException:
        control.put(("error", settings.name, traceback.format_exc()))
        raise
