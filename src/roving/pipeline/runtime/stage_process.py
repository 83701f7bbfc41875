"""A stage process: a roving process that holds one stage of the model and serves microbatches along
their routes, driven by the coordinator's messages (``protocol``: what each message means, and how
rounds are read).

Each stage process reads its own ``inbox`` (a Queue it creates, so peers' puts go straight to it over
the transport and tensors travel as out-of-band frames, without copies), answers the coordinator on
``control`` and sends heartbeats on ``beats`` from a thread of its own (``Beat`` every ``heartbeat``
seconds, so that a process that stops answering is found even while it computes). Sends to peers go
through one sender thread per destination (``senders.Senders``).

Serving policy, as the simulator's: backward work (backward and loss) before forward work, then the
task that arrived first (the coordinator hands microbatches to their origins in the plan's priority
order, so microbatches ready together are served in that order). At most ``in_flight`` microbatches
are held (from the start of their forward here to the end of their backward here); a forward that would
exceed it waits.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import traceback
import warnings
from typing import Any, Callable

import torch

from .. import protocol as m
from ..errors import CoordinatorLost
from ..verify.conduct import HONEST, Conduct
from ..verify.evidence import Evidence, platform, recheck
from ..optim import AdamW
from ..planning.plan import Route
from ...transport import zap
from ...transport.identity import node_key, revoke
from ...transport.postbox import PostboxAddress
from .mail import Directory, Inbox, Outbox, coordinator_only
from .averaging import Averaging
from .settings import StageSettings
from .senders import Senders
from .stalls import BACKWARD, DONE, FORWARD, Key, flat
from ..stages import Stage

log = logging.getLogger(__name__)

#: serving classes: backward work (a backward, or the loss that starts one) before forward work.
BACKWARD_WORK, FORWARD_WORK = 0, 1
#: messages that belong to the round's work (an aborted round's are dropped).
_WORK = (m.Microbatch, m.Forward, m.Backward, m.Gradients, m.SyncOrder, m.Step)
#: how the trace of a process's work names each kind of task.
_TRACE_KIND = {m.Microbatch: "mb", m.Forward: "fwd", m.Backward: "bwd"}


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


class StageProcess(Averaging):
    """One stage process's state and loop (``run``); ``stage_main`` is the process's target."""

    def __init__(self, s: StageSettings, inbox: Any, control: Any, beats: Any = None) -> None:
        """``inbox``: what it reads (a ``mail.Inbox``, or a plain queue in tests); ``control`` and
        ``beats``: where it answers the coordinator and sends its heartbeats (anything with ``put``)."""
        self.settings, self.inbox, self.control, self.beats = s, inbox, control, beats
        #: the hooks where a node could lie (``conduct``), called the same whatever the node
        self.conduct: Conduct = HONEST if s.adversary is None else s.adversary
        #: who is who among its peers (the inbox's, where it has one): filled from the coordinator's word
        self.directory: Directory | None = getattr(inbox, "directory", None)
        self.name = s.name
        self.device = torch.device(pick_device(s.device, s.index))
        torch.manual_seed(s.seed)
        self.peers: Senders | None = None
        self.round = -1
        self.aborted = -1  # the latest round given up: its messages are dropped
        self.throttle = 1.0
        self.evidence = Evidence(s.name, s.verify, s.receipt_key)
        self.platform = platform(self.device)  # what its weights after a step are compared within
        self._hold(s.stage, s.in_flight)
        #: why the process leaves without the coordinator's word (its watchdog), once it does
        self._lost: str | None = None
        self.stats: dict[str, Any] = {"processed": 0, "compute_s": 0.0, "peak_in_flight": 0, "trace": []}
        self._handlers: dict[type, Callable[[Any], None]] = {
            m.Peers: self._on_peers, m.PeerJoined: self._on_peer_joined, m.Forget: self._on_forget,
            m.Abort: self._on_abort, m.SyncOrder: self._on_sync_order, m.Gradients: self._on_gradients,
            m.Step: self._on_step, m.Export: self._on_export, m.Load: self._on_load,
            m.StateRequest: self._on_state_request, m.Throttle: self._on_throttle,
            m.EvidenceRequest: self._on_evidence_request, m.Recheck: self._on_recheck,
            m.ShowWeights: self._on_show_weights, m.ProgressRequest: self._on_progress_request}

    def _hold(self, stage: int, in_flight: int) -> None:
        """Build the modules and optimizer of ``stage`` (initial weights from the seed)."""
        self.stage_index, self.in_flight = stage, in_flight
        self.last_sq_norm = math.nan  # the squared norm of the latest averaged gradient (none yet)
        self.stage = Stage(self.settings.model, stage, self.settings.stages, seed=self.settings.seed).to(self.device)
        self.params = [p for p in self.stage.parameters()]
        self.opt = AdamW(self.params, lr=self.settings.lr, weight_decay=self.settings.weight_decay,
                         betas=self.settings.betas)
        self._clear_round()

    def _clear_round(self) -> None:
        self.pending: list[tuple] = []  # (class, arrival, message)
        self.arrivals = 0
        self.stash: dict[tuple[int, int], tuple] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.share_counts: dict[int, dict[str, int]] = {}  # round -> replica -> its microbatches
        self.sync_order: dict[int, m.SyncOrder] = {}
        self.backwards = 0  # backward passes run in the current round
        self._losses: dict[tuple[int, int], float] = {}
        #: the round's messages of microbatches received and sent, for a stalled round's account (``stalls``)
        self.received: set[Key] = set()
        self.sent: set[Key] = set()
        self.evidence.clear()
        self.opt.zero_grad()

    # -- helpers -----------------------------------------------------------------------------
    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.settings.bf16)

    def _in(self, t: torch.Tensor, grad: bool = False) -> torch.Tensor:
        t = t.to(self.device, non_blocking=True)
        return t.requires_grad_(True) if grad else t

    @staticmethod
    def _out(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous()

    def _beat(self) -> None:
        while not self._leaving.is_set():
            try:
                self.beats.put(m.Beat(self.name, self.settings.incarnation))
            except OSError:  # the coordinator cannot be reached now: its watchdog (_watch) decides
                pass
            self._leaving.wait(self.settings.heartbeat)

    def _wait_message(self) -> Any:
        """The next message of the inbox; ``CoordinatorLost`` once the watchdog has given the coordinator
        up (looked at every second while nothing comes)."""
        while True:
            try:
                return self.inbox.get(timeout=1.0)
            except queue.Empty:
                if self._lost is not None:
                    raise CoordinatorLost(self._lost) from None

    def _watch(self, timeout: float) -> None:
        """The coordinator's watchdog: a round trip to its heartbeats' inbox every few heartbeats; when
        none is answered for ``timeout`` seconds, the process leaves (its inbox closed under its loop,
        which then raises ``CoordinatorLost`` naming the address)."""
        answered = time.monotonic()
        while not self._leaving.wait(max(self.settings.heartbeat, 0.1) * 4):
            left = timeout - (time.monotonic() - answered)
            if self.beats.reachable(max(0.1, min(left, 10.0))):
                answered = time.monotonic()
            elif time.monotonic() - answered >= timeout:
                self._lost = (f"stage process {self.name}: the coordinator at {self.beats.address.node} has not "
                              f"answered for {timeout:g} s (its process ended, or it cannot be reached): leaving")
                log.error("%s", self._lost)
                self.inbox.close()
                return

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until ``Stop``; raises ProtocolError for a message this process does not handle."""
        self._leaving = threading.Event()
        self._beating: threading.Thread | None = None
        if self.beats is not None and self.settings.heartbeat > 0:
            self._beating = threading.Thread(target=self._beat, name="roving-heartbeat", daemon=True)
            self._beating.start()
        if hasattr(self.beats, "reachable") and self.settings.coordinator_timeout > 0:
            threading.Thread(target=self._watch, args=(self.settings.coordinator_timeout,),
                             name="roving-coordinator-watchdog", daemon=True).start()
        try:
            self._loop()
        except OSError:
            if self._lost is None:
                raise
            raise CoordinatorLost(self._lost) from None
        finally:
            self._leaving.set()

    def _loop(self) -> None:
        self.control.put(m.Ready(self.name, self.settings.incarnation, getattr(self.inbox, "address", self.inbox)))
        while True:
            task = self._next_task()
            if task is None:
                if self.evidence.unsummarised:  # an idle moment: a summary, unless a message waits
                    try:
                        msg = self.inbox.get_nowait()
                    except queue.Empty:
                        self.evidence.summarize_one()
                        continue
                else:
                    msg = self._wait_message()
                if isinstance(msg, m.Stop):
                    break
                self._accept(msg)
                continue
            t0 = time.perf_counter()
            self._serve(task)
            t1 = time.perf_counter()
            if self.throttle > 1.0:  # fault injection: a process slowed down by other work
                time.sleep((t1 - t0) * (self.throttle - 1.0))
                t1 = time.perf_counter()
            self.stats["compute_s"] += t1 - t0
            # wall-clock spans of the work done (one clock for every process on a machine)
            self.stats["trace"].append((_TRACE_KIND[type(task)], task.mb, time.time() - (t1 - t0), time.time()))
        self._leaving.set()
        if self._beating is not None:
            self._beating.join(timeout=5)
        self._shut_down(msg.live)

    def _shut_down(self, live: list[str] | None) -> None:
        """Leave without stranding anyone: every send to a live peer is confirmed (a round trip to each
        inbox) while all processes are still up, and the process exits only when the coordinator
        releases it, so no exiting process waits on a peer that has gone."""
        if self.peers is not None:
            self.peers.confirm([n for n in (live if live is not None else self.peers.senders) if n != self.name])
        self.control.put(m.Stopped(self.name))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the coordinator's Release, once every process stopped
            try:
                if isinstance(self.inbox.get(timeout=max(0.0, deadline - time.monotonic())), m.Release):
                    self.control.put(m.Released(self.name))
                    return
            except queue.Empty:
                return

    def _current(self, rnd: int) -> bool:
        """Whether a message of round ``rnd`` is to be handled (``protocol``, Rounds)."""
        if rnd < self.round or rnd <= self.aborted:
            return False
        if rnd > self.round:
            if self.stash or self.pending or self.grads or self.sync_order:
                self._clear_round()
            else:  # the previous round ended with its step (its audit before it): its evidence goes
                self.evidence.clear()
            self.round = rnd
            self.backwards = 0
        return True

    def _accept(self, msg: Any) -> None:
        if isinstance(msg, _WORK) and not self._current(msg.round):
            return
        if isinstance(msg, (m.Forward, m.Backward)):
            self.evidence.keep("activation" if isinstance(msg, m.Forward) else "gradient", msg.round, msg.mb,
                               msg.hop, msg.sender, msg.tensor, msg.receipt)
        elif isinstance(msg, m.Gradients):
            self.evidence.keep("share", msg.round, -1, -1, msg.sender, msg.flat, msg.receipt)
        if isinstance(msg, (m.Microbatch, m.Forward, m.Backward)):
            self.received.add(Key(BACKWARD if isinstance(msg, m.Backward) else FORWARD, msg.mb,
                                  -1 if isinstance(msg, m.Microbatch) else msg.hop))
            if isinstance(msg, m.Microbatch) or isinstance(msg, m.Forward) and msg.hop < len(msg.route.nodes):
                cls = FORWARD_WORK
            else:  # a backward, or activations back at the origin for the loss
                cls = BACKWARD_WORK
            self.arrivals += 1
            self.pending.append((cls, self.arrivals, msg))
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise m.unexpected(msg, f"stage process {self.name}")
        handler(msg)

    # -- control messages ----------------------------------------------------------------------
    def _on_peers(self, msg: m.Peers) -> None:
        if self.directory is not None:
            for name, node_id in msg.ids.items():
                self.directory.add(node_id, name)
                _admit(msg.inboxes.get(name), node_id)
        if self.peers is None:
            self.peers = Senders(self.name, msg.inboxes, self.settings.emulate)
        else:
            for name, q in msg.inboxes.items():
                self.peers.add(name, q)

    def _senders(self) -> Senders:
        """The senders to the peers; ProtocolError before the coordinator's ``Peers``."""
        if self.peers is None:
            raise m.ProtocolError(f"stage process {self.name}: a message that needs its peers came before Peers")
        return self.peers

    def _on_peer_joined(self, msg: m.PeerJoined) -> None:
        if self.directory is not None:
            self.directory.drop(msg.name)  # an earlier incarnation's id speaks for it no more
            self.directory.add(msg.node_id, msg.name)
            _admit(msg.inbox, msg.node_id)
        self._senders().add(msg.name, msg.inbox, msg.link)

    def _on_forget(self, msg: m.Forget) -> None:
        """Dead or excluded peers: no more sends to them, and their credentials refused here from now
        on (their connections to this process closed), as at the coordinator."""
        self._senders().forget(msg.names)
        if self.directory is not None:
            for name in msg.names:
                for node_id in self.directory.ids_of(name):
                    revoke(node_id)
                self.directory.drop(name)

    def _on_abort(self, msg: m.Abort) -> None:
        if msg.round >= self.round:
            self._clear_round()
            self.round = msg.round
        self.aborted = max(self.aborted, msg.round)

    def _on_progress_request(self, msg: m.ProgressRequest) -> None:
        """The round stalled: what this process received and sent in it (nothing, for another round)."""
        mine = msg.round == self.round and msg.round > self.aborted
        self.control.put(m.Progress(msg.round, self.name, flat(self.received) if mine else (),
                                    flat(self.sent) if mine else ()))

    def _weights(self) -> dict[str, torch.Tensor]:
        """This stage's weights by parameter name, on the CPU (to travel)."""
        return {k: v.detach().to("cpu") for k, v in self.stage.state_dict().items()}

    def _exported(self) -> dict[str, torch.Tensor]:
        """This stage's weights as it exports them (``Export``, ``StateRequest``), through ``conduct``: an
        ``export`` adversary poisons them, and shows and steps with its honest ones."""
        return self.conduct.exported(self._weights(), self.name, self.round)

    def _on_export(self, msg: m.Export) -> None:
        self.control.put(m.Exported(self.name, self.stage_index, self._exported(), _to_cpu(self.opt.state_dict())))

    def _on_load(self, msg: m.Load) -> None:
        if msg.stage != self.stage_index or msg.optimizer is None:  # None: a fresh optimizer state
            self._hold(msg.stage, msg.in_flight)
        self.in_flight = msg.in_flight
        self.stage.load_state_dict(msg.params)
        if msg.optimizer is not None:
            self.opt.load_state_dict(msg.optimizer)
        self._clear_round()
        self.control.put(m.Loaded(self.name, msg.stage))

    def _on_state_request(self, msg: m.StateRequest) -> None:
        if msg.grads:  # for checks: the gradients as they are now
            sd = {n: p.grad.detach().to("cpu") for n, p in self.stage.named_parameters() if p.grad is not None}
        else:
            sd = self._exported()
        self.control.put(m.State(self.name, self.stage_index, sd))

    def _on_throttle(self, msg: m.Throttle) -> None:
        self.throttle = float(msg.factor)

    def _on_evidence_request(self, msg: m.EvidenceRequest) -> None:
        items = self.evidence.show(msg.keys) if msg.round == self.round else {}
        self.control.put(m.EvidenceItems(msg.round, self.name, items, msg.ask))

    def _on_show_weights(self, msg: m.ShowWeights) -> None:
        self.control.put(m.WeightsShown(msg.round, self.name, self.stage_index, self._weights()))

    def _on_recheck(self, msg: m.Recheck) -> None:
        """Recompute with the weights held now (every replica's until the round's step): ``evidence.recheck``."""
        with self.evidence.timed("rechecks"):
            answer = recheck(self.stage, self.stage_index, msg, self.device, self.settings.bf16,
                             self.conduct, self.name)
        self.control.put(answer)

    # -- microbatch work -----------------------------------------------------------------------
    def _next_task(self) -> Any:
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
        return self.pending.pop(best)[2]

    def _serve(self, msg: Any) -> None:
        rnd, mb, route = msg.round, msg.mb, msg.route
        if isinstance(msg, m.Microbatch):
            with self._autocast():
                h = self.stage(self.stage.embed(self._in(msg.tokens)))
            self.stash[rnd, mb] = (None, h, self._in(msg.targets))
            self._track()
            self._forward_on(rnd, mb, 0, h, route)
        elif isinstance(msg, m.Forward):
            hop = msg.hop
            if hop == len(route.nodes):  # back at the origin: final norm, head and loss
                x = self._in(msg.tensor, grad=True)
                _, _, targets = self.stash[rnd, mb]
                with self._autocast():
                    loss = self.stage.loss(x, targets)
                loss.backward()
                assert x.grad is not None  # x requires grad and the loss is computed from it
                self._backward_on(rnd, mb, hop - 1, x.grad, route, loss=float(loss.detach()))
                return
            x = self._in(msg.tensor, grad=True)
            with self._autocast():
                y = self.stage(x)
            self.stash[rnd, mb] = (x, y, None)
            self._track()
            self._forward_on(rnd, mb, hop + 1, y, route, given=msg.tensor)
        else:  # Backward
            x, y, _ = self.stash.pop((rnd, mb))
            y.backward(self._in(msg.tensor))
            self.stats["processed"] += 1
            self.backwards += 1
            if msg.hop == -1:
                self.control.put(m.Done(rnd, self.name, mb, self._losses.pop((rnd, mb))))
                self.sent.add(Key(DONE, mb, 0))
            else:
                self._backward_on(rnd, mb, msg.hop - 1, x.grad, route, given=msg.tensor)
            self._try_sync(rnd)  # after the send: the next process's work does not wait for the averaging

    def _track(self) -> None:
        self.stats["peak_in_flight"] = max(self.stats["peak_in_flight"], len(self.stash))

    def _forward_on(self, rnd: int, mb: int, hop: int, h: torch.Tensor, route: Route,
                    given: torch.Tensor | None = None) -> None:
        """Send activations to the process at ``hop`` of the route (the origin when past the end);
        ``given``: the activations this process was given (an adversary's input)."""
        out = self._out(h)
        if route.nodes:  # sent to another process (not a loss run here)
            out = self.conduct.tamper("activation", out, self.name, rnd, mb, given)
        seal = self.evidence.sealer("activation", rnd, mb, hop, out) if route.nodes else None
        msg = m.Forward(rnd, self.name, mb, hop, out, route)
        if hop == len(route.nodes):
            if not route.nodes:  # a route that visits no other stage: the loss runs here at once
                self._accept(msg)
                return
            dst = route.origin
        else:
            dst = route.nodes[hop]
        self._senders().send(dst, msg, out, seal)
        self.sent.add(Key(FORWARD, mb, hop))

    def _backward_on(self, rnd: int, mb: int, hop: int, g: torch.Tensor, route: Route,
                     loss: float | None = None, given: torch.Tensor | None = None) -> None:
        if loss is not None:
            self._losses[rnd, mb] = loss
        out = self._out(g)
        if route.nodes:  # sent to another process
            out = self.conduct.tamper("gradient", out, self.name, rnd, mb, given)
        seal = self.evidence.sealer("gradient", rnd, mb, hop, out) if route.nodes else None
        msg = m.Backward(rnd, self.name, mb, hop, out, route)
        if hop == -1 and not route.nodes:
            self._accept(msg)
            return
        dst = route.origin if hop == -1 else route.nodes[hop]
        self._senders().send(dst, msg, out, seal)
        self.sent.add(Key(BACKWARD, mb, hop))


def _admit(inbox: Any, node_id: str) -> None:
    """Let the peer whose inbox is ``inbox`` reach this process's node under its own node key (what a
    node that joined through the open door, holding no member secret, connects with: ``zap.admit``);
    who it is and what it may do are then its certificate's to say."""
    key = node_key(inbox.node) if isinstance(inbox, PostboxAddress) and node_id else None
    if key:
        zap.admit(key, node_id)


def _to_cpu(obj: Any) -> Any:
    """An optimizer state dict with its tensors on the CPU (to travel and to be saved)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def stage_main(settings: StageSettings, control: PostboxAddress, beats: PostboxAddress | None = None) -> None:
    """The target of a stage's roving Process: ``control`` and ``beats`` are the coordinator's inboxes."""
    torch.set_num_threads(settings.threads)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    to_coordinator = Outbox(control)
    try:
        inbox = Inbox(Directory({settings.coordinator_id: m.COORDINATOR}), accept=coordinator_only)
        StageProcess(settings, inbox, to_coordinator, Outbox(beats) if beats is not None else None).run()
    except CoordinatorLost:
        raise  # nobody to tell
    except BaseException:
        to_coordinator.put(m.Failed(settings.name, traceback.format_exc()))
        raise
