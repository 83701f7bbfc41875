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
   fault. Then every verifier's answer is held to it (``confirm.Confirmations.hold``): a mismatch where
   the coordinator found none is a "false mismatch" (so nobody can be framed by a false report), a match
   where it found a difference beyond what float nondeterminism allows is a "false match" (an accomplice
   passing a colluder's work), either caught; a verifier whose weights are not the node's is a dispute instead.
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

import contextlib
import math
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

from .. import protocol as m
from ..dispatch import Dispatch
from ..errors import NodesLost
from .audit import Audit
from .checks import Check, round_checks
from .confirm import Confirmations
from .findings import Findings
from .gather import Gather
from .replicas import Replicas
from .reports import Reports
from .sampling import Sampling
from .screen import Screen
from .settings import Settings
from .tensor_id import Kind


class Verifier:
    """The checks of one training run (the module doc), composed of the parts that own their state:
    ``findings`` (who was caught or suspected, the totals), ``gather`` (evidence asked for and judged),
    ``confirm`` (the coordinator's own recomputations), ``sampling`` (which computations are checked, their
    rechecks), ``replicas`` (what each replica holds; the weights, export and averaging checks) and
    ``reports`` (screening). Per round: ``begin`` (before its microbatches go out), ``finished`` as each
    microbatch is done, ``note`` for each ``Norm``, ``take`` for each answer of ``kinds`` (its handler in
    ``dispatch``), then ``audit``, which returns the nodes caught (name -> why); ``abandon`` when the round
    is given up."""

    def __init__(self, config: Any, model: Any, roster: Any, event: Callable[..., None],
                 dispatch: Dispatch | None = None) -> None:
        """``dispatch``: the coordinator's reader of its control inbox (one of ``roster``'s own when not
        given), which hands this verifier the answers its audits asked for (``kinds``), whoever reads them."""
        self.settings = Settings.of(config)
        self.roster = roster
        self.findings = Findings(event)
        self.gather = Gather(self.findings, roster)
        self.replicas = Replicas(self.settings, self.findings, roster, model, self.gather)
        self.confirm = Confirmations(self.settings, self.findings, roster, model, self.replicas.held)
        self.sampling = Sampling(self.settings, self.findings, roster, self.gather, self.confirm)
        self.reports = Reports(self.findings)
        self._audit: Audit | None = None
        #: the messages of the nodes that an audit takes (``take``), whoever reads them
        self.kinds: tuple[type, ...] = (m.EvidenceItems, m.Rechecked, m.WeightsShown) if self.on else ()
        self.dispatch = Dispatch(roster) if dispatch is None else dispatch
        if self.kinds:
            self.dispatch.on(self.kinds, self.take)
        #: the latest audit's figures (checks run, rechecks, confirmations, nodes caught; ``seconds``: its
        #: time after the replicas' averaging, on the round's critical path; ``overlapped_seconds``: its
        #: own work while the round's microbatches ran; ``cpu_seconds``: the CPU time of all of its own
        #: work on the coordinator, waits not counted), for the iteration's record
        self.last: dict[str, Any] = {}

    @property
    def on(self) -> bool:
        return self.settings.on

    @property
    def totals(self) -> dict[str, Any]:
        """The run's figures so far (``findings.Findings.totals``)."""
        return self.findings.totals

    @property
    def suspects(self) -> set[str]:
        """The nodes screening named or a dispute involved."""
        return self.findings.suspects

    @property
    def held(self) -> dict[str, tuple[int, bytes]]:
        """name -> (stage, digest of the weights it holds) (``replicas.Replicas.held``)."""
        return self.replicas.held

    @property
    def screen(self) -> Screen:
        return self.reports.screen

    @property
    def rng(self) -> Any:
        """Where every draw is made (``settings.Settings.rng``)."""
        return self.settings.rng

    @rng.setter
    def rng(self, rng: Any) -> None:
        self.settings.rng = rng

    # -- one round, as it runs ------------------------------------------------------------------------
    def begin(self, rnd: int, plan: Any, alloc: dict[str, int], batches: list) -> None:
        """Round ``rnd`` starts, run on ``plan`` by the nodes of ``alloc``, on ``batches``: its computations
        are listed, to be drawn as they are done."""
        if not self.on:
            return
        t0 = time.thread_time()
        by_mb: dict[int, list[Check]] = {}
        shares: dict[str, Check] = {}
        for c in round_checks(rnd, plan, alloc, batches):
            if c.kind == Kind.SHARE:
                shares[c.node] = c
            else:
                by_mb.setdefault(c.mb, []).append(c)
        self._audit = Audit(rnd, plan, dict(alloc), by_mb, shares, plan.backward_counts())
        self._audit.cpu = time.thread_time() - t0

    def finished(self, rnd: int, mb: int) -> None:
        """Microbatch ``mb`` of round ``rnd`` is done (its origin's ``Done``): every tensor of its
        computations was sent and received, so they are drawn now, and the evidence of those drawn asked
        for, while the round's other microbatches run."""
        a = self._current(rnd)
        if a is not None:
            with self._overlapped(a):
                self.sampling.decide(a, a.by_mb.get(mb, []))

    def note(self, msg: m.Norm) -> None:
        """A ``Norm`` of the round: kept for ``audit`` (screening rows, disputes, share cosines). A
        replica's share is drawn once its own and its share's holder's ``Norm`` came (the holder combined
        it, so it has it)."""
        a = self._current(msg.round)
        if a is None:
            return
        with self._overlapped(a):
            a.norms.append(msg)
            self.reports.screen_norm(a, msg)
            normed = {n.sender for n in a.norms}
            self.sampling.decide(a, [c for c in a.shares.values() if c.node in normed and c.claimed.holder in normed])

    def take(self, msg: m.Message) -> None:
        """An answer of ``kinds`` (its handler in ``dispatch``): taken by the round's audit, timed as work
        overlapped with the round while the round runs."""
        a = self._current(getattr(msg, "round", None))
        if a is None:
            return
        if a.ending:
            self._take(a, msg)
            return
        with self._overlapped(a):
            self._take(a, msg)

    def abandon(self) -> dict[str, str]:
        """The round is given up (a node lost, or it stalled): its audit is dropped; returns the nodes it
        caught so far (out for good all the same: what they sent is evidence of its own)."""
        a, self._audit = self._audit, None
        self.screen.forget_round()
        return dict(a.caught) if a is not None else {}

    def _current(self, rnd: Any) -> Audit | None:
        a = self._audit
        return a if a is not None and a.rnd == rnd else None

    @contextlib.contextmanager
    def _overlapped(self, a: Audit) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            a.overlapped += time.perf_counter() - t0
            a.cpu += time.thread_time() - c0

    def _take(self, a: Audit, msg: m.Message) -> None:
        if isinstance(msg, m.EvidenceItems):
            self.gather.take(a, msg)
        elif isinstance(msg, m.Rechecked):
            self.sampling.take(a, msg)
        elif isinstance(msg, m.WeightsShown):
            self.confirm.take(a, msg)
        self.confirm.ready(a)

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
        a.ending = True
        self.reports.suspects(a)
        self.confirm.flagged(a)
        self.replicas.averaging(a)
        every = not math.isfinite(norm)
        rest = [c for c in a.every() if c.claimed.key not in a.drawn and (
            every or any(o.key in a.flagged for o in c.outputs()) or self.sampling.redraw(a, c))]
        a.decided.update((c.claimed.key, 1.0) for c in rest)
        self.sampling.examine(a, rest)
        try:  # answers until none is awaited (each may ask for more: weights for a confirmation)
            self.dispatch.until(lambda: not a.awaited(), rnd=a.rnd, timeout=self.settings.timeout)
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

    # -- the replicas' weights (``replicas``) ----------------------------------------------------------
    def stepped(self, rnd: int, alloc: dict[str, int], digests: dict[str, Any],
                platforms: dict[str, str] | None = None) -> dict[str, str]:
        """``replicas.Replicas.stepped``: the nodes caught (name -> why), also in ``last``."""
        caught = self.replicas.stepped(rnd, alloc, digests, platforms)
        if caught:
            self.last = {**self.last, "caught": sorted(set(self.last.get("caught", [])) | set(caught))}
        return caught

    def loaded(self, names: Iterable[str]) -> None:
        """``replicas.Replicas.loaded``."""
        self.replicas.loaded(names)

    def started(self, holding: dict[str, int | None]) -> None:
        """``replicas.Replicas.started``."""
        self.replicas.started(holding)

    def holds(self, name: str, stage: int, tensors: Any) -> None:
        """``replicas.Replicas.holds``."""
        self.replicas.holds(name, stage, tensors)

    def exported(self, name: str, holds: int | None, stage: Any, tensors: Any) -> dict[str, str]:
        """``replicas.Replicas.exported``: the node caught (name -> why), or {}."""
        return self.replicas.exported(name, holds, stage, tensors)

    def combined_needed(self, replicas: Sequence[str]) -> bool:
        """``replicas.Replicas.combined_needed``."""
        return self.replicas.combined_needed(replicas)

    def combined_asked(self, rnd: int, replicas: Sequence[str]) -> bool:
        """``combined_needed``, for the ``SyncOrder`` of round ``rnd`` to ``replicas``: remembered by the
        round's audit, whose averaging check compares only the digests it asked for."""
        needed = self.combined_needed(replicas)
        a = self._current(rnd)
        if needed and a is not None:
            a.combined.add(tuple(sorted(replicas)))
        return needed
