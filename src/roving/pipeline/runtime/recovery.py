"""Recovering a stage that no live process holds any more (issue 24), and the failures injected to
test it.

The policy (``[faults] stage_recovery``) decides where a lost stage's weights come from when a process
takes it over:

- ``snapshot``: its latest in-memory snapshot (weights and optimizer state; the stage rolls back to
  the snapshot's iteration). What roving did before this policy existed.
- ``skip``: nothing: the stage is dropped for good, every path skips it from then on and no process
  is given it again (SkipPipe trains paths that skip stages, so the model keeps working without it).
  Stage 0 (embedding, head, loss) cannot be skipped.
- ``neighbours``: CheckFree's rule (Blagoev et al., arXiv 2506.15461): the new stage's weights are the
  average of its two adjacent stages' weights, each weighted by the norm of its latest gradient,

      W_s = (g_{s-1} * W_{s-1} + g_{s+1} * W_{s+1}) / (g_{s-1} + g_{s+1}),

  where g_j is the L2 norm of stage j's latest (replica-averaged, unclipped) gradient, as the stage
  processes report it with each step (``protocol.Stepped.grad_norm``). The stage gets a fresh
  optimizer state, and its learning rate is multiplied by ``recovery_lr_factor`` (CheckFree uses
  1.1-1.2) from then on. Layers are matched by position: the k-th layer of the lost stage averages the
  k-th layer of each neighbour (a neighbour with fewer layers gives its last one). Stage 0's layers
  are ordinary transformer layers, so stage 1's neighbours are stage 0 and stage 2. A stage with one
  neighbour (the last stage; or stage 0 itself, whose only neighbour is stage 1) copies that
  neighbour's layers (the rule with a single term); what only stage 0 holds (the embedding, the final
  norm, the head) has no neighbour and comes from stage 0's latest snapshot (CheckFree does not
  recover its first and last stages either). When both gradient norms are zero (or unknown: before
  the first step) the two neighbours count equally. A neighbour that no live process holds is left
  out; with no live neighbour at all, the snapshot is used (recorded in the event).
- ``auto``: ``neighbours`` when the stage's latest snapshot is more than ``auto_snapshot_age``
  iterations old, else ``snapshot``.

Failure injection (``[faults] fail_rate`` / ``fail_at``): ``FailureSchedule`` says which stages lose
every replica at the start of which iteration: scripted ("10:2,30:1": at iteration 10 stage 2, at 30
stage 1) and/or at random, ``fail_rate`` failures per stage per ``fail_hour_iterations`` iterations
(a scaled hour; 0.1: 10% of the stages fail per hour): each stage after 0 fails at each iteration with
probability ``fail_rate / fail_hour_iterations``, drawn from the run's seed, the iteration and the
stage alone (the same schedule on every run with that seed, whatever else happens). Random failures
spare stage 0.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, cast

import torch

from ..errors import PlanError
from ..faults import POLICIES
from ..stages import layer_ranges
from .weights import StageWeights, Weights

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def choose(policy: str, snapshot_age: int | None, bound: int) -> str:
    """The way a lost stage is recovered under ``policy``: "snapshot", "skip" or "neighbours". For
    ``auto``: "neighbours" when ``snapshot_age`` (iterations since the stage's latest snapshot; None:
    no snapshot) is over ``bound``, else "snapshot"."""
    if policy not in POLICIES:
        raise PlanError(f"stage_recovery must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy != "auto":
        return policy
    return "neighbours" if snapshot_age is None or snapshot_age > bound else "snapshot"


def neighbours_of(stage: int, stages: int) -> list[int]:
    """The stages adjacent to ``stage`` in a split into ``stages``."""
    return [s for s in (stage - 1, stage + 1) if 0 <= s < stages]


def _layers(sd: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        hit = _LAYER.match(key)
        if hit:
            out.setdefault(int(hit.group(1)), {})[hit.group(2)] = value
    return out


def neighbour_weights(target_layers: range, neighbours: Mapping[int, Mapping[str, torch.Tensor]],
                      norms: Mapping[int, float]) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """CheckFree's weighted average (the module doc) for a stage holding ``target_layers``, from the
    state dicts of its live ``neighbours`` (stage -> {parameter name: tensor}) and their latest
    gradient norms (``norms``; missing or non-finite: 0). Returns the layers' state dict (named for
    ``target_layers``) and the weight each neighbour got (summing to 1). Computed in float64 and cast
    back to each tensor's dtype."""
    if not neighbours:
        raise PlanError("no neighbour to rebuild the stage from")
    g = {s: float(norms.get(s, 0.0)) for s in neighbours}
    g = {s: v if math.isfinite(v) and v > 0 else 0.0 for s, v in g.items()}
    total = sum(g.values())
    share = {s: (v / total if total > 0 else 1.0 / len(g)) for s, v in g.items()}
    layered = {s: _layers(sd) for s, sd in neighbours.items()}
    out: dict[str, torch.Tensor] = {}
    for k, layer in enumerate(target_layers):
        parts = []
        for s, by_layer in layered.items():
            have = sorted(by_layer)
            if not have:
                raise PlanError(f"neighbour stage {s} holds no layers")
            parts.append((share[s], by_layer[have[min(k, len(have) - 1)]]))
        for name in parts[0][1]:
            acc = cast(torch.Tensor, sum(w * p[name].double() for w, p in parts))  # parts is not empty: not 0
            out[f"layers.{layer}.{name}"] = acc.to(parts[0][1][name].dtype)
    return out, share


