"""Weights checked when they leave a node (issue 51): every export a run keeps or hands on (a snapshot, a
checkpoint, an evaluation, the weights a joining node loads, a neighbour's for the recovery) is held to the
digest of what its node holds (reported after its latest step, loaded by the coordinator, or the run's
initial weights) and to its stage's majority; a node that exports other weights is caught and excluded,
another replica's copy is used, and where none checks out nothing is saved or evaluated. Against an
``export`` adversary (honest in everything it computes, sends, steps and shows; poisoned in what it
exports): the saved, evaluated or joined weights are the honest replica's, the liar is caught, nobody
else is."""

import math
import types

import pytest
import torch

torch.set_num_threads(1)

from roving.pipeline.runtime import checkpoint_file
from roving.pipeline import protocol as m
from roving.pipeline.verify import receipts
from roving.pipeline.verify.adversary import Adversary
from roving.pipeline.errors import ExportRejected
from roving.pipeline.run.evaluate import evaluate_model
from roving.pipeline.model import Llama
from roving.pipeline.presets import preset
from roving.pipeline.stages import Stage, merge_state_dicts
from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare
from roving.pipeline.verify.verifier import Verifier
from roving.pipeline.runtime.weights import Weights

CFG = preset("tiny", max_seq_len=16)
RUN_KEY = b"k" * 32


def initial(stage: int) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s initial weights in a run of 2 stages and seed 0, as its processes build them."""
    return Stage(CFG, stage, 2, seed=0).state_dict()


def poisoned(weights: dict, node: str) -> dict:
    return Adversary("export").exported(weights, node, 0)


class Nodes:
    """Stage processes as ``Weights`` and ``Verifier`` see them through a roster: each holds a stage's
    weights (``weights``: stage -> state dict, shared by its replicas) and answers at once; a liar's
    exports are poisoned (``Adversary("export")``). ``excluded``: those fenced off, as ``Roster.exclude``
    does (out of ``inboxes``)."""

    run_key = RUN_KEY

    def __init__(self, holding: dict[str, int], liars: tuple[str, ...] = ()) -> None:
        self.holding: dict[str, int | None] = dict(holding)
        self.inboxes = dict.fromkeys(holding)
        self.weights = {s: initial(s) for s in set(holding.values())}
        self.own: dict[str, dict] = {}  # what a node loaded, when it did
        self.liars = set(liars)
        self.excluded: dict[str, str] = {}
        self.asked: list[str] = []
        self._out: list[m.Message] = []

    def held(self, name: str) -> dict:
        return self.own.get(name) or self.weights[self.holding[name]]

    def put(self, name: str, msg: m.Message) -> None:
        assert name in self.inboxes, f"{name} was asked after it was excluded"
        if isinstance(msg, m.Load):
            self.own[name] = dict(msg.params)
            self.holding[name] = msg.stage
            self._out.append(m.Loaded(name, msg.stage))
            return
        self.asked.append(name)
        w = poisoned(self.held(name), name) if name in self.liars else self.held(name)
        if isinstance(msg, m.Export):
            self._out.append(m.Exported(name, self.holding[name], w, {"state": {}, "param_groups": []}))
        elif isinstance(msg, m.StateRequest):
            self._out.append(m.State(name, self.holding[name], w))

    def recv(self, kind, timeout=None, rnd=None, names=None, check=True) -> m.Message:
        for i, msg in enumerate(self._out):
            if isinstance(msg, kind) and (names is None or msg.sender in names):
                return self._out.pop(i)
        raise AssertionError(f"nothing of {kind} from {names} to receive")

    def exclude(self, caught: dict[str, str]) -> None:
        self.excluded.update(caught)
        for name in caught:
            self.inboxes.pop(name, None)


def verifier(nodes: object, mode: str = "spot") -> tuple[Verifier, list]:
    events: list = []
    config = types.SimpleNamespace(mode=mode, verify_rate=0.05, tolerance=1e-3, stages=2, seed=0, bf16=False,
                                   aggregation="mean", verifiers=2, confirm_rate=0.0, timeout=5.0)
    return Verifier(config, CFG, nodes, lambda kind, **f: events.append((kind, f))), events


def weights_of(nodes: Nodes, mode: str = "spot") -> tuple[Weights, Verifier, list]:
    """A run's ``Weights`` over ``nodes``, its exports checked by a verifier of ``mode`` that saw them start."""
    v, events = verifier(nodes, mode)
    v.started(dict(nodes.holding))
    prep = types.SimpleNamespace(config=types.SimpleNamespace(stages=2), model=CFG)
    return Weights(prep, nodes, lambda kind, **f: events.append((kind, f)), v), v, events


def caught(events: list) -> dict[str, dict]:
    return {f["node"]: f for kind, f in events if kind == "caught"}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the check itself ------------------------------------------------------------------------------------
