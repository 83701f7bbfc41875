"""The coordinator's side of verification (``[verify]``; issue 32): after a round's microbatches and
averaging, before its step, it screens what every node reported receiving, spot-checks sampled
computations by having another replica of the same stage recompute them, confirms every mismatch
itself, and names the nodes caught. The trainer excludes them and runs the round again without them
(``trainer``), so nothing they computed in the round reaches the weights.

What is checked. Every tensor a node sends is the result of one *computation* by that node, from
inputs that others sent it (or the coordinator: tokens and targets): an origin's first forward
("first"), a forward at a visited stage ("forward"), the origin's loss gradient ("loss"), a backward
at a visited stage ("backward"), and a replica's summed gradients ("share"). A *check* of one
computation gathers the tensors it needs from the nodes that received them (``evidence``: each kept
with its sender's receipt), so the node checked cannot choose what it is checked on:

1. *Evidence.* Each tensor shown must be covered by its sender's receipt (``receipts``): a holder that
   shows a tensor its sender's receipt does not name, or shows nothing, is caught itself (an honest one
   kept what it got, and checked its digest when it came). A tensor the holder reported at once as not
   matching its receipt, or a receipt whose MAC is not its sender's, is a *dispute*: the sender or the
   holder lies, and the coordinator cannot tell which; neither is blamed for it, both become suspects.
2. *Recomputation* (modes "spot" and "full"): a replica of the node's stage, chosen at random after the
   fact, recomputes the computation with the weights it holds (every replica's weights are bitwise equal
   until the step: they average the same shares in the same order) and reports the relative difference
   (``evidence.difference``). With no other replica, the coordinator recomputes.
3. *Confirmation* of every difference above ``tolerance``: the coordinator fetches the weights of the
   node and of the verifier, and when they are equal recomputes itself. Its own difference above
   ``tolerance`` confirms the node's fault; at or below it, the verifier reported a mismatch that was
   not there and is caught instead (so nobody can be framed by a false report); unequal weights are a
   dispute.

The replicas' averaging. Every replica reports a digest of the gradient it combined from its stage's
shares (``Norm.combined``); when a stage's replicas' digests differ, the coordinator combines the shares
itself, each as its sender's receipt names it, and catches each replica whose gradient differs from that
(one that combined another share than was sent, its own included, would step to other weights than its
replicas, and later checks could no longer compare them). Every round, in every mode but "off".

Which computations. ``full``: all. ``spot``: each with probability ``verify_rate``, drawn here from the
operating system's randomness after the round's tensors were sent (so no node can know which of its
tensors will be checked); a screening suspect's with at least ``SUSPECT_RATE``. Any mode but "off":
every computation whose output a receiver found non-finite or all zero when screening it. In "screen"
mode those are judged without recomputation: non-finite outputs from finite inputs are the node's fault.

Screening (``screen``): each node reports a summary of every tensor it received (``Norm.screened``),
kept per boundary (what, the sender's stage) and sender; a node whose statistics leave its boundary's
band is a *suspect* (an event, a higher check rate; never blamed for that alone).

Every finding is an event (``trainer._event``): "caught" (who, which check, the evidence: the
computation, microbatch and hop, the verifier and both differences), "dispute" and "suspect".
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from . import protocol as m
from . import receipts
from .aggregate import combine
from .errors import NodesLost
from .evidence import COMBINED, difference, recompute
from .screen import Screen
from .stages import Stage

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
    microbatch ``mb`` (-1: a share) at ``hop``; its output ``claimed`` and its ``inputs`` (by the name
    ``evidence.recompute`` reads; a share's ``visits`` are a list of such dicts)."""

    node: str
    stage: int
    kind: str
    mb: int
    hop: int
    claimed: Source
    inputs: dict = field(default_factory=dict)
    visits: list = field(default_factory=list)

    def sources(self) -> Iterable[Source]:
        yield self.claimed
        yield from self.inputs.values()
        for v in self.visits:
            yield from v.values()

    def describe(self) -> dict:
        return {"computation": self.kind, "stage": self.stage, "mb": self.mb, "hop": self.hop}


