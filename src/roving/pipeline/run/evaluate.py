"""Validation loss of the whole model, or of the model with some stages dropped (SkipPipe's claim: a
model trained with stages skipped keeps working when stages are missing at inference)."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from ..errors import PlanError
from ..model import Llama
from ..stages import layer_ranges


def kept_layers(model: Llama, stages: int, drop: Iterable[int]) -> list[int]:
    """The layers left when ``drop`` (stage indices, never 0) are removed from the split into ``stages``."""
    drop = set(drop)
    if 0 in drop:
        raise PlanError("stage 0 holds the embedding and head: it cannot be dropped")
    return [i for s, r in enumerate(layer_ranges(model.cfg, stages)) if s not in drop for i in r]


def half_of_the_stages(stages: int) -> list[int]:
    """Half of the droppable stages (those after 0): ``round((stages - 1) / 2)`` of them (Python's
    rounding, halves to even), spread evenly over the depth, each at the middle of its share of the
    stages 1..stages-1. For 6 stages: [2, 4] (2 of 5); for 4: [1, 3]; for 2: [] (nothing to halve)."""
    droppable = stages - 1
    k = round(droppable / 2)
    return [1 + int((i + 0.5) * droppable / k) for i in range(k)] if k else []


@torch.no_grad()
def validation_loss(model: Llama, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    layers: Sequence[int] | None = None, bf16: bool = False) -> float:
    """Mean loss over ``batches``, running only ``layers`` (all when None), in order."""
    device = next(model.parameters()).device
    total = 0.0
    for tokens, targets in batches:
        tokens, targets = tokens.to(device), targets.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits, _ = model(tokens, layers=layers)
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).item()
    return total / len(batches)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


@torch.no_grad()
def evaluate_model(model: Llama, batches: list, stages: int, skipped: Iterable[int] = (), bf16: bool = False) -> dict:
    """What a training run records of an evaluation: the validation loss and perplexity of ``model``
    over ``batches`` without the stages ``skipped`` for good (paths leave them out), and the loss with
    half of the stages after 0 dropped (``half_of_the_stages``)."""
    model.eval()
    skipped = set(skipped)
    val = validation_loss(model, batches, kept_layers(model, stages, skipped) if skipped else None, bf16=bf16)
    drop = half_of_the_stages(stages)
    dropped = validation_loss(model, batches, kept_layers(model, stages, drop), bf16=bf16)
    return {"val_loss": val, "perplexity": perplexity(val), "val_loss_half_stages_dropped": dropped,
            "dropped_stages": drop}