def test_an_export_is_held_to_the_digest_its_node_holds_and_to_its_stages_majority():
    """In a fresh run each node holds its stage's initial weights (built by the coordinator from the seed):
    an honest export passes; poisoned weights, weights of another stage than it holds, or what is no state
    dict have it caught (check "export"); once it reported a digest after a step, the weights before it are
    no longer what it holds; a node whose own digest is not known (it loaded other weights, unreported) is
    held to its stage's strict majority; a single replica whose digest is not known cannot be checked; with
    verification off nothing is."""
    nodes = Nodes({"a": 0, "b": 0, "c": 0, "d": 1})
    v, events = verifier(nodes)
    v.started(dict(nodes.holding))
    w0, w1 = initial(0), initial(1)
    assert v.exported("a", 0, 0, w0) == {} and v.exported("d", 1, 1, w1) == {} and events == []
    assert list(v.exported("a", 0, 0, poisoned(w0, "a"))) == ["a"]
    assert "exported weights of stage 0 that differ from its stepped digest" in caught(events)["a"]["why"]
    assert caught(events)["a"]["check"] == "export" and "a" not in v.held
    assert "holds stage 0" in v.exported("b", 0, 1, w1)["b"], "another stage than it holds"
    assert "not a state dict" in v.exported("c", 0, 0, [1, 2])["c"]
    assert sorted(caught(events)) == ["a", "b", "c"] and v.totals["caught"] == 3
    assert v.exported("d", None, 1, w1) == {}, "where the stage it holds is not known, its digest still is"
    assert "stepped digest" in v.exported("d", None, 1, poisoned(w1, "d"))["d"]

    nodes = Nodes({"a": 0, "b": 0, "c": 0, "d": 1})
    v, events = verifier(nodes)
    v.started(dict(nodes.holding))
    v.loaded(["c", "d"])  # what they hold is not known any more
    found = v.exported("c", 0, 0, poisoned(w0, "c"))
    assert "differ from those 2 of its stage's 3 replicas hold" in found["c"]
    assert v.exported("c", 0, 0, w0) == {}, "the majority's weights pass"
    assert v.exported("d", 1, 1, poisoned(w1, "d")) == {}, "a single replica with no known digest: unchecked"
    v.holds("d", 1, w1)  # loaded by the coordinator: it holds those
    assert list(v.exported("d", 1, 1, poisoned(w1, "d"))) == ["d"]
    stepped = {k: t + 1 for k, t in w0.items()}
    assert v.stepped(0, {"a": 0, "b": 0}, {n: receipts.weights_digest(stepped) for n in "ab"}) == {}
    assert v.exported("a", 0, 0, stepped) == {}
    assert "stepped digest" in v.exported("b", 0, 0, w0)["b"], "the weights from before its step"

    off, events = verifier(Nodes({"a": 0}), mode="off")
    off.started({"a": 0})
    assert off.exported("a", 0, 1, poisoned(w0, "a")) == {} and events == [] and off.held == {}


# -- each export of Weights ------------------------------------------------------------------------------
def test_a_snapshot_takes_another_replicas_weights_when_one_exports_others_and_fails_when_none_checks_out():
    nodes = Nodes({"a": 0, "b": 0, "c": 1}, liars=("a",))
    w, v, events = weights_of(nodes)
    snap = w.take_snapshot(3)
    assert nodes.asked == ["a", "c", "b"], "a first (the first of its stage), then b in its place"
    assert same(snap["stages"][0]["params"], initial(0)) and same(snap["stages"][1]["params"], initial(1))
    assert list(caught(events)) == ["a"] and list(nodes.excluded) == ["a"]

    nodes = Nodes({"a": 0, "b": 0, "c": 1}, liars=("a", "b"))
    w, v, events = weights_of(nodes)
    w.snapshot = before = {"iteration": 1, "stages": {}}
    with pytest.raises(ExportRejected, match=r"no replica of stage\(s\) 0 exported weights that check out.*"
                                             r"stage 0: a, b"):
        w.take_snapshot(3)
    assert w.snapshot is before, "the snapshot is unchanged"
    assert sorted(caught(events)) == ["a", "b"] and "c" not in nodes.excluded


