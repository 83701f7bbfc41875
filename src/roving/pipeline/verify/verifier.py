"""The coordinator's side of verification (``[verify]``; issue 32): it screens what every node reported
receiving, spot-checks sampled computations by having another replica of the same stage recompute them,
confirms every mismatch itself, and names the nodes caught, all before the round's step. The trainer
excludes them and runs the round again without them (``trainer``), so nothing they computed in the
round reaches the weights.

When. An audit runs alongside its round, not after it: a microbatch's computations are drawn as soon as
its origin reports it done (every tensor of it was sent and received by then), a replica's share once
the replica and the holder of its share have both averaged; the evidence of those drawn is asked for at
once, each recheck sent as its evidence is judged, each confirmation run as its weights come, while the
round's other microbatches run (a node answers between its tasks); each node's screening rows are
screened as its ``Norm`` comes. What is left after the replicas' averaging is the round's end: the last
``Norm``'s rows, the screening band (a tensor found bad is checked then), the averaging check, the
computations of a round whose gradient norm is not finite, and the answers still on their way.

What is checked. Every tensor a node sends is the result of one *computation* by that node, from
inputs that others sent it (or the coordinator: tokens and targets): an origin's first forward
("first"), a visited stage's forward and, from the same activations and the gradient that came back,
its backward (the two are one "visit": rechecking the backward redoes the forward anyway, so both are
checked together for the price of the backward), the origin's loss gradient ("loss"), and a replica's
summed gradients ("share"). A *check* gathers the tensors it needs from the nodes that received them
(``evidence``: each kept with its sender's receipt), so the node checked cannot choose what it is
checked on:

1. *Evidence.* Each tensor shown must be covered by its sender's receipt (``receipts``): a holder that
   shows a tensor its sender's receipt does not name, or shows nothing, is caught itself (an honest one
   kept what it got, and checked its digest when it came). A tensor the holder reported at once as not
   matching its receipt, or a receipt whose MAC is not its sender's, is a *dispute*: the sender or the
   holder lies, and the coordinator cannot tell which; neither is blamed for it, both become suspects.
2. *Recomputation* (modes "spot" and "full"): ``verifiers`` replicas of the node's stage (as many as it
   has others; one for a share, whose recheck redoes every visit of its replica: a second would cost as
   much as its replica's round), chosen at random after the fact, each recompute the computation with
   the weights it holds (every replica's weights are bitwise equal until the step: they average the same
   shares in the same order) and report the relative difference (``evidence.difference``). With no other
   replica, the coordinator recomputes.
3. *Confirmation* of the first difference above ``tolerance`` a recheck gets: the coordinator fetches
   the weights of the node and of its verifiers and recomputes itself, with the node's (which must be
   those it reported after its latest step). Its own difference above ``tolerance`` confirms the node's
   fault. Then every verifier's answer is held to it (``_hold``): a mismatch where the coordinator found
   none is a "false mismatch" (so nobody can be framed by a false report), a match where it found a
   difference beyond what float nondeterminism allows is a "false match" (an accomplice passing a
   colluder's work), either caught; a verifier whose weights are not the node's is a dispute instead.
   With two verifiers, two colluders of a stage of 3 or more escape no check drawn of a microbatch's
   computations: the other verifier is honest, and the accomplice's match is caught with the colluder
   (a check of a share escapes when its verifier is the accomplice). A recheck that every verifier
   passed is confirmed all the same with chance ``confirm_rate`` (drawn after their answers), and
   always where its node is opposed or turned in the round (below): what catches a coalition that is
   all of a stage's other replicas (a stage of 2 whose replicas collude), at the price of the
   coordinator's own recomputation -- with ``confirm_rate`` 0, only in the rounds screening singles out.

The replicas' averaging. Every replica reports a digest of the gradient it combined from its stage's
shares (``Norm.combined``); when a stage's replicas' digests differ, the coordinator combines the shares
itself, each as its sender's receipt names it, and catches each replica whose gradient differs from that
(one that combined another share than was sent, its own included, would step to other weights than its
replicas, and later checks could no longer compare them). Every round, in every mode but "off", for
stages of 2 replicas or of replicas on more than one platform; with 3 or more on one platform the
weights check below names such a replica at the step (``combined_needed``), and no digest is asked for.

The replicas' weights. Replicas that combined one gradient step bitwise alike on one platform (device
model, torch; ``evidence.platform``), so after every step each replica reports a digest of the weights
it stepped to (``Stepped.weights``; ``stepped``; a stage's only replica too, for what it exports and
shows later), compared with those of the replicas of its stage on its platform (the one it reported
first: a later claim does not move it). Where they differ, a strict majority of at least 3 names the
others, caught ("weights"; one that steps with another gradient than it combined, or combined another,
or reports no digest); with no such majority (2 replicas) it is a dispute. Every round, in every mode
but "off", before the weights are snapshotted or evaluated. A confirmation then holds each node to its
report: weights shown that are not the ones it reported after its latest step (of the stage it holds
now) have it caught ("weights"), so a node cannot compute with other weights than it reported and show
the honest ones.

Weights that leave a node. What the coordinator keeps or hands on of a node's weights (a snapshot, a
checkpoint, an evaluation, the weights a joining or taking-over node loads, a neighbour's for the
recovery: ``weights.Weights``) is checked by ``exported`` before it is used: the digest of the weights
exported must be that of the weights the node holds (``held``: what it reported after its latest step
-- every replica reports one, a stage of one replica too -- or what the coordinator loaded it with, or in
a fresh run the stage's initial weights, which the coordinator builds from the seed as the processes
do), and that of a strict majority of its stage's replicas on its platform. A node that exports other
weights is caught ("export") and excluded, and another replica's export is taken; where none checks
out, the snapshot, checkpoint or evaluation fails (``errors.ExportRejected``), and a stage to take over
is left to the recovery policy as one that no live process holds. A single replica's weights are held
to what it reported and computes with, not to its step, which no replica repeats; with mode "off"
nothing is checked. The optimizer state exported with the weights is not checked: replicas' moments are
bitwise equal as their weights are, but a digest of them after every step would hash twice the bytes of
the weights again (and copy them from the device), for state that only a resume or a takeover reads.

Which computations. ``full``: all. ``spot``: each with probability ``verify_rate`` (a visit's forward and
backward together, as the issue's spot check has it: a microbatch's forward "and, for gradients, the
backward" on the same input), drawn here from the
operating system's randomness after the tensors it checks were sent (so no node can know which of its
tensors will be checked); a screening suspect's with at least ``SUSPECT_RATE``, and so are those of a
round whose share of a node is *opposed* (below). Any mode but "off":
every computation whose output a receiver found non-finite or all zero when screening it. In "screen"
mode those are judged without recomputation: non-finite outputs from finite inputs are the node's fault.

Screening (``screen``): each node reports a summary of every activation and gradient it received, and
of the gradient shares it is the summariser of (``Norm.screened``; ``evidence.summariser``), kept per
boundary (what, the sender's stage, and the hop, or for a share the microbatches it was summed over) and
sender, and its own share's cosine to each of its replicas'
(``Norm.cosines``): a share's cosine is the median of what its other replicas report. A node whose
statistics leave its boundary's band is a *suspect* (an event, a higher check rate; never blamed for
that alone). A share whose cosine of a round is below 0 and far below its earlier rounds' (it points
away from its replicas', as a negated one does; ``Screen.cosine``) has its node *opposed* in that round,
and a node whose outputs' profile of the round left the one it keeps round to round (``Screen.turned``:
what a whole stage sending made-up tensors does, with no replica left to disagree) is *turned*: either
way its computations of the round, those already drawn for included, are checked at the suspect's rate,
and what its verifiers pass is confirmed (above); the next round starts afresh (a band over the whole
run would see a lie that starts late only after many rounds, and a suspect stays one). A report that is
not of the shape a stage process makes has its sender caught ("report").

Every finding is an event (``trainer._event``): "caught" (who, which check, the evidence: the
computation, microbatch and hop, the verifier and both differences), "dispute" and "suspect".
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .. import protocol as m
from . import receipts
from .aggregate import combine
from ..errors import NodesLost
from .evidence import COMBINED, difference, recompute
from .screen import Screen, sound
from ..stages import Stage

log = logging.getLogger(__name__)

#: the least chance that a suspect's computation is checked in mode "spot".
SUSPECT_RATE = 0.25


@dataclass(frozen=True)
class Source:
    """Where a check's tensor comes from: the kept tensor ``key`` of node ``holder``, or ``value`` (the
    coordinator's own: tokens, targets)."""

    holder: str = ""
    key: tuple = ()
    value: Any = None


