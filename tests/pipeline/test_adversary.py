"""Adversary injection (``pipeline.adversary``): what each kind does to a tensor, from which round and
for which fraction of microbatches, that colluders agree, and the errors for a bad ``adversaries``."""

import math

import pytest
import torch

from roving.pipeline.verify.adversary import KINDS, Adversary, parse_adversaries
from roving.pipeline.errors import PlanError


def tensor(seed: int = 0) -> torch.Tensor:
    return torch.randn((4, 8, 16), generator=torch.Generator().manual_seed(seed)) + 0.3


def test_each_kind_changes_what_it_should_and_leaves_the_rest():
    t, given = tensor(0), tensor(1)
    for kind in KINDS:
        adv = Adversary(kind)
        for what in ("activation", "gradient", "share"):
            out = adv.tamper(what, t, "n01", 0, 3, given)
            assert out.shape == t.shape and out.dtype == t.dtype
            untouched = (kind == "weights" and what != "share") or (kind == "signflip" and what == "activation") \
                or kind in ("frame", "drift", "export")  # a framer lies only when asked to recheck, a drifter
            # as it steps, an exporter in the weights it exports
            assert torch.equal(out, t) == untouched, (kind, what)
    assert torch.equal(Adversary("scale").tamper("gradient", t, "n", 0, 0), t * 10)
    assert torch.equal(Adversary("scale", strength=3).tamper("gradient", t, "n", 0, 0), t * 3)
    assert torch.equal(Adversary("signflip").tamper("gradient", t, "n", 0, 0), -t)
    assert torch.equal(Adversary("lazy").tamper("activation", t, "n", 0, 0, given), given)
    assert torch.equal(Adversary("lazy").tamper("share", t, "n", 0, 0, given), torch.zeros_like(t))
    assert torch.equal(Adversary("lazy").tamper("activation", t, "n", 0, 0, given[:2]), torch.zeros_like(t))
    noise = Adversary("noise").tamper("activation", t, "n", 0, 0)
    assert float(noise.norm()) == pytest.approx(float(t.norm()), rel=1e-5)
    assert abs(float(torch.nn.functional.cosine_similarity(noise.flatten(), t.flatten(), dim=0))) < 0.1
    bias = Adversary("bias").tamper("activation", t, "n", 0, 0)
    rms = float(t.pow(2).mean().sqrt())
    assert torch.allclose(bias - t, torch.full_like(t, 0.01 * rms), atol=1e-6)
    assert float(bias.norm()) / float(t.norm()) - 1 < 0.02, "a bias survives a norm check"
    nan = Adversary("nan").tamper("gradient", t, "n", 0, 0)
    assert int((~torch.isfinite(nan)).sum()) == 1 and math.isnan(float(nan[~torch.isfinite(nan)][0]))
    inf = Adversary("nan").tamper("gradient", t, "n", 0, 1)
    assert float(inf[~torch.isfinite(inf)][0]) == math.inf
    w = Adversary("weights").tamper("share", t, "n", 0, -1)
    assert float((w - t).norm()) == pytest.approx(10 * float(t.norm()), rel=1e-4)
    assert not t.requires_grad and torch.equal(t, tensor(0)), "the original is never changed in place"


def test_a_drifter_steps_with_a_gradient_of_its_own_from_its_round_on_and_the_others_with_theirs():
    g = tensor(3).flatten()
    drift = Adversary("drift", start=2)
    assert drift.stepped(g, "n", 1) is g, "before its round it steps honestly"
    own = drift.stepped(g, "n", 2)
    assert float((own - g).norm()) == pytest.approx(10 * float(g.norm()), rel=1e-4)
    assert torch.equal(own, drift.stepped(g, "n", 2)) and not torch.equal(own, drift.stepped(g, "n", 3))
    assert torch.equal(g, tensor(3).flatten()), "never changed in place"
    assert all(Adversary(k).stepped(g, "n", 5) is g for k in KINDS if k != "drift")


def test_an_exporter_poisons_the_weights_it_exports_from_its_round_on_and_the_others_export_theirs():
    weights = {"w": tensor(4), "b": tensor(5)[0, 0], "steps": torch.tensor([3])}
    export = Adversary("export", start=2)
    assert export.exported(weights, "n", 1) is weights, "before its round it exports honestly"
    out = export.exported(weights, "n", 2)
    assert out.keys() == weights.keys() and torch.equal(out["steps"], weights["steps"]), "integers left alone"
    for name in ("w", "b"):
        assert out[name].dtype == weights[name].dtype and out[name].shape == weights[name].shape
        assert float((out[name] - weights[name]).norm()) == pytest.approx(0.1 * float(weights[name].norm()), rel=1e-4)
    assert torch.equal(out["w"], export.exported(weights, "n", 2)["w"]), "a pure function of its arguments"
    assert torch.equal(weights["w"], tensor(4)), "never changed in place"
    assert not torch.equal(Adversary("export").exported(weights, "n", -1)["w"], weights["w"]), \
        "an export before the first round is round 0's"
    assert all(Adversary(k).exported(weights, "n", 5) is weights for k in KINDS if k != "export")


