"""Recovering a stage that lost every replica (issue 24), on local roving processes: CheckFree's
neighbour average checked against a hand computation, training going on and its loss recovering,
``auto`` choosing the snapshot or the neighbours as documented, ``skip`` dropping the stage for good,
the events and ``pipeline status`` saying what happened, injected failures, and bad settings refused."""

import math
import re

import pytest
import torch

torch.set_num_threads(1)

from roving.cli import main as roving_main
from roving.pipeline.runtime.control import ControlFolder
from roving.pipeline.errors import PlanError
from roving.pipeline.protocol import Export, Exported
from roving.pipeline.faults import FailureSchedule, parse_fail_at
from roving.pipeline.runtime.recovery import choose, neighbour_weights
from roving.pipeline.run.runconfig import TrainConfig
from roving.pipeline.run.trainer import Trainer, prepare

CFG = dict(model="tiny", nodes=6, stages=3, skip=0.33, microbatches=6, samples=4, seq_len=32,
           iterations=30, lr=3e-3, warmup=1, eval_every=100, eval_batches=4, planner_budget=0.3,
           replan_budget=0.2, replan_evals=200, speed=1e-3, clip=1.0, timeout=120, in_flight=2,
           snapshot_every=100)


def events(t: Trainer, kind: str) -> list[dict]:
    return [e for e in t.metrics["events"] if e["event"] == kind]


def holders(t: Trainer, stage: int) -> list[str]:
    return sorted(n for n, s in t.alloc.items() if s == stage)


# -- the rule and the choice, by hand ------------------------------------------------------------------
def test_neighbour_weights_are_the_gradient_norm_weighted_average_of_the_adjacent_layers():
    a = {"layers.0.w": torch.tensor([1.0, 2.0]), "layers.0.b": torch.tensor([0.0])}
    c = {"layers.2.w": torch.tensor([3.0, 6.0]), "layers.2.b": torch.tensor([4.0]),
         "layers.3.w": torch.tensor([9.0, 9.0]), "layers.3.b": torch.tensor([9.0])}
    out, share = neighbour_weights(range(1, 2), {0: a, 2: c}, {0: 1.0, 2: 3.0})
    # (1 * W_0 + 3 * W_2) / (1 + 3), the k-th layer of each neighbour (layer 0 of stage 0, layer 2 of stage 2)
    assert torch.equal(out["layers.1.w"], torch.tensor([(1 * 1 + 3 * 3) / 4, (1 * 2 + 3 * 6) / 4]))
    assert torch.equal(out["layers.1.b"], torch.tensor([(0 + 3 * 4) / 4]))
    assert set(out) == {"layers.1.w", "layers.1.b"}
    assert share == {0: 0.25, 2: 0.75}
    # one neighbour (the last stage): a copy; norms unknown or zero: equal weights
    one, share = neighbour_weights(range(2, 4), {1: {"layers.1.w": torch.tensor([5.0])}}, {1: 2.0})
    assert share == {1: 1.0} and torch.equal(one["layers.2.w"], torch.tensor([5.0]))
    assert torch.equal(one["layers.3.w"], torch.tensor([5.0])), "a neighbour with fewer layers gives its last"
    even, share = neighbour_weights(range(1, 2), {0: a, 2: c}, {0: math.nan, 2: 0.0})
    assert share == {0: 0.5, 2: 0.5} and torch.equal(even["layers.1.w"], torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError, match="no neighbour"):
        neighbour_weights(range(1, 2), {}, {})


def test_auto_takes_the_snapshot_up_to_the_bound_and_the_neighbours_beyond_it():
    assert choose("auto", 0, 10) == "snapshot"
    assert choose("auto", 10, 10) == "snapshot"
    assert choose("auto", 11, 10) == "neighbours"
    assert choose("auto", None, 10) == "neighbours", "no snapshot at all: the neighbours"
    assert [choose(p, 99, 10) for p in ("snapshot", "skip", "neighbours")] == ["snapshot", "skip", "neighbours"]
    with pytest.raises(PlanError, match="stage_recovery must be one of"):
        choose("checkfree", 1, 10)


