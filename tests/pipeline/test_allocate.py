"""The allocation helpers on their own: sizes and memory checks, the stage matching, slot assignment
under memory limits, replica counts, the cost matrix and tour, label spreading and the swap search."""

from __future__ import annotations

import random

import pytest

from roving.pipeline import ModelSpec, PlanError, build_network
from roving.pipeline.planning.allocate import (
    assign,
    check_memory,
    check_sizes,
    holdable,
    memory_fallback,
    node_cost_matrix,
    replica_counts,
    spread_labels,
    stage_matching,
    swap_search,
    tour_order,
    visits_per_microbatch,
)
from roving.pipeline.planning.costs import stage_layers, stage_memory, transfer_time

MODEL = ModelSpec(n_layers=8, dim=256, seq_len=64, samples_per_microbatch=2, vocab_size=8000, name="m8")
TWO_REGIONS = {"regions": ["a", "b"], "links": [{"a": "a", "b": "b", "latency_ms": 80, "bandwidth": 0.05}],
               "bandwidth_unit": "GiB/s"}


def _need_mb(stage: int, stages: int) -> float:
    return stage_memory(MODEL, stages)[stage].needs_mb(1)


def _nodes(*specs: tuple[str, str, float | None]):
    """A network over TWO_REGIONS from (name, region, memory_mb or None) triples."""
    docs = [{"name": n, "region": r, **({"memory_mb": m} if m is not None else {})} for n, r, m in specs]
    return build_network(TWO_REGIONS, docs)


def test_check_sizes_wants_a_node_per_stage():
    net = build_network("gcp12", 4)
    check_sizes(net, 4)
    check_sizes(net, 2)
    with pytest.raises(PlanError, match="4 nodes cannot hold 5 stages; use at least 5 nodes or fewer stages"):
        check_sizes(net, 5)


def test_visits_per_microbatch_rejects_fractions_and_stage_counts_that_leave_nothing_to_visit():
    assert visits_per_microbatch(5, 0.5) == 2
    assert visits_per_microbatch(2, 0.0) == 1
    with pytest.raises(PlanError, match=r"skip fraction must be in \[0, 1\), got 1.0"):
        visits_per_microbatch(4, 1.0)
    with pytest.raises(PlanError, match=r"skip fraction must be in \[0, 1\), got -0.1"):
        visits_per_microbatch(4, -0.1)
    with pytest.raises(PlanError, match="need at least 2 stages, got 1"):
        visits_per_microbatch(1, 0.0)


def test_holdable_gives_each_node_the_stages_its_memory_fits():
    stages = 3
    # stage 0 (embedding and head besides its layers) needs the most; between its need and the
    # largest other stage's need, a node holds every stage but 0
    small = (max(_need_mb(s, stages) for s in range(1, stages)) + _need_mb(0, stages)) / 2
    assert small < _need_mb(0, stages)
    net = _nodes(("big", "a", 2 * _need_mb(0, stages)), ("small", "a", small), ("count", "b", None))
    can = holdable(net, MODEL, stages)
    assert can == {"big": frozenset({0, 1, 2}), "small": frozenset({1, 2}), "count": frozenset({0, 1, 2})}


def test_check_memory_returns_what_holdable_says_when_every_stage_can_be_placed():
    stages = 3
    small = (max(_need_mb(s, stages) for s in range(1, stages)) + _need_mb(0, stages)) / 2
    net = _nodes(("big", "a", 2 * _need_mb(0, stages)), ("s1", "a", small), ("s2", "b", small))
    assert check_memory(net, MODEL, stages) == holdable(net, MODEL, stages)


def test_check_memory_names_a_node_that_can_hold_no_stage():
    stages = 3
    tiny = 0.5 * min(_need_mb(s, stages) for s in range(stages))
    net = _nodes(("big", "a", 2 * _need_mb(0, stages)), ("b2", "a", 2 * _need_mb(0, stages)),
                 ("b3", "b", 2 * _need_mb(0, stages)), ("tiny", "b", tiny))
    with pytest.raises(PlanError, match=rf"node tiny with {tiny:g} MB cannot hold any stage of m8 in 3 stages"):
        check_memory(net, MODEL, stages)


