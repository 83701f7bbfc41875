"""The one cost model shared by the planner, the simulator and (later) the training runtime.

Compute of a stage for one microbatch takes ``layers_in_stage x samples x seconds_per_sample_per_layer``
for the forward pass and ``backward_ratio`` times that for the backward pass. Stage 0 also embeds the
tokens at the start and runs the final norm, head and loss at the end; that extra work is expressed
in layer equivalents (``head_layers``). A transfer takes ``latency + bytes / bandwidth`` where the
bytes of an activation (forward) or a gradient (backward) are ``samples x seq_len x dim x
bytes_per_activation``. The paper (SkipPipe, arXiv 2502.19913) adds the latency once per transfer,
and so do we.

Memory of a node that holds stage ``s`` (``stage_memory``), in bytes:

* **Training state**, ``params x bytes_per_param_state`` for the stage's parameters: ``12 x dim^2``
  per transformer layer (attention 4h^2 + a LLaMA SwiGLU MLP of three h x 8h/3 matrices, 8h^2; norms
  ignored), and at stage 0 also the untied input embedding and output head, ``2 x vocab_size x dim``.
  16 bytes per parameter: mixed-precision Adam keeps 16-bit weights (2) and gradients (2) plus fp32
  master weights, momentum and variance (4 + 4 + 4) -- the 2 + 2 + 12 bytes of ZeRO (Rajbhandari et
  al. 2020, section 3.1). No optimizer sharding: each replica of a stage holds all of it.
* **Stage 0's loss workspace**: the fp32 logits of one microbatch, ``4 x samples x seq_len x vocab_size``;
  only one loss task runs on a node at a time, so it is paid once.
* **Activations per microbatch in flight**: ``activation_factor x samples x seq_len x dim`` bytes per
  layer held, with ``activation_factor = 34``: the activations a transformer layer stores for its
  backward pass in 16-bit without recomputation, ``s b h (34 + 5 a s / h)`` (Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", section 4.1), less the ``5 a s / h``
  attention-score term that fused attention kernels (FlashAttention) do not store. Without
  recomputation because the compute model above has no recomputation cost (backward = ratio x forward).

Framework overheads (CUDA context, allocator fragmentation, temporary buffers) are not modelled: give
the memory a node can really use. ``microbatches_in_flight`` is what is left after the static part,
in whole microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ..errors import PlanError
from ..presets import ARCHITECTURES, DEFAULT_PLANNING, PLANNING

#: SkipPipe's assumed compute speed (several nodes sharing older GPUs), seconds per sample per layer.
PAPER_SECONDS_PER_SAMPLE_LAYER = 0.055
MIB = float(2**20)
#: mixed-precision Adam: 2 (16-bit weights) + 2 (16-bit gradients) + 4 + 4 + 4 (fp32 master, m, v).
BYTES_PER_PARAM_STATE = 16.0
#: bytes a layer stores for backward per token per hidden unit (Korthikanti et al. 2022, 16-bit,
#: no recomputation, attention scores not stored).
ACTIVATION_FACTOR = 34.0


@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs to know about the model being trained."""

    #: transformer layers (``model.LlamaConfig.n_layers``)
    n_layers: int
    #: hidden size (``model.LlamaConfig.dim``)
    dim: int
    seq_len: int
    samples_per_microbatch: int = 4
    bytes_per_activation: int = 2
    backward_ratio: float = 2.0
    #: embedding + final norm + head + loss, in layer equivalents, paid by stage 0 only.
    head_layers: float = 1.0
    #: vocabulary size (LLaMA's tokenizer): the embedding, the head and the logits.
    vocab_size: int = 32000
    #: bytes of training state per parameter (weights, gradients, optimizer state); see the module doc.
    bytes_per_param_state: float = BYTES_PER_PARAM_STATE
    #: bytes of stored activations per layer per token per hidden unit; see the module doc.
    activation_factor: float = ACTIVATION_FACTOR
    #: a name for messages (the preset's); not part of the model's identity.
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("n_layers", "dim", "seq_len", "samples_per_microbatch", "bytes_per_activation", "vocab_size"):
            if getattr(self, name) < 1:
                raise PlanError(f"model {name} must be at least 1, got {getattr(self, name)}")
        if self.backward_ratio <= 0 or self.head_layers < 0:
            raise PlanError("model backward_ratio must be > 0 and head_layers >= 0")
        if self.bytes_per_param_state < 0 or self.activation_factor <= 0:
            raise PlanError("model bytes_per_param_state must be >= 0 and activation_factor > 0")

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer: attention 4 h^2 + SwiGLU MLP 8 h^2."""
        return 12 * self.dim ** 2

    @property
    def head_params(self) -> int:
        """Parameters stage 0 holds besides its layers: untied input embedding and output head."""
        return 2 * self.vocab_size * self.dim

    @property
    def transfer_bytes(self) -> float:
        """Bytes of one microbatch's activations (forward) or gradients (backward) between stages."""
        return float(self.samples_per_microbatch * self.seq_len * self.dim * self.bytes_per_activation)