class Verifier:
    """The checks of one training run (the module doc). ``note`` takes every ``Norm`` of a round;
    ``audit`` runs the round's checks and returns the nodes caught (name -> why)."""

    def __init__(self, config: Any, model: Any, roster: Any, event: Callable[..., None]) -> None:
        self.mode, self.rate, self.tolerance = config.mode, config.verify_rate, config.tolerance
        self.aggregation = config.aggregation
        self.stages, self.seed, self.bf16 = config.stages, config.seed, config.bf16
        self.timeout = config.timeout
        self.model, self.roster, self._event = model, roster, event
        self.screen = Screen()
        self.rng = random.SystemRandom()
        self.device = torch.device("cpu")
        self._norms: dict[int, list[m.Norm]] = {}
        self._weights: dict[str, tuple[int, dict]] = {}  # nodes' weights fetched in the current audit
        self._built: dict[str, Any] = {}  # the stages built from them (recompute leaves them unchanged)
        self._suspected: set[tuple] = set()
        self.suspects: set[str] = set()
        self._check_id = 0
        #: the latest audit's figures (checks run, rechecks, seconds), for the iteration's record
        self.last: dict[str, Any] = {}
        #: the run's figures so far; ``max_difference``: the largest difference of a recheck that passed
        #: (what float nondeterminism amounts to here, against ``tolerance``)
        self.totals = {"checks": 0, "rechecks": 0, "confirmations": 0, "caught": 0, "disputes": 0, "seconds": 0.0,
                       "max_difference": 0.0}

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def note(self, msg: m.Norm) -> None:
        """A ``Norm`` of the round: its screening rows, disputes and share cosines are kept for ``audit``."""
        if self.on:
            self._norms.setdefault(msg.round, []).append(msg)

    # -- one round --------------------------------------------------------------------------------
    def audit(self, rnd: int, plan: Any, alloc: dict[str, int], batches: list, norm: float = 0.0) -> dict[str, str]:
        """Screen and check round ``rnd`` (run on ``plan`` by the nodes of ``alloc``, on ``batches``; ``norm``:
        its gradient norm, which, when not finite, has every computation checked, so that whoever made
        it so is caught before the step); returns the nodes caught, name -> why (each also an event).
        Raises NodesLost when a node it asks dies meanwhile (the round is then run again); those it had
        caught before are in it too, as its ``caught``, to be excluded all the same."""
        if not self.on:
            return {}
        t0 = time.perf_counter()
        norms = self._norms.pop(rnd, [])
        for old in [r for r in self._norms if r < rnd]:
            del self._norms[old]
        self._weights, self._built = {}, {}
        flagged = self._screen(norms, alloc)
        checks = self._checks(plan, alloc, batches)
        every = not math.isfinite(norm)
        chosen = [c for c in checks if every or c.claimed.key in flagged or self._draw(c)]
        caught: dict[str, str] = {}
        try:
            chosen, rechecks, confirmations = self._judge(rnd, norms, plan, alloc, chosen, caught)
        except NodesLost as exc:  # who was caught before it is still out for good
            if not caught:
                raise
            raise NodesLost({**exc.names, **caught}, caught=caught) from exc
        seconds = time.perf_counter() - t0
        self.last = {"checks": len(chosen), "rechecks": rechecks, "confirmations": confirmations,
                     "caught": sorted(caught), "seconds": seconds}
        for k, v in (("checks", len(chosen)), ("rechecks", rechecks), ("confirmations", confirmations),
                     ("caught", len(caught)), ("seconds", seconds)):
            self.totals[k] += v
        return caught

    def _judge(self, rnd: int, norms: list[m.Norm], plan: Any, alloc: dict[str, int], chosen: list[Check],
               caught: dict[str, str]) -> tuple[list[Check], int, int]:
        """The averaging check, then ``chosen``'s evidence and rechecks: adds to ``caught``; returns the
        checks made, the rechecks and the confirmations."""
        rechecks = confirmations = 0
        self._combined(rnd, norms, plan, alloc, caught)
        chosen = [c for c in chosen if c.node not in caught]
        if chosen:
            shown = self._gather(rnd, chosen)
            judged = []
            for c in chosen:
                tensors = self._evidence(c, shown, caught)
                if tensors is None:
                    continue
                claimed = tensors[0]
                if not bool(torch.isfinite(claimed).all()) and all(
                        bool(torch.isfinite(t).all()) for t in _tensors(tensors[1]) if t.is_floating_point()):
                    if self.mode == "screen":
                        self._catch(caught, c.node, "non-finite", c, reason="sent non-finite values computed from "
                                    "finite inputs")
                        continue
                if self.mode in ("spot", "full"):
                    judged.append((c, tensors))
            rechecks, confirmations = self._recheck(rnd, judged, alloc, caught)
        return chosen, rechecks, confirmations

    def _draw(self, c: Check) -> bool:
        if self.mode == "full":
            return True
        if self.mode != "spot":
            return False
        rate = max(self.rate, SUSPECT_RATE) if c.node in self.suspects else self.rate
        return self.rng.random() < rate

    # -- screening ----------------------------------------------------------------------------------
    def _screen(self, norms: list[m.Norm], alloc: dict[str, int]) -> set[tuple]:
        """Feed the round's screening rows to the screen; the keys of tensors found bad at once. Disputes
        and new suspects become events."""
        flagged: set[tuple] = set()
        cosines: dict[str, list[float]] = {}
        for msg in norms:
            for what, mb, hop, sender, summary in msg.screened:
                stage = alloc.get(sender)
                if stage is None:
                    continue
                # comparable tensors: of one stage, at one position on the routes (the residual stream
                # grows along a route, and a route may skip stages)
                boundary = (what, stage) if what == "share" else (what, stage, hop)
                if self.screen.add(boundary, sender, summary):
                    flagged.add((what, mb, hop, sender))
            for key in msg.disputes:
                self._dispute([key[3], msg.sender], "a tensor did not match its sender's receipt on arrival",
                              key=list(key))
            for name, cos in (msg.cosines or {}).items():
                cosines.setdefault(name, []).append(cos)
        for name, values in cosines.items():  # the median of the replicas' reports: liars are outvoted
            if name in alloc:
                self.screen.add_statistic(("share", alloc[name]), name, "cosine", statistics.median(values))
        for s in self.screen.suspects():
            mark = (s.node, str(s.boundary), s.check)
            # what is found at once is checked at once (``flagged``): a suspect is one out of the band
            if s.node in alloc and math.isfinite(s.z) and mark not in self._suspected:
                self._suspected.add(mark)
                self.suspects.add(s.node)
                self._event("suspect", node=s.node, boundary=list(s.boundary) if isinstance(s.boundary, tuple)
                            else s.boundary, check=s.check,
                            z=s.z if math.isfinite(s.z) else None, value=s.value, others=s.others)
        return flagged

    def _dispute(self, nodes: list[str], why: str, **evidence: Any) -> None:
        self.suspects.update(nodes)
        self.totals["disputes"] += 1
        self._event("dispute", nodes=sorted(set(nodes)), why=why, **evidence)

    # -- which computations ---------------------------------------------------------------------------
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

    # -- evidence -------------------------------------------------------------------------------------
    def _gather(self, rnd: int, checks: list[Check]) -> dict[str, dict]:
        """Ask each holder for the kept tensors the checks need; holder -> key -> (tensor, receipt,
        disputed)."""
        wanted: dict[str, set] = {}
        for c in checks:
            for src in c.sources():
                if src.holder:
                    wanted.setdefault(src.holder, set()).add(src.key)
        return self._ask(rnd, wanted)

    def _ask(self, rnd: int, wanted: dict[str, set]) -> dict[str, dict]:
        for holder, keys in wanted.items():
            self.roster.put(holder, m.EvidenceRequest(rnd, tuple(sorted(keys))))
        shown: dict[str, dict] = {}
        while set(wanted) - set(shown):
            msg = self.roster.recv(m.EvidenceItems, timeout=self.timeout, rnd=rnd, names=set(wanted) - set(shown))
            shown[msg.sender] = msg.items if isinstance(msg.items, dict) else {}
        return shown

    def _shown(self, src: Source, shown: dict[str, dict], caught: dict[str, str], c: Check) -> Any:
        """The tensor of ``src`` once it is covered by its sender's receipt; None, after blaming the holder
        or recording a dispute, when it is not (the module doc, Evidence)."""
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
        fields = isinstance(receipt, receipts.Receipt) and (receipt.sender, receipt.what, receipt.mb,
                                                             receipt.hop) == (sender, what, mb, hop)
        if not fields or not receipts.matches(receipt, tensor):
            self._catch(caught, src.holder, "evidence", c, reason=f"showed a tensor {list(src.key)} that "
                        f"{sender}'s receipt does not name")
            return None
        if not receipts.genuine(self._key(sender), receipt):
            self._dispute([sender, src.holder], "a receipt's MAC is not its sender's", key=list(src.key))
            return None
        return tensor

    def _evidence(self, c: Check, shown: dict[str, dict], caught: dict[str, str]) -> tuple | None:
        """The check's tensors (claimed, inputs) once each is covered by its sender's receipt; None, after
        blaming or recording a dispute, when one is not."""
        claimed = self._shown(c.claimed, shown, caught, c)
        if claimed is None:
            return None
        inputs = {}
        for name, src in c.inputs.items():
            inputs[name] = self._shown(src, shown, caught, c)
            if inputs[name] is None:
                return None
        visits = []
        for v in c.visits:
            got = {name: self._shown(src, shown, caught, c) for name, src in v.items()}
            if any(t is None for t in got.values()):
                return None
            visits.append(got)
        if c.kind == "share":
            inputs = {"visits": visits}
        return claimed, inputs

    # -- the replicas' averaging ------------------------------------------------------------------------
    def _combined(self, rnd: int, norms: list[m.Norm], plan: Any, alloc: dict[str, int],
                  caught: dict[str, str]) -> None:
        """Every replica of a stage must combine the shares as they were sent (so that they hold equal
        weights after the step): when the digests of what they combined (``Norm.combined``) differ, the
        coordinator combines the shares itself, each as its sender's receipt names it, and catches every
        replica whose gradient differs from that by more than ``tolerance``."""
        digests = {msg.sender: msg.combined for msg in norms}
        groups: dict[int, list[str]] = {}
        for name, stage in sorted(alloc.items()):
            groups.setdefault(stage, []).append(name)
        split = {s: names for s, names in groups.items()
                 if len(names) > 1 and len({digests.get(n) for n in names}) > 1}
        if not split:
            return
        wanted: dict[str, set] = {}
        for names in split.values():
            for r in names:
                holder = next(o for o in names if o != r)
                wanted.setdefault(holder, set()).add(("share", -1, -1, r))
                wanted.setdefault(r, set()).add(COMBINED)
        shown = self._ask(rnd, wanted)
        counts, visits = plan.backward_counts(), plan.stage_visits()
        for stage, names in split.items():
            shares = []
            for r in names:
                holder = next(o for o in names if o != r)
                c = Check(r, stage, "share", -1, -1, Source(holder, ("share", -1, -1, r)))
                share = self._shown(c.claimed, shown, caught, c)
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
                    self._catch(caught, r, "combine", c, reason=f"combined its stage's shares into a gradient "
                                f"that differs by {d:.3g} from the shares as their senders sent them",
                                difference=d if math.isfinite(d) else None, tolerance=self.tolerance)

    def _key(self, name: str) -> bytes:
        return receipts.node_key(self.roster.run_key, name)

    # -- recomputation and confirmation -----------------------------------------------------------------
    def _recheck(self, rnd: int, judged: list[tuple], alloc: dict[str, int], caught: dict[str, str]) -> tuple[int, int]:
        """Have a replica recompute each check, confirm each mismatch (the module doc); returns (rechecks
        sent to replicas, confirmations by the coordinator)."""
        asked: dict[int, tuple] = {}
        confirm: list[tuple] = []
        for c, (claimed, inputs) in judged:
            if c.node in caught:
                continue
            others = [n for n, s in alloc.items() if s == c.stage and n != c.node and n in self.roster.inboxes
                      and n not in caught]
            if not others:
                confirm.append((c, claimed, inputs, None, math.nan))
                continue
            verifier = self.rng.choice(sorted(others))
            self._check_id += 1
            asked[self._check_id] = (c, claimed, inputs, verifier)
            self.roster.put(verifier, m.Recheck(rnd, self._check_id, c.stage, c.kind, inputs, claimed))
        pending = set(asked)
        while pending:
            names = {asked[i][3] for i in pending}
            msg = self.roster.recv(m.Rechecked, timeout=self.timeout, rnd=rnd, names=names)
            if msg.check not in pending or asked[msg.check][3] != msg.sender:
                continue
            pending.discard(msg.check)
            c, claimed, inputs, verifier = asked[msg.check]
            d = msg.difference
            if isinstance(d, (int, float)) and d <= self.tolerance:
                self.totals["max_difference"] = max(self.totals["max_difference"], d)
                continue
            confirm.append((c, claimed, inputs, verifier, d))
        for c, claimed, inputs, verifier, d in confirm:
            if c.node not in caught and (verifier is None or verifier not in caught):
                self._confirm(c, claimed, inputs, verifier, d, caught)
        return len(asked), len(confirm)

    def _confirm(self, c: Check, claimed: Any, inputs: dict, verifier: str | None, reported: float,
                 caught: dict[str, str]) -> None:
        """The coordinator recomputes ``c`` itself, with the node's weights (equal to the verifier's)."""
        states = self._states([c.node] + ([verifier] if verifier else []))
        mine = states.get(c.node)
        if mine is None or mine[0] != c.stage:
            self._catch(caught, c.node, c.kind, c, reason=f"did not show its weights of stage {c.stage}")
            return
        if verifier is not None:
            theirs = states.get(verifier)
            if theirs is None or not _equal(mine[1], theirs[1]):
                self._dispute([c.node, verifier], "the weights of two replicas of a stage differ", **c.describe())
                return
        stage = self._built.get(c.node)
        if stage is None:  # one build a node an audit, however many of its computations are confirmed
            stage = self._built[c.node] = Stage(self.model, c.stage, self.stages, seed=self.seed)
            stage.load_state_dict(mine[1])
            stage.to(self.device)
        own = difference(claimed, recompute(stage, c.kind, inputs, self.device, self.bf16))
        evidence = {**c.describe(), "verifier": verifier or "coordinator",
                    "difference": reported if verifier and math.isfinite(reported) else None,
                    "confirmed_difference": own if math.isfinite(own) else None, "tolerance": self.tolerance}
        if own > self.tolerance:
            what = "share of the round" if c.kind == "share" else f"{c.kind} of microbatch {c.mb}"
            self._catch(caught, c.node, c.kind, c, reason=f"its {what} differs from the recomputation by {own:.3g} "
                        f"(tolerance {self.tolerance:g})", **evidence)
        elif verifier is not None and not (isinstance(reported, float) and math.isnan(reported)):
            self._catch(caught, verifier, "false mismatch", c, reason=f"reported that {c.node}'s {c.kind} differs "
                        f"by {reported:.3g}; the coordinator's recomputation differs by {own:.3g}", **evidence)

    def _states(self, names: list[str]) -> dict[str, tuple[int, dict]]:
        """The weights of ``names``: name -> (stage, state dict); fetched once an audit (they do not change
        before the step). NodesLost when nodes die meanwhile, raised once every other node asked has
        answered: a ``State`` belongs to no round, so one left on its way would reach the trainer's next
        wait, which would refuse it (NodeFailed) instead of running the round again."""
        ask = [n for n in names if n not in self._weights]
        for n in ask:
            self.roster.put(n, m.StateRequest())
        waiting, lost = set(ask), {}
        while waiting:
            try:
                msg = self.roster.recv(m.State, timeout=self.timeout, names=waiting)
            except NodesLost as exc:
                lost.update(exc.names)
                waiting -= set(exc.names)
                continue
            self._weights[msg.sender] = (msg.stage, msg.tensors)
            waiting.discard(msg.sender)
        if lost:
            raise NodesLost(lost)
        return {n: self._weights[n] for n in names}

    def _catch(self, caught: dict[str, str], node: str, check: str, c: Check, reason: str, **evidence: Any) -> None:
        if node in caught:
            return
        caught[node] = f"{check}: {reason}"
        log.warning("verification: node %s caught: %s", node, reason)
        fields = {**c.describe(), "computed_by": c.node, **evidence}
        self._event("caught", node=node, nodes=[node], check=check, why=reason, **fields)


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
    for h in range(1, n + 1):
        out.append(Check(nodes[h - 1], route.stages[h - 1], "forward", mb, h, Source(at(h), fwd(h)),
                         {"x": Source(nodes[h - 1], fwd(h - 1))}))
    out.append(Check(o, 0, "loss", mb, n - 1, Source(at(n - 1), bwd(n - 1)),
                     {"a": Source(o, fwd(n)), "targets": Source(value=targets)}))
    for h in range(n - 2, -2, -1):
        x = nodes[h + 1]
        out.append(Check(x, route.stages[h + 1], "backward", mb, h, Source(at(h), bwd(h)),
                         {"x": Source(x, fwd(h + 1)), "g": Source(x, bwd(h + 1))}))
    visits.setdefault(o, []).append({"tokens": Source(value=tokens), "targets": Source(value=targets),
                                     "a": Source(o, fwd(n)), "g": Source(o, bwd(-1))})
    for h, x in enumerate(nodes):
        visits.setdefault(x, []).append({"x": Source(x, fwd(h)), "g": Source(x, bwd(h))})
    return out


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
