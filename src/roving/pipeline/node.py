"""A stage node: a roving process that holds one stage and serves microbatches along their paths.

Protocol (tuples over roving queues; each node reads its own ``inbox``, a Queue it creates, so peers'
puts go straight to it over the transport and tensors travel as out-of-band frames, without copies):

coordinator -> node
  ("peers", {name: inbox})                          everyone's inbox, once, after all are ready
  ("mb", it, mb, rank, tokens, targets, path)       to the microbatch's origin (a stage-0 node)
  ("sync", it, replicas, count)                     average gradients with ``replicas`` (sorted names
                                                    of this stage's nodes), over ``count`` microbatches
  ("step", it, clip_coef, lr)                       scale gradients, AdamW step
  ("state",) / ("grads",)                           send this stage's weights / gradients
  ("stop",)
node -> node
  ("fwd", it, mb, hop, h, path)  activations; ``hop`` is the receiver's index in ``path.nodes``, or
                                 ``len(path.nodes)`` when they return to the origin for the loss
  ("bwd", it, mb, hop, g, path)  gradients; ``hop`` = -1 when they reach the origin
  ("grad", it, name, flat)       a replica's summed gradients
node -> coordinator (``control``)
  ("ready", name, inbox) ("done", it, mb, loss) ("norm", it, name, stage, sq_norm)
  ("stepped", it, name, stats) ("state", name, stage, state_dict) ("error", name, traceback)

Serving policy, as the simulator's: backward work (backward and loss) before forward work, then the
task that arrived first (the coordinator hands microbatches to their origins in the plan's priority
order, so microbatches ready together are served in that order). At most ``in_flight`` microbatches
are held (from the start of their forward here to the end of their backward here); a forward that would
exceed it waits.
"""

from __future__ import annotations

import logging
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .model import LlamaConfig
from .network import Link
from .paths import Path
from .stages import Stage

log = logging.getLogger(__name__)

#: serving classes: backward work (a backward, or the loss that starts one) before forward work.
BACKWARD_WORK, FORWARD_WORK = 0, 1


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


class Peers:
    """Sends to other nodes' inboxes: directly, or held back by the link emulator."""

    def __init__(self, inboxes: dict[str, Any], emulate: dict[str, Link] | None) -> None:
        self.inboxes = inboxes
        self.emulator = None
        if emulate:
            from .emulate import LinkEmulator

            self.emulator = LinkEmulator(emulate)

    def send(self, dst: str, msg: tuple, payload: torch.Tensor) -> None:
        q = self.inboxes[dst]
        if self.emulator is None:
            q.put(msg)
        else:
            self.emulator.send(dst, payload.numel() * payload.element_size(), lambda: q.put(msg))

    def confirm(self, me: str) -> None:
        """Make sure everything sent has arrived: one round trip to every peer's inbox, from the
        thread that sent (the transport confirms per connection, and connections are per thread)."""
        others = [q for name, q in self.inboxes.items() if name != me]
        if self.emulator is None:
            for q in others:
                q.qsize()
            return
        self.emulator.drain()
        for name, q in self.inboxes.items():
            if name != me:
                self.emulator.send(name, 0, q.qsize)
        self.emulator.drain()
        self.emulator.close()


