"""Screening (``pipeline.screen``) against plain tensors, no processes: every adversary kind of
``pipeline.adversary`` sent by one node (two for ``collude``) is named within a stated number of
observations, no honest node is, and clean data gives no suspect over many draws and seeds.

The synthetic boundary: honest nodes send ``P + N(0, 1)`` tensors of shape (4, 64, 128) with a
per-feature profile ``P`` (N(0, 0.5^2), fixed per boundary), as a stage's outputs share a structure;
its input to a node is another such tensor. Gradient shares of a round: a common ``G`` (new each
round) plus N(0, 0.5^2) per replica."""

import math
import statistics

import pytest
import torch

from roving.pipeline.verify.adversary import Adversary
from roving.pipeline.verify.screen import (Screen, Summary, cosines_to, median_cosines, sound, summarize,
                                          summarize_squared)

SHAPE = (4, 64, 128)
NODES = ["n0", "n1", "n2", "n3", "n4"]
#: the observations each node sends before the bad one must be named (every kind, fraction 1).
WITHIN = 60


def activations(seed: int, draws: int, shape=SHAPE):
    """{(draw, node): (output, input)} of honest nodes at one boundary."""
    g = torch.Generator().manual_seed(seed)
    profile = torch.randn(shape[-1], generator=g) * 0.5
    return {(d, n): (profile + torch.randn(shape, generator=g), profile + torch.randn(shape, generator=g))
            for d in range(draws) for n in NODES}


def run_activations(adversaries: dict, what: str, seed: int = 0, draws: int = WITHIN):
    screen = Screen()
    first = None
    for (d, node), (out, given) in activations(seed, draws).items():
        adv = adversaries.get(node)
        sent = adv.tamper(what, out, node, d, 0, given) if adv else out
        screen.observe(("s1", what), node, sent, given)
        if first is None and screen.suspects():
            first = d
    return screen.suspects(), first


@pytest.mark.parametrize("kind, what", [
    ("noise", "activation"), ("scale", "activation"), ("signflip", "gradient"), ("lazy", "activation"),
    ("bias", "activation"), ("nan", "gradient"), ("collude", "activation"), ("scale", "gradient"),
])
def test_each_kind_on_the_boundary_is_named_within_the_stated_observations(kind, what):
    bad = {"n3", "n1"} if kind == "collude" else {"n3"}
    suspects, first = run_activations({n: Adversary(kind, seed=5) for n in bad}, what)
    named = {s.node for s in suspects}
    assert named == bad, (kind, suspects)
    assert first is not None and first < WITHIN, first


@pytest.mark.parametrize("kind", ["weights", "collude", "signflip", "scale", "noise"])
def test_a_tampered_gradient_share_is_named_by_its_statistics_or_its_cosine_to_the_other_replicas(kind):
    g = torch.Generator().manual_seed(11)
    bad = {"n3", "n1"} if kind == "collude" else {"n3"}
    adv = Adversary(kind, seed=2)
    screen = Screen()
    for rnd in range(WITHIN):
        common = torch.randn(4096, generator=g)
        shares = {n: common + 0.5 * torch.randn(4096, generator=g) for n in NODES}
        sent = {n: adv.tamper("share", s, n, rnd, -1) if n in bad else s for n, s in shares.items()}
        for n, s in sent.items():
            screen.observe(("share", 1), n, s)
        screen.compare(("share", 1), sent)
    suspects = screen.suspects()
    assert {s.node for s in suspects} == bad, suspects
    if kind in ("signflip", "noise", "collude"):  # norms kept: the cosine (or the profile) tells
        assert {s.check for s in suspects} & {"cosine", "profile"}, suspects


def test_an_adversary_that_lies_about_a_fraction_of_its_microbatches_is_named_too():
    # a fifth of its tensors times 3: its mean log-norm moves by 0.2 ln 3 with a spread of about 0.44
    # per tensor, so z = 6 takes about (6 * 0.44 / 0.22) ** 2 = 144 observations
    suspects, first = run_activations({"n2": Adversary("scale", fraction=0.2, strength=3, seed=1)}, "activation",
                                      draws=250)
    assert {s.node for s in suspects} == {"n2"}, suspects
    assert first is not None and first > WITHIN, "a rarer lie takes longer to see: the bound is honest"