def test_an_evaluation_takes_the_honest_replicas_weights_and_fails_when_none_checks_out():
    nodes = Nodes({"a": 0, "b": 0, "c": 1, "d": 1}, liars=("c",))
    w, v, events = weights_of(nodes)
    model = w.full_model({"a": 0, "b": 0, "c": 1, "d": 1})
    want = Llama(CFG)
    want.load_state_dict(merge_state_dicts([initial(0), initial(1)]))
    assert same(model.state_dict(), want.state_dict())
    assert list(caught(events)) == ["c"]
    every = w.stage_states({"a": 0, "b": 0, "d": 1}, all_replicas=True)
    assert sorted(every) == ["a", "b", "d"] and list(caught(events)) == ["c"]

    nodes = Nodes({"a": 0, "c": 1}, liars=("c",))
    w, v, events = weights_of(nodes)
    with pytest.raises(ExportRejected, match="stage 1: c"):
        w.full_model({"a": 0, "c": 1})
    nodes = Nodes({"a": 0, "c": 1}, liars=("c",))
    w, v, events = weights_of(nodes)
    with pytest.raises(ExportRejected, match="stage 1: c"):
        w.stage_states({"a": 0, "c": 1}, all_replicas=True)
    grads = Nodes({"a": 0, "c": 1}, liars=("c",))
    w, v, events = weights_of(grads)
    w.stage_states({"a": 0, "c": 1}, grads=True)
    assert events == [], "gradients are not weights: not checked"


def test_a_stage_moved_takes_a_keeper_whose_weights_check_out_and_is_an_orphan_when_none_does():
    """e joins stage 0 and f stage 1: a (the keeper asked first) exports poisoned weights and is caught, b's
    are taken; every keeper of stage 1 lies, so stage 1 is left to the recovery policy as an orphan. What e
    loaded is what it holds from then on: its own later export is held to it. A neighbour's weights for the
    recovery come from a holder whose export checks out, else the neighbour is left out."""
    nodes = Nodes({"a": 0, "b": 0, "c": 1, "e": 1, "f": 0}, liars=("a", "c"))
    w, v, events = weights_of(nodes)
    takeover = w.gather({"e": 0, "f": 1}, {"a": 0, "b": 0, "c": 1, "e": 0, "f": 1})
    assert takeover.found[0].source == "b" and same(takeover.found[0].params, initial(0))
    # keepers of stage 1: c (stays) first, then e (moving away): c is caught, e's weights check out
    assert takeover.found[1].source == "e" and not takeover.orphans
    assert sorted(caught(events)) == ["a", "c"]
    v.loaded(["e", "f"])
    w.move(takeover, {}, lambda name, stage: 1)
    assert nodes.holding["e"] == 0 and v.held["e"] == (0, receipts.weights_digest(initial(0)))
    nodes.liars.add("e")
    assert list(w.held_states([0])) == [0] and "e" not in caught(events), "b is the first holder of stage 0"

    nodes = Nodes({"a": 0, "c": 1, "d": 1, "e": 0}, liars=("c", "d"))
    w, v, events = weights_of(nodes)
    takeover = w.gather({"e": 1}, {"a": 0, "c": 1, "d": 1, "e": 1})
    assert takeover.orphans == {1: ["e"]} and not takeover.found and sorted(caught(events)) == ["c", "d"]

    nodes = Nodes({"a": 0, "c": 1, "d": 1}, liars=("c",))
    w, v, events = weights_of(nodes)
    assert same(w.held_states([1])[1], initial(1)) and list(caught(events)) == ["c"]
    nodes.liars.add("d")
    assert w.held_states([1]) == {} and sorted(caught(events)) == ["c", "d"]


# -- training with an exporter that lies ----------------------------------------------------------------
BASE = dict(model="tiny", nodes=6, stages=3, skip=0.0, microbatches=4, samples=2, seq_len=16, lr=3e-3, warmup=1,
            eval_every=100, eval_batches=2, planner_budget=0.5, planner_evals=20, replan_budget=0.5,
            replan_evals=10, speed=1e-3, clip=1.0, timeout=120, in_flight=2, seed=1, mode="spot",
            verify_rate=0.0, snapshot_every=0, checkpoint_every=0, start_wait=120)


def run_with_exporter(start: int = 1, **extra) -> tuple[Trainer, str, int]:
    """A run of 6 nodes (3 stages of 2), verification on at spot rate 0 (no computation drawn: only the
    weights checks); the first node of the first stage with 2 replicas (the one asked first for its stage's
    weights) exports poisoned weights from iteration ``start`` on. Returns the trainer (not started), the
    liar and its stage."""
    prep = prepare(TrainConfig(**{**BASE, **extra}))
    by_stage: dict[int, list[str]] = {}
    for name, stage in sorted(prep.plan.allocation.items()):
        by_stage.setdefault(stage, []).append(name)
    stage = next(s for s, names in sorted(by_stage.items()) if len(names) >= 2)
    liar = by_stage[stage][0]
    prep.config.adversaries = f"{liar}:export:{start}"
    return Trainer(prep), liar, stage


def honest_weights(t: Trainer, stage: int, liar: str) -> tuple[str, dict]:
    """A live replica of ``stage`` other than the liar, and its weights as it holds them."""
    name = next(n for n, s in sorted(t.alloc.items()) if s == stage and n != liar and n in t.roster.inboxes)
    return name, t.weights.ask(m.StateRequest(), m.State, [name])[name].tensors