@dataclass
class Check:
    """One computation to check: by ``node`` holding ``stage``, of ``kind`` (``evidence.KINDS``), for
    microbatch ``mb`` (-1: a share) at ``hop`` (a visit's: the hop of the activations it received); its
    output ``claimed`` (a visit's forward output; ``also``: its backward output) and its ``inputs`` (by the
    name ``evidence.recompute`` reads; a share's ``visits`` are a list of such dicts)."""

    node: str
    stage: int
    kind: str
    mb: int
    hop: int
    claimed: Source
    inputs: dict = field(default_factory=dict)
    visits: list = field(default_factory=list)
    also: Source | None = None

    def outputs(self) -> tuple[Source, ...]:
        """The tensors it sent that the check compares (one; a visit's two)."""
        return (self.claimed,) if self.also is None else (self.claimed, self.also)

    def sources(self) -> Iterable[Source]:
        yield from self.outputs()
        yield from self.inputs.values()
        for v in self.visits:
            yield from v.values()

    def describe(self) -> dict:
        return {"computation": self.kind, "stage": self.stage, "mb": self.mb, "hop": self.hop}


@dataclass
class _Ask:
    """One request for evidence: the holders still to answer, what those that did showed, and what is
    done with it once every holder has answered (``then``)."""

    waiting: set[str]
    then: Callable[[dict[str, dict]], None]
    shown: dict[str, dict] = field(default_factory=dict)


@dataclass
class _Recheck:
    """A computation sent to its verifiers to recompute (none: the stage had no other replica, and the
    coordinator recomputes it at once): what each answered (``answers``: verifier -> its difference,
    None until it answers) and, once the coordinator recomputed it, its own difference (``confirmed``),
    which every answer is then held to. A confirmation waits for the weights of the node and of each
    verifier (``needs``)."""

    check: Check
    claimed: Any
    inputs: dict
    answers: dict[str, float | None] = field(default_factory=dict)
    confirming: bool = False  # the coordinator recomputes it (or did)
    mismatch: str | None = None  # the verifier whose mismatch had it do so (None: no verifier, or drawn)
    confirmed: float | None = None

    def needs(self) -> list[str]:
        return [self.check.node, *self.answers]


@dataclass
class _Audit:
    """An audit of one round while it runs (``Verifier.begin`` to ``Verifier.audit``): its computations
    (a microbatch's by its number, a share's by its node), which were drawn, and what is on its way."""

    rnd: int
    plan: Any
    alloc: dict[str, int]
    by_mb: dict[int, list[Check]]
    shares: dict[str, Check]
    loads: dict[str, int] = field(default_factory=dict)  # node -> the microbatches it runs the backward of
    decided: dict[tuple, float] = field(default_factory=dict)  # claimed key -> the chance it was drawn with
    drawn: set[tuple] = field(default_factory=set)  # those checked
    norms: list[m.Norm] = field(default_factory=list)
    flagged: set[tuple] = field(default_factory=set)  # keys of tensors screening found bad at once
    cosines: dict[str, list[float]] = field(default_factory=dict)  # node -> its share's cosines, as reported
    opposed: set[str] = field(default_factory=set)  # nodes whose share pointed away from its replicas'
    turned: set[str] = field(default_factory=set)  # nodes whose outputs' profile turned from their own
    caught: dict[str, str] = field(default_factory=dict)
    asks: dict[int, _Ask] = field(default_factory=dict)  # unanswered evidence requests by number
    rechecks: dict[int, _Recheck] = field(default_factory=dict)  # by number
    confirming: list[_Recheck] = field(default_factory=list)  # confirmations waiting for weights
    weights: dict[str, tuple[int, dict]] = field(default_factory=dict)  # name -> (stage, state dict)
    weights_asked: set[str] = field(default_factory=set)
    loaded: dict[int, str] = field(default_factory=dict)  # stage -> whose weights its module holds this audit
    combined: set[tuple] = field(default_factory=set)  # the stages' replicas asked for a combined digest
    sent_rechecks: int = 0
    confirmations: int = 0
    overlapped: float = 0.0  # seconds of the audit's own work while the round ran
    cpu: float = 0.0  # the coordinator's CPU seconds of the audit's own work (its thread's)

    def awaited(self) -> set[str]:
        """The nodes an answer is awaited from."""
        names = {v for r in self.rechecks.values() for v, d in r.answers.items() if d is None}
        names |= self.weights_asked - set(self.weights)
        for a in self.asks.values():
            names |= a.waiting
        return names

    def every(self) -> list[Check]:
        return [c for checks in self.by_mb.values() for c in checks] + list(self.shares.values())


