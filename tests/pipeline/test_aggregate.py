"""Robust aggregation of a stage's replicas' gradient shares (``pipeline.aggregate``): ``mean`` is
bitwise the arithmetic the stage processes always did, and one bad replica of 3 or more cannot drag
``trimmed``, ``median`` or ``clip`` beyond the bound each rule's doc states, whatever it sends."""

import math

import pytest
import torch

from roving.pipeline.verify.aggregate import RULES, combine, trim_count

D = 257


def honest(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(D, generator=g)
    return [base + 0.1 * torch.randn(D, generator=g) for _ in range(n)]


def bad_shares(like: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    return {"huge": like * 1e6, "flipped": -like * 50, "noise": torch.randn(D, generator=g) * 1e4,
            "nan": torch.full((D,), math.nan), "inf": torch.full((D,), -math.inf), "zeros": torch.zeros(D),
            "spike": torch.zeros(D).index_fill_(0, torch.tensor([3]), 1e9)}


def test_mean_is_bitwise_the_sum_in_replica_order_divided_by_the_count():
    shares = honest(4, 0)
    total = torch.zeros_like(shares[0])
    for s in shares:
        total += s
    total /= 9
    assert torch.equal(combine(shares, [2, 2, 2, 3], 9, "mean"), total)
    # another order gives (possibly) other bits: the rule really adds in the order given
    assert torch.allclose(combine(shares[::-1], [3, 2, 2, 2], 9, "mean"), total, atol=1e-6)


def test_below_three_replicas_every_rule_is_the_mean():
    shares = honest(2, 1)
    want = combine(shares, [1, 1], 2, "mean")
    for rule in RULES:
        assert torch.equal(combine(shares, [1, 1], 2, rule), want), rule


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_one_bad_replica_cannot_drag_a_robust_rule_beyond_its_bound(n):
    for seed in range(5):
        good = honest(n - 1, seed)
        stacked = torch.stack(good)
        lo, hi = stacked.min(dim=0).values, stacked.max(dim=0).values
        centre = stacked.mean(dim=0)
        spread = max(float((s - centre).norm()) for s in good)
        for name, bad in bad_shares(good[0], seed).items():
            for at in (0, n - 1):  # first or last in the replicas' order
                shares = good[:at] + [bad] + good[at:]
                counts = [1] * n
                for rule in ("trimmed", "median"):
                    out = combine(shares, counts, n, rule)
                    assert bool(torch.isfinite(out).all()), (rule, name)
                    assert bool(((out >= lo - 1e-6) & (out <= hi + 1e-6)).all()), (rule, name, n)
                # clip: within tau of the coordinate-wise median, tau at most the largest honest distance
                median = combine(shares, counts, n, "median")
                tau = max(float((s - median).norm()) for s in good)
                out = combine(shares, counts, n, "clip")
                assert bool(torch.isfinite(out).all()), name
                assert float((out - median).norm()) <= tau * (1 + 1e-5), (name, n)
                if name != "zeros":  # the plain mean is dragged far (or poisoned): the rules protect
                    mean = combine(shares, counts, n, "mean")
                    assert not bool(torch.isfinite(mean).all()) or float((mean - centre).norm()) > 10 * spread, name


def test_robust_rules_agree_with_the_mean_on_honest_replicas_with_equal_loads():
    shares = [s * 3 for s in honest(5, 7)]  # sums over 3 microbatches each
    mean = combine(shares, [3] * 5, 15, "mean")
    spread = max(float((s / 3 - mean).norm()) for s in shares)
    for rule in ("trimmed", "median", "clip"):
        assert float((combine(shares, [3] * 5, 15, rule) - mean).norm()) < spread, rule


def test_robust_rules_weigh_each_replica_by_its_own_microbatches():
    per = honest(3, 9)
    shares = [p * k for p, k in zip(per, (1, 4, 2))]
    want = torch.stack(per).sort(dim=0).values[1]
    assert torch.allclose(combine(shares, [1, 4, 2], 7, "median"), want)


def test_trim_counts_and_bad_arguments():
    assert [trim_count(n) for n in range(1, 11)] == [0, 0, 1, 1, 1, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="aggregation must be one of mean, trimmed, median, clip"):
        combine(honest(3, 0), [1, 1, 1], 3, "krum")
    with pytest.raises(ValueError, match="3 shares for 2 counts"):
        combine(honest(3, 0), [1, 1], 3, "mean")
