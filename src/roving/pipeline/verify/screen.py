"""Cheap screening of what crosses a stage boundary (``[verify] mode = "screen"``; issue 32): running
statistics per boundary and per sending node, and the nodes whose statistics leave the band of the
boundary's other nodes.

A *boundary* is whatever key the caller gives (e.g. "stage 1 -> 2, forward"): tensors observed under
one key must be comparable (the same stage's output, for inputs drawn from the same data), so that
honest nodes' statistics agree in expectation. Per observed tensor (``Screen.observe``):

- found at once: any non-finite element ("non-finite"), an all-zero tensor ("zeros"), a tensor equal
  to the input the node was given ("unchanged": it did not compute);
- running statistics (Welford, per boundary and node): ``norm`` (log of the L2 norm), ``mean`` (mean
  over RMS: a constant added to every element shows here), ``std`` (log of the elements' standard
  deviation), and, for tensors of 2 dimensions or more, ``profile``: the cosine of the tensor's
  per-feature mean (over every dimension but the last) to the coordinate-wise median of the
  boundary's nodes' running profiles (its own included; random or sign-flipped tensors lose the
  profile honest outputs share). A 1-D tensor (a gradient share) changes from round to round: it is
  compared with the other replicas' of the same round instead (``compare``).

``Screen.compare`` takes the tensors several replicas sent for comparable inputs in one go (their
gradient shares of a round) and records each one's ``cosine``: the median of its cosines to the
others (two colluders agreeing on a wrong share still disagree with the honest majority). Where the
tensors are in different processes (a stage's replicas, each holding all the shares), each computes
its own share's cosines to the others' (``cosines_to``) and the median of a share's is taken over what
the others computed (``cosine``), so that no sender has a say on its own.

A share's cosine is also judged round by round (``Screen.cosine``): replicas that hold the same weights
compute their shares on independent microbatches, so their shares point together in expectation, and a
negated share points away from its replicas' in every round it is negated. A round's cosine below 0 and
``round_z`` standard deviations below the mean of the node's earlier rounds (``min_rounds`` of them at
least) is *opposed*: a lie that starts late is seen in the round it starts, where a running mean over
the whole run would see it only after as many rounds again. An opposed round does not join that
baseline, so a liar cannot make its lie the baseline; one that lies from its first round has none, and
is for the band (below).

A node's *profile* is judged round by round too (``Screen.turned``): the profile of what one node sends
across one boundary is its stage's own, so it stays from round to round while the weights move slowly
(cosines of 0.95 to 0.99 between a round's mean profile and the node's earlier rounds' in this project's
runs), where a stage whose replicas all send made-up tensors loses it at once (the cosine of a random
tensor's profile to any fixed one is about 0), with no replica left to compare it with. A round's mean
profile whose cosine to the node's *anchor* (its earlier rounds' mean profiles, averaged with the
weight ``drift`` on the latest, so that it follows the weights) is below ``turn`` and ``round_z``
spreads (the median absolute deviation, scaled to a standard deviation) below the median of its latest
``TURNS`` rounds' cosines has the node *turned* in that round -- only where that median is ``steady``
(0.7) at least: a profile that does not stay (of gradients, whose per-feature means are mostly noise)
has no turn to take. A turned round joins neither the anchor nor the rounds judged by, and nothing
is judged before ``min_rounds`` rounds: a stage that lies from its first round has no profile of its own
to lose. A stage after a turned one may turn too (its inputs did): turned means "check this round
closely" (``verify``), never a blame.

``Screen.suspects`` names a node when, at a boundary where at least 3 nodes have ``min_samples``
observations, a statistic of it is ``z`` standard errors away from the median over the boundary's nodes,
itself included (so fewer than half the nodes, colluding or not, cannot move it; the error: the node's
own standard error and the median of all, added in quadrature, with a small floor): both ways for
``norm``, ``mean`` and ``std``, downwards only for ``profile`` and ``cosine``. At a boundary of 2 nodes
there is no median: where their ``norm``, ``mean`` or ``std`` are ``z`` standard errors apart, or the
mean of either's ``cosine`` (the one pair's, as the other reported it) is ``z`` standard errors below 0,
both are named (one of them is out; the spot checks tell which). Honest nodes stay inside the band (``z = 6``: a
chance of about 1e-9 per test for a statistic that is near normal) -- measured on synthetic data in
``tests/pipeline/test_screen.py``.
What it cannot see: a lie that keeps every statistic (a node that sends another honest-looking
tensor of the right profile and norm); a bias smaller than the boundary's own noise needs many
observations (about ``2 * (z * sd / bias) ** 2``, sd the spread of ``mean`` between tensors); a
boundary of 2 nodes only a gap between them or shares pointing apart (no ``profile``: nothing to take a
median of), and one of a single node nothing. Those are for the spot checks (recomputation).
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field
from typing import Hashable, Mapping

import torch

#: the running statistics, and the ones where only a fall is suspect.
STATS = ("norm", "mean", "std", "profile", "cosine")
ONE_SIDED = ("profile", "cosine")
#: how many of a node's latest rounds its profile's next round is judged by (``Screen.turned``).
TURNS = 32


@dataclass
class Running:
    """Welford's running mean and variance of one statistic."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        d = x - self.mean
        self.mean += d / self.count
        self.m2 += d * (x - self.mean)

    @property
    def variance(self) -> float:
        """The sample variance (inf below 2 observations)."""
        return self.m2 / (self.count - 1) if self.count > 1 else math.inf

    @property
    def sq_error(self) -> float:
        """The squared standard error of the mean (inf below 2 observations)."""
        return self.variance / self.count if self.count > 1 else math.inf