class StageRecovery:
    """A run's recovery of lost stages: the latest gradient norm of each stage (``observe``), the
    learning-rate factor of stages rebuilt from their neighbours (``lr``), the stages skipped for good
    (``skip_lost``), and the weights of a stage that no live process holds (``rebuild``, for the
    orphans of ``weights.Weights.gather``). ``config``: the run's TrainConfig; ``model``: its LlamaConfig;
    ``weights``: its ``weights.Weights`` (asked for the neighbours' weights and the snapshot);
    ``event(kind, **fields)`` records; ``done()`` is the count of iterations done."""

    def __init__(self, config: Any, model: Any, weights: Weights, event: Callable[..., None],
                 done: Callable[[], int]) -> None:
        self.config, self.model, self.weights, self._event, self._done = config, model, weights, event, done
        self.grad_norms: dict[int, float] = {}  # stage -> norm of its latest gradient (protocol.Stepped)
        self.lr_factor: dict[int, float] = {}  # stage -> learning-rate factor (rebuilt from neighbours)
        self.dropped: set[int] = set()  # stages skipped for good (stage_recovery = "skip")

    def observe(self, stage: int | None, grad_norm: float) -> None:
        """A stage process of ``stage`` stepped with gradient norm ``grad_norm`` (NaN: none)."""
        if stage is not None and math.isfinite(grad_norm):
            self.grad_norms[stage] = grad_norm

    def lr(self, stage: int | None, lr: float) -> float:
        """The learning rate of ``stage`` when the schedule's is ``lr``."""
        return lr * (self.lr_factor.get(stage, 1.0) if stage is not None else 1.0)

    def skip_lost(self, lost: list[int], replicas: Mapping[int, list[str]]) -> bool:
        """Stages ``lost`` lost every replica (``replicas``: their nodes). Under ``skip`` they are
        dropped for good (recorded); False when stage 0 is among them (it cannot be skipped)."""
        if self.config.stage_recovery != "skip":
            return True
        if 0 in lost:
            return False
        for stage in lost:
            self.dropped.add(stage)
            self._event("recovery", stage=stage, policy="skip", chosen="skip", nodes=sorted(replicas[stage]))
        return True

    def rebuild(self, stage: int, nodes: list[str]) -> StageWeights | None:
        """The weights for ``stage``, which no live process holds and ``nodes`` take over (an orphan of
        ``weights.Takeover``), as ``stage_recovery`` says: rebuilt from the neighbours (with a fresh
        optimizer), or None: from the snapshot. Recorded as a "recovery" event with the choice and its
        inputs."""
        snapshot = self.weights.snapshot
        snap = (snapshot or {}).get("stages", {}).get(stage)
        age = None if snap is None else self._done() - snap["iteration"]  # in iterations done since it
        policy = self.config.stage_recovery
        chosen = choose(policy, age, self.config.auto_snapshot_age)
        info = dict(stage=stage, policy=policy, nodes=nodes,
                    snapshot_iteration=None if snap is None else snap["iteration"], snapshot_age=age,
                    auto_snapshot_age=self.config.auto_snapshot_age)
        if chosen != "neighbours":  # skip never gets here: a skipped stage is given to no node
            self.lr_factor.pop(stage, None)  # the snapshot's optimizer state, the schedule's learning rate
            self._event("recovery", chosen="snapshot", **info)
            return None
        near = neighbours_of(stage, self.config.stages)
        states = self.weights.held_states(near)
        norms = {s: self.grad_norms.get(s, math.nan) for s in near}
        if not states or (stage == 0 and snap is None):
            self.lr_factor.pop(stage, None)
            self._event("recovery", chosen="snapshot", why="no live neighbour" if not states else "no snapshot "
                        "of the embedding and head", neighbours=near, grad_norms=norms, **info)
            return None
        layers, share = neighbour_weights(layer_ranges(self.model, self.config.stages)[stage], states, norms)
        params = dict(layers)
        if stage == 0:  # the embedding, final norm and head have no neighbour: from the snapshot
            params.update({k: v for k, v in snap["params"].items() if not k.startswith("layers.")})
        self.lr_factor[stage] = self.config.recovery_lr_factor
        self._event("recovery", chosen="neighbours", neighbours=sorted(states), grad_norms=norms,
                    shares=share, lr_factor=self.config.recovery_lr_factor, **info)
        return StageWeights(params, None, "neighbours " + "+".join(str(s) for s in sorted(states)))
