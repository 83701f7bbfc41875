"""Adversarial nodes injected to test verification (issue 32), as ``recovery`` injects failures.

``[verify] adversaries`` (flag ``--adversaries``) names the nodes that lie and how, entries separated
by commas::

    NODE:KIND[:FROM[:FRACTION[:STRENGTH]]]      e.g.  "n03:scale:10:0.5:4, n05:nan"

from round ``FROM`` on (default 0; a stage process counts rounds, which are the iterations while no
round is retried), for a fraction ``FRACTION`` of its microbatches (default 1: always; which ones is
drawn from the run's seed, the node, the round and the microbatch), with ``STRENGTH`` (the kind's
default when left out). What the node tampers with, as it sends it (``stage_process``): the
activations it forwards ("activation"), the gradients it sends back ("gradient"), and its summed
gradients sent to its stage's other replicas for averaging ("share", once a round: FRACTION is drawn
for it as for microbatch -1). The kinds:

- ``noise``: a random tensor of the same norm (unrelated to the input).
- ``scale``: the tensor times STRENGTH (default 10).
- ``signflip``: gradients and shares negated (activations are sent as they are).
- ``lazy``: what it was given instead of computing (the input activations; the incoming gradient), or
  zeros where the shapes differ, and zeros as its share.
- ``bias``: STRENGTH (default 0.01) times the tensor's RMS added to every element: the norm moves by
  about STRENGTH**2 / 2, below any norm band.
- ``nan``: one element in each tampered tensor becomes NaN (every other tampered one: +Inf).
- ``weights``: only its share is tampered with: STRENGTH (default 10) times a random direction of the
  share's norm added to it (a tampered share of the stage's averaging: replicas average gradients,
  not weights, before each step); microbatch traffic is honest. It averages its own true share (the
  other kinds average the share they sent, as their replicas do), so it steps to other weights than
  its replicas.
- ``drift``: sends everything honestly and combines its stage's shares as sent, but steps with another
  gradient (``stepped``: STRENGTH, default 10, times a random direction of the gradient's norm added
  before its optimizer step), so its weights leave its replicas' from that step on, and with them
  everything it computes later. It reports the digest of the weights it holds (``verify``: the
  replicas' weights check).
- ``collude``: like ``noise``, but drawn from the run's seed, the round, the microbatch and what is
  sent alone (not the node), so every colluding node of a stage sends the same wrong tensor for the
  same microbatch and round (for its share: the same wrong share); asked to recheck another node's
  work (``verify``), a colluder says it matches.
- ``export``: computes, sends, steps and shows its weights honestly (its digest after each step is that
  of the weights it holds), but the weights it exports (``Export``: snapshots, checkpoints, a stage taken
  over or joined; ``StateRequest``: evaluation, a neighbour's for the recovery) have STRENGTH (default
  0.1) times a random direction of each tensor's norm added (``exported``): a poisoned saved model that
  no check of its arithmetic would see. An export before its first round counts as round 0's.
- ``frame``: sends what it computes, but asked to recheck another node's work says it differs (a node
  trying to have an honest one blamed).

``Adversary.tamper`` is a pure function of its arguments: the same call gives the same tensor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the run's configuration parses adversaries without PyTorch
    import torch

from ..errors import PlanError
from .conduct import Conduct

#: the adversary kinds, as ``[verify] adversaries`` names them.
KINDS = ("noise", "scale", "signflip", "lazy", "bias", "nan", "weights", "drift", "collude", "frame", "export")
#: what a stage process sends that an adversary can tamper with.
WHATS = ("activation", "gradient", "share")
_STRENGTH = {"scale": 10.0, "bias": 0.01, "weights": 10.0, "drift": 10.0, "export": 0.1}


@dataclass(frozen=True)
class Adversary(Conduct):
    """One lying node: its ``kind`` (``KINDS``), from round ``start`` on, for a ``fraction`` of its
    microbatches, with ``strength`` (the kind's parameter; see the module doc). A ``conduct.Conduct``: the
    stage process calls its hooks as it calls an honest node's."""

    kind: str
    start: int = 0
    fraction: float = 1.0
    strength: float = 0.0
    seed: int = 0

    def active(self, node: str, rnd: int, mb: int) -> bool:
        """Whether ``node`` lies about microbatch ``mb`` of round ``rnd`` (-1: its share)."""
        if rnd < self.start:
            return False
        if self.fraction >= 1.0:
            return True
        return random.Random(f"adversary:{self.seed}:{node}:{rnd}:{mb}").random() < self.fraction

    def reports(self, node: str, rnd: int, difference: float) -> float:
        """What ``node`` reports of a recheck it was asked for in round ``rnd`` (``difference``: what it
        found): a colluder says every tensor matches, a framer that every one differs."""
        if self.kind not in ("collude", "frame") or not self.active(node, rnd, -1):
            return difference
        return 0.0 if self.kind == "collude" else 1.0

    def tamper(self, what: str, tensor: torch.Tensor, node: str, rnd: int, mb: int,
               given: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``node`` sends instead of ``tensor`` (``what``: one of ``WHATS``; ``given``: the
        input it was given, for ``lazy``); ``tensor`` itself when it does not lie about this one.
        Never changes ``tensor`` in place."""
        if what not in WHATS:
            raise ValueError(f"what must be one of {', '.join(WHATS)}, got {what!r}")
        kind = self.kind
        if not self.active(node, rnd, mb) or kind in ("frame", "drift", "export") or \
                (kind == "weights" and what != "share") or (kind == "signflip" and what == "activation"):
            return tensor
        t = tensor.detach().float()
        if kind == "scale":
            out = t * (self.strength or _STRENGTH["scale"])
        elif kind == "signflip":
            out = -t
        elif kind == "lazy":
            fits = given is not None and given.shape == tensor.shape and what != "share"
            out = given.detach().float().clone() if fits and given is not None else t.new_zeros(t.shape)
        elif kind == "bias":
            rms = t.pow(2).mean().sqrt()
            out = t + (self.strength or _STRENGTH["bias"]) * rms
        elif kind == "nan":
            out = t.clone()
            if out.numel():
                bad = float("nan") if (rnd + mb) % 2 == 0 else float("inf")
                out.view(-1)[random.Random(f"nan:{self.seed}:{node}:{rnd}:{mb}").randrange(out.numel())] = bad
        else:  # noise, collude, weights: a random direction
            key = f"{self.seed}:{rnd}:{mb}:{what}" if kind == "collude" else f"{self.seed}:{node}:{rnd}:{mb}:{what}"
            r = _direction(key, t)
            out = t + (self.strength or _STRENGTH["weights"]) * r if kind == "weights" else r
        return out.to(tensor.dtype).contiguous()

    def averages(self, own: torch.Tensor, honest: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        """A liar averages the share it sent, as its replicas do, so that its weights stay theirs; but
        ``weights``, which keeps its own true share (the replicas' averaging check catches that)."""
        if sent is honest or self.kind == "weights":
            return own
        return sent.to(own.device)

    def steps(self, grads: list[torch.Tensor], node: str, rnd: int) -> None:
        """A ``drift`` liar's own gradient put in place of ``grads`` (``stepped``)."""
        if self.kind != "drift" or not grads:
            return
        import torch

        flat = torch.cat([g.flatten() for g in grads])
        own = self.stepped(flat, node, rnd)
        if own is not flat:
            offset = 0
            for g in grads:
                g.copy_(own[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def stepped(self, gradient: torch.Tensor, node: str, rnd: int) -> torch.Tensor:
        """The gradient ``node`` steps with in round ``rnd`` instead of ``gradient`` (the one it combined,
        flattened): a ``drift`` liar's own, ``gradient`` itself otherwise (as ``tamper``: drawn for
        microbatch -1, never changed in place)."""
        if self.kind != "drift" or not self.active(node, rnd, -1):
            return gradient
        t = gradient.detach().float()
        out = t + (self.strength or _STRENGTH["drift"]) * _direction(f"{self.seed}:{node}:{rnd}:step", t)
        return out.to(gradient.dtype)


    def exported(self, weights: dict[str, torch.Tensor], node: str, rnd: int) -> dict[str, torch.Tensor]:
        """The weights ``node`` exports in round ``rnd`` instead of ``weights`` (its stage's, by name): an
        ``export`` liar's poisoned (each floating tensor moved by STRENGTH times a random direction of its
        norm), ``weights`` itself otherwise (drawn for microbatch -1; before the first round, as round 0;
        never changed in place)."""
        if self.kind != "export" or not self.active(node, max(rnd, 0), -1):
            return weights
        out = {}
        for name, t in weights.items():
            if t.is_floating_point() and t.numel():
                f = t.detach().float()
                r = _direction(f"{self.seed}:{node}:{rnd}:export:{name}", f)
                out[name] = (f + (self.strength or _STRENGTH["export"]) * r).to(t.dtype)
            else:
                out[name] = t
        return out


def _direction(key: str, like: torch.Tensor) -> torch.Tensor:
    """A random tensor of ``like``'s shape and norm, drawn from ``key`` alone."""
    import torch

    gen = torch.Generator().manual_seed(random.Random(key).getrandbits(63))
    r = torch.randn(like.shape, generator=gen)
    return r * (like.norm() / r.norm().clamp_min(1e-30))


def parse_adversaries(text: str, seed: int = 0) -> dict[str, Adversary]:
    """``[verify] adversaries`` (the module doc) as {node: Adversary}; PlanError naming the bad entry
    otherwise."""
    out: dict[str, Adversary] = {}
    if not isinstance(text, str):
        raise PlanError(f"adversaries must be a string like \"n03:scale:10:0.5\", got {text!r}")
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if not 2 <= len(parts) <= 5 or not parts[0]:
            raise PlanError(f"adversaries: {entry!r} is not NODE:KIND[:FROM[:FRACTION[:STRENGTH]]] "
                            f"(e.g. \"n03:scale:10:0.5:4\")")
        node, kind = parts[0], parts[1]
        if kind not in KINDS:
            raise PlanError(f"adversaries: {kind!r} in {entry!r} is not a kind; the kinds are {', '.join(KINDS)}")
        try:
            start = int(parts[2]) if len(parts) > 2 else 0
            fraction = float(parts[3]) if len(parts) > 3 else 1.0
            strength = float(parts[4]) if len(parts) > 4 else 0.0
        except ValueError:
            raise PlanError(f"adversaries: {entry!r}: FROM must be an integer, FRACTION and STRENGTH "
                            "numbers") from None
        if start < 0 or not 0.0 < fraction <= 1.0:
            raise PlanError(f"adversaries: {entry!r}: FROM must be >= 0 and FRACTION in (0, 1]")
        if node in out:
            raise PlanError(f"adversaries: node {node} is given twice")
        out[node] = Adversary(kind, start, fraction, strength, seed)
    return out