def only_caught(t: Trainer, liar: str) -> dict:
    found = [e for e in t.metrics["events"] if e["event"] == "caught"]
    assert [(e["node"], e["check"]) for e in found] == [(liar, "export")], found
    assert "differ from its stepped digest" in found[0]["why"]
    assert set(t.roster.excluded) == {liar}
    assert not [e for e in t.metrics["events"] if e["event"] == "dispute"]
    return found[0]


def test_a_snapshot_has_the_honest_replicas_weights_and_the_exporter_is_caught():
    t, liar, stage = run_with_exporter(iterations=2, snapshot_every=1)
    with t:
        t.train()
        name, honest = honest_weights(t, stage, liar)
        snap = t.weights.snapshot
        assert snap["iteration"] == 2 and same(snap["stages"][stage]["params"], honest)
    assert only_caught(t, liar)["iteration"] == 1


def test_a_checkpoint_holds_the_honest_replicas_weights_and_the_exporter_is_caught(tmp_path):
    path = tmp_path / "run.pt"
    t, liar, stage = run_with_exporter(iterations=2, checkpoint=str(path))
    with t:
        t.train()
        name, honest = honest_weights(t, stage, liar)
        exported = t.weights.ask(m.Export(), m.Exported, [name])[name]
    ck = checkpoint_file.load_checkpoint(path)
    assert ck["iteration"] == 2 and same(ck["stages"][stage]["params"], honest)
    assert all(torch.equal(ck["model"][k], v) for k, v in honest.items()), "the whole model too"
    for k, v in exported.optimizer["state"].items():  # and the optimizer state came from the same replica
        assert all(torch.equal(ck["stages"][stage]["optimizer"]["state"][k][f], x) for f, x in v.items()
                   if isinstance(x, torch.Tensor))
    assert only_caught(t, liar)["iteration"] == 1


def test_an_evaluation_uses_the_honest_replicas_weights_and_the_exporter_is_caught():
    t, liar, stage = run_with_exporter(iterations=2)
    with t:
        metrics = t.train()
        states = t.stage_states()  # the liar is out: one honest replica of each stage
        assert liar not in states
        model = Llama(t.prepared.model)
        model.load_state_dict(merge_state_dicts([sd for _, sd in states.values()]))
        want = evaluate_model(model, t._val, t.config.stages)
        lying = {n: (s, poisoned(sd, liar) if s == stage else sd) for n, (s, sd) in states.items()}
        model.load_state_dict(merge_state_dicts([sd for _, sd in lying.values()]))
        poison = evaluate_model(model, t._val, t.config.stages)
    final = metrics["evaluations"][-1]
    assert final["iteration"] == 2 and final["val_loss"] == want["val_loss"]
    assert math.isfinite(poison["val_loss"]) and poison["val_loss"] != want["val_loss"], "the poison shows"
    assert only_caught(t, liar)["iteration"] == 1, "at the evaluation after iteration 1: the one export since"


def test_a_joining_node_loads_the_honest_replicas_weights_and_the_exporter_is_caught():
    """Every stage's first node exports poisoned weights from iteration 1 on; after two iterations a node
    joins: the keeper asked first for its stage's weights is caught, the joiner loads an honest replica's,
    and nobody but liars is caught."""
    prep = prepare(TrainConfig(**BASE, iterations=3))
    by_stage: dict[int, list[str]] = {}
    for name, s in sorted(prep.plan.allocation.items()):
        by_stage.setdefault(s, []).append(name)
    assert all(len(names) >= 2 for names in by_stage.values()), by_stage
    liars = {names[0] for names in by_stage.values()}
    prep.config.adversaries = ", ".join(f"{n}:export:1" for n in sorted(liars))
    with Trainer(prep) as t:
        t.iteration(0)
        t.iteration(1)
        new = t.join([None])[0]
        stage = t.alloc[new]
        keepers = [n for n, s in sorted(t.alloc.items()) if s == stage and n != new and n in t.roster.inboxes]
        got = t.weights.ask(m.StateRequest(), m.State, [new, *keepers])
        honest = [n for n in keepers if n not in liars]
        assert honest and all(same(got[new].tensors, got[n].tensors) for n in honest)
        found = {e["node"]: e for e in t.metrics["events"] if e["event"] == "caught"}
        assert found and set(found) <= liars and all(e["check"] == "export" for e in found.values())
        assert any(e["stage"] == stage for e in found.values()), "the keeper of the joiner's stage was asked"
        assert set(t.roster.excluded) == set(found)
        rec = t.iteration(2)  # re-planned without the liars caught; training goes on
        assert math.isfinite(rec["train_loss"]) and not set(found) & set(t.alloc)