@pytest.mark.parametrize("seed", range(12))
def test_clean_data_gives_no_suspect_over_many_draws(seed):
    screen = Screen()
    g = torch.Generator().manual_seed(100 + seed)
    profile = torch.randn(128, generator=g) * 0.5
    for d in range(200):
        common = torch.randn(2048, generator=g)
        shares = {}
        for n in NODES:
            screen.observe("fwd", n, profile + torch.randn((2, 32, 128), generator=g),
                           profile + torch.randn((2, 32, 128), generator=g))
            screen.observe("bwd", n, torch.randn((2, 32, 128), generator=g) * 1e-3)
            if n in NODES[:2]:  # a boundary of two: their gap is never z standard errors wide
                screen.observe("pair", n, profile + torch.randn((2, 32, 128), generator=g))
            shares[n] = common + 0.5 * torch.randn(2048, generator=g)
            screen.observe("share", n, shares[n])
        screen.compare("share", shares)
        if d % 20 == 19:
            assert screen.suspects() == [], (d, screen.suspects())


def test_two_nodes_apart_are_both_named_one_node_has_no_band_and_what_is_found_at_once_still_shows():
    """A boundary of 2 nodes has no median: where their statistics are z standard errors apart both are
    named (one is out, and only a recomputation can tell which), each with its value and the other's;
    a boundary of one node is compared with nothing; a non-finite tensor is named at once anyway."""
    screen = Screen()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        screen.observe("b", "a", torch.randn(64, generator=g))
        screen.observe("b", "b", torch.randn(64, generator=g) * 100)
        screen.observe("alone", "c", torch.randn(64, generator=g) * (100 if _ % 2 else 1))
    named = {(s.node, s.check) for s in screen.suspects()}
    assert named == {("a", "norm"), ("b", "norm"), ("a", "std"), ("b", "std")}, named
    norm = {s.node: s for s in screen.suspects() if s.check == "norm"}
    assert norm["b"].z > 6 and norm["a"].z == -norm["b"].z and norm["a"].others == norm["b"].value
    screen.observe("alone", "c", torch.full((64,), float("nan")))
    assert [(s.node, s.check) for s in screen.suspects() if s.node == "c"] == [("c", "non-finite")]


def test_median_cosines_agree_with_each_pair_computed_on_its_own_and_leave_out_what_they_should():
    g = torch.Generator().manual_seed(3)
    common = torch.randn(10_000, generator=g)
    sent = {f"r{i}": common + torch.randn(10_000, generator=g) * (0.3 + 0.2 * i) for i in range(4)}
    naive = {n: statistics.median(float(torch.nn.functional.cosine_similarity(t, o, dim=0))
                                  for m, o in sent.items() if m != n) for n, t in sent.items()}
    bad = dict(sent, nan=torch.full((10_000,), math.nan), zeros=torch.zeros(10_000),
               huge=common * 1e30)  # finite, but its squares overflow float32: still a cosine of 1 to common
    got = median_cosines(sent)
    assert got.keys() == naive.keys()
    for n in naive:
        assert got[n] == pytest.approx(naive[n], rel=1e-5), n
    with_bad = median_cosines(bad, skip_zeros=True)
    assert set(with_bad) == set(sent) | {"huge"}  # the non-finite one and the zeros left out
    alone = median_cosines({**sent, "huge": bad["huge"], "common": common})
    assert alone["huge"] == pytest.approx(alone["common"], rel=1e-5)  # parallel tensors: the same cosines
    assert median_cosines({"a": common, "b": common, "nan": bad["nan"]}) == {}  # fewer than 3 finite
    kept_zero = median_cosines({**sent, "zeros": bad["zeros"]})
    assert kept_zero["zeros"] == 0.0  # without skip_zeros, zeros has a cosine of 0 to everything


def test_cosines_to_one_tensor_agree_with_each_pair_computed_on_its_own_and_reuse_known_squares():
    g = torch.Generator().manual_seed(5)
    common = torch.randn(10_000, generator=g)
    mine = common + torch.randn(10_000, generator=g)
    others = {f"r{i}": common + torch.randn(10_000, generator=g) * (0.5 + i) for i in range(3)}
    naive = {n: float(torch.nn.functional.cosine_similarity(mine, o, dim=0)) for n, o in others.items()}
    got = cosines_to(mine, others)
    assert got.keys() == naive.keys() and all(got[n] == pytest.approx(naive[n], rel=1e-5) for n in naive)
    summary, sq = summarize_squared(others["r0"], divisor=3)
    assert summary == summarize(others["r0"], divisor=3) and sq == pytest.approx(float(others["r0"].pow(2).sum()))
    assert cosines_to(mine, others, known={"r0": sq}) == got  # the known square is the one it would compute
    assert cosines_to(mine, others, known={"r0": 4 * sq})["r0"] == pytest.approx(got["r0"] / 2), "known is used"
    with_bad = cosines_to(mine, {**others, "nan": torch.full((10_000,), math.nan), "zeros": torch.zeros(10_000),
                                 "huge": mine * 1e30})
    assert set(with_bad) == set(others) | {"huge"} and with_bad["huge"] == pytest.approx(1.0, rel=1e-5)
    assert cosines_to(torch.zeros(10_000), others) == {} and cosines_to(mine * math.nan, others) == {}