def test_failure_schedules_are_scripted_or_drawn_from_the_seed_and_reproducible():
    assert parse_fail_at("10:2, 30:1,10:1", 3) == {10: [2, 1], 30: [1]}
    s = FailureSchedule(4, seed=7, fail_rate=0.5, hour_iterations=10, fail_at="3:0")
    drawn = [s.at(i) for i in range(400)]
    assert drawn == [FailureSchedule(4, seed=7, fail_rate=0.5, hour_iterations=10, fail_at="3:0").at(i)
                     for i in range(400)], "the same seed, the same failures"
    assert 0 in drawn[3] and all(0 not in d for i, d in enumerate(drawn) if i != 3), "random ones spare stage 0"
    count = sum(len(d) for i, d in enumerate(drawn) if i != 3)
    assert 35 <= count <= 90, f"3 stages failing 0.5 times per 10 iterations, over 400: about 60, got {count}"
    other = [FailureSchedule(4, seed=8, fail_rate=0.5, hour_iterations=10).at(i) for i in range(400)]
    assert other != [[st for st in d if st != 0] for d in drawn], "another seed, other failures"
    assert not FailureSchedule(3) and not any(FailureSchedule(3).at(i) for i in range(50))


@pytest.mark.parametrize("bad, message", [
    (dict(stage_recovery="checkpoint"), "stage_recovery must be one of snapshot, skip, neighbours, auto"),
    (dict(recovery_lr_factor=0), "recovery_lr_factor must be a positive number"),
    (dict(recovery_lr_factor=True), "[faults] recovery_lr_factor must be a number, got True"),
    (dict(auto_snapshot_age=-1), "auto_snapshot_age must be an integer >= 0"),
    (dict(fail_hour_iterations=0), "fail_hour_iterations must be an integer >= 1"),
    (dict(fail_rate=-0.1), "fail_rate must be the failures of each stage per fail_hour_iterations"),
    (dict(fail_at="10-2"), "fail_at: '10-2' is not ITERATION:STAGE"),
    (dict(fail_at="10:3"), "fail_at: stage 3 in '10:3' is not one of the run's stages 0..2"),
    (dict(fail_at="-1:1"), "fail_at: iteration -1 in '-1:1' is negative"),
    (dict(fail_at="4:0", stage_recovery="skip"), "cannot skip"),
])
def test_bad_recovery_settings_are_refused_naming_the_key(bad, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        TrainConfig.from_dict({"plan": {"stages": 3}, "faults": bad})


def test_the_recovery_keys_belong_in_faults():
    cfg = TrainConfig.from_dict({"faults": {"stage_recovery": "auto", "auto_snapshot_age": 4, "fail_at": "2:1",
                                            "fail_rate": 5, "recovery_lr_factor": 1.2}})
    faults = cfg.section("faults")
    assert (faults.stage_recovery, faults.auto_snapshot_age, faults.fail_at, faults.fail_rate,
            faults.recovery_lr_factor) == ("auto", 4, "2:1", 5, 1.2)
    with pytest.raises(PlanError, match=r"stage_recovery belongs in \[faults\], not in \[optim\]"):
        TrainConfig.from_dict({"optim": {"stage_recovery": "skip"}})
    with pytest.raises(PlanError, match="fail_at must be a string"):
        TrainConfig.from_dict({"faults": {"fail_at": 3}})


# -- on running stage processes ---------------------------------------------------------------------
def test_a_stage_killed_whole_is_rebuilt_from_its_neighbours_exactly_and_training_recovers(tmp_path, capsys):
    prep = prepare(TrainConfig(**CFG, stage_recovery="neighbours", recovery_lr_factor=1.2))
    with Trainer(prep) as t:
        for it in range(4):
            t.iteration(it)
        loss_before = t.metrics["iterations"][-1]["train_loss"]
        # the run's records: the neighbours' weights now, and their latest gradient norms
        weights = {s: sd for _, (s, sd) in t.stage_states().items()}
        norms = t.metrics["iterations"][-1]["stage_grad_norms"]
        assert set(norms) == {0, 1, 2} and all(v > 0 and math.isfinite(v) for v in norms.values())
        lost = holders(t, 1)
        assert len(lost) >= 1
        killed = t.kill_stage(1)
        assert killed == lost and not set(lost) & set(t.alloc)
        new = holders(t, 1)
        assert new and not set(new) & set(lost), "a live node took the stage over"
        rebuilt = t.stage_states(all_replicas=True)
        g0, g2 = norms[0], norms[2]
        for name in new:
            stage, state = rebuilt[name]
            assert stage == 1 and set(state) == set(weights[1])
            for key, value in state.items():  # stage 1 holds layer 1; stage 0 layer 0, stage 2 layers 2, 3
                tail = key.split(".", 2)[2]
                w0, w2 = weights[0][f"layers.0.{tail}"], weights[2][f"layers.2.{tail}"]
                hand = ((g0 * w0.double() + g2 * w2.double()) / (g0 + g2)).float()
                assert torch.allclose(value, hand, rtol=1e-6, atol=1e-7), f"{key} is not the weighted average"
                assert not torch.equal(value, weights[1][key]), f"{key} kept the lost stage's weights"
        # a fresh optimizer state and the raised learning rate
        got = t.weights.ask(Export(), Exported, new)
        assert all(not got[n].optimizer["state"] for n in new), "the rebuilt stage starts a fresh optimizer"
        assert t.recovery.lr_factor == {1: 1.2}
        rec = events(t, "recovery")[-1]
        assert rec["stage"] == 1 and rec["policy"] == "neighbours" and rec["chosen"] == "neighbours"
        assert rec["neighbours"] == [0, 2] and rec["grad_norms"] == {0: g0, 2: g2}
        assert rec["shares"] == pytest.approx({0: g0 / (g0 + g2), 2: g2 / (g0 + g2)})
        assert rec["snapshot_age"] == 4 and rec["lr_factor"] == 1.2
        assert events(t, "injected")[-1]["nodes"] == lost
        assert events(t, "replan")[-1]["weights_from"] == {1: "neighbours 0+2"}
        # status.json and `roving pipeline status` say what happened
        ControlFolder(tmp_path).write_status(t.metrics, t.config.iterations, t.alloc, t.missing_stages, [], False)
        assert roving_main(["pipeline", "status", "--control", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "[recovery] at iteration 3: stage 1 by neighbours (stage_recovery = neighbours, snapshot 4 " \
               "iterations old, neighbours 0 (gradient norm" in out, out
        assert f"{g0:.4g}" in out and f"{g2:.4g}" in out
        # training goes on, and the loss comes back to where it was within 8 iterations
        losses = [t.iteration(it)["train_loss"] for it in range(4, 12)]
        assert all(math.isfinite(x) for x in losses)
        assert min(losses) <= loss_before, f"the loss did not recover to {loss_before:.4f} in 8 iterations: {losses}"


def test_auto_takes_the_fresh_snapshot_then_the_neighbours_when_it_is_too_old():
    cfg = TrainConfig(**dict(CFG, stage_recovery="auto", auto_snapshot_age=2, fail_at="1:1,5:2", iterations=8))
    with Trainer(prepare(cfg)) as t:
        snap1 = {k: v.clone() for k, v in t.weights.snapshot["stages"][1]["params"].items()}
        for it in range(5):
            t.iteration(it)
        first = events(t, "recovery")
        assert [e["stage"] for e in first] == [1] and first[0]["chosen"] == "snapshot"
        assert first[0]["snapshot_age"] == 1 and first[0]["policy"] == "auto"
        assert events(t, "injected")[0]["iteration"] == 1
        assert t.recovery.lr_factor == {}, "from a snapshot: the learning rate as it was"
        t.iteration(5)  # stage 2 is killed whole at its start
        if t.missing_stages:  # no spare node was left: the stage waits for a node to join
            t.join([None])
        second = [e for e in events(t, "recovery") if e["stage"] == 2]
        assert len(second) == 1 and second[0]["chosen"] == "neighbours", second
        assert second[0]["snapshot_age"] >= 5 > cfg.auto_snapshot_age and second[0]["neighbours"] == [1]
        assert t.recovery.lr_factor == {2: cfg.recovery_lr_factor}
        r = t.iteration(6)
        assert r["missing_stages"] == [] and math.isfinite(r["train_loss"])
    assert snap1 and first[0]["snapshot_iteration"] == 0


def test_skip_drops_a_lost_stage_for_good():
    # four nodes: one more than the stages is enough, the stage dropped needs no spare to take it over
    cfg = TrainConfig(**dict(CFG, nodes=4, stage_recovery="skip", iterations=8))
    with Trainer(prepare(cfg)) as t:
        for it in range(2):
            t.iteration(it)
        lost = t.kill_stage(2)
        assert t.recovery.dropped == {2} and t.missing_stages == [2] and not set(lost) & set(t.alloc)
        assert all(2 not in p.stages for p in t.plan.paths)
        rec = events(t, "recovery")[-1]
        assert (rec["stage"], rec["policy"], rec["chosen"], rec["nodes"]) == (2, "skip", "skip", lost)
        for it in range(2, 4):
            r = t.iteration(it)
            assert r["missing_stages"] == [2] and math.isfinite(r["train_loss"])
        new = t.join([None])[0]
        assert t.alloc[new] != 2 and t.missing_stages == [2], "a joining node is not given the skipped stage"
        ev = t.evaluate(4)
        assert math.isfinite(ev["val_loss"])
        r = t.iteration(4)
        assert all(2 not in p.stages for p in t.plan.paths) and math.isfinite(r["train_loss"])
