"""The one cost model shared by the planner, the simulator and (later) the training runtime.

Compute of a stage for one microbatch takes ``layers_in_stage x samples x seconds_per_sample_per_layer``
for the forward pass and ``backward_ratio`` times that for the backward pass. Stage 0 also embeds the
tokens at the start and runs the final norm, head and loss at the end; that extra work is expressed
in layer equivalents (``head_layers``). A transfer takes ``latency + bytes / bandwidth`` where the
bytes of an activation (forward) or a gradient (backward) are ``samples x seq_len x hidden x
bytes_per_activation``. The paper (SkipPipe, arXiv 2502.19913) adds the latency once per transfer,
and so do we.
"""

from __future__ import annotations

from dataclasses import dataclass

#: SkipPipe's assumed compute speed (several nodes sharing older GPUs), seconds per sample per layer.
PAPER_SECONDS_PER_SAMPLE_LAYER = 0.055


class PlanError(ValueError):
    """Input that no plan can be made from; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs to know about the model being trained."""

    layers: int
    hidden: int
    seq_len: int
    samples_per_microbatch: int = 4
    bytes_per_activation: int = 2
    backward_ratio: float = 2.0
    #: embedding + final norm + head + loss, in layer equivalents, paid by stage 0 only.
    head_layers: float = 1.0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "seq_len", "samples_per_microbatch", "bytes_per_activation"):
            if getattr(self, name) < 1:
                raise PlanError(f"model {name} must be at least 1, got {getattr(self, name)}")
        if self.backward_ratio <= 0 or self.head_layers < 0:
            raise PlanError("model backward_ratio must be > 0 and head_layers >= 0")

    @property
    def transfer_bytes(self) -> float:
        """Bytes of one microbatch's activations (forward) or gradients (backward) between stages."""
        return float(self.samples_per_microbatch * self.seq_len * self.hidden * self.bytes_per_activation)


#: LLaMA-style sizes close to the ones the paper trains (500M to 8B); sequence length 1024, bf16.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-500m": ModelSpec(layers=24, hidden=1280, seq_len=1024),
    "llama-1.5b": ModelSpec(layers=24, hidden=2048, seq_len=1024),
    "llama-3b": ModelSpec(layers=26, hidden=3200, seq_len=1024),
    "llama-8b": ModelSpec(layers=32, hidden=4096, seq_len=1024),
    # The paper's own LLaMA-1.5B runs (released code, trainer.py and create_schedule.py): hidden 2048,
    # 24 layers, sequence 4096, one sample per microbatch (16 MiB of activations), and its simulator's
    # backward of 1.5x the forward.
    "llama-1.5b-skippipe": ModelSpec(layers=24, hidden=2048, seq_len=4096, samples_per_microbatch=1,
                                     backward_ratio=1.5),
}
DEFAULT_MODEL = "llama-1.5b"


def model_preset(name: str) -> ModelSpec:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise PlanError(f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}") from None


def stage_layers(model: ModelSpec, stages: int) -> list[int]:
    """Transformer layers held by each stage: as even as possible, any extra going to the later stages
    (stage 0 already carries the embedding and head)."""
    if stages < 2:
        raise PlanError(f"need at least 2 stages (stage 0 plus one to route through), got {stages}")
    if stages > model.layers:
        raise PlanError(f"{stages} stages but the model has only {model.layers} layers; use fewer stages")
    base, extra = divmod(model.layers, stages)
    return [base + (1 if s >= stages - extra else 0) for s in range(stages)]


@dataclass(frozen=True)
class StageCosts:
    """Seconds of compute per microbatch for one node speed, per stage (forward; backward = ratio x)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    #: stage 0 only: final norm + head + loss, forward and backward, run when the microbatch returns.
    loss: float


def stage_costs(model: ModelSpec, stages: int, seconds_per_sample_layer: float) -> StageCosts:
    per_layer = model.samples_per_microbatch * seconds_per_sample_layer
    layers = stage_layers(model, stages)
    # Half the head-equivalent work is the embedding (front of stage 0), half is norm+head+loss.
    fwd = [n * per_layer for n in layers]
    fwd[0] += 0.5 * model.head_layers * per_layer
    bwd = [f * model.backward_ratio for f in fwd]
    loss = 0.5 * model.head_layers * per_layer * (1.0 + model.backward_ratio)
    return StageCosts(tuple(fwd), tuple(bwd), loss)


def transfer_time(latency_s: float, bandwidth_bps: float, nbytes: float) -> float:
    """Seconds for one transfer alone on its link."""
    return latency_s + nbytes / bandwidth_bps