def test_a_summary_is_sound_only_as_summarize_makes_one_and_a_profile_of_another_shape_is_not_taken():
    g = torch.Generator().manual_seed(6)
    made = [summarize(torch.randn(4, 8, 16, generator=g)), summarize(torch.randn(100, generator=g)),
            summarize(torch.zeros(5)), summarize(torch.full((5,), math.inf)),
            # finite, but its squares and its sums overflow float32: what a receiver reports of it is sound
            summarize(torch.full((4, 1024, 16), 3e38)), summarize(torch.full((5000,), -3e38), divisor=7)]
    assert all(sound(s) for s in made)
    good = made[0]
    for bad in ("a summary", Summary(("zeros", "zeros")), Summary(("tampered",)), Summary(found="zeros"),
                Summary((), math.nan, 0.0, 0.0), Summary((), 1.0, "0", 0.0),
                Summary((), good.norm, good.mean, good.std, good.profile.reshape(4, 4)),
                Summary((), good.norm, good.mean, good.std, torch.full((16,), math.inf)),
                Summary((), good.norm, good.mean, good.std, [0.0] * 16)):
        assert not sound(bad), bad
    screen = Screen()
    screen.add("b", "n", good)
    screen.add("b", "n", Summary((), good.norm, good.mean, good.std, torch.zeros(32)))  # another shape
    ns = screen.nodes["b"]["n"]
    assert ns.stats["norm"].count == 2 and ns.profiles == 1 and ns.profile.shape == (16,)


def test_a_summary_with_a_divisor_is_the_summary_of_the_divided_tensor():
    g = torch.Generator().manual_seed(4)
    for shape in ((50_000,), (4, 64, 128)):
        t = torch.randn(shape, generator=g) * 3 + 0.5
        a, b = summarize(t, divisor=7), summarize(t / 7)
        assert (a.found, b.found) == ((), ())
        assert (a.norm, a.mean, a.std) == pytest.approx((b.norm, b.mean, b.std), rel=1e-5, abs=1e-6)
        if len(shape) > 1:
            assert torch.allclose(a.profile, b.profile, rtol=1e-4, atol=1e-6)
            assert torch.allclose(a.profile, (t / 7).reshape(-1, shape[-1]).mean(dim=0), rtol=1e-4, atol=1e-6)
        else:
            assert a.profile is None
    huge = summarize(torch.full((100,), 1e30))
    assert huge.norm == pytest.approx(math.log(1e31), rel=1e-6) and huge.std == pytest.approx(math.log(1e-30))
    assert summarize(torch.zeros(10), divisor=3).found == ("zeros",)
    assert summarize(torch.tensor([1.0, math.inf]), divisor=3).found == ("non-finite",)


def test_a_share_cosine_that_turns_below_zero_is_opposed_in_each_round_it_does_and_never_becomes_the_baseline():
    """Round by round (``Screen.cosine``): a pair's shares pointing together (cosine 0.4 +- 0.1) for 20
    rounds, one of them negated for the next 10 (-0.4 +- 0.1): no honest round is opposed, every negated one
    is (its rounds do not move the baseline), and the first honest round after is not. Nothing is opposed
    before ``min_rounds`` rounds, however far below 0 (a liar from the first round has no baseline): the
    band names that pair instead, once either's mean cosine is ``z`` standard errors below 0; a pair
    pointing together is named by nothing."""
    g = torch.Generator().manual_seed(0)
    noise = (torch.randn(31, generator=g) * 0.1).tolist()
    screen = Screen()
    honest = [screen.cosine(("share", 1), n, 0.4 + noise[r]) for r in range(20) for n in ("a", "b")]
    negated = [screen.cosine(("share", 1), n, -0.4 + noise[r]) for r in range(20, 30) for n in ("a", "b")]
    assert not any(honest) and all(negated)
    assert not screen.cosine(("share", 1), "a", 0.4 + noise[30])
    assert screen.suspects() == [], "20 rounds of 0.4 and 10 of -0.4: the mean is still above 0"
    liar = Screen()
    early = [liar.cosine(("share", 2), n, -0.4 + noise[r]) for r in range(liar.min_samples) for n in ("c", "d")]
    assert not any(early)
    named = liar.suspects()
    assert [(s.node, s.check) for s in named] == [("c", "cosine"), ("d", "cosine")]
    assert all(s.z < -liar.z and s.value < 0 for s in named)


