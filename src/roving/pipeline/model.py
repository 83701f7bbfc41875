"""A LLaMA-style decoder in plain PyTorch: RMSNorm, rotary position embeddings, SwiGLU feed-forward and
causal attention through ``scaled_dot_product_attention``; untied input embedding and output head.

Nothing here knows about pipelines: how the layers are split into stages, and how stages are run on
nodes, lives in ``stages.py`` and ``stage_process.py``. Weights are initialised part by part from ``(seed,
part)`` (see ``init_part``), so a node that builds only its own layers gets exactly the weights the
whole model would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


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
            raise ValueError(f"dim {self.dim} must split into {self.n_heads} heads of an even size")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be at least 1, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


#: tiny runs the tests on 2 CPU cores; 500m and 1b are the sizes SkipPipe trains (with LLaMA's
#: 32000-token vocabulary the embedding and head add 82M and 131M parameters).
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(dim=64, n_layers=4, n_heads=4, max_seq_len=64),
    "small": LlamaConfig(dim=128, n_layers=8, n_heads=4, max_seq_len=128),
    "500m": LlamaConfig(vocab_size=32000, dim=1280, n_layers=24, n_heads=20, multiple_of=256, max_seq_len=1024),
    "1b": LlamaConfig(vocab_size=32000, dim=2048, n_layers=18, n_heads=16, multiple_of=256, max_seq_len=1024),
}


def preset(name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


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
            p.copy_(torch.randn(p.shape, generator=gen) * std)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_part(self.tok_embeddings, cfg, seed, -1)
        for i, layer in enumerate(self.layers):
            init_part(layer, cfg, seed, i)
        init_part(self.norm, cfg, seed, -2)
        init_part(self.output, cfg, seed, -2)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (batch, seq, vocab) and, given targets, the mean cross-entropy over all tokens."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        logits = self.output(self.norm(h))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        """Sample ``new_tokens`` after ``tokens`` (batch, seq); the context is cut to max_seq_len."""
        for _ in range(new_tokens):
            logits, _ = self(tokens[:, -self.cfg.max_seq_len:])
            probs = F.softmax(logits[:, -1].float() / max(temperature, 1e-6), dim=-1)
            tokens = torch.cat((tokens, torch.multinomial(probs, 1)), dim=1)
        return tokens