def test_check_memory_says_which_stage_no_node_can_hold():
    stages = 3
    small = (max(_need_mb(s, stages) for s in range(1, stages)) + _need_mb(0, stages)) / 2
    net = _nodes(("s1", "a", small), ("s2", "a", small), ("s3", "b", small))
    with pytest.raises(PlanError, match=rf"memory {small:g} MB per node cannot hold stage 0 of m8 in 3 stages"):
        check_memory(net, MODEL, stages)


def test_stage_matching_gives_every_stage_a_distinct_node_when_one_exists():
    can = {"a": frozenset({0, 1}), "b": frozenset({0}), "c": frozenset({1, 2})}
    owner, short, only = stage_matching(can, 3)
    assert (short, only) == ([], [])
    assert sorted(owner) == [0, 1, 2] and len(set(owner.values())) == 3
    assert all(s in can[n] for s, n in owner.items())
    assert owner == {0: "b", 1: "a", 2: "c"}  # the only matching


def test_stage_matching_names_the_stages_left_short_and_the_few_nodes_that_could_hold_them():
    can = {"a": frozenset({0, 2}), "b": frozenset({1}), "c": frozenset({1})}
    owner, short, only = stage_matching(can, 3)
    assert short == [0, 2] and only == ["a"]  # two stages, one node
    assert len(only) < len(short)
    assert all(s in can[n] for s, n in owner.items())


def test_assign_keeps_the_order_exactly_without_memory_limits():
    order = ["n3", "n1", "n2", "n0"]
    labels = [0, 1, 2, 1]
    can = {n: frozenset({0, 1, 2}) for n in order}
    assert assign(order, labels, can) == order


def test_assign_moves_only_what_memory_forces_and_every_node_can_hold_its_slot():
    order = ["x", "y", "z", "w"]
    labels = [0, 1, 1, 2]
    can = {"x": frozenset({1, 2}), "y": frozenset({0, 1, 2}), "z": frozenset({1, 2}), "w": frozenset({1, 2})}
    got = assign(order, labels, can)
    assert got is not None and sorted(got) == sorted(order)
    assert all(labels[i] in can[n] for i, n in enumerate(got))
    assert got[0] == "y"  # the only node that holds stage 0
    assert got[2] == "z" and got[3] == "w"  # slots whose own node fits keep it


def test_assign_returns_none_when_no_assignment_respects_memory():
    can = {"x": frozenset({1}), "y": frozenset({1}), "z": frozenset({0, 1})}
    assert assign(["x", "y", "z"], [0, 0, 1], can) is None


def test_memory_fallback_places_every_stage_and_respects_memory():
    order = ["a", "b", "c", "d", "e"]
    can = {"a": frozenset({1, 2}), "b": frozenset({1, 2}), "c": frozenset({0, 1, 2}), "d": frozenset({1, 2}),
           "e": frozenset({2})}
    counts = [3, 1, 1]  # three stage-0 nodes wanted, but only c can hold stage 0
    labels, slots = memory_fallback(order, counts, can, 3)
    assert slots == order and len(labels) == len(order)
    assert set(labels) == {0, 1, 2}
    assert all(lab in can[n] for n, lab in zip(slots, labels))
    assert labels[slots.index("c")] == 0


def test_replica_counts_follow_each_stages_share_of_the_compute():
    stages, skip = 4, 0.34
    for n in (4, 7, 12, 30):
        counts = replica_counts(n, stages, skip, MODEL)
        assert sum(counts) == n and min(counts) >= 1
    counts = replica_counts(30, stages, skip, MODEL)
    visits = visits_per_microbatch(stages, skip)
    layers = stage_layers(MODEL, stages)
    work = [layers[0] + MODEL.head_layers] + [n * visits / (stages - 1) for n in layers[1:]]
    share = [w / sum(work) * 30 for w in work]
    assert all(abs(c - x) <= 1.0 for c, x in zip(counts, share)), (counts, share)
    assert counts[0] == max(counts)  # every microbatch passes stage 0, which also runs the head


