"""Pins the training's arithmetic: 20 iterations of the real Trainer (local backend, one process per
node, replicas of every stage) give the losses and final weights of a plain single-process PyTorch
reference written here -- its own model code, its own initialisation, AdamW, clipping by the whole
model's gradient norm and the learning-rate schedule, nothing taken from roving but the batches and the
plan's routes.

* ``dtfm`` (a full pipeline, every microbatch through every stage): the reference is plain training of
  the whole model on the mean loss of the iteration's microbatches.
* ``skippipe`` (skip > 0): each microbatch runs the route the plan gave it (stage 0's layers, the layers
  of its stages in its order, the final norm and head); each stage's gradient is the sum over the
  microbatches that visited it divided by how many did (stage 0: every microbatch) -- the rule
  ``trainer.py`` and ``stage_process.py`` document.

Tolerance: the runtime adds the microbatches' gradients in the order their backward passes happen to
run and then across replicas; the reference adds them in microbatch order. Float32 addition is not
associative, so the two differ by rounding (about 1e-7 relative) at every step, and AdamW turns a
gradient element that is nearly 0 into a step of about ``lr`` whose sign that rounding can decide.
``LOSS_RTOL``, ``NORM_RTOL`` and ``WEIGHT_ATOL`` bound what 20 such steps give (measured: see the
constants); a real change of the arithmetic (no clipping, the schedule one step off, another averaging
rule) moves losses and weights by orders of magnitude more, and
``test_the_comparison_catches_a_wrong_reference`` checks that it would fail then. Initial weights are
compared bitwise (no arithmetic differs there).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

from roving.pipeline import TrainConfig, Trainer, prepare
from roving.pipeline.run.data import train_batches

ITERATIONS = 20
BASE = dict(model="tiny", nodes=6, microbatches=6, samples=2, seq_len=32, iterations=ITERATIONS, lr=3e-3,
            min_lr=3e-4, warmup=3, weight_decay=0.1, clip=0.5, eval_every=1000, eval_batches=1,
            planner_budget=2.0, planner_evals=200, speed=1e-3, in_flight=2, seed=3, device="cpu",
            timeout=120, dead_after=10.0, slow_factor=0.0, snapshot_every=0)
#: measured on 2 CPU cores over 20 iterations: mean losses agree to 6e-8 relative, gradient norms to
#: 5e-6, weights to 2.2e-6 at the worst element (median 4e-9); the deliberately wrong references (no
#: clipping, the schedule one step late, the plain mean instead of the per-stage rule) are off by at
#: least 6e-3 in the loss, 2e-2 in the norm and 1e-2 in some weight. The bounds sit 10-20x above the
#: rounding and 100x or more below the smallest real change.
LOSS_RTOL = 1e-6
NORM_RTOL = 1e-4
WEIGHT_ATOL = 2e-5
BETAS = (0.9, 0.95)  # the trainer's AdamW betas (StageSettings' default)


# -- the reference: a LLaMA-style decoder in a few plain functions ----------------------------------

def ffn_dim(cfg) -> int:
    hidden = int(2 * 4 * cfg.dim / 3)
    return cfg.multiple_of * ((hidden + cfg.multiple_of - 1) // cfg.multiple_of)


def init_weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    """The documented rule: each part (layer i, -1 the embedding, -2 the final norm and head) draws
    from its own generator seeded ``seed * 1_000_003 + part + 2``, its weights in module order, N(0,
    0.02), wo and w2 scaled by 1/sqrt(2 n_layers); norms are ones and draw nothing."""
    d, f, v = cfg.dim, ffn_dim(cfg), cfg.vocab_size

    def gen(part):
        return torch.Generator().manual_seed(seed * 1_000_003 + part + 2)

    small = 0.02 / math.sqrt(2 * cfg.n_layers)
    w = {"tok_embeddings.weight": torch.randn((v, d), generator=gen(-1)) * 0.02}
    for i in range(cfg.n_layers):
        g, p = gen(i), f"layers.{i}."
        w[p + "attention_norm.weight"] = torch.ones(d)
        for name in ("wq", "wk", "wv", "wo"):
            w[p + f"attention.{name}.weight"] = torch.randn((d, d), generator=g) * (small if name == "wo" else 0.02)
        w[p + "ffn_norm.weight"] = torch.ones(d)
        for name, shape in (("w1", (f, d)), ("w2", (d, f)), ("w3", (f, d))):
            w[p + f"feed_forward.{name}.weight"] = torch.randn(shape, generator=g) * (small if name == "w2" else 0.02)
    w["norm.weight"] = torch.ones(d)
    w["output.weight"] = torch.randn((v, d), generator=gen(-2)) * 0.02
    return w


def rms(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def rope(x, cos, sin):
    t = x.shape[-2]
    cos, sin = cos[:t], sin[:t]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def loss_through(w, cfg, layers, tokens, targets):
    """Embedding, ``layers`` in that order, final norm, head; the mean cross-entropy."""
    hd = cfg.dim // cfg.n_heads
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv)
    cos, sin = angles.cos(), angles.sin()
    h = F.embedding(tokens, w["tok_embeddings.weight"])
    b, t, d = h.shape
    for i in layers:
        p = f"layers.{i}."
        x = rms(h, w[p + "attention_norm.weight"], cfg.norm_eps)
        q, k, v = (F.linear(x, w[p + f"attention.{n}.weight"]).view(b, t, cfg.n_heads, hd).transpose(1, 2)
                   for n in ("wq", "wk", "wv"))
        y = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        h = h + F.linear(y.transpose(1, 2).reshape(b, t, d), w[p + "attention.wo.weight"])
        x = rms(h, w[p + "ffn_norm.weight"], cfg.norm_eps)
        ff = F.silu(F.linear(x, w[p + "feed_forward.w1.weight"])) * F.linear(x, w[p + "feed_forward.w3.weight"])
        h = h + F.linear(ff, w[p + "feed_forward.w2.weight"])
    logits = F.linear(rms(h, w["norm.weight"], cfg.norm_eps), w["output.weight"])
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def lr_at(c: dict, it: int) -> float:
    """Linear warm-up over ``warmup`` iterations, then cosine from lr to min_lr at the last one."""
    if it < c["warmup"]:
        return c["lr"] * (it + 1) / c["warmup"]
    frac = (it - c["warmup"]) / max(1, c["iterations"] - c["warmup"])
    return c["min_lr"] + 0.5 * (c["lr"] - c["min_lr"]) * (1 + math.cos(math.pi * frac))


def reference(c: dict, cfg, routes, stage_layers, batches, *, per_stage: bool, clip: bool = True,
              lr_shift: int = 0):
    """The run in one process. ``routes``: the stages each microbatch visits after stage 0;
    ``stage_layers``: the layers of each stage. ``per_stage``: average each stage's gradient over the
    microbatches that visited it (else the plain mean loss). ``clip``/``lr_shift``: deliberately wrong
    variants, to see that the test fails."""
    w = {k: v.requires_grad_(True) for k, v in init_weights(cfg, c["seed"]).items()}
    stage_of = {}
    for s, layers in enumerate(stage_layers):
        for i in layers:
            stage_of.update({k: s for k in w if k.startswith(f"layers.{i}.")})
    stage_of.update({k: 0 for k in w if not k.startswith("layers.")})
    counts = [len(routes)] + [sum(s in r for r in routes) for s in range(1, len(stage_layers))]
    opt = torch.optim.AdamW(list(w.values()), lr=c["lr"], betas=BETAS, weight_decay=c["weight_decay"])
    losses, norms = [], []
    for it in range(c["iterations"]):
        step_losses = []
        for route, (tokens, targets) in zip(routes, batches[it]):
            layers = [i for s in (0, *route) for i in stage_layers[s]]
            loss = loss_through(w, cfg, layers, tokens, targets)
            (loss if per_stage else loss / len(routes)).backward()
            step_losses.append(loss.item())
        if per_stage:
            for k, p in w.items():
                p.grad /= counts[stage_of[k]]
        if clip:
            norm = float(torch.nn.utils.clip_grad_norm_(list(w.values()), c["clip"]))
        else:
            norm = float(torch.sqrt(sum(p.grad.pow(2).sum() for p in w.values())))
        for group in opt.param_groups:
            group["lr"] = lr_at(c, it + lr_shift)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / len(step_losses))
        norms.append(norm)
    return {k: v.detach() for k, v in w.items()}, losses, norms


# -- the real run -----------------------------------------------------------------------------------

def train(**over):
    """20 iterations of the Trainer; the plan it used, its records, every node's initial and final
    weights, and the batches it drew."""
    c = {**BASE, **over}
    prep = prepare(TrainConfig(**c))
    with Trainer(prep) as t:
        init = t.stage_states(all_replicas=True)
        records = [t.iteration(it) for it in range(ITERATIONS)]
        final = t.stage_states(all_replicas=True)
        used = t.plan.to_dict()
        events = list(t.metrics["events"])
    assert not events, f"the run re-planned ({events}): the reference assumes one plan throughout"
    assert used == prep.plan.to_dict()
    gen = train_batches(prep.corpus.train, c["samples"], c["seq_len"], c["seed"])
    batches = [[next(gen) for _ in used["paths"]] for _ in range(ITERATIONS)]
    return dict(c=c, cfg=prep.model, plan=used, records=records, init=init, final=final, batches=batches)


def stage_layers_of(states) -> list[list[int]]:
    """Which layers each stage holds, read from the names of the weights its nodes hold."""
    held: dict[int, set[int]] = {}
    for stage, sd in states.values():
        held.setdefault(stage, set()).update(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    return [sorted(held[s]) for s in range(len(held))]


def check(run, want, losses, norms) -> None:
    c = run["c"]
    got_losses = [r["train_loss"] for r in run["records"]]
    for it, (g, r) in enumerate(zip(got_losses, losses)):
        assert g == pytest.approx(r, rel=LOSS_RTOL), (it, got_losses, losses)
    # AdamW is blind to a gradient scaled by a constant (m / sqrt(v) cancels it), so a wrong divisor in
    # the averaging shows in the weights only through clipping; the recorded norm shows it directly.
    for it, (rec, n) in enumerate(zip(run["records"], norms)):
        assert rec["grad_norm"] == pytest.approx(n, rel=NORM_RTOL), it
        assert rec["lr"] == pytest.approx(lr_at(c, it), rel=1e-12), it
    # clipping really was at work, and the loss really moved: the comparison covers both
    assert sum(n > c["clip"] for n in norms) >= 3, norms
    assert losses[-1] < losses[0] - 0.3, losses
    for node, (_stage, sd) in run["final"].items():
        for k, v in sd.items():
            diff = (v - want[k]).abs().max().item()
            assert diff <= WEIGHT_ATOL, (node, k, diff)


@pytest.fixture(scope="module")
def dtfm():
    return train(schedule="dtfm", stages=3, skip=0.0)


@pytest.fixture(scope="module")
def skippipe():
    return train(schedule="skippipe", stages=4, skip=0.33, microbatches=7)


def test_initial_weights_follow_the_documented_rule_bitwise(dtfm, skippipe):
    for run in (dtfm, skippipe):
        ref = init_weights(run["cfg"], run["c"]["seed"])
        seen = set()
        for node, (_stage, sd) in run["init"].items():
            for k, v in sd.items():
                assert torch.equal(v, ref[k]), (node, k)
                seen.add(k)
        assert seen == set(ref), set(ref) ^ seen  # every weight of the model is held by some node


def test_full_pipeline_with_replicas_trains_as_one_process(dtfm):
    stages = dtfm["c"]["stages"]
    alloc = dtfm["plan"]["allocation"]
    assert all(list(alloc.values()).count(s) >= 2 for s in range(stages)), alloc  # every stage replicated
    routes = [tuple(p["stages"]) for p in dtfm["plan"]["paths"]]
    assert set(routes) == {tuple(range(1, stages))}
    layers = stage_layers_of(dtfm["init"])
    want, losses, norms = reference(dtfm["c"], dtfm["cfg"], routes, layers, dtfm["batches"], per_stage=False)
    check(dtfm, want, losses, norms)


def test_skip_pipeline_averages_each_stage_over_the_microbatches_that_visited_it(skippipe):
    stages = skippipe["c"]["stages"]
    alloc = skippipe["plan"]["allocation"]
    assert max(list(alloc.values()).count(s) for s in range(stages)) >= 2, alloc
    routes = [tuple(p["stages"]) for p in skippipe["plan"]["paths"]]
    assert all(len(r) == 2 for r in routes), routes  # 2 of the 3 stages after 0: stages are skipped
    counts = [sum(s in r for r in routes) for s in range(1, stages)]
    assert len(set(counts)) > 1, counts  # stages visited unequally often: the averaging rule shows
    layers = stage_layers_of(skippipe["init"])
    want, losses, norms = reference(skippipe["c"], skippipe["cfg"], routes, layers, skippipe["batches"],
                                    per_stage=True)
    check(skippipe, want, losses, norms)


def test_the_comparison_catches_a_wrong_reference(skippipe):
    """The tolerances are not so loose that a wrong arithmetic passes: no clipping, the learning-rate
    schedule one iteration late, or the plain mean over microbatches instead of the per-stage rule
    each fail the comparison."""
    routes = [tuple(p["stages"]) for p in skippipe["plan"]["paths"]]
    layers = stage_layers_of(skippipe["init"])
    for wrong in (dict(clip=False), dict(lr_shift=1), dict(per_stage=False)):
        kw = {"per_stage": True, **wrong}
        want, losses, norms = reference(skippipe["c"], skippipe["cfg"], routes, layers, skippipe["batches"], **kw)
        with pytest.raises(AssertionError):
            check(skippipe, want, losses, norms)
