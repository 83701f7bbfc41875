"""How a stage's replicas' gradient shares are combined into the stage's gradient (``[verify]
aggregation``; issue 32), so that a bad replica's damage is bounded before it is caught.

Each replica r of a stage sends the sum ``S_r`` of its gradients over the ``k_r`` microbatches it ran
backward in the round (``protocol.Gradients``); the stage's gradient is the average over the
``count`` microbatches the stage processed (``stage_process``, ``trainer``'s doc). The rules:

- ``mean``: ``(S_1 + ... + S_n) / count``, added in the order of ``replicas`` -- exactly (bitwise) the
  arithmetic before this module existed (``tests/pipeline/test_arithmetic.py`` pins it). No protection:
  one replica can move the result anywhere.
- ``trimmed``: per coordinate, the per-microbatch means ``g_r = S_r / k_r`` sorted, the ``f`` lowest
  and ``f`` highest dropped, the rest averaged (``trim_count``: ``f`` = 1 for 3-4 replicas,
  ``(n - 1) // 4`` from 5 on). Bound: with at most ``f`` bad replicas every coordinate lies within
  the honest replicas' range of that coordinate.
- ``median``: the coordinate-wise median of the ``g_r`` (the lower middle for an even count). Bound:
  with fewer than half the replicas bad, every coordinate lies within the honest range.
- ``clip``: centered clipping (Karimireddy et al., 2021) from the coordinate-wise median ``v``:
  ``v + mean_r(clip(g_r - v, tau))`` with ``tau`` the median of the distances ``|g_r - v|`` (L2; each
  difference scaled down to norm ``tau`` when longer). Bound: the result is within ``tau`` (L2) of the
  median, and ``tau`` is at most the largest honest distance when fewer than half are bad.

With fewer than 3 replicas no rule but the mean protects anything (a bad one of 2 cannot be told from
the good one): every rule is the mean there. Robust rules weigh the replicas equally (each ``g_r`` is
one estimate of the per-microbatch gradient), where ``mean`` weighs them by ``k_r``; with equal loads
they agree on honest data. NaN and +Inf sort above every finite value, -Inf below (such a replica is
trimmed, or is not the median), and ``clip`` leaves out a replica whose distance is not finite.
Everything is computed in float32 on the shares' device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # the run's configuration reads RULES without PyTorch
    import torch

#: the aggregation rules, as ``[verify] aggregation`` names them.
RULES = ("mean", "trimmed", "median", "clip")


def trim_count(n: int) -> int:
    """How many replicas ``trimmed`` drops at each end, out of ``n`` (0 below 3)."""
    if n < 3:
        return 0
    return 1 if n < 5 else max(1, (n - 1) // 4)


def combine(shares: Sequence[torch.Tensor], counts: Sequence[int], total: int, rule: str = "mean") -> torch.Tensor:
    """The stage's gradient from the replicas' summed gradients ``shares`` (in the replicas' order),
    each over ``counts[r]`` microbatches, ``total`` microbatches in all (the module doc). ValueError
    for an unknown rule or mismatched lengths."""
    import torch

    if rule not in RULES:
        raise ValueError(f"aggregation must be one of {', '.join(RULES)}, got {rule!r}")
    if not shares or len(shares) != len(counts):
        raise ValueError(f"{len(shares)} shares for {len(counts)} counts")
    if rule == "mean" or len(shares) < 3:
        out = torch.zeros_like(shares[0])
        for s in shares:
            out += s
        out /= max(total, 1)
        return out
    n = len(shares)
    per = torch.stack([s.float() / max(int(k), 1) for s, k in zip(shares, counts)])  # one estimate each
    ordered = per.sort(dim=0).values  # NaN sorts last
    if rule == "trimmed":
        f = trim_count(n)
        return ordered[f:n - f].mean(dim=0)
    center = ordered[(n - 1) // 2]
    if rule == "median":
        return center
    diffs = per - center
    dist = diffs.norm(dim=1)
    finite = torch.isfinite(dist)
    tau = dist.sort().values[(n - 1) // 2]  # a non-finite distance sorts last
    scale = torch.where(dist > tau, tau / dist.clamp_min(1e-30), torch.ones_like(dist))
    scale = torch.where(finite, scale, torch.zeros_like(dist))
    diffs = torch.where(finite[:, None], diffs, torch.zeros_like(diffs))
    return center + (diffs * scale[:, None]).mean(dim=0)