def test_an_adversary_starts_at_its_round_and_lies_about_the_fraction_of_microbatches_given():
    t = tensor(2)
    late = Adversary("scale", start=5)
    assert all(torch.equal(late.tamper("gradient", t, "n", r, 0), t) for r in range(5))
    assert not torch.equal(late.tamper("gradient", t, "n", 5, 0), t)
    part = Adversary("scale", fraction=0.3, seed=7)
    hits = sum(part.active("n02", r, mb) for r in range(50) for mb in range(20))
    assert 0.25 < hits / 1000 < 0.35, hits
    again = sum(Adversary("scale", fraction=0.3, seed=7).active("n02", r, mb) for r in range(50) for mb in range(20))
    assert again == hits, "drawn from the seed, the node, the round and the microbatch alone"


def test_colluders_send_the_same_wrong_tensor_and_plain_noise_differs_by_node():
    t = tensor(3)
    a = Adversary("collude", seed=1).tamper("share", t, "n01", 4, -1)
    b = Adversary("collude", seed=1).tamper("share", t, "n04", 4, -1)
    assert torch.equal(a, b) and not torch.equal(a, t)
    assert not torch.equal(a, Adversary("collude", seed=1).tamper("share", t, "n01", 5, -1))
    x = Adversary("noise", seed=1).tamper("share", t, "n01", 4, -1)
    y = Adversary("noise", seed=1).tamper("share", t, "n04", 4, -1)
    assert not torch.equal(x, y)


def test_the_adversaries_entry_is_parsed_and_bad_entries_are_named():
    got = parse_adversaries("n03:scale:10:0.5:4, n05:nan", seed=2)
    assert got == {"n03": Adversary("scale", 10, 0.5, 4.0, 2), "n05": Adversary("nan", 0, 1.0, 0.0, 2)}
    assert parse_adversaries("") == {}
    for bad, why in (("n03", "is not NODE:KIND"), ("n03:evil", "'evil' in 'n03:evil' is not a kind"),
                     ("n03:scale:x", "FROM must be an integer"), ("n03:scale:1:0", r"FRACTION in \(0, 1\]"),
                     ("n03:scale,n03:nan", "node n03 is given twice"), ("n03:scale:-1", "FROM must be >= 0")):
        with pytest.raises(PlanError, match=why):
            parse_adversaries(bad)


def test_a_colluder_reports_every_recheck_as_matching_a_framer_as_differing_the_others_what_they_found():
    assert Adversary("collude").reports("n", 0, 0.7) == 0.0
    assert Adversary("frame").reports("n", 0, 0.0) == 1.0
    assert Adversary("frame", start=3).reports("n", 2, 0.0) == 0.0, "not yet lying"
    assert Adversary("scale").reports("n", 5, 0.25) == 0.25


def test_the_honest_conduct_gives_back_every_object_it_is_given_and_an_adversary_is_a_conduct():
    from roving.pipeline.verify.conduct import HONEST, Conduct

    t, own, weights, grads = tensor(0), tensor(1), {"w": tensor(2)}, [tensor(3)]
    before = grads[0].clone()
    assert HONEST.tamper("activation", t, "n", 0, 0) is t
    assert HONEST.averages(own, t, t + 1) is own
    assert HONEST.reports("n", 0, 0.25) == 0.25
    assert HONEST.exported(weights, "n", 0) is weights
    HONEST.steps(grads, "n", 0)
    assert torch.equal(grads[0], before), "an honest step keeps its gradient"
    assert all(isinstance(Adversary(kind), Conduct) for kind in KINDS)


def test_an_adversary_averages_the_share_it_sent_but_weights_keeps_its_own_and_drift_steps_with_another():
    own, honest = tensor(0), tensor(0)
    sent = Adversary("scale").tamper("share", honest, "n", 0, -1)
    assert torch.equal(Adversary("scale").averages(own, honest, sent), sent)
    assert Adversary("weights").averages(own, honest, Adversary("weights").tamper("share", honest, "n", 0, -1)) is own
    assert Adversary("scale").averages(own, honest, honest) is own, "nothing tampered: its own"
    grads = [tensor(4), tensor(5)]
    before = [g.clone() for g in grads]
    Adversary("drift").steps(grads, "n", 0)
    assert not any(torch.equal(g, b) for g, b in zip(grads, before))
    drifted = [g.clone() for g in grads]
    Adversary("scale").steps(grads, "n", 0)  # only a drifter steps with another gradient
    assert all(torch.equal(g, d) for g, d in zip(grads, drifted))
