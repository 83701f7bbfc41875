"""A LLaMA-style decoder in plain PyTorch: RMSNorm, rotary position embeddings, SwiGLU feed-forward and
causal attention through ``scaled_dot_product_attention``; untied input embedding and output head.

One forward serves every use: ``Llama.forward`` runs the embedding, any subset of the layers in any
order (``layers``; all by default), the final norm and the head. A model may also hold only part of
itself (``Llama(cfg, layers=..., ends=False)``): it is declared whole on the meta device, cut to that
part, and only the part is materialised. That is what a pipeline stage is (``stages.py``, run by
``stage_process.py``); nothing here knows about pipelines beyond that.

Weights are initialised part by part from ``(seed, part)`` (``init_part``), so a part built alone gets
exactly the weights the whole model would give it, and parameter names are the whole model's
(``layers.5.attention.wq.weight``, ...) whatever part is held.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from .errors import PlanError
from .presets import LlamaConfig  # the sizes: plain data, read without PyTorch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 even under bf16 autocast: the mean of squares loses too much otherwise
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(cfg: LlamaConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, (max_seq_len, head_dim / 2)."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of ``x`` (batch, heads, seq, head_dim) by its position's angle."""
    seq = x.shape[-2]
    cos, sin = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Layers(nn.ModuleDict):
    """The blocks a model holds, keyed by their index in the whole model (so a part's parameter names
    are the whole model's); indexed by that number, iterated in order."""

    def __getitem__(self, i: int | str) -> Block:
        return cast(Block, super().__getitem__(str(i)))  # it holds Blocks only

    def __iter__(self) -> Iterator[Block]:  # type: ignore[override]  # its blocks, not their keys (see above)
        return cast(Iterator[Block], iter(self.values()))

    def __contains__(self, i: object) -> bool:
        return super().__contains__(str(i))


def init_part(module: nn.Module, cfg: LlamaConfig, seed: int, part: int) -> None:
    """Initialise one part of the model from ``(seed, part)`` alone: part i >= 0 is layer i, -1 the
    embedding, -2 the final norm and head. Linear and embedding weights ~ N(0, 0.02); the projections
    that write into the residual stream (wo, w2) are scaled by 1/sqrt(2 n_layers) as in GPT-2."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + part + 2)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name == "weight" and isinstance(module, RMSNorm):
                p.fill_(1.0)
                continue
            std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * std)


class Llama(nn.Module):
    """The decoder, or a part of it: ``layers`` (indices into the whole model, default all) and, with
    ``ends``, the embedding, final norm and head. Built on the meta device, cut to the part, then
    materialised on the current default device and initialised part by part (``init_part``): a part
    gets the weights the whole model would give it. Under ``torch.device("meta")`` nothing is
    materialised (to count parameters)."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0, *, layers: Iterable[int] | None = None,
                 ends: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        held = list(range(cfg.n_layers)) if layers is None else list(layers)
        if any(not 0 <= i < cfg.n_layers for i in held) or len(set(held)) != len(held):
            raise PlanError(f"layers {held} are not distinct layers of a {cfg.n_layers}-layer model")
        device = torch.empty(0).device  # the default device, before the meta one is entered
        with torch.device("meta"):
            # Layers first: a part's parameters keep the order they had in checkpoints, where the
            # optimizer state is matched to them by position.
            self.layers = Layers({str(i): Block(cfg) for i in range(cfg.n_layers)})
            # None in a part without the ends (below)
            # given its (meta) weight, the embedding skips its default initialisation: a normal_() on the
            # meta device imports torch._dynamo (2.3 s of CPU at every stage process's start), and init_part
            # writes every weight anyway
            self.tok_embeddings: nn.Embedding | None = nn.Embedding(
                cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
            self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
            self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for i in set(range(cfg.n_layers)) - set(held):
            del self.layers[str(i)]
        if not ends:
            self.tok_embeddings = self.norm = self.output = None
        self.layer_ids = sorted(held)
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights(seed)
        cos, sin = rope_tables(cfg, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def ends(self) -> bool:
        """Whether this model holds the embedding, the final norm and the head."""
        return self.tok_embeddings is not None

    def init_weights(self, seed: int) -> None:
        """Every part held, initialised from ``(seed, part)``."""
        for i in self.layer_ids:
            init_part(self.layers[i], self.cfg, seed, i)
        if self.ends:
            assert self.tok_embeddings is not None and self.norm is not None and self.output is not None, \
                "the ends are held together"
            init_part(self.tok_embeddings, self.cfg, seed, -1)
            init_part(self.norm, self.cfg, seed, -2)
            init_part(self.output, self.cfg, seed, -2)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.tok_embeddings is not None, "a part without the ends has no embedding"
        return self.tok_embeddings(tokens)

    def run_layers(self, h: torch.Tensor, layers: Sequence[int] | None = None) -> torch.Tensor:
        """``h`` (batch, seq, dim) through ``layers`` in the order given (default: every layer held, in
        order); each must be held."""
        for i in self.layer_ids if layers is None else layers:
            h = self.layers[i](h, self.rope_cos, self.rope_sin)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and head: (batch, seq, vocab)."""
        assert self.output is not None and self.norm is not None, "a part without the ends has no head"
        return self.output(self.norm(h))

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, head and the mean cross-entropy over all tokens (in fp32)."""
        return F.cross_entropy(self.logits(h).flatten(0, 1).float(), targets.flatten())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                layers: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (batch, seq, vocab) of ``tokens`` through the embedding, ``layers`` (all by default)
        in order, the final norm and the head; given targets, also the mean cross-entropy."""
        logits = self.logits(self.run_layers(self.embed(tokens), layers))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
