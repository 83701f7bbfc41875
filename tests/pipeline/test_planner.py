"""The planner's public helpers beside ``plan``/``replan``: the input checks and the stage a joining
node takes while training plans around missing stages."""

from __future__ import annotations

import pytest

from roving.pipeline import ModelSpec, PlanError, build_network
from roving.pipeline.costs import stage_memory
from roving.pipeline.network import Node
from roving.pipeline.plan import Plan, Route
from roving.pipeline.planner import check_inputs, place_joining

MODEL = ModelSpec(layers=8, hidden=256, seq_len=64, samples_per_microbatch=2, vocab=8000, name="m8")


def _plan(stages: int, stage_sets: list[tuple[int, ...]]) -> Plan:
    """A plan whose routes visit the given stage sets (nodes do not matter to the joining rule)."""
    return Plan(stages, 0.0, {}, [Route("o", tuple(f"n{s}" for s in ss), ss) for ss in stage_sets])


def test_stage_visits_counts_every_microbatch_at_stage_0_and_each_visit_elsewhere():
    assert _plan(4, [(1, 2), (2, 3), (1, 3), (3,)]).stage_visits() == [4, 2, 2, 3]
    assert _plan(3, []).stage_visits() == [0, 0, 0]


def test_check_inputs_returns_the_visits_and_names_what_is_wrong():
    net = build_network("gcp12", 6)
    assert check_inputs(net, MODEL, 4, 0.34, 8) == 2
    with pytest.raises(PlanError, match="6 nodes cannot hold 7 stages"):
        check_inputs(net, MODEL, 7, 0.0, 8)
    with pytest.raises(PlanError, match="need at least one microbatch, got 0"):
        check_inputs(net, MODEL, 4, 0.34, 0)
    with pytest.raises(PlanError, match="leaves no stage besides stage 0"):
        check_inputs(net, MODEL, 3, 0.9, 8)
    tiny = build_network("gcp12", 6, memory_mb=1.0)
    with pytest.raises(PlanError, match="cannot hold stage 0 of m8 in 4 stages"):
        check_inputs(tiny, MODEL, 4, 0.34, 8)


def test_a_joining_node_takes_the_lowest_stage_no_node_holds():
    current = _plan(4, [(1, 2, 3)] * 4)
    alloc = {"a": 0, "b": 2}
    got = place_joining(current, alloc, [Node("j", "r")], MODEL)
    assert got == {"a": 0, "b": 2, "j": 1}
    assert alloc == {"a": 0, "b": 2}  # the caller's allocation is not changed


def test_a_joining_node_skips_a_missing_stage_its_memory_cannot_hold():
    stages = 3
    needs = [stage_memory(MODEL, stages)[s].needs_mb(1) for s in range(stages)]
    assert needs[0] > max(needs[1:])  # stage 0 holds the embedding and the head
    small = Node("j", "r", memory_mb=(needs[0] + max(needs[1:])) / 2)
    current = _plan(stages, [(1, 2)] * 2)
    assert place_joining(current, {"b": 2}, [small], MODEL)["j"] == 1  # 0 is missing but too big
    # when every missing stage is too big, it goes where the work per replica is highest
    got = place_joining(current, {"b": 1, "c": 2, "d": 2}, [small], MODEL)
    assert got["j"] == 1  # stage 1: 2 visits on 1 replica; stage 2: 2 visits on 2


def test_with_every_stage_held_a_joining_node_goes_where_the_visits_per_replica_are_highest():
    current = _plan(4, [(1, 2), (2, 3), (2, 3), (1, 2)])  # visits [4, 2, 4, 2]
    alloc = {"z0": 0, "z1": 0, "s1": 1, "s2": 2, "s3": 3}  # per replica: 2, 2, 4, 2
    assert place_joining(current, alloc, [Node("j", "r")], MODEL)["j"] == 2
    tie = {"z0": 0, "z1": 0, "s1": 1, "s2": 2, "t2": 2, "s3": 3}  # per replica: 2, 2, 2, 2
    assert place_joining(current, tie, [Node("j", "r")], MODEL)["j"] == 0  # the lowest on a tie


def test_joining_nodes_are_placed_in_order_each_counting_for_the_next():
    current = _plan(4, [(1, 2), (2, 3), (2, 3), (1, 2)])  # visits [4, 2, 4, 2]
    alloc = {"z0": 0, "s1": 1, "s2": 2}  # stage 3 missing
    got = place_joining(current, alloc, [Node("j1", "r"), Node("j2", "r"), Node("j3", "r")], MODEL)
    assert got["j1"] == 3  # the missing stage first
    assert got["j2"] == 0  # then per replica 4, 2, 4, 2: the lowest of the busiest
    assert got["j3"] == 2  # stage 0 now has two replicas (2 each), stage 2 still 4


def test_a_joining_node_that_can_hold_nothing_with_nothing_held_is_a_plan_error():
    tiny = Node("j", "r", memory_mb=0.5)
    with pytest.raises(PlanError, match="joining node j cannot hold any stage and no node holds one"):
        place_joining(_plan(3, [(1, 2)]), {}, [tiny], MODEL)
