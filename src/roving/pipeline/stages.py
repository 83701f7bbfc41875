"""The model split into stages of consecutive layers, and a microbatch run along a path of stages.

Stage 0 holds the embedding, its own layers, the final norm, the head and the loss: a microbatch starts
and ends there (SkipPipe). Any other stage holds only layers. The split is the cost model's
(``costs.stage_layers``), so what the planner and simulator assume is what the nodes hold.

A stage is the model cut to its part (``model.Llama``'s ``layers`` and ``ends``), so its parameters
are named as in the whole model (``layers.5.attention.wq.weight``, ...) and the state dicts of one
replica of each stage merge into the whole model's state dict.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .planning.costs import ModelSpec, stage_layers
from .errors import PlanError
from .model import Llama
from .presets import LlamaConfig


def layer_ranges(cfg: LlamaConfig, stages: int) -> list[range]:
    """Which layers each stage holds (consecutive, split as the cost model splits them). Raises
    PlanError when the model has fewer layers than stages."""
    if stages < 2:
        raise PlanError(f"need at least 2 stages (stage 0 plus one to route through), got {stages}")
    if stages > cfg.n_layers:
        raise PlanError(f"{stages} stages but the model has only {cfg.n_layers} layers; use fewer stages "
                        "or a deeper model")
    out, start = [], 0
    for n in stage_layers(ModelSpec(n_layers=cfg.n_layers, dim=cfg.dim, seq_len=cfg.max_seq_len), stages):
        out.append(range(start, start + n))
        start += n
    return out


def model_spec(cfg: LlamaConfig, samples_per_microbatch: int, seq_len: int, *, bytes_per_activation: int = 4,
               backward_ratio: float = 2.0, head_layers: float = 1.0) -> ModelSpec:
    """The cost model's view of ``cfg``."""
    return ModelSpec(n_layers=cfg.n_layers, dim=cfg.dim, seq_len=seq_len,
                     samples_per_microbatch=samples_per_microbatch, bytes_per_activation=bytes_per_activation,
                     backward_ratio=backward_ratio, head_layers=head_layers, vocab_size=cfg.vocab_size)


def stage_gradient_bytes(cfg: LlamaConfig, stages: int) -> list[float]:
    """Bytes of each stage's gradients as replicas exchange them (float32, every parameter of the
    stage), counted exactly on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        return [4.0 * sum(p.numel() for p in Stage(cfg, s, stages).parameters()) for s in range(stages)]


class Stage(Llama):
    """One stage: the model cut to the stage's layers and, at stage 0, the embedding, final norm and
    head (``Llama(layers=..., ends=...)``); its weights are the ones the whole model gets from the same
    seed. Called, it runs its layers on hidden states (batch, seq, dim); ``embed`` and ``loss`` are
    the model's (stage 0 only)."""

    def __init__(self, cfg: LlamaConfig, stage: int, stages: int, seed: int = 0) -> None:
        super().__init__(cfg, seed, layers=layer_ranges(cfg, stages)[stage], ends=stage == 0)
        self.stage = stage

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """This stage's layers, in order."""
        return self.run_layers(h)


def run_path(stages: Sequence[Stage], path: Sequence[int], tokens: torch.Tensor,
             targets: torch.Tensor) -> torch.Tensor:
    """The loss of one microbatch that starts at ``stages[0]``, visits ``path`` (stage indices, any
    subset and order, without 0) and returns to stage 0 -- in one process, for evaluation and tests."""
    h = stages[0](stages[0].embed(tokens))
    for s in path:
        h = stages[s](h)
    return stages[0].loss(h, targets)


def merge_state_dicts(parts: Sequence[dict]) -> dict:
    """One replica's state dict per stage -> the whole model's state dict."""
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged
