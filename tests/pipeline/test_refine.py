"""A quick re-plan after a failure is followed by a fresh plan searched in the background
(``refine_budget``), taken at an iteration boundary when it is faster; one overtaken by a newer re-plan
is dropped, and one that fails leaves the plan in use. On local roving processes; the background
planner (``BackgroundPlan``, a child process) on its own too."""

import math
import os
import signal
import threading
import time

import pytest
import torch

torch.set_num_threads(1)

from roving.pipeline import PlanError, build_network, model_preset, plan, validate
from roving.pipeline.planning.background import BackgroundPlan
from roving.pipeline.planning import background as background_mod
from roving.pipeline.run.trainer import REFINE_GAIN, Trainer, TrainConfig, prepare
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
        assert {n: t.roster.holding[n] for n in t.alloc} == t.alloc
        assert set(ev["weights_from"]) == set(ev["moved"].values())
        for _ in range(2):
            rec = t.iteration(it)
            it += 1
            assert math.isfinite(rec["train_loss"]) and rec["attempts"] == 1
        for stage, names in stage_groups(t).items():
            if len(names) >= 2:
                replicas_equal(t, stage)
        assert len(refine_events(t)) == 1, "one refinement per re-plan"


class HeldPlan:
    """Stands in for ``BackgroundPlan`` (same interface): each one plans, for real, in a thread, but only
    once the test releases it; the second one made fails, the third cannot even start."""

    made: list = []

    def __init__(self, *args, **kwargs):
        self.k = len(HeldPlan.made)
        if self.k == 2:
            raise OSError("injected: cannot start")
        HeldPlan.made.append(self)
        self.gate, self.finished, self.cancelled = threading.Event(), threading.Event(), False
        self.value = self.error = None
        threading.Thread(target=self._run, args=(args, kwargs), daemon=True).start()

    def _run(self, args, kwargs):
        assert self.gate.wait(120), "never released"
        try:
            if self.k == 1:
                raise PlanError("injected: no plan")
            self.value = plan(*args, **kwargs)
        except PlanError as exc:
            self.error = exc
        self.finished.set()

    def done(self):
        return self.finished.is_set()

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value

    def cancel(self):
        self.cancelled = True


def test_a_refinement_overtaken_by_a_newer_re_plan_is_dropped_and_a_failed_one_keeps_the_plan(monkeypatch):
    """The first refinement is still running when a second failure re-plans again: it is cancelled
    and, though it finishes later, never taken; the second one fails: reported, the plan stays; the
    third cannot start: reported, training goes on."""
    HeldPlan.made = []
    monkeypatch.setattr(background_mod, "BackgroundPlan", HeldPlan)
    prep = prepare(TrainConfig(**REFINE_CFG))
    with Trainer(prep) as t:
        t.iteration(0)
        first = kill_one_replica(t, 1)
        t.iteration(2)
        assert len(HeldPlan.made) == 1 and refine_events(t) == []
        second = kill_one_replica(t, 3)
        assert len(HeldPlan.made) == 2 and {first, second}.isdisjoint(t.alloc)
        assert HeldPlan.made[0].cancelled and not HeldPlan.made[1].cancelled
        after_second = (dict(t.alloc), t.plan)
        HeldPlan.made[0].gate.set()  # the first refinement ends now: stale
        assert HeldPlan.made[0].finished.wait(60) and HeldPlan.made[0].value is not None
        t.iteration(4)
        assert refine_events(t) == [] and t.plan is after_second[1], "a stale refinement was taken"
        HeldPlan.made[1].gate.set()
        train_until(t, 5, lambda: refine_events(t), "the failed refinement was never reported")
        ev = refine_events(t)
        assert len(ev) == 1 and not ev[0]["adopted"] and "injected: no plan" in ev[0]["error"]
        assert t.alloc == after_second[0] and t.plan is after_second[1], "the plan in use stays"
        it = len(t.metrics["iterations"])
        kill_one_replica(t, it)
        ev = refine_events(t)
        assert len(HeldPlan.made) == 2 and len(ev) == 2 and ev[1]["error"] == "OSError: injected: cannot start"
        rec = t.iteration(it + 1)
        assert math.isfinite(rec["train_loss"]) and rec["attempts"] == 1


def small_case():
    net = build_network("gcp12", 6, memory=2)
    return net, model_preset("llama-1.5b-skippipe")


def test_a_background_plan_is_the_plan_the_planner_makes_in_process():
    net, m = small_case()
    job = BackgroundPlan(net, m, 3, 0.34, 8, budget_s=60.0, seed=2, max_evals=150)
    deadline = time.monotonic() + 60
    while not job.done():
        assert time.monotonic() < deadline, "the planning process did not finish"
        time.sleep(0.05)
    got = job.result()
    here = plan(net, m, 3, 0.34, 8, budget_s=60.0, seed=2, max_evals=150)
    assert got.to_dict() == here.to_dict() and got.predicted_s == here.predicted_s
    assert not job._dir.exists(), "its temporary folder is removed"


def test_a_background_plan_reports_bad_input_a_crash_and_can_be_cancelled():
    net, m = small_case()
    bad = BackgroundPlan(net, m, 3, 0.34, 0, budget_s=5.0)
    with pytest.raises(PlanError, match="need at least one microbatch, got 0"):
        bad.result()
    broken = BackgroundPlan(net, m, 3, 0.34, 8, budget_s="soon")  # not a PlanError: a RuntimeError naming it
    with pytest.raises(RuntimeError, match=r"^TypeError: "):
        broken.result()
    garbled = BackgroundPlan(net, m, 3, 0.34, 8, budget_s=0.2)
    garbled._proc.wait()
    (garbled._dir / "out.pkl").write_bytes(b"not a pickle")
    with pytest.raises(RuntimeError, match="result could not be read"):
        garbled.result()
    crashed = BackgroundPlan(net, m, 3, 0.34, 8, budget_s=60.0)
    time.sleep(0.5)
    os.kill(crashed._proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"ended without a plan \(exit code -9\)"):
        crashed.result()
    slow = BackgroundPlan(net, m, 3, 0.34, 8, budget_s=60.0)
    assert not slow.done()
    # it plans 10 nice steps below this process (field 19 of /proc/PID/stat), so that nodes on the same
    # machine come first
    want = str(min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
    deadline = time.monotonic() + 20
    while open(f"/proc/{slow._proc.pid}/stat").read().rsplit(")", 1)[1].split()[16] != want:
        assert time.monotonic() < deadline, "the planning process never lowered its priority"
        time.sleep(0.05)
    slow.cancel()
    assert slow.done() and slow._proc.returncode == -signal.SIGKILL and not slow._dir.exists()


@pytest.mark.parametrize("name", ["refine_budget", "replan_budget"])
@pytest.mark.parametrize("bad", [-1.0, "5", True, float("nan")])
def test_refine_and_replan_budgets_must_be_seconds(name, bad):
    with pytest.raises(PlanError, match=f"{name} must be a number of seconds"):
        TrainConfig(**dict(REFINE_CFG, **{name: bad})).check()