class StageNode:
    def __init__(self, s: NodeSettings, inbox: Any, control: Any, release: Any) -> None:
        self.s, self.inbox, self.control, self.release = s, inbox, control, release
        self.device = torch.device(pick_device(s.device, s.index))
        torch.manual_seed(s.seed)
        self.stage = Stage(s.model, s.stage, s.stages, seed=s.seed).to(self.device)
        self.params = [p for p in self.stage.parameters()]
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.params, lr=s.lr, weight_decay=s.weight_decay, betas=s.betas, **fused)
        self.peers: Peers | None = None
        self.pending: list[tuple] = []  # (class, arrival, kind, message)
        self.arrivals = 0
        self.stash: dict[tuple[int, int], tuple] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.sync_order: dict[int, tuple[list[str], int]] = {}
        self._losses: dict[tuple[int, int], float] = {}
        self.stats: dict[str, Any] = {"processed": 0, "compute_s": 0.0, "peak_in_flight": 0, "trace": []}

    # -- helpers -----------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.s.bf16)

    def _in(self, t: torch.Tensor, grad: bool = False) -> torch.Tensor:
        t = t.to(self.device, non_blocking=True)
        return t.requires_grad_(True) if grad else t

    @staticmethod
    def _out(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous()

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        self.control.put(("ready", self.s.name, self.inbox))
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
            self.stats["compute_s"] += t1 - t0
            # wall-clock spans of the work done (one clock for every process on a machine)
            self.stats["trace"].append((task[0], task[1][2], time.time() - (t1 - t0), time.time()))
        self._shut_down()

    def _shut_down(self) -> None:
        """Leave without stranding anyone: every send to a peer is confirmed (a round trip to each inbox)
        while all nodes are still up, and the process exits only when the coordinator releases it, so
        no exiting process waits on a peer that has gone."""
        if self.peers is not None:
            self.peers.confirm(self.s.name)
        self.control.put(("stopped", self.s.name))
        self.release.get(timeout=60)

    def _accept(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("mb", "fwd", "bwd"):
            if kind == "fwd" and msg[3] < len(msg[5].nodes) or kind == "mb":
                cls = FORWARD_WORK
            else:  # a backward, or activations back at the origin for the loss
                cls = BACKWARD_WORK
            self.arrivals += 1
            self.pending.append((cls, self.arrivals, kind, msg))
        elif kind == "peers":
            self.peers = Peers(msg[1], self.s.emulate)
        elif kind == "sync":
            self.sync_order[msg[1]] = (msg[2], msg[3])
            self._try_sync(msg[1])
        elif kind == "grad":
            self.grads.setdefault(msg[1], {})[msg[2]] = msg[3]
            self._try_sync(msg[1])
        elif kind == "step":
            self._step(msg[1], msg[2], msg[3])
        elif kind == "state":
            sd = {k: v.detach().to("cpu") for k, v in self.stage.state_dict().items()}
            self.control.put(("state", self.s.name, self.s.stage, sd))
        elif kind == "grads":  # for checks: the gradients as they are now
            sd = {n: p.grad.detach().to("cpu") for n, p in self.stage.named_parameters() if p.grad is not None}
            self.control.put(("state", self.s.name, self.s.stage, sd))
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _next_task(self):
        best = None
        room = len(self.stash) < self.s.in_flight
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
            _, it, mb, _, tokens, targets, path = msg
            with self._autocast():
                h = self.stage(self.stage.embed(self._in(tokens)))
            self.stash[it, mb] = (None, h, self._in(targets))
            self._track()
            self._forward_on(it, mb, 0, h, path)
        elif kind == "fwd":
            _, it, mb, hop, h_in, path = msg
            if hop == len(path.nodes):  # back at the origin: final norm, head and loss
                x = self._in(h_in, grad=True)
                _, _, targets = self.stash[it, mb]
                with self._autocast():
                    loss = self.stage.loss(x, targets)
                loss.backward()
                self._backward_on(it, mb, hop - 1, x.grad, path, loss=float(loss.detach()))
                return
            x = self._in(h_in, grad=True)
            with self._autocast():
                y = self.stage(x)
            self.stash[it, mb] = (x, y, None)
            self._track()
            self._forward_on(it, mb, hop + 1, y, path)
        else:  # bwd
            _, it, mb, hop, g, path = msg
            x, y, _ = self.stash.pop((it, mb))
            y.backward(self._in(g))
            self.stats["processed"] += 1
            if hop == -1:
                self.control.put(("done", it, mb, self._losses.pop((it, mb))))
            else:
                self._backward_on(it, mb, hop - 1, x.grad, path)

    def _track(self) -> None:
        self.stats["peak_in_flight"] = max(self.stats["peak_in_flight"], len(self.stash))

    def _forward_on(self, it: int, mb: int, hop: int, h: torch.Tensor, path: Path) -> None:
        """Send activations to the node at ``hop`` of the path (the origin when past the end)."""
        out = self._out(h)
        if hop == len(path.nodes):
            if not path.nodes:  # a path that visits no other stage: the loss runs here at once
                self._accept(("fwd", it, mb, hop, out, path))
                return
            dst = path.origin
        else:
            dst = path.nodes[hop]
        self.peers.send(dst, ("fwd", it, mb, hop, out, path), out)

    def _backward_on(self, it: int, mb: int, hop: int, g: torch.Tensor, path: Path, loss: float | None = None) -> None:
        if loss is not None:
            self._losses[it, mb] = loss
        out = self._out(g)
        if hop == -1 and not path.nodes:
            self._accept(("bwd", it, mb, -1, out, path))
            return
        dst = path.origin if hop == -1 else path.nodes[hop]
        self.peers.send(dst, ("bwd", it, mb, hop, out, path), out)

    # -- replica averaging and the optimizer step ----------------------------------------------
    def _flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                          for p in self.params])

    def _try_sync(self, it: int) -> None:
        if it not in self.sync_order:
            return
        replicas, count = self.sync_order[it]
        mine = self._flat_grads()
        got = self.grads.setdefault(it, {})
        if self.s.name not in got:
            got[self.s.name] = mine
            out = self._out(mine)
            for r in replicas:
                if r != self.s.name:
                    self.peers.send(r, ("grad", it, self.s.name, out), out)
        if len(got) < len(replicas):
            return
        # Every replica adds the same tensors in the same order: the results are bitwise equal.
        total = torch.zeros_like(mine)
        for r in replicas:
            total += got[r].to(self.device)
        total /= max(count, 1)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
        del self.grads[it], self.sync_order[it]
        self.control.put(("norm", it, self.s.name, self.s.stage, float(total.pow(2).sum())))

    def _step(self, it: int, coef: float, lr: float) -> None:
        if coef < 1.0:
            for p in self.params:
                p.grad.mul_(coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        stats = dict(self.stats)
        self.stats.update(processed=0, compute_s=0.0, peak_in_flight=0, trace=[])
        self.control.put(("stepped", it, self.s.name, stats))


def node_main(settings: NodeSettings, control: Any, release: Any) -> None:
    """The target of a node's roving Process."""
    import roving

    torch.set_num_threads(settings.threads)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    try:
        inbox = roving.Queue()
        StageNode(settings, inbox, control, release).run()
    except BaseException:
        control.put(("error", settings.name, traceback.format_exc()))
        raise