class Verifier:
    """The checks of one training run (the module doc). Per round: ``begin`` (before its microbatches
    go out), ``finished`` as each microbatch is done, ``note`` for each ``Norm``, ``take`` for each
    answer of ``kinds`` that comes meanwhile, then ``audit``, which returns the nodes caught (name ->
    why); ``abandon`` when the round is given up."""

    def __init__(self, config: Any, model: Any, roster: Any, event: Callable[..., None]) -> None:
        self.mode, self.rate, self.tolerance = config.mode, config.verify_rate, config.tolerance
        self.verifiers, self.confirm_rate = config.verifiers, config.confirm_rate
        self.aggregation = config.aggregation
        self.stages, self.seed, self.bf16 = config.stages, config.seed, config.bf16
        self.timeout = config.timeout
        self.model, self.roster, self._event = model, roster, event
        self.screen = Screen()
        self.rng = random.SystemRandom()
        self.device = torch.device("cpu")
        self._audit: _Audit | None = None
        self._modules: dict[int, Stage] = {}  # one a stage, built once a run, loaded with the weights to confirm
        self._suspected: set[tuple] = set()
        self.suspects: set[str] = set()
        #: name -> (stage, digest of the weights it reported after its latest step): what it holds until
        #: its next step (a process's weights change only when it steps, or loads another stage's)
        self.held: dict[str, tuple[int, bytes]] = {}
        #: name -> the platform it first reported since it last loaded weights (``Stepped.platform``): where
        #: its weights are compared, whatever it claims later (a process's platform does not change)
        self.platform: dict[str, str] = {}
        self._check_id = self._ask_id = 0
        #: the messages of the nodes that an audit takes (``take``) while the trainer waits for the round's
        self.kinds: tuple[type, ...] = (m.EvidenceItems, m.Rechecked, m.WeightsShown) if self.on else ()
        #: the latest audit's figures (checks run, rechecks, confirmations, nodes caught; ``seconds``: its
        #: time after the replicas' averaging, on the round's critical path; ``overlapped_seconds``: its
        #: own work while the round's microbatches ran; ``cpu_seconds``: the CPU time of all of its own
        #: work on the coordinator, waits not counted), for the iteration's record
        self.last: dict[str, Any] = {}
        #: the run's figures so far; ``max_difference``: the largest difference of a recheck that passed
        #: (what float nondeterminism amounts to here, against ``tolerance``)
        self.totals = {"checks": 0, "rechecks": 0, "confirmations": 0, "caught": 0, "disputes": 0, "opposed": 0,
                       "turned": 0, "exports": 0,
                       "seconds": 0.0, "overlapped_seconds": 0.0, "cpu_seconds": 0.0, "max_difference": 0.0}

    @property
    def on(self) -> bool:
        return self.mode != "off"

    # -- one round, as it runs ------------------------------------------------------------------------
    def begin(self, rnd: int, plan: Any, alloc: dict[str, int], batches: list) -> None:
        """Round ``rnd`` starts, run on ``plan`` by the nodes of ``alloc``, on ``batches``: its computations
        are listed, to be drawn as they are done."""
        if not self.on:
            return
        t0 = time.thread_time()
        by_mb: dict[int, list[Check]] = {}
        shares: dict[str, Check] = {}
        for c in self._checks(plan, alloc, batches):
            if c.kind == "share":
                shares[c.node] = c
            else:
                by_mb.setdefault(c.mb, []).append(c)
        self._audit = _Audit(rnd, plan, dict(alloc), by_mb, shares, plan.backward_counts())
        self._audit.cpu = time.thread_time() - t0

    def finished(self, rnd: int, mb: int) -> None:
        """Microbatch ``mb`` of round ``rnd`` is done (its origin's ``Done``): every tensor of its
        computations was sent and received, so they are drawn now, and the evidence of those drawn asked
        for, while the round's other microbatches run."""
        a = self._current(rnd)
        if a is not None:
            with self._overlapped(a):
                self._decide(a, a.by_mb.get(mb, []))

    def note(self, msg: m.Norm) -> None:
        """A ``Norm`` of the round: kept for ``audit`` (screening rows, disputes, share cosines). A
        replica's share is drawn once its own and its share's holder's ``Norm`` came (the holder combined
        it, so it has it)."""
        a = self._current(msg.round)
        if a is None:
            return
        with self._overlapped(a):
            a.norms.append(msg)
            self._screen(a, msg)
            normed = {n.sender for n in a.norms}
            self._decide(a, [c for c in a.shares.values() if c.node in normed and c.claimed.holder in normed])

    def take(self, msg: m.Message) -> None:
        """An answer of ``kinds`` that came while the trainer waited for the round's own messages."""
        a = self._current(getattr(msg, "round", None))
        if a is not None:
            with self._overlapped(a):
                self._take(a, msg)

    def abandon(self) -> dict[str, str]:
        """The round is given up (a node lost, or it stalled): its audit is dropped; returns the nodes it
        caught so far (out for good all the same: what they sent is evidence of its own)."""
        a, self._audit = self._audit, None
        self.screen.forget_round()
        return dict(a.caught) if a is not None else {}

    def _current(self, rnd: Any) -> _Audit | None:
        a = self._audit
        return a if a is not None and a.rnd == rnd else None

    @contextlib.contextmanager
    def _overlapped(self, a: _Audit) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            a.overlapped += time.perf_counter() - t0
            a.cpu += time.thread_time() - c0

    # -- the round's end -------------------------------------------------------------------------------
    def audit(self, rnd: int, norm: float = 0.0) -> dict[str, str]:
        """Finish the audit of round ``rnd``, once its replicas averaged (every ``Norm`` noted): screen,
        check the averaging, draw what is left (``norm``: the round's gradient norm; not finite, it has
        every computation checked, so that whoever made it so is caught before the step), wait for every
        answer; returns the nodes caught, name -> why (each also an event). Raises NodesLost when a node
        dies meanwhile (the round is then run again); those caught before are in it too, as its
        ``caught``, to be excluded all the same."""
        if not self.on:
            return {}
        a = self._current(rnd)
        if a is None:
            raise ValueError(f"audit of round {rnd}, which verification was not told of (Verifier.begin)")
        t0, c0 = time.perf_counter(), time.thread_time()
        self._suspects(a)
        self._confirm_flagged(a)
        self._combined(a)
        every = not math.isfinite(norm)
        rest = [c for c in a.every() if c.claimed.key not in a.drawn and (
            every or any(o.key in a.flagged for o in c.outputs()) or self._redraw(a, c))]
        a.decided.update((c.claimed.key, 1.0) for c in rest)
        self._examine(a, rest)
        try:
            self._wait(a)
        except NodesLost as exc:  # who was caught before it is still out for good
            if not a.caught:
                raise
            raise NodesLost({**exc.names, **a.caught}, caught=dict(a.caught)) from exc
        seconds = time.perf_counter() - t0
        a.cpu += time.thread_time() - c0
        self.last = {"checks": len(a.drawn), "rechecks": a.sent_rechecks, "confirmations": a.confirmations,
                     "caught": sorted(a.caught), "opposed": sorted(a.opposed), "turned": sorted(a.turned),
                     "seconds": seconds,
                     "overlapped_seconds": a.overlapped, "cpu_seconds": a.cpu}
        for k, v in (("checks", len(a.drawn)), ("rechecks", a.sent_rechecks), ("confirmations", a.confirmations),
                     ("caught", len(a.caught)), ("opposed", len(a.opposed)), ("turned", len(a.turned)),
                     ("seconds", seconds),
                     ("overlapped_seconds", a.overlapped), ("cpu_seconds", a.cpu)):
            self.totals[k] += v
        return dict(a.caught)

    def _wait(self, a: _Audit) -> None:
        """Take answers until none is awaited (each may ask for more: weights for a confirmation)."""
        while names := a.awaited():
            self._take(a, self.roster.recv(self.kinds, timeout=self.timeout, rnd=a.rnd, names=names))

    def _take(self, a: _Audit, msg: m.Message) -> None:
        if isinstance(msg, m.EvidenceItems):
            ask = a.asks.get(msg.ask)
            if ask is None or msg.sender not in ask.waiting:
                return
            ask.shown[msg.sender] = msg.items if isinstance(msg.items, dict) else {}
            ask.waiting.discard(msg.sender)
            if not ask.waiting:
                del a.asks[msg.ask]
                ask.then(ask.shown)
        elif isinstance(msg, m.Rechecked):
            r = a.rechecks.get(msg.check)
            if r is not None and msg.sender in r.answers and r.answers[msg.sender] is None:  # once each
                self._answered(a, r, msg.sender, msg.difference)
        elif isinstance(msg, m.WeightsShown):
            if msg.sender in a.weights_asked and msg.sender not in a.weights:
                a.weights[msg.sender] = (msg.stage, msg.tensors)
        self._confirm_ready(a)

    # -- which computations are checked -----------------------------------------------------------------
    def _decide(self, a: _Audit, checks: list[Check]) -> None:
        """Draw each of ``checks`` not drawn for yet; examine those drawn."""
        drawn = []
        for c in checks:
            if c.claimed.key not in a.decided:
                a.decided[c.claimed.key] = rate = self._rate(a, c)
                if self.rng.random() < rate:
                    drawn.append(c)
        self._examine(a, drawn)

    def _rate(self, a: _Audit, c: Check) -> float:
        """The chance that ``c`` is checked: all in mode "full", none in "screen"; in "spot"
        ``verify_rate``, and at least ``SUSPECT_RATE`` for a suspect's, or an opposed node's this round."""
        if self.mode != "spot":
            return 1.0 if self.mode == "full" else 0.0
        flagged = c.node in self.suspects or c.node in a.opposed or c.node in a.turned
        return max(self.rate, SUSPECT_RATE) if flagged else self.rate

    def _redraw(self, a: _Audit, c: Check) -> bool:
        """The round's end draw of ``c``, not drawn so far: at its rate if it was not decided yet; if it was,
        at a lower rate than its node has now (named a suspect, or opposed, at the round's end), with the
        chance that makes up the difference: so a suspect's computations of the round that named it are
        checked at the suspect's rate too (``before + (1 - before) * extra == rate``)."""
        rate, before = self._rate(a, c), a.decided.get(c.claimed.key)
        if before is None:
            return self.rng.random() < rate
        return rate > before and self.rng.random() < (rate - before) / (1.0 - before)

    def _checks(self, plan: Any, alloc: dict[str, int], batches: list) -> list[Check]:
        """Every computation of the round whose output another process received (the module doc)."""
        out: list[Check] = []
        visits: dict[str, list[dict]] = {}
        for mb, route in enumerate(plan.paths):
            tokens, targets = batches[mb]
            out += _route_checks(mb, route, tokens, targets, visits)
        replicas: dict[int, list[str]] = {}
        for name, stage in sorted(alloc.items()):
            replicas.setdefault(stage, []).append(name)
        for name, stage in sorted(alloc.items()):
            others = [r for r in replicas[stage] if r != name]
            if others:  # a share is sent only to other replicas (zeros by one that ran no microbatch)
                out.append(Check(name, stage, "share", -1, -1, Source(others[0], ("share", -1, -1, name)),
                                 visits=visits.get(name, [])))
        return out

    # -- screening ----------------------------------------------------------------------------------
    def _screen(self, a: _Audit, msg: m.Norm) -> None:
        """Feed a ``Norm``'s screening rows to the screen as it comes (so that only the last one's are
        left for the round's end): the keys of tensors found bad at once go to ``a.flagged``, disputes
        become events, its share cosines are kept for ``_suspects``. (The rows of a round later given up
        count too: those tensors were sent.) A report that is not one (a row, a dispute or a cosine of
        another shape) has its sender caught: only it could have sent it, over its own connection."""
        if not _well_formed(msg):
            c = Check(msg.sender, a.alloc.get(msg.sender, -1), "report", -1, -1, Source())
            self._catch(a.caught, msg.sender, "report", c,
                        reason="sent a screening report that is not one (its rows, disputes or cosines malformed)")
            return
        for what, mb, hop, sender, summary in msg.screened:
            stage = a.alloc.get(sender)
            if stage is None:
                continue
            # comparable tensors: of one stage, at one position on the routes (the residual stream
            # grows along a route, and a route may skip stages); shares of one stage and one load (a share
            # is summarised per microbatch, but where noise makes most of a gradient the norm of a mean
            # of k falls as 1/sqrt(k): honest replicas of unequal loads would stand apart)
            boundary = ("share", stage, a.loads.get(sender, -1)) if what == "share" else (what, stage, hop)
            if self.screen.add(boundary, sender, summary):
                a.flagged.add((what, mb, hop, sender))
        for key in msg.disputes:
            self._dispute([key[3], msg.sender], "a tensor did not match its sender's receipt on arrival",
                          key=list(key))
        # a replica reports its own share's cosine to each of its stage's other replicas': a
        # share's cosines are those its *other* replicas report, so that nobody speaks for its own
        stage = a.alloc.get(msg.sender)
        for name, cos in (msg.cosines or {}).items():
            if name != msg.sender and stage is not None and a.alloc.get(name) == stage:
                a.cosines.setdefault(name, []).append(cos)

    def _suspects(self, a: _Audit) -> None:
        """The round's end of screening: each share's cosine (the median of what its other replicas
        reported of it: one liar of 4 replicas is outvoted, of 3 it moves the mean of two; a suspect is
        only checked more), then the nodes out of their boundary's band, each new one an event. A share
        whose cosine of the round is opposed (``Screen.cosine``: below 0, and far below its earlier
        rounds') has its node's computations of the round checked at the suspect's rate (``_redraw``), in
        this round only: a negated share is opposed in every round it is negated. (With 2 replicas the one
        cosine is both shares': both are opposed; the checks tell which lied.) Likewise a node whose
        outputs' profile turned this round (``Screen.turned``)."""
        for name, values in a.cosines.items():
            if name in a.alloc:
                if self.screen.cosine(("share", a.alloc[name]), name, statistics.median(values)):
                    a.opposed.add(name)
        a.turned.update(n for n in self.screen.turned() if n in a.alloc)
        for s in self.screen.suspects():
            mark = (s.node, str(s.boundary), s.check)
            # what is found at once is checked at once (``flagged``): a suspect is one out of the band
            if s.node in a.alloc and math.isfinite(s.z) and mark not in self._suspected:
                self._suspected.add(mark)
                self.suspects.add(s.node)
                self._event("suspect", node=s.node, boundary=list(s.boundary) if isinstance(s.boundary, tuple)
                            else s.boundary, check=s.check,
                            z=s.z if math.isfinite(s.z) else None, value=s.value, others=s.others)

    def _dispute(self, nodes: list[str], why: str, **evidence: Any) -> None:
        self.suspects.update(nodes)
        self.totals["disputes"] += 1
        self._event("dispute", nodes=sorted(set(nodes)), why=why, **evidence)

    # -- the replicas' weights -------------------------------------------------------------------------
    def stepped(self, rnd: int, alloc: dict[str, int], digests: dict[str, Any],
                platforms: dict[str, str] | None = None) -> dict[str, str]:
        """The nodes of ``alloc`` stepped after round ``rnd``; ``digests``: name -> the digest of the weights
        each reported (``Stepped.weights``; those that did not step are left out), ``platforms``: name ->
        what its arithmetic runs on (``Stepped.platform``; one platform for all when not given). Compares
        the replicas of each stage on one platform (the module doc) and returns the nodes caught, name ->
        why (each also an event), for the trainer to exclude."""
        if not self.on:
            return {}
        for name, p in (platforms or {}).items():  # (a platform that is no name is one of its own)
            self.platform.setdefault(name, p if isinstance(p, str) else f"not a platform: {p!r:.80}")
        for name, d in digests.items():  # what each holds now (none known: it stepped alone)
            if isinstance(d, bytes) and name in alloc:
                self.held[name] = (alloc[name], d)
            else:
                self.held.pop(name, None)
        replicated = {s for s in alloc.values() if sum(1 for x in alloc.values() if x == s) > 1}
        groups: dict[tuple[int, str], dict[str, Any]] = {}
        for name, stage in sorted(alloc.items()):
            if name in digests and stage in replicated:
                groups.setdefault((stage, self.platform.get(name, "")), {})[name] = digests[name]
        caught: dict[str, str] = {}
        for (stage, _), got in sorted(groups.items()):
            votes = collections.Counter(d if isinstance(d, bytes) else None for d in got.values())
            if len(votes) < 2:
                continue
            top, n = votes.most_common(1)[0]
            if len(got) >= 3 and 2 * n > len(got) and top is not None:
                agreeing = sorted(o for o, x in got.items() if x == top)
                for name in sorted(set(got) - set(agreeing)):
                    what = (f"stepped to other weights than {n} of the {len(got)} replicas of stage {stage}"
                            if isinstance(got[name], bytes) else "reported no digest of the weights it stepped to")
                    self._catch(caught, name, "weights", Check(name, stage, "weights", -1, -1, Source(name, ())),
                                reason=f"{what} after round {rnd}", round=rnd, agreeing=agreeing)
            else:
                self._dispute(sorted(got), f"the replicas of stage {stage} stepped to different weights after "
                              f"round {rnd}, with no majority of 3 or more", stage=stage, round=rnd)
        for name in caught:
            self.held.pop(name, None)
        self.totals["caught"] += len(caught)
        if caught:
            self.last = {**self.last, "caught": sorted(set(self.last.get("caught", [])) | set(caught))}
        return caught

    def loaded(self, names: Iterable[str]) -> None:
        """``names`` load other weights (a stage taken over, or a node admitted again, maybe elsewhere):
        what they reported after their latest step is no longer what they hold, and their platform is
        taken again from their next report."""
        for name in names:
            self.held.pop(name, None)
            self.platform.pop(name, None)

    def started(self, holding: dict[str, int | None]) -> None:
        """A fresh run's processes started (``holding``: name -> the stage each holds, None: not the run's
        initial weights): each holds its stage's initial weights, which the coordinator builds from the
        seed as the processes do (``model.init_part``), so what each holds is known before its first step."""
        if not self.on:
            return
        digests: dict[int, bytes] = {}
        for name, stage in sorted(holding.items()):
            if stage is None:
                continue
            if stage not in digests:  # (built on the CPU, and let go: a stage process's are bitwise the same)
                digests[stage] = receipts.weights_digest(
                    Stage(self.model, stage, self.stages, seed=self.seed).state_dict())
            self.held[name] = (stage, digests[stage])

    def holds(self, name: str, stage: int, tensors: Any) -> None:
        """``name`` loaded ``tensors`` as its weights of ``stage`` (from the coordinator, which checked
        them or built them): it holds exactly those until its next step."""
        if self.on:
            self.held[name] = (stage, receipts.weights_digest(tensors))
            self.platform.pop(name, None)

    def exported(self, name: str, holds: int | None, stage: Any, tensors: Any) -> dict[str, str]:
        """Check weights that ``name`` exported (a snapshot, a checkpoint, an evaluation, a stage taken
        over, a neighbour's for the recovery), as stage ``stage``, where the coordinator knows it ``holds``
        that stage (None: not known): they must be of the stage it holds, have the digest of what it holds
        (``held``: what it reported after its latest step, or was loaded with, or, in a fresh run before
        its first step, the stage's initial weights), and the digest a strict majority of its stage's live
        replicas on its platform hold, where there is one. Returns the node caught (name -> why; also an
        event, check "export"), for the caller to exclude and to take another replica's export; {} when
        they pass.

        What cannot be checked: with verification "off", nothing; weights whose node holds no known
        digest and whose stage has no such majority (a node that reported none after its step, in a stage
        of 2 replicas: a dispute; a single replica that did so) are taken as they come. A stage of a single
        replica is held to what it reported after its step and computes with (its computations are checked
        against the weights it shows, which must be those), not to the step itself, which no replica
        repeats. The optimizer state that comes with an export is not checked (the module doc)."""
        if not self.on:
            return {}
        caught: dict[str, str] = {}
        c = Check(name, stage if isinstance(stage, int) else -1, "export", -1, -1, Source(name, ()))
        if not isinstance(stage, int) or isinstance(stage, bool) or (holds is not None and stage != holds):
            self._catch(caught, name, "export", c, reason=f"exported weights of stage {stage!r} while it holds "
                        f"stage {holds}")
        elif not isinstance(tensors, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
            self._catch(caught, name, "export", c, reason=f"exported weights of stage {stage} that are not a "
                        "state dict of tensors")
        else:
            got = receipts.weights_digest(tensors)
            held = self.held.get(name)
            own = held[1] if held is not None and held[0] == stage else None
            where = self.platform.get(name, "")
            peers = [d for o, (s, d) in self.held.items()
                     if s == stage and o != name and o in self.roster.inboxes and self.platform.get(o, "") == where]
            votes = collections.Counter(peers + ([own] if own is not None else []))
            top, agree = votes.most_common(1)[0] if votes else (None, 0)
            size = len(peers) + 1
            if own is not None and got != own:
                self._catch(caught, name, "export", c, reason=f"exported weights of stage {stage} that differ "
                            "from its stepped digest (what it reported holding after its latest step, or was "
                            "loaded with)")
            elif top is not None and size >= 2 and 2 * agree > size and got != top:
                self._catch(caught, name, "export", c, reason=f"exported weights of stage {stage} that differ "
                            f"from those {agree} of its stage's {size} replicas hold")
        for who in caught:
            self.held.pop(who, None)
        self.totals["caught"] += len(caught)
        self.totals["exports"] += 1
        return caught

    def combined_needed(self, replicas: Sequence[str]) -> bool:
        """Whether the replicas of a stage (``replicas``) must each report a digest of the gradient they
        combine this round (``Norm.combined``; the averaging check, ``_combined``): yes with verification
        on, unless they are 3 or more that all reported one platform. Then a replica that combines another
        gradient than its replicas steps to other weights than the others, and the weights check after
        the step names it (``stepped``; by the platform it reported first, so that a new claim cannot take
        it out of its group); with 2, or across platforms, only the averaging check can."""
        if not self.on:
            return False
        known = {self.platform.get(n) for n in replicas}
        return len(replicas) < 3 or None in known or len(known) > 1

    def combined_asked(self, rnd: int, replicas: Sequence[str]) -> bool:
        """``combined_needed``, for the ``SyncOrder`` of round ``rnd`` to ``replicas``: remembered by the
        round's audit, whose averaging check compares only the digests it asked for."""
        needed = self.combined_needed(replicas)
        a = self._current(rnd)
        if needed and a is not None:
            a.combined.add(tuple(sorted(replicas)))
        return needed

    # -- evidence -------------------------------------------------------------------------------------
    def _ask(self, a: _Audit, wanted: dict[str, set], then: Callable[[dict[str, dict]], None]) -> None:
        """Ask each holder of ``wanted`` (holder -> keys) for its kept tensors; ``then`` gets them (holder
        -> key -> (tensor, receipt, disputed)) once every holder answered."""
        if not wanted:
            then({})
            return
        self._ask_id += 1
        for holder, keys in wanted.items():
            self.roster.put(holder, m.EvidenceRequest(a.rnd, tuple(sorted(keys)), self._ask_id))
        a.asks[self._ask_id] = _Ask(set(wanted), then)

    def _examine(self, a: _Audit, checks: list[Check]) -> None:
        """Check each of ``checks`` (of nodes not caught): their evidence asked for, then judged."""
        checks = [c for c in checks if c.node not in a.caught]
        if not checks:
            return
        a.drawn.update(c.claimed.key for c in checks)
        wanted: dict[str, set] = {}
        for c in checks:
            for src in c.sources():
                if src.holder:
                    wanted.setdefault(src.holder, set()).add(src.key)
        self._ask(a, wanted, lambda shown: self._judge(a, checks, shown))

    def _judge(self, a: _Audit, checks: list[Check], shown: dict[str, dict]) -> None:
        """Each check's evidence, then (modes "spot" and "full") its recheck; in mode "screen", non-finite
        values computed from finite inputs are their sender's fault."""
        for c in checks:
            if c.node in a.caught:
                continue
            tensors = self._evidence(c, shown, a.caught, a.rnd)
            if tensors is None:
                continue
            claimed, inputs = tensors
            if self.mode == "screen":
                if _non_finite_from_finite(c.kind, claimed, inputs):
                    self._catch(a.caught, c.node, "non-finite", c, reason="sent non-finite values computed "
                                "from finite inputs")
                continue
            self._recheck(a, c, claimed, inputs)

    def _shown(self, src: Source, shown: dict[str, dict], caught: dict[str, str], c: Check, rnd: int) -> Any:
        """The tensor of ``src`` once it is covered by its sender's receipt for round ``rnd``; None, after
        blaming the holder or recording a dispute, when it is not (the module doc, Evidence). A tensor
        under the receipt of another round is not this round's (its sender's work of another round is
        not checked against this round's inputs): its holder is caught."""
        if not src.holder:
            return src.value
        got = shown.get(src.holder, {}).get(src.key)
        sender = src.key[3]
        if got is None or not isinstance(got, tuple) or len(got) != 3:
            self._catch(caught, src.holder, "evidence", c, reason=f"did not show the tensor {list(src.key)} "
                        f"it received from {sender}")
            return None
        tensor, receipt, disputed = got
        if disputed:
            self._dispute([sender, src.holder], "a tensor did not match its sender's receipt on arrival",
                          key=list(src.key))
            return None
        what, mb, hop, _ = src.key
        fields = isinstance(receipt, receipts.Receipt) and (receipt.sender, receipt.round, receipt.what, receipt.mb,
                                                             receipt.hop) == (sender, rnd, what, mb, hop)
        if not fields or not receipts.matches(receipt, tensor):
            self._catch(caught, src.holder, "evidence", c, reason=f"showed a tensor {list(src.key)} that "
                        f"{sender}'s receipt does not name")
            return None
        if not receipts.genuine(self._key(sender), receipt):
            self._dispute([sender, src.holder], "a receipt's MAC is not its sender's", key=list(src.key))
            return None
        return tensor

    def _evidence(self, c: Check, shown: dict[str, dict], caught: dict[str, str], rnd: int) -> tuple | None:
        """The check's tensors (claimed, inputs) once each is covered by its sender's receipt; None, after
        blaming or recording a dispute, when one is not."""
        outputs = [self._shown(src, shown, caught, c, rnd) for src in c.outputs()]
        if any(t is None for t in outputs):
            return None
        claimed = outputs[0] if len(outputs) == 1 else tuple(outputs)
        inputs = {}
        for name, src in c.inputs.items():
            inputs[name] = self._shown(src, shown, caught, c, rnd)
            if inputs[name] is None:
                return None
        visits = []
        for v in c.visits:
            got = {name: self._shown(src, shown, caught, c, rnd) for name, src in v.items()}
            if any(t is None for t in got.values()):
                return None
            visits.append(got)
        if c.kind == "share":
            inputs = {"visits": visits}
        return claimed, inputs

    # -- the replicas' averaging ------------------------------------------------------------------------
    def _combined(self, a: _Audit) -> None:
        """Every replica of a stage must combine the shares as they were sent (so that they hold equal
        weights after the step): when the digests of what they combined (``Norm.combined``) differ, the
        coordinator combines the shares itself, each as its sender's receipt names it, and catches every
        replica whose gradient differs from that by more than ``tolerance``."""
        digests = {msg.sender: msg.combined for msg in a.norms}
        groups: dict[int, list[str]] = {}
        for name, stage in sorted(a.alloc.items()):
            groups.setdefault(stage, []).append(name)
        # only where the digests were asked for (``combined_asked``): a digest nobody asked for is no
        # evidence, and the replicas not asked keep no combined gradient to show
        split = {s: names for s, names in groups.items()
                 if tuple(names) in a.combined and len({digests.get(n) for n in names}) > 1}
        if not split:
            return
        wanted: dict[str, set] = {}
        for names in split.values():
            for r in names:
                holder = next(o for o in names if o != r)
                wanted.setdefault(holder, set()).add(("share", -1, -1, r))
                wanted.setdefault(r, set()).add(COMBINED)
        self._ask(a, wanted, lambda shown: self._judge_combined(a, split, shown))

    def _judge_combined(self, a: _Audit, split: dict[int, list[str]], shown: dict[str, dict]) -> None:
        counts, visits = a.plan.backward_counts(), a.plan.stage_visits()
        for stage, names in split.items():
            shares = []
            for r in names:
                holder = next(o for o in names if o != r)
                c = Check(r, stage, "share", -1, -1, Source(holder, ("share", -1, -1, r)))
                share = self._shown(c.claimed, shown, a.caught, c, a.rnd)
                if share is None:
                    break
                shares.append(share.float())
            if len(shares) < len(names):
                continue  # a share not shown, or disputed: dealt with above
            want = combine(shares, [counts.get(r, 0) for r in names], visits[stage], self.aggregation)
            for r in names:
                got = shown.get(r, {}).get(COMBINED)
                c = Check(r, stage, "combine", -1, -1, Source(r, COMBINED))
                d = difference(got[0] if isinstance(got, tuple) and got else None, want)
                if d > self.tolerance:
                    self._catch(a.caught, r, "combine", c, reason=f"combined its stage's shares into a gradient "
                                f"that differs by {d:.3g} from the shares as their senders sent them",
                                difference=d if math.isfinite(d) else None, tolerance=self.tolerance)

    def _key(self, name: str) -> bytes:
        return receipts.node_key(self.roster.run_key, name)

    # -- recomputation and confirmation -----------------------------------------------------------------
    def _recheck(self, a: _Audit, c: Check, claimed: Any, inputs: dict) -> None:
        """Have ``verifiers`` replicas of ``c``'s stage (as many as it has others; one for a share),
        chosen at random, recompute it; with none, the coordinator does (a confirmation)."""
        others = [n for n, s in a.alloc.items() if s == c.stage and n != c.node and n in self.roster.inboxes
                  and n not in a.caught]
        if not others:
            self._confirmation(a, _Recheck(c, claimed, inputs))
            return
        chosen = self.rng.sample(sorted(others), min(1 if c.kind == "share" else self.verifiers, len(others)))
        self._check_id += 1
        a.rechecks[self._check_id] = _Recheck(c, claimed, inputs, {v: None for v in chosen})
        for v in chosen:
            a.sent_rechecks += 1
            self.roster.put(v, m.Recheck(a.rnd, self._check_id, c.stage, c.kind, inputs, claimed))

    def _answered(self, a: _Audit, r: _Recheck, verifier: str, d: Any) -> None:
        """``verifier``'s answer ``d`` to ``r``: a difference above the tolerance has the coordinator
        confirm it (once a recheck), every answer is held to the confirmation once there is one; an
        answer that is not a difference has its sender caught (only it could have sent it)."""
        if isinstance(d, bool) or not isinstance(d, (int, float)):
            r.answers[verifier] = math.nan
            self._catch(a.caught, verifier, "report", r.check,
                        reason=f"answered a recheck of {r.check.node}'s {r.check.kind} with {type(d).__name__}, "
                        "not a difference")
            return
        r.answers[verifier] = float(d)
        if d <= self.tolerance:
            self.totals["max_difference"] = max(self.totals["max_difference"], d)
        if r.confirmed is not None:
            self._hold(a, r, verifier)
        elif r.confirming:
            return
        elif not d <= self.tolerance:
            r.mismatch = verifier
            self._confirmation(a, r)
        elif None not in r.answers.values() and self.rng.random() < self._confirm_rate(a, r.check):
            self._confirmation(a, r)  # every verifier passed it: confirmed anyway, drawn after their answers

    def _confirm_rate(self, a: _Audit, c: Check) -> float:
        """The chance that a recheck of ``c`` that every verifier passed is confirmed all the same:
        ``confirm_rate``, and 1 for a node opposed or turned this round (its verifiers may be all of its
        stage's other replicas, in league with it)."""
        return 1.0 if c.node in a.opposed or c.node in a.turned else self.confirm_rate

    def _confirm_flagged(self, a: _Audit) -> None:
        """The round's end: the rechecks that every verifier passed before their node was found opposed or
        turned (at the round's end) are confirmed now, as those answered after it are (``_confirm_rate``)."""
        for r in list(a.rechecks.values()):
            if (r.check.node in a.opposed or r.check.node in a.turned) and not r.confirming and \
                    r.answers and None not in r.answers.values():
                self._confirmation(a, r)

    def _confirmation(self, a: _Audit, k: _Recheck) -> None:
        """``k`` waits for the weights it needs (asked for once an audit: they do not change before the
        step)."""
        k.confirming = True
        a.confirming.append(k)
        for n in k.needs():
            if n not in a.weights_asked:
                a.weights_asked.add(n)
                self.roster.put(n, m.ShowWeights(a.rnd))

    def _confirm_ready(self, a: _Audit) -> None:
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
                self._confirm(a, k)
            else:
                waiting.append(k)
        a.confirming = waiting

    def _confirm(self, a: _Audit, r: _Recheck) -> None:
        """The coordinator recomputes ``r`` itself, with the weights the node shows (those it reported
        after its latest step, or it is caught for them): its own difference above ``tolerance`` has the
        node caught. Then each verifier's answer is held to it (``_hold``)."""
        c = r.check
        mine = a.weights[c.node]
        if mine[0] != c.stage:
            self._catch(a.caught, c.node, c.kind, c, reason=f"did not show its weights of stage {c.stage}")
            return
        moved = set()  # those that show other weights than they reported: nothing is judged by them
        for n in (n for n in r.needs() if n in a.weights):
            held = self.held.get(n)
            if held is not None and held[0] == c.stage and a.weights[n][0] == c.stage and \
                    receipts.weights_digest(a.weights[n][1]) != held[1]:
                moved.add(n)
                self._catch(a.caught, n, "weights", c, reason=f"showed other weights of stage {c.stage} than "
                            "it reported after its latest step")
        if c.node in moved:
            return
        stage = self._modules.get(c.stage)
        if stage is None:  # built once a run (building initialises every weight); loaded once a node an audit
            stage = self._modules[c.stage] = Stage(self.model, c.stage, self.stages, seed=self.seed).to(self.device)
        if a.loaded.get(c.stage) != c.node:  # recompute leaves the weights as loaded
            stage.load_state_dict(mine[1])
            a.loaded[c.stage] = c.node
        want = recompute(stage, c.kind, r.inputs, self.device, self.bf16)
        own = r.confirmed = difference(r.claimed, want)
        if own > self.tolerance:
            what = "share of the round" if c.kind == "share" else \
                f"{_what(c, r.claimed, want, self.tolerance)} of microbatch {c.mb}"
            verb = "differ" if " and " in what else "differs"
            reported = r.answers[r.mismatch] if r.mismatch else None
            self._catch(a.caught, c.node, c.kind, c, reason=f"its {what} {verb} from the recomputation by "
                        f"{own:.3g} (tolerance {self.tolerance:g})", verifier=r.mismatch or "coordinator",
                        difference=_finite(reported) if reported is not None else None,
                        confirmed_difference=_finite(own), tolerance=self.tolerance)
        for v in r.answers:
            self._hold(a, r, v)

    def _hold(self, a: _Audit, r: _Recheck, verifier: str) -> None:
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
        t = self.tolerance
        false_mismatch = d > t and own <= t
        false_match = d <= t and not own <= t and d < (own - t) / (1 + t)
        if not (false_mismatch or false_match):
            return
        # (its weights came before the confirmation ran, which waited for every verifier not caught)
        if not _equal(a.weights[c.node][1], a.weights[verifier][1]):
            self._dispute([c.node, verifier], "the weights of two replicas of a stage differ", **c.describe())
            return
        evidence = {"verifier": verifier, "difference": d, "confirmed_difference": _finite(own), "tolerance": t}
        if false_mismatch:
            self._catch(a.caught, verifier, "false mismatch", c, reason=f"reported that {c.node}'s {c.kind} "
                        f"differs by {d:.3g}; the coordinator's recomputation differs by {own:.3g}", **evidence)
        else:
            self._catch(a.caught, verifier, "false match", c, reason=f"reported that {c.node}'s {c.kind} "
                        f"matches (difference {d:.3g}); the coordinator's recomputation differs by {own:.3g}",
                        **evidence)

    def _catch(self, caught: dict[str, str], node: str, check: str, c: Check, reason: str, **evidence: Any) -> None:
        if node in caught:
            return
        caught[node] = f"{check}: {reason}"
        log.warning("verification: node %s caught: %s", node, reason)
        fields = {**c.describe(), "computed_by": c.node, **evidence}
        self._event("caught", node=node, nodes=[node], check=check, why=reason, **fields)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _well_formed(msg: m.Norm) -> bool:
    """Whether a ``Norm``'s screening report has the shape a stage process makes: rows (what, mb, hop,
    sender, ``screen.Summary``), disputed keys (what, mb, hop, sender), and cosines (name -> a number
    within [-1, 1], give or take far more than rounding), or none."""
    def key(k: object) -> bool:
        return (isinstance(k, tuple) and len(k) == 4 and isinstance(k[0], str) and isinstance(k[1], int)
                and isinstance(k[2], int) and isinstance(k[3], str))

    rows, disputes, cosines = msg.screened, msg.disputes, msg.cosines
    if not isinstance(rows, tuple) or not isinstance(disputes, tuple):
        return False
    if not all(isinstance(r, tuple) and len(r) == 5 and key(r[:4]) and sound(r[4]) for r in rows):
        return False
    if not all(key(k) for k in disputes):
        return False
    if cosines is None:
        return True
    return isinstance(cosines, dict) and all(
        isinstance(n, str) and isinstance(c, float) and abs(c) <= 1.01 for n, c in cosines.items())


def _route_checks(mb: int, route: Any, tokens: torch.Tensor, targets: torch.Tensor,
                  visits: dict[str, list[dict]]) -> list[Check]:
    """The checks of microbatch ``mb``'s computations along ``route``; adds what each node's share was
    computed from to ``visits`` (node -> its visits' inputs)."""
    o, nodes, n = route.origin, route.nodes, len(route.nodes)
    if not n:
        visits.setdefault(o, []).append({"tokens": Source(value=tokens), "targets": Source(value=targets)})
        return []

    def fwd(h: int) -> tuple:  # the activations sent at hop h, as their receiver keeps them
        return ("activation", mb, h, o if h == 0 else nodes[h - 1])

    def bwd(h: int) -> tuple:  # the gradients sent at hop h
        return ("gradient", mb, h, o if h == n - 1 else nodes[h + 1])

    def at(h: int) -> str:  # who receives hop h
        return nodes[h] if 0 <= h < n else o

    out = [Check(o, 0, "first", mb, 0, Source(at(0), fwd(0)), {"tokens": Source(value=tokens)})]
    for h, x in enumerate(nodes):  # it got fwd(h) and bwd(h); it sent fwd(h + 1) and bwd(h - 1)
        out.append(Check(x, route.stages[h], "visit", mb, h, Source(at(h + 1), fwd(h + 1)),
                         {"x": Source(x, fwd(h)), "g": Source(x, bwd(h))}, also=Source(at(h - 1), bwd(h - 1))))
    out.append(Check(o, 0, "loss", mb, n - 1, Source(at(n - 1), bwd(n - 1)),
                     {"a": Source(o, fwd(n)), "targets": Source(value=targets)}))
    visits.setdefault(o, []).append({"tokens": Source(value=tokens), "targets": Source(value=targets),
                                     "a": Source(o, fwd(n)), "g": Source(o, bwd(-1))})
    for h, x in enumerate(nodes):
        visits.setdefault(x, []).append({"x": Source(x, fwd(h)), "g": Source(x, bwd(h))})
    return out


def _what(c: Check, claimed: Any, want: Any, tolerance: float) -> str:
    """Which of a check's computations differ beyond ``tolerance`` (a visit's forward, backward, or both)."""
    if c.kind != "visit" or not isinstance(want, tuple):
        return c.kind
    parts = ("forward", "backward")
    bad = [p for p, g, w in zip(parts, claimed if isinstance(claimed, tuple) else (None, None), want)
           if difference(g, w) > tolerance]
    return " and ".join(bad or parts)


def _all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _non_finite_from_finite(kind: str, claimed: Any, inputs: dict) -> bool:
    """Whether a computation's output is non-finite although what it was computed from is finite (its
    maker's fault, in mode "screen"). A visit's two outputs are judged apart, each against what it
    depends on: its forward output against ``x`` alone, its backward output against ``x`` and ``g``.
    Judged together, a node whose forward output was made NaN was excused by the NaN gradient that came
    back for it (the loss of a NaN activation is NaN): nobody was caught, the NaN reached the step, and
    in the next round honest nodes, their weights NaN by then, were blamed."""
    if kind == "visit":
        forward, backward = claimed
        return (not _all_finite([forward]) and _all_finite([inputs["x"]])) or (
            not _all_finite([backward]) and _all_finite([inputs["x"], inputs["g"]]))
    outputs = claimed if isinstance(claimed, tuple) else (claimed,)
    return not _all_finite(outputs) and _all_finite(_tensors(inputs))


def _tensors(inputs: dict) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in inputs.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, list):
            for d in v:
                out.extend(t for t in d.values() if isinstance(t, torch.Tensor))
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
