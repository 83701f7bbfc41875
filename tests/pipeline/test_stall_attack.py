"""A node that stalls rounds on purpose: it keeps the activations it should pass on to its peers, and
says it sent them (so the dispute is its word against a peer's). Rounds stall; the nodes' accounts break
its links one after another (``runtime/stalls.py``); it is kept out of the plan; no node is blamed; the
training finishes. Real stage processes on the local backend."""
from __future__ import annotations

import math

import torch

torch.set_num_threads(1)

import hostile_node

from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare
from roving.pipeline.runtime import roster as roster_module


def test_a_node_that_keeps_what_it_should_pass_on_and_lies_about_it_is_benched_and_the_training_finishes(
        monkeypatch):
    monkeypatch.setattr(roster_module, "stage_main", hostile_node.withholding_main)
    cfg = TrainConfig(model="tiny", network="gcp12", nodes=5, stages=2, skip=0.0, microbatches=4, samples=2,
                      seq_len=16, iterations=5, eval_every=100, eval_batches=2, planner_budget=0.3, timeout=120,
                      start_wait=30, seed=2, stall_after=5.0)
    prep = prepare(cfg)
    bad = hostile_node.WITHHOLDER
    assert bad in prep.plan.allocation
    with Trainer(prep) as t:
        metrics = t.train()
        accounts = [e for e in metrics["events"] if e["event"] == "stall-accounts"]
        assert accounts, [e["event"] for e in metrics["events"]]
        assert all(bad in pair for e in accounts for pair in e["disputes"]), accounts  # every broken link is its
        assert not any(e["held"] for e in accounts), accounts  # it lied: nobody is convicted on its word
        assert t.stalls.benched == {bad}, (t.stalls.benched, accounts)  # its partners came back
        assert bad not in t.alloc
        others = set(prep.plan.allocation) - {bad}
        assert others <= set(t.alloc), (others, t.alloc)
    assert not [e for e in metrics["events"] if e["event"] == "caught"], "no node is blamed on another's word"
    assert len(metrics["iterations"]) == 5 and all(math.isfinite(r["train_loss"]) for r in metrics["iterations"])
