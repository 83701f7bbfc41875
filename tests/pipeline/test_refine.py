"""A quick re-plan after a failure is followed by a fresh plan searched in the background
(``refine_budget``), taken at an iteration boundary when it is faster; one overtaken by a newer re-plan
is dropped, and one that fails leaves the plan in use. On local roving processes."""

import math
import threading
import time

import pytest
import torch

torch.set_num_threads(1)

from roving.pipeline import PlanError, validate
from roving.pipeline import trainer as trainer_mod
from roving.pipeline.trainer import REFINE_GAIN, Trainer, TrainConfig, prepare
from test_faults import CFG, kill_mid_iteration, replicas_equal, stage_groups

# 8 nodes over 4 stages: a re-plan without search (replan_budget 0, so it is the same every run) keeps
# the survivors' stages, where a fresh allocation does better; evaluation counts make both plans fixed.
REFINE_CFG = dict(CFG, nodes=8, stages=4, microbatches=8, replan_budget=0.0, refine_budget=60.0,
                  planner_evals=300)


def refine_events(t: Trainer) -> list[dict]:
    return [e for e in t.metrics["events"] if e["event"] == "refine"]


def train_until(t: Trainer, it: int, done, what: str, timeout: float = 90.0) -> int:
    """Run iterations from ``it`` until ``done()``; returns the next iteration number."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        t.iteration(it)
        it += 1
    return it


def kill_one_replica(t: Trainer, it: int) -> str:
    """Kill a node of the stage with the most replicas in the middle of iteration ``it``."""
    stage, names = max(stage_groups(t).items(), key=lambda kv: (len(kv[1]), -kv[0]))
    victim = sorted(names)[0]
    t.iteration_no = it - 1
    kill_mid_iteration(t, [victim])
    return victim


def test_a_faster_plan_found_in_the_background_replaces_the_quick_re_plan():
    prep = prepare(TrainConfig(**REFINE_CFG))
    with Trainer(prep) as t:
        for it in range(2):
            t.iteration(it)
        victim = kill_one_replica(t, 2)
        quick = dict(t.alloc)
        assert victim not in quick
        it = train_until(t, 3, lambda: refine_events(t), "the refined plan never arrived")
        ev = refine_events(t)[0]
        assert ev["adopted"], ev
        assert ev["iteration_s_refined"] < ev["iteration_s_before"] * (1 - REFINE_GAIN)
        # the plan in use is the refined one: valid on the survivors, its allocation is the event's,
        # and every node that changed stage holds its new stage's weights
        assert validate(t.plan, t.net) == [] and ev["allocation"] == t.alloc
        assert victim not in t.alloc and all(victim not in (p.origin, *p.nodes) for p in t.plan.paths)
        assert ev["moved"] == {n: s for n, s in t.alloc.items() if quick.get(n) != s} and ev["moved"]
        assert {n: t.holding[n] for n in t.alloc} == t.alloc
        assert set(ev["weights_from"]) == set(ev["moved"].values())
        for _ in range(2):
            rec = t.iteration(it)
            it += 1
            assert math.isfinite(rec["train_loss"]) and rec["attempts"] == 1
        for stage, names in stage_groups(t).items():
            if len(names) >= 2:
                replicas_equal(t, stage)
        assert len(refine_events(t)) == 1, "one refinement per re-plan"


def test_a_refinement_overtaken_by_a_newer_re_plan_is_dropped_and_a_failed_one_keeps_the_plan(monkeypatch):
    """The background planner is held until released: the first refinement finishes only after a
    second failure re-planned again (so it is dropped, whatever it found), the second one fails."""
    real_plan = trainer_mod.plan
    gates = [threading.Event(), threading.Event()]
    calls = []

    def held_plan(*args, **kwargs):
        k = len(calls)
        calls.append(k)
        assert gates[k].wait(120), "never released"
        if k == 1:
            raise PlanError("injected: no plan")
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "plan", held_plan)
    prep = prepare(TrainConfig(**REFINE_CFG))
    with Trainer(prep) as t:
        t.iteration(0)
        first = kill_one_replica(t, 1)
        t.iteration(2)
        assert calls == [0] and refine_events(t) == []
        second = kill_one_replica(t, 3)
        assert calls == [0, 1] and {first, second}.isdisjoint(t.alloc)
        after_second = (dict(t.alloc), t.plan)
        gates[0].set()  # the first refinement ends now: stale
        time.sleep(1.0)
        t.iteration(4)
        assert refine_events(t) == [] and t.plan is after_second[1], "a stale refinement was taken"
        gates[1].set()
        train_until(t, 5, lambda: refine_events(t), "the failed refinement was never reported")
        ev = refine_events(t)
        assert len(ev) == 1 and not ev[0]["adopted"] and "injected: no plan" in ev[0]["error"]
        assert t.alloc == after_second[0] and t.plan is after_second[1], "the plan in use stays"


@pytest.mark.parametrize("bad", [-1.0, "5", True, float("nan")])
def test_refine_budget_must_be_seconds(bad):
    with pytest.raises(PlanError, match="refine_budget must be a number of seconds"):
        TrainConfig(**dict(REFINE_CFG, refine_budget=bad)).check()
