"""Every named model size, in one table: the architecture (``LlamaConfig``'s fields, model.py) of each.
Training builds the sizes in ``TRAINING`` (``model.PRESETS``); the planner offers the sizes in
``PLANNING`` as the cost model sees them (``costs.MODEL_PRESETS``), each with the run shape the
cost model assumes for it. Both tables are made from this one, so a size is written down once.
``PLAN_PRESETS``: SkipPipe's whole planning settings (network, nodes, stages, skip, memory, model), what
``roving pipeline plan --preset`` runs.

Plain data and the standard library only: planning and the run's configuration never need PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .errors import PlanError

#: name -> LlamaConfig's fields. tiny runs the tests on 2 CPU cores; 500m and 1b are the sizes SkipPipe
#: trains (with LLaMA's 32000-token vocabulary the embedding and head add 82M and 131M parameters); the
#: llama-* sizes are close to the ones the paper plans for (500M to 8B, sequence length 1024).
ARCHITECTURES: dict[str, dict] = {
    "tiny": dict(vocab_size=256, dim=64, n_layers=4, n_heads=4, multiple_of=32, max_seq_len=64),
    "small": dict(vocab_size=256, dim=128, n_layers=8, n_heads=4, multiple_of=32, max_seq_len=128),
    "500m": dict(vocab_size=32000, dim=1280, n_layers=24, n_heads=20, multiple_of=256, max_seq_len=1024),
    "1b": dict(vocab_size=32000, dim=2048, n_layers=18, n_heads=16, multiple_of=256, max_seq_len=1024),
    "llama-1.5b": dict(vocab_size=32000, dim=2048, n_layers=24, n_heads=16, multiple_of=256, max_seq_len=1024),
    "llama-3b": dict(vocab_size=32000, dim=3200, n_layers=26, n_heads=32, multiple_of=256, max_seq_len=1024),
    "llama-8b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, multiple_of=256, max_seq_len=1024),
}

#: the sizes ``roving pipeline train`` builds (``--model``).
TRAINING: tuple[str, ...] = ("tiny", "small", "500m", "1b")

#: the planner's presets (``roving pipeline plan --model``): name -> (size, the cost model's settings
#: that differ from ``ModelSpec``'s defaults; the sequence length is the size's max_seq_len unless
#: given). llama-1.5b-skippipe is the paper's own LLaMA-1.5B run (its released trainer.py and
#: create_schedule.py): sequence 4096, one sample per microbatch (16 MiB of activations), and its
#: simulator's backward of 1.5x the forward.
PLANNING: dict[str, tuple[str, dict]] = {
    "llama-500m": ("500m", {}),
    "llama-1.5b": ("llama-1.5b", {}),
    "llama-3b": ("llama-3b", {}),
    "llama-8b": ("llama-8b", {}),
    "llama-1.5b-skippipe": ("llama-1.5b", dict(seq_len=4096, samples_per_microbatch=1, backward_ratio=1.5)),
    # the shape of the schedule.json SkipPipe's repository ships: 2 samples a microbatch, 4 layers a stage
    "llama-1.5b-skippipe-2": ("llama-1.5b", dict(seq_len=4096, samples_per_microbatch=2, backward_ratio=1.5)),
}
DEFAULT_PLANNING = "llama-1.5b"


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    #: SwiGLU hidden size = multiple_of-rounded 2/3 of 4 x dim (LLaMA's rule).
    multiple_of: int = 32
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise PlanError(f"dim {self.dim} must split into {self.n_heads} heads of an even size")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            if getattr(self, name) < 1:
                raise PlanError(f"model {name} must be at least 1, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


#: the sizes training builds, from the one table of sizes (``presets.py``).
PRESETS: dict[str, LlamaConfig] = {name: LlamaConfig(**ARCHITECTURES[name]) for name in TRAINING}


def preset(name: str, **overrides: Any) -> LlamaConfig:
    if name not in PRESETS:
        raise PlanError(f"unknown model {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


#: SkipPipe's node placement on gcp12 (its create_schedule.py and communication_costs.py): nodes go
#: round-robin over the regions in this order.
SKIPPIPE_GCP_ORDER: tuple[str, ...] = ("Belgium", "Canada", "Germany", "Iowa", "Japan", "LA", "NL", "Oregon",
                                       "Singapore", "Taiwan", "London", "Australia")
#: the regions of SkipPipe's "5-clusters" setting.
SKIPPIPE_FIVE_REGIONS: tuple[str, ...] = ("LA", "NL", "Germany", "Singapore", "Oregon")

#: SkipPipe's planning settings (``roving pipeline plan --preset NAME``): its 20 nodes in 6 stages of the
#: LLaMA-1.5B run (4 layers each), skip 0.33, 3 microbatches in flight per node, each of the 5 stage-0
#: nodes of its partition [5, 3, 3, 3, 3, 3] sending 6 microbatches (30), on gcp12's measured links,
#: placed as its code places them (``setting`` = geo-distributed, single-cluster, 5-clusters there).
#: ``regions``: the regions the nodes go to in turn (None: the network file's order).
PLAN_PRESETS: dict[str, dict] = {
    "skippipe-geo-distributed": dict(network="gcp12", nodes=20, regions=list(SKIPPIPE_GCP_ORDER), stages=6,
                                     skip=0.33, microbatches=30, memory_microbatches=3,
                                     model="llama-1.5b-skippipe"),
    "skippipe-single-cluster": dict(network="gcp12", nodes=20, regions=["Germany"], stages=6, skip=0.33,
                                    microbatches=30, memory_microbatches=3, model="llama-1.5b-skippipe"),
    "skippipe-5-clusters": dict(network="gcp12", nodes=20, regions=list(SKIPPIPE_FIVE_REGIONS), stages=6,
                                skip=0.33, microbatches=30, memory_microbatches=3, model="llama-1.5b-skippipe"),
    # the shape of its shipped schedule.json: the geo-distributed setting with 2 samples a microbatch
    "skippipe-shipped": dict(network="gcp12", nodes=20, regions=list(SKIPPIPE_GCP_ORDER), stages=6, skip=0.33,
                             microbatches=30, memory_microbatches=3, model="llama-1.5b-skippipe-2"),
}
