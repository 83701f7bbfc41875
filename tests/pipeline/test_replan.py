"""Re-planning after failures, slow-downs and joins: never through a failed node, rules kept, fast."""

import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from roving.pipeline import ModelSpec, PlanError, build_network, model_preset, plan, replan
from roving.pipeline.planning.network import Node
from helpers_pipeline import assert_memory_respected, assert_paths_valid, small_network

MODEL = ModelSpec(n_layers=12, dim=256, seq_len=256, samples_per_microbatch=2)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stages=st.integers(2, 4), extra=st.integers(1, 6), regions=st.integers(1, 4),
       microbatches=st.integers(1, 12), data=st.data())
def test_replan_after_failures_never_routes_through_a_failed_node(stages, extra, regions, microbatches, data):
    n_links = max(1, regions * (regions - 1) // 2)
    lat = data.draw(st.lists(st.floats(1, 150), min_size=n_links, max_size=n_links))
    bw = data.draw(st.lists(st.floats(0.01, 1.0), min_size=n_links, max_size=n_links))
    net = small_network(regions, lat, bw, stages + extra, memory=3)
    skip = 0.34 if stages > 2 else 0.0
    p = plan(net, MODEL, stages, skip, microbatches, budget_s=0.05, seed=1)
    # fail nodes, but never so many that some stage is left without any node and no spare exists
    failed = data.draw(st.lists(st.sampled_from(sorted(p.allocation)), max_size=extra, unique=True))
    new, new_net = replan(p, net, MODEL, failed=failed, budget_s=0.05)
    used = {q.origin for q in new.paths} | {n for q in new.paths for n in q.nodes}
    assert not used & set(failed)
    assert not set(new.allocation) & set(failed)
    assert set(failed).isdisjoint(n.name for n in new_net.nodes)
    assert_paths_valid(new, new_net, stages, skip, microbatches)
    assert_memory_respected(new, new_net, MODEL)


def test_replan_of_20_gcp12_nodes_after_two_failures_takes_under_a_second():
    net = build_network("gcp12", 20)
    m = model_preset("llama-1.5b")
    p = plan(net, m, 6, 0.33, 40, budget_s=1.0)
    victims = [p.paths[0].origin, p.paths[0].nodes[0]]
    t = time.perf_counter()
    new, new_net = replan(p, net, m, failed=victims)
    assert time.perf_counter() - t < 1.0
    assert all(v not in (q.origin, *q.nodes) for q in new.paths for v in victims)
    assert_paths_valid(new, new_net, 6, 0.33, 40)


def test_losing_every_node_of_a_stage_without_spares_is_a_clear_error():
    net = small_network(1, [1], [1.0], 3)
    p = plan(net, MODEL, 3, 0.0, 4, budget_s=0.05)
    only = next(n for n, s in p.allocation.items() if s == 2)
    with pytest.raises(PlanError, match="stage 2 lost all its nodes"):
        replan(p, net, MODEL, failed=[only])


def test_stage_left_without_nodes_takes_a_spare_replica():
    net = small_network(2, [20], [0.2], 8)
    p = plan(net, MODEL, 3, 0.0, 8, budget_s=0.1)
    stage2 = [n for n, s in p.allocation.items() if s == 2]
    new, new_net = replan(p, net, MODEL, failed=stage2)
    assert 2 in new.allocation.values()
    assert_paths_valid(new, new_net, 3, 0.0, 8)


def test_joined_node_gets_a_stage_and_slowed_node_is_used_less():
    net = small_network(1, [1], [1.0], 9)
    p = plan(net, MODEL, 3, 0.5, 12, budget_s=0.2)
    joined = Node("new", "r0", 0.055, 3)
    new, new_net = replan(p, net, MODEL, joined=[joined], budget_s=0.2)
    assert "new" in new.allocation
    assert_paths_valid(new, new_net, 3, 0.5, 12)
    # a node with a replica of its stage slowed 50x: the re-plan routes fewer microbatches through it than before
    target = next(q.nodes[0] for q in p.paths
                  if sum(s == p.allocation[q.nodes[0]] for s in p.allocation.values()) > 1)
    before = sum(target in q.nodes for q in p.paths)
    slow, slow_net = replan(p, net, MODEL, slowed_by={target: 50.0}, budget_s=0.3)
    assert slow_net.node(target).speed == pytest.approx(50 * 0.055)
    after = sum(target in q.nodes for q in slow.paths)
    assert after < before


def test_a_stage_that_lost_its_only_node_takes_a_node_the_plan_left_idle():
    """full_pipeline on 7 nodes and 6 stages leaves one node idle; when the only node of a stage fails,
    replan gives that stage the idle node instead of reporting that the stage lost all its nodes."""
    from roving.pipeline import full_pipeline
    net = small_network(2, [20], [0.2], 7)
    p = full_pipeline(net, MODEL, 6, 6, budget_s=0.1)
    idle = [n for n in net.names if n not in p.allocation]
    assert len(idle) == 1
    victim = next(n for n, s in p.allocation.items() if s == 3)
    assert sum(1 for s in p.allocation.values() if s == 3) == 1
    new, new_net = replan(p, net, MODEL, failed=[victim], budget_s=0.1)
    assert new.allocation[idle[0]] == 3
    assert victim not in new.allocation
    assert_paths_valid(new, new_net, 6, 0.0, 6)


def test_a_replan_by_evaluation_count_is_the_same_whatever_its_budget():
    from roving.pipeline.planning.planner import plan_held

    net = build_network("gcp12", 12)
    m = model_preset("llama-1.5b")
    p = plan(net, m, 4, 0.34, 16, budget_s=30, max_evals=200, seed=1)
    victim = p.paths[0].nodes[0]
    runs = [replan(p, net, m, failed=[victim], budget_s=b, max_evals=150, seed=2)[0] for b in (5.0, 30.0)]
    assert [q.nodes for q in runs[0].paths] == [q.nodes for q in runs[1].paths]
    assert runs[0].predicted_s == runs[1].predicted_s
    assert [r.stats["path_evaluations"] for r in runs] == [150, 150] and not runs[0].stats["capped"]
    held = {n: s for n, s in p.allocation.items() if s != 3}  # stage 3 lost: paths skip it
    again = [plan_held(net.without([n for n in p.allocation if n not in held]), m, held, 4, 0.34, 16,
                       budget_s=b, seed=2, max_evals=100) for b in (5.0, 30.0)]
    assert [q.nodes for q in again[0].paths] == [q.nodes for q in again[1].paths]
    assert again[0].stats["path_evaluations"] == 100