def _planner_preset(name: str) -> ModelSpec:
    size, settings = PLANNING[name]
    arch = ARCHITECTURES[size]
    shape = {"n_layers": arch["n_layers"], "dim": arch["dim"], "seq_len": arch["max_seq_len"],
             "vocab_size": arch["vocab_size"]}
    return ModelSpec(**{**shape, **settings}, name=name)


#: the planner's model presets, made from the one table of sizes (``presets.py``).
MODEL_PRESETS: dict[str, ModelSpec] = {name: _planner_preset(name) for name in PLANNING}
DEFAULT_MODEL = DEFAULT_PLANNING


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
    if stages > model.n_layers:
        raise PlanError(f"{stages} stages but the model has only {model.n_layers} layers; use fewer stages")
    base, extra = divmod(model.n_layers, stages)
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


@dataclass(frozen=True)
class StageMemory:
    """Bytes a node needs to hold one stage: a fixed part and a part per microbatch in flight."""

    #: training state of the stage's parameters (and, at stage 0, the loss workspace).
    static_bytes: float
    #: activations stored for the backward pass of one microbatch.
    per_microbatch_bytes: float

    def needs_mb(self, in_flight: int = 1) -> float:
        """MiB needed to hold the stage with ``in_flight`` microbatches in flight."""
        return (self.static_bytes + in_flight * self.per_microbatch_bytes) / MIB


@lru_cache(maxsize=1024)
def stage_params(model: ModelSpec, stages: int) -> list[int]:
    """Parameters of each stage: its layers, and for stage 0 also the embedding and the head."""
    return [n * model.layer_params + (model.head_params if s == 0 else 0)
            for s, n in enumerate(stage_layers(model, stages))]


def gradient_bytes(model: ModelSpec, stages: int, bytes_per_value: float = 4.0) -> list[float]:
    """Bytes of each stage's gradients, which a replica sends every other replica of its stage to
    average them (``simulate(..., sync_bytes=...)``); 4 bytes a value as the runtime sends them. The
    cost model's count, within 5-10% of a real split (norms and the rounding of the MLP width left
    out); ``stages.stage_gradient_bytes`` counts a real model's exactly."""
    return [float(p * bytes_per_value) for p in stage_params(model, stages)]


def stage_memory(model: ModelSpec, stages: int) -> tuple[StageMemory, ...]:
    """The memory model (module doc) for each stage of ``model`` split into ``stages``."""
    tokens_hidden = model.samples_per_microbatch * model.seq_len * model.dim
    out = []
    for s, (n, params) in enumerate(zip(stage_layers(model, stages), stage_params(model, stages))):
        static = params * model.bytes_per_param_state
        if s == 0:
            static += 4.0 * model.samples_per_microbatch * model.seq_len * model.vocab_size
        out.append(StageMemory(float(static), float(n * model.activation_factor * tokens_hidden)))
    return tuple(out)


def microbatches_in_flight(memory_mb: float, stage: int, model: ModelSpec, stages: int) -> int:
    """How many microbatches a node with ``memory_mb`` MiB can hold in flight while it holds ``stage``:
    what fits after the stage's static memory, in whole microbatches (0: it cannot hold the stage)."""
    m = stage_memory(model, stages)[stage]
    spare = memory_mb * MIB - m.static_bytes
    if spare < m.per_microbatch_bytes:
        return 0
    return int(spare // m.per_microbatch_bytes)