@pytest.mark.parametrize("mean, sd", [(0.1, 0.25), (0.4, 0.2), (0.0, 0.02)])
def test_honest_share_cosines_are_seldom_opposed(mean, sd):
    """Honest shares whose cosines are noisy (mean 0.1, sd 0.25, as a 6-node run of a small model had them),
    steadier (0.4, 0.2) or near orthogonal (0, 0.02): over 2,000 rounds under 0.5% are opposed (about 0.1%
    for normal cosines: below 0 and 3 standard deviations below the mean), and the band names nobody."""
    g = torch.Generator().manual_seed(1)
    screen = Screen()
    values = (mean + sd * torch.randn(2000, generator=g)).clamp(-1, 1).tolist()
    opposed = sum(screen.cosine(("share", 0), n, x) for x in values for n in ("a", "b"))
    assert opposed < 0.005 * 2 * len(values), opposed
    assert screen.suspects() == []


def stage_round(g: torch.Generator, r: int, profile: torch.Tensor, drift: torch.Tensor, sd: float = 1.0,
                shape=(2, 32, 128)) -> torch.Tensor:
    """One honest output of round ``r``: the stage's profile, which moves by ``drift`` a round (its
    weights move), plus noise of ``sd``."""
    return profile + r * drift + sd * torch.randn(shape, generator=g)


def test_a_whole_stage_sending_made_up_tensors_is_turned_in_each_round_it_does_and_never_before():
    """Round by round (``Screen.turned``): a stage of 2 replicas (c, d) sends honest outputs whose profile
    moves slowly for 10 rounds (4 tensors a replica a round), then both collude (the same random tensor
    of the right norm for each microbatch: no statistic of one differs from the other's) for 5 rounds,
    then send honest outputs again. No honest round turns, every colluding round turns both, and the
    first honest round after does not (the colluding rounds did not move the anchor). A node of another
    boundary is judged on its own profile only."""
    g = torch.Generator().manual_seed(0)
    profile, drift = torch.randn(128, generator=g) * 0.5, torch.randn(128, generator=g) * 0.005
    other = torch.randn(128, generator=g) * 0.5
    liar = Adversary("collude", start=10, seed=3)
    screen = Screen()
    boundary = ("activation", 1, 1)
    got = []
    for r in range(16):
        for mb in range(4):
            for node in ("c", "d"):
                out = stage_round(g, r, profile, drift)
                sent = liar.tamper("activation", out, node, r, mb) if r < 15 else out
                screen.add(boundary, node, summarize(sent))
            screen.add(("activation", 2, 1), "e", summarize(stage_round(g, r, other, drift)))
        got.append(screen.turned())
    assert got[:10] == [{}] * 10
    assert got[10:15] == [{"c": [boundary], "d": [boundary]}] * 5
    assert got[15] == {}


def test_a_stage_that_lies_from_its_first_round_has_no_profile_to_lose_and_a_round_given_up_is_no_round():
    """The limits of the round rule: a stage colluding from round 0 is never turned (its own rounds are its
    baseline: the band and the spot checks are for it); a round given up (``forget_round``) is not judged,
    nor does it join the anchor: honest rounds after it stay unturned."""
    g = torch.Generator().manual_seed(1)
    profile, drift = torch.randn(128, generator=g) * 0.5, torch.zeros(128)
    liar = Adversary("collude", seed=4)
    screen = Screen()
    for r in range(20):
        for mb in range(4):
            for node in ("c", "d"):
                screen.add(("activation", 1, 1), node,
                           summarize(liar.tamper("activation", stage_round(g, r, profile, drift), node, r, mb)))
        assert screen.turned() == {}
    honest = Screen()
    for r in range(12):
        for _ in range(4):
            out = stage_round(g, r, profile, drift)
            honest.add(("activation", 1, 1), "c", summarize(out if r != 8 else torch.randn_like(out)))
        if r == 8:
            honest.forget_round()  # the round of made-up tensors was given up
        assert honest.turned() == {}, r


@pytest.mark.parametrize("sd, steady", [(1.0, True), (4.0, True), (1.0, False)],
                         ids=["steady", "noisy", "no-profile"])
def test_honest_profiles_are_seldom_turned(sd, steady):
    """Over 1,000 rounds of honest outputs (2 tensors a round) whose profile drifts: a steady profile (round
    cosines ~0.99), a noisy one (~0.8) and outputs with no profile to keep (gradients: per-feature means
    that are noise, round cosines ~0, never ``steady``): under 0.5% of rounds turned."""
    g = torch.Generator().manual_seed(2)
    profile = torch.randn(128, generator=g) * 0.5 if steady else torch.zeros(128)
    drift = torch.randn(128, generator=g) * 0.0005 if steady else torch.zeros(128)
    screen = Screen()
    turned = 0
    for r in range(1000):
        for _ in range(2):
            screen.add(("activation", 1, 1), "c", summarize(stage_round(g, r, profile, drift, sd)))
        turned += bool(screen.turned())
    assert turned < 5, turned