def test_replica_counts_rejects_fewer_nodes_than_stages_and_a_bad_skip():
    with pytest.raises(PlanError, match="3 nodes cannot hold 4 stages"):
        replica_counts(3, 4, 0.0, MODEL)
    with pytest.raises(PlanError, match="skip fraction must be in"):
        replica_counts(8, 4, 1.5, MODEL)


def test_node_cost_matrix_is_the_transfer_time_of_one_activation_per_ordered_pair():
    net = _nodes(("a1", "a", None), ("a2", "a", None), ("b1", "b", None))
    cost = node_cost_matrix(net, MODEL)
    assert set(cost) == {(x, y) for x in net.names for y in net.names if x != y}
    for (x, y), v in cost.items():
        link = net.link(x, y)
        assert v == transfer_time(link.latency_s, link.bandwidth_bps, MODEL.transfer_bytes)
    assert cost["a1", "a2"] < cost["a1", "b1"]  # inside a region is faster than across
    assert cost["a1", "b1"] == cost["b1", "a1"]  # the link is symmetric


def test_tour_order_visits_every_node_once_and_crosses_between_regions_once():
    net = _nodes(*[(f"a{i}", "a", None) for i in range(3)], *[(f"b{i}", "b", None) for i in range(3)])
    cost = node_cost_matrix(net, MODEL)
    order = tour_order(net, cost)
    assert sorted(order) == sorted(net.names)
    regions = [net.node(n).region for n in order]
    assert sum(1 for x, y in zip(regions, regions[1:]) if x != y) == 1
    assert tour_order(_nodes(("only", "a", None)), {}) == ["only"]


def test_spread_labels_hold_each_stage_its_count_spread_evenly():
    assert spread_labels([2, 2]) == [0, 1, 0, 1]
    for counts in ([1, 3], [4, 1, 2], [3, 3, 3], [5, 1]):
        labels = spread_labels(counts)
        n = len(labels)
        assert [labels.count(s) for s in range(len(counts))] == counts
        for i in range(1, n + 1):  # every prefix is within one of each stage's even share
            for s, c in enumerate(counts):
                assert abs(labels[:i].count(s) - c * i / n) < 1.0 + 1e-9


def _misplaced(target: list[str]):
    def judge(slots: list[str]) -> float:
        judge.calls += 1
        return float(sum(1 for a, b in zip(slots, target) if a != b))

    judge.calls = 0
    return judge


def test_swap_search_reaches_the_best_slots_and_returns_their_score():
    roles = [0, 1, 2, 3]
    target = ["d", "c", "b", "a"]
    judge = _misplaced(target)
    best, score = swap_search(["a", "b", "c", "d"], roles, judge, float("inf"), random.Random(1), max_evals=400)
    assert best == target and score == 0.0


def test_swap_search_stops_after_max_evals_and_is_deterministic_for_a_seed():
    roles = [0, 0, 1, 1, 2, 2]
    slots = list("abcdef")
    runs = []
    for _ in range(2):
        judge = _misplaced(list("fedcba"))
        runs.append(swap_search(slots, roles, judge, float("inf"), random.Random(7), max_evals=5))
        assert judge.calls == 1 + 5  # the start, then one per evaluated swap
    assert runs[0] == runs[1]
    assert slots == list("abcdef")  # the caller's list is not changed


def test_swap_search_never_puts_a_node_on_a_role_it_cannot_take():
    roles = [0, 1, 2]
    seen: list[list[str]] = []

    def judge(slots: list[str]) -> float:
        seen.append(list(slots))
        return -float(slots.index("x"))  # x wants the last slot

    def ok(node: str, role: int) -> bool:
        return not (node == "y" and role == 0)  # y cannot hold stage 0

    best, _ = swap_search(["x", "y", "z"], roles, judge, float("inf"), random.Random(3), max_evals=60, ok=ok)
    assert all(s[0] != "y" for s in seen)
    assert best[2] == "x" and best[0] != "y"


def test_swap_search_with_one_role_only_judges_the_start():
    judge = _misplaced(["b", "a"])
    best, score = swap_search(["a", "b"], [1, 1], judge, float("inf"), random.Random(0), max_evals=50)
    assert best == ["a", "b"] and score == 2.0 and judge.calls == 1