@dataclass
class NodeStats:
    """One node's statistics at one boundary, and what was found at once."""

    stats: dict[str, Running] = field(default_factory=lambda: {s: Running() for s in STATS})
    profile: torch.Tensor | None = None  # the running mean of its tensors' profiles
    profiles: int = 0
    found: dict[str, int] = field(default_factory=dict)  # "non-finite" / "zeros" / "unchanged" -> count
    baseline: Running = field(default_factory=Running)  # its share's cosines of the rounds not opposed
    round_sum: torch.Tensor | None = None  # the sum of this round's profiles (``add``), and their count
    round_count: int = 0
    anchor: torch.Tensor | None = None  # its rounds' mean profiles, averaged (``turned``), but turned ones
    #: its latest rounds' cosines to the anchor (``TURNS`` of them), but turned ones
    turns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TURNS))


@dataclass(frozen=True)
class Suspect:
    """A node outside its boundary's band: ``check`` ("norm", ..., "non-finite"), and how far out
    (``z``; inf for what is found at once), with the node's and the others' values."""

    node: str
    boundary: Hashable
    check: str
    z: float
    value: float
    others: float


@dataclass(frozen=True)
class Summary:
    """What screening keeps of one tensor (``summarize``): what was found at once, else the statistics
    (``norm``: log L2 norm, ``mean``: mean over RMS, ``std``: log standard deviation, ``profile``: the
    per-feature mean, for tensors of 2 dimensions or more)."""

    found: tuple[str, ...] = ()
    norm: float = 0.0
    mean: float = 0.0
    std: float = 0.0
    profile: torch.Tensor | None = None


def make_summary(found: tuple[str, ...], norm: float, mean: float, std: float, profile: torch.Tensor | None) -> Summary:
    """``Summary(found, norm, mean, std, profile)``, made without the frozen dataclass's ``__init__`` (each
    field through ``object.__setattr__``): for a report's rows read off the wire (``rows``). ``Summary``
    checks nothing of its fields (``sound`` judges them), so the two are the same."""
    summary = object.__new__(Summary)
    summary.__dict__.update(found=found, norm=norm, mean=mean, std=std, profile=profile)
    return summary


#: what ``summarize`` can find at once.
FOUND = ("non-finite", "zeros", "unchanged")


def sound(summary: object) -> bool:
    """Whether ``summary`` could be what ``summarize`` made (a ``Summary`` of one finding, or finite
    statistics and a finite 1-D float profile or none): what a coordinator asks of a summary a node
    reports before its screen takes it."""
    if not isinstance(summary, Summary) or not isinstance(summary.found, tuple):
        return False
    if summary.found:
        return len(summary.found) == 1 and summary.found[0] in FOUND
    stats = (summary.norm, summary.mean, summary.std)
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in stats):
        return False
    p = summary.profile
    return p is None or (isinstance(p, torch.Tensor) and p.dim() == 1 and p.is_floating_point()
                         and bool(torch.isfinite(p).all()))


def summarize(tensor: torch.Tensor, given: torch.Tensor | None = None, divisor: int = 1) -> Summary:
    """The ``Summary`` of ``tensor / divisor`` (``given``: the input its sender was given, when known).
    Two passes over the tensor when it is finite: its squared norm, and its per-feature sums (the profile,
    whose sum is the total); the ``divisor`` is applied to the statistics, not to the tensor."""
    return summarize_squared(tensor, given, divisor)[0]


def summarize_squared(tensor: torch.Tensor, given: torch.Tensor | None = None,
                      divisor: int = 1) -> tuple[Summary, float]:
    """``summarize``, and the sum of the squares of ``tensor``'s elements in float32 that it computed on
    the way (what ``cosines_to`` takes as ``known``, so that no pass is made twice)."""
    t = tensor.detach().float()
    flat = t.reshape(-1)
    sq = float(torch.dot(flat, flat)) if flat.numel() else 0.0  # one pass for the norm and the variance
    if not math.isfinite(sq):
        if not bool(torch.isfinite(t).all()):
            return Summary(("non-finite",)), sq
        # finite, but its squares (and maybe its sums) overflow float32: the rest in float64, so that
        # a finite tensor always has finite statistics (``sound``), whatever a sender made it of
        t = t.double()
        flat = t.reshape(-1)
    if sq == 0.0:
        return Summary(("zeros",)), sq
    if given is not None and given.shape == t.shape and torch.equal(given.detach().to(t.dtype), t):
        return Summary(("unchanged",)), sq
    n = flat.numel()
    profile = None
    if t.dim() >= 2:
        sums = t.reshape(-1, t.shape[-1]).sum(dim=0)
        total = float(sums.sum())
        profile = (sums / (n // t.shape[-1]) / divisor).float()  # a mean of finite float32s: finite
    else:
        total = float(flat.sum())
    norm = math.sqrt(sq) if math.isfinite(sq) else float(flat.norm())  # (in float64 where sq overflowed)
    rms = norm / math.sqrt(n)
    var = max(0.0, (norm * norm - total * total / n) / (n - 1)) if n > 1 else 0.0
    shift = math.log(divisor)  # the norm and the deviation of tensor / divisor, in logs
    return Summary((), math.log(norm) - shift, total / n / rms, math.log(max(math.sqrt(var), 1e-30)) - shift,
                   profile), sq


class Screen:
    """Running statistics of what crosses each boundary (the module doc)."""

    def __init__(self, z: float = 6.0, min_samples: int = 8, floor: float = 1e-4, round_z: float = 3.0,
                 min_rounds: int = 4, turn: float = 0.5, steady: float = 0.7, drift: float = 0.25) -> None:
        self.z, self.min_samples, self.floor = z, min_samples, floor
        self.round_z, self.min_rounds = round_z, min_rounds
        self.turn, self.steady, self.drift = turn, steady, drift
        self.nodes: dict[Hashable, dict[str, NodeStats]] = {}

    def _of(self, boundary: Hashable, node: str) -> NodeStats:
        return self.nodes.setdefault(boundary, {}).setdefault(node, NodeStats())

    def observe(self, boundary: Hashable, node: str, tensor: torch.Tensor,
                given: torch.Tensor | None = None) -> list[str]:
        """``node`` sent ``tensor`` across ``boundary`` (``given``: the input it had been given);
        returns what was found at once ("non-finite", "zeros", "unchanged")."""
        return self.add(boundary, node, summarize(tensor, given))

    def add(self, boundary: Hashable, node: str, summary: Summary) -> list[str]:
        """As ``observe``, from the ``summarize`` of the tensor made where the tensor is (a receiving
        stage process): only the summary travels."""
        ns = self._of(boundary, node)
        found = list(summary.found)
        if not found:
            ns.stats["norm"].add(summary.norm)
            ns.stats["mean"].add(summary.mean)
            ns.stats["std"].add(summary.std)
            prof = summary.profile
            if prof is not None and (ns.profile is None or ns.profile.shape == prof.shape):
                ref = self._reference(boundary, prof.shape)
                if ref is not None:
                    ns.stats["profile"].add(_cosine(prof, ref))
                ns.profiles += 1
                ns.profile = prof.clone() if ns.profile is None else ns.profile + (prof - ns.profile) / ns.profiles
                ns.round_sum = prof.clone() if ns.round_sum is None else ns.round_sum + prof
                ns.round_count += 1
        for f in found:
            ns.found[f] = ns.found.get(f, 0) + 1
        return found

    def cosine(self, boundary: Hashable, node: str, value: float) -> bool:
        """One round's ``cosine`` of ``node``'s share at ``boundary``, computed elsewhere (the median of what
        its other replicas reported); returns whether it is opposed this round (the module doc): below 0
        and ``round_z`` standard deviations below the mean of its earlier rounds that were not."""
        ns = self._of(boundary, node)
        ns.stats["cosine"].add(value)
        base = ns.baseline
        opposed = (value < 0.0 and base.count >= self.min_rounds
                   and value < base.mean - self.round_z * math.sqrt(base.variance))
        if not opposed:
            base.add(value)
        return opposed

    def turned(self) -> dict[str, list[Hashable]]:
        """The round's end for profiles (the module doc): at each boundary, each node's mean profile of the
        round against its own earlier rounds'; returns the nodes whose profile turned, node -> the
        boundaries where it did. Starts the next round's profiles afresh."""
        out: dict[str, list[Hashable]] = {}
        for boundary, nodes in self.nodes.items():
            for node, ns in nodes.items():
                if ns.round_sum is None:
                    continue
                now = ns.round_sum / ns.round_count
                ns.round_sum, ns.round_count = None, 0
                if ns.anchor is None or ns.anchor.shape != now.shape:
                    ns.anchor = now
                    continue
                value, turns = _cosine(now, ns.anchor), ns.turns
                if value < self.turn and len(turns) >= self.min_rounds:
                    mid = statistics.median(turns)
                    spread = 1.4826 * statistics.median(abs(x - mid) for x in turns)  # ~ sd, for normal ones
                    if mid >= self.steady and value < mid - self.round_z * max(spread, self.floor):
                        out.setdefault(node, []).append(boundary)
                        continue  # a turned round joins neither the anchor nor the rounds it is judged by
                turns.append(value)
                ns.anchor = ns.anchor + self.drift * (now - ns.anchor)
        return out

    def forget_round(self) -> None:
        """The round is given up: its profiles so far are not a round's (``turned``)."""
        for nodes in self.nodes.values():
            for ns in nodes.values():
                ns.round_sum, ns.round_count = None, 0

    def _reference(self, boundary: Hashable, shape: torch.Size) -> torch.Tensor | None:
        """The coordinate-wise median of the boundary's nodes' running profiles (None with fewer
        than 3)."""
        have = [ns.profile for ns in self.nodes.get(boundary, {}).values()
                if ns.profile is not None and ns.profile.shape == shape]
        if len(have) < 3:
            return None
        return torch.stack(have).median(dim=0).values

    def compare(self, boundary: Hashable, sent: Mapping[str, torch.Tensor]) -> None:
        """Tensors that several nodes sent for comparable inputs (a round's gradient shares of one
        stage): each finite one's ``cosine`` is the median of its cosines to the others (the median
        of the middle two for an even count)."""
        for n, cos in median_cosines(sent).items():
            self._of(boundary, n).stats["cosine"].add(cos)

    def suspects(self) -> list[Suspect]:
        """The nodes outside their boundary's band now (the module doc), sorted by node."""
        out = []
        for boundary, nodes in self.nodes.items():
            for node, ns in nodes.items():
                for f, count in ns.found.items():
                    out.append(Suspect(node, boundary, f, math.inf, float(count), 0.0))
            for stat in STATS:
                ready = {n: ns.stats[stat] for n, ns in nodes.items() if ns.stats[stat].count >= self.min_samples}
                if len(ready) == 2 and stat == "cosine":
                    out += self._below_zero(boundary, ready)
                elif len(ready) == 2 and stat not in ONE_SIDED:
                    out += self._apart(boundary, stat, ready)
                if len(ready) < 3:
                    continue
                ref = statistics.median(o.mean for o in ready.values())
                spread = statistics.median(o.sq_error for o in ready.values())
                for node, r in ready.items():
                    se = math.sqrt(r.sq_error + spread + self.floor ** 2)
                    z = (r.mean - ref) / se
                    if (z < -self.z) or (stat not in ONE_SIDED and z > self.z):
                        out.append(Suspect(node, boundary, stat, z, r.mean, ref))
        return sorted(out, key=lambda s: (s.node, str(s.boundary), s.check))

    def _apart(self, boundary: Hashable, stat: str, pair: dict[str, Running]) -> list[Suspect]:
        """Two nodes at a boundary (no median to go by): where their means of ``stat`` are ``z``
        standard errors apart, one of them is out and nobody can tell which: both are suspects."""
        (a, ra), (b, rb) = sorted(pair.items())
        z = (ra.mean - rb.mean) / math.sqrt(ra.sq_error + rb.sq_error + self.floor ** 2)
        if abs(z) <= self.z:
            return []
        return [Suspect(a, boundary, stat, z, ra.mean, rb.mean), Suspect(b, boundary, stat, -z, rb.mean, ra.mean)]

    def _below_zero(self, boundary: Hashable, pair: dict[str, Running]) -> list[Suspect]:
        """Two nodes' shares at a boundary (each one's ``cosine``: the pair's, as the other reported it):
        where the mean of either is ``z`` standard errors below 0, their shares point apart, and nobody can
        tell whose is turned: both are suspects."""
        z = {n: r.mean / math.sqrt(r.sq_error + self.floor ** 2) for n, r in pair.items()}
        if min(z.values()) >= -self.z:
            return []
        return [Suspect(n, boundary, "cosine", z[n], r.mean, 0.0) for n, r in sorted(pair.items())]


def median_cosines(sent: Mapping[str, torch.Tensor], skip_zeros: bool = False) -> dict[str, float]:
    """For 3 finite tensors or more (all-zero ones left out with ``skip_zeros``): each one's median
    cosine to the others' (the mean of the middle two for an even count); {} for fewer. One pass over
    each tensor for its norm (which also tells whether it is finite) and one over each pair for their
    dot product: each cosine is computed once, for both of its tensors."""
    flat = {n: t.detach().float().reshape(-1) for n, t in sent.items()}
    sq = {n: float(torch.dot(t, t)) for n, t in flat.items()}
    names = [n for n in flat if _taken(flat[n], sq[n], skip_zeros)]
    if len(names) < 3:
        return {}
    cos: dict[tuple[str, str], float] = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            cos[a, b] = cos[b, a] = _pair_cosine(flat[a], sq[a], flat[b], sq[b])
    return {n: statistics.median(cos[n, o] for o in names if o != n) for n in names}


def cosines_to(mine: torch.Tensor, others: Mapping[str, torch.Tensor],
               known: Mapping[str, float] | None = None) -> dict[str, float]:
    """The cosine of ``mine`` to each of ``others`` that is finite and not all zeros ({} when ``mine``
    itself is not): one pass over each tensor for its squared norm, none for those whose float32 sum of
    squares is ``known`` (by name; ``summarize_squared`` gives it), and one over each pair for their dot
    product. What one replica reports of its stage's gradient shares: its own share's cosine to each of
    the others'."""
    own = mine.detach().float().reshape(-1)
    own_sq = float(torch.dot(own, own))
    if not _taken(own, own_sq, skip_zeros=True):
        return {}
    known = known or {}
    out = {}
    for name, t in others.items():
        flat = t.detach().float().reshape(-1)
        sq = known[name] if name in known else float(torch.dot(flat, flat))
        if _taken(flat, sq, skip_zeros=True):
            out[name] = _pair_cosine(own, own_sq, flat, sq)
    return out


def _taken(flat: torch.Tensor, sq: float, skip_zeros: bool) -> bool:
    """Whether a tensor of squared norm ``sq`` takes part in cosines: it is finite (a non-finite sum of
    squares is a non-finite tensor, or a finite one whose squares overflowed) and, with ``skip_zeros``,
    not all zeros (a zero sum is all zeros, or values whose squares all rounded to zero)."""
    if not math.isfinite(sq) and not bool(torch.isfinite(flat).all()):
        return False
    return not (skip_zeros and sq == 0.0 and not bool(flat.any()))


def _pair_cosine(a: torch.Tensor, sq_a: float, b: torch.Tensor, sq_b: float) -> float:
    """The cosine of two finite flat tensors of float32 squared norms ``sq_a`` and ``sq_b`` (in float64
    where a square overflowed float32; 0 where either is all zeros)."""
    wide = not (math.isfinite(sq_a) and math.isfinite(sq_b))
    na = math.sqrt(sq_a) if math.isfinite(sq_a) else float(a.double().norm())
    nb = math.sqrt(sq_b) if math.isfinite(sq_b) else float(b.double().norm())
    d = na * nb
    if d == 0.0:
        return 0.0
    x, y = (a.double(), b.double()) if wide else (a, b)
    return float(torch.dot(x, y)) / d


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(torch.dot(a.flatten(), b.flatten())) / (na * nb)
