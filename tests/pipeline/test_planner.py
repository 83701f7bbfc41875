"""The planner: every route rule holds on generated plans over random networks (property-based), plans
are deterministic by evaluation count, judged with replica synchronisation, report their progress; and
its public helpers beside ``plan``/``replan`` (the input checks, the stage a joining node takes)."""

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from roving.pipeline import (ModelSpec, PlanError, build_network, full_pipeline, plan, random_skip, replan, simulate,
                             validate)
from roving.pipeline.planning.costs import stage_memory
from roving.pipeline.planning.network import Node
from roving.pipeline.planning.plan import Plan, Route
from roving.pipeline.planning.planner import check_inputs, place_joining
from helpers_pipeline import assert_memory_respected, assert_paths_valid, small_network

MODEL = ModelSpec(n_layers=12, dim=256, seq_len=256, samples_per_microbatch=2)


@st.composite
def settings_(draw):
    stages = draw(st.integers(2, 5))
    skip = draw(st.sampled_from([0.0, 0.25, 0.34, 0.5]))
    if math.floor((1 - skip) * (stages - 1) + 0.5) < 1:
        skip = 0.0
    regions = draw(st.integers(1, 4))
    n_links = regions * (regions - 1) // 2 or 1
    lat = draw(st.lists(st.floats(1, 200), min_size=n_links, max_size=n_links))
    bw = draw(st.lists(st.floats(0.005, 2.0), min_size=n_links, max_size=n_links))
    nodes = draw(st.integers(stages, stages + 6))
    memory = draw(st.integers(1, 4))
    microbatches = draw(st.integers(1, 14))
    seed = draw(st.integers(0, 1000))
    return small_network(regions, lat, bw, nodes, memory), stages, skip, microbatches, seed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(settings_())
def test_planned_paths_obey_every_rule_on_random_networks(case):
    network, stages, skip, microbatches, seed = case
    p = plan(network, MODEL, stages, skip, microbatches, budget_s=0.08, seed=seed)
    assert_paths_valid(p, network, stages, skip, microbatches)
    assert validate(p, network) == []
    makespan = assert_memory_respected(p, network, MODEL)
    assert makespan == pytest.approx(p.predicted_s)


@settings(max_examples=20, deadline=None)
@given(settings_())
def test_random_skip_and_full_pipeline_baselines_are_valid_plans(case):
    network, stages, skip, microbatches, seed = case
    alloc = {n.name: i % stages for i, n in enumerate(network.nodes)}
    r = random_skip(network, MODEL, alloc, stages, skip, microbatches, seed=seed)
    assert_paths_valid(r, network, stages, skip, microbatches)
    assert all(p.swaps == 0 for p in r.paths)
    assert_memory_respected(r, network, MODEL)
    f = full_pipeline(network, MODEL, stages, microbatches, budget_s=0.03, seed=seed)
    assert_paths_valid(f, network, stages, 0.0, microbatches)
    # fixed pipelines: every microbatch of one origin follows the same chain through all stages
    chains = {}
    for p in f.paths:
        assert p.stages == tuple(range(1, stages))
        assert chains.setdefault(p.origin, p.nodes) == p.nodes
    assert len(chains) == min(microbatches, len(network.nodes) // stages)
    assert_memory_respected(f, network, MODEL)


def test_planner_beats_random_paths_and_respects_budget_on_gcp12():
    from roving.pipeline import build_network, model_preset
    import time
    net = build_network("gcp12", 12)
    m = model_preset("llama-1.5b")
    t = time.perf_counter()
    p = plan(net, m, 4, 0.34, 16, budget_s=1.0, seed=1)
    assert time.perf_counter() - t < 1.5
    r = random_skip(net, m, p.allocation, 4, 0.34, 16, seed=1)
    assert p.predicted_s < r.predicted_s
    assert simulate(net, m, p).makespan == pytest.approx(p.predicted_s)


def test_plan_rejects_impossible_settings_with_clear_errors():
    net = small_network(2, [10], [1.0], 3)
    with pytest.raises(PlanError, match="3 nodes cannot hold 4 stages"):
        plan(net, MODEL, 4, 0.0, 4, budget_s=0.05)
    with pytest.raises(PlanError, match="leaves no stage besides stage 0"):
        plan(net, MODEL, 3, 0.9, 4, budget_s=0.05)


def test_planning_with_replica_synchronisation_keeps_replicas_near_each_other():
    """Two regions joined by a slow link, two nodes in each. By the microbatch phase alone the best plan
    is two local pipelines (each stage's replicas on both sides of the slow link: nothing crosses it
    until the replicas average). With heavy gradients the planner judged by the whole iteration puts
    each stage's replicas in one region instead, and its plan is faster by that measure."""
    from roving.pipeline import build_network
    links = {"regions": ["A", "B"], "bandwidth_unit": "MiB/s",
             "links": [{"a": "A", "b": "B", "latency_ms": 50, "bandwidth": 10}]}
    net = build_network(links, [dict(name=f"{r}{i}", region=r, speed=0.01, memory=4)
                                for r in "AB" for i in (1, 2)])
    model = ModelSpec(n_layers=2, dim=64, seq_len=64, samples_per_microbatch=1, head_layers=0.0, vocab_size=64)
    grads = [200 * 2.0 ** 20, 200 * 2.0 ** 20]  # 20 s over the slow link
    phase = plan(net, model, 2, 0.0, 8, budget_s=1.0, seed=0)
    whole = plan(net, model, 2, 0.0, 8, budget_s=1.0, seed=0, sync_bytes=grads)
    region = {n.name: n.region for n in net.nodes}
    groups = lambda p: [{region[n] for n, s in p.allocation.items() if s == st} for st in (0, 1)]
    assert groups(phase) == [{"A", "B"}, {"A", "B"}]  # local pipelines: replicas apart
    assert groups(whole) == [{"A"}, {"B"}] or groups(whole) == [{"B"}, {"A"}]
    judge = lambda p: simulate(net, model, p, record=False, sync_bytes=grads).makespan
    assert judge(whole) < judge(phase) / 5
    assert whole.predicted_s == pytest.approx(judge(whole))


def test_a_plan_by_evaluation_count_is_the_same_whatever_the_machine_load():
    """With ``max_evals`` the search is shared out by simulator evaluations, not seconds: two runs give
    the same plan, even with a busy thread competing for the interpreter during one of them."""
    import threading
    from roving.pipeline import build_network, model_preset
    net = build_network("gcp12", 12)
    m = model_preset("llama-1.5b")
    first = plan(net, m, 4, 0.34, 16, budget_s=60.0, seed=3, max_evals=600)
    stop = threading.Event()

    def burn():
        while not stop.is_set():
            sum(i * i for i in range(1000))

    t = threading.Thread(target=burn)
    t.start()
    try:
        second = plan(net, m, 4, 0.34, 16, budget_s=60.0, seed=3, max_evals=600)
    finally:
        stop.set()
        t.join()
    assert first.stats["path_evaluations"] == second.stats["path_evaluations"] == 600
    assert not first.stats["capped"] and not second.stats["capped"]
    assert first.to_dict() == second.to_dict() and first.predicted_s == second.predicted_s
    assert validate(first, net) == []


def test_when_memory_binds_a_split_with_more_stage0_nodes_races_too():
    """aws10 with room for 3 microbatches per node and 36 microbatches: an origin of the compute-
    proportional split sends 6, more than it holds, so the split with the most stage-0 nodes gets its own
    allocation search; the plan stays valid and the same by evaluation count. With room for all of an
    origin's microbatches, only one split is searched."""
    from roving.pipeline import build_network, model_preset
    m = model_preset("llama-1.5b-skippipe")
    net = build_network("aws10", 18, memory=3)
    first = plan(net, m, 4, 0.25, 36, budget_s=60.0, seed=1, max_evals=300)
    splits = first.stats["splits"]
    assert len(splits) == 2 and splits[1][0] > splits[0][0] and all(sum(c) == 18 for c in splits)
    assert validate(first, net) == []
    again = plan(net, m, 4, 0.25, 36, budget_s=60.0, seed=1, max_evals=300)
    assert again.to_dict() == first.to_dict() and again.predicted_s == first.predicted_s
    roomy = plan(build_network("aws10", 18, memory=8), m, 4, 0.25, 36, budget_s=60.0, seed=1, max_evals=300)
    assert len(roomy.stats["splits"]) == 1


def test_plan_progress_reports_each_phase_and_leaves_the_search_as_it_was():
    from roving.pipeline import build_network, model_preset

    net = build_network("gcp12", 10, memory=4)
    model = model_preset("llama-1.5b-skippipe")
    events = []
    seen = plan(net, model, 4, 0.34, 10, budget_s=30, seed=3, max_evals=400, progress=events.append)
    quiet = plan(net, model, 4, 0.34, 10, budget_s=30, seed=3, max_evals=400)
    assert [p.nodes for p in seen.paths] == [p.nodes for p in quiet.paths]
    assert seen.allocation == quiet.allocation and seen.predicted_s == quiet.predicted_s
    phases = [e["phase"] for e in events]
    assert phases[0] == "allocation" and phases[-1] == "done"
    assert phases.count("race") == events[1]["rounds"] and set(phases) <= {"allocation", "race", "paths", "done"}
    times = [e["elapsed_s"] for e in events]
    assert times == sorted(times)
    assert events[-1]["best_s"] == seen.predicted_s and events[-1]["evaluations"] == seen.stats["path_evaluations"]
    better = [e["best_s"] for e in events if e["phase"] == "paths"]
    assert better == sorted(better, reverse=True) and all(b >= seen.predicted_s for b in better)


# ---- the input checks and the joining rule ----

M8 = ModelSpec(n_layers=8, dim=256, seq_len=64, samples_per_microbatch=2, vocab_size=8000, name="m8")


def _plan(stages: int, stage_sets: list[tuple[int, ...]]) -> Plan:
    """A plan whose routes visit the given stage sets (nodes do not matter to the joining rule)."""
    return Plan(stages, 0.0, {}, [Route("o", tuple(f"n{s}" for s in ss), ss) for ss in stage_sets])


def test_stage_visits_counts_every_microbatch_at_stage_0_and_each_visit_elsewhere():
    assert _plan(4, [(1, 2), (2, 3), (1, 3), (3,)]).stage_visits() == [4, 2, 2, 3]
    assert _plan(3, []).stage_visits() == [0, 0, 0]


def test_check_inputs_returns_the_visits_and_names_what_is_wrong():
    net = build_network("gcp12", 6)
    assert check_inputs(net, M8, 4, 0.34, 8) == 2
    with pytest.raises(PlanError, match="6 nodes cannot hold 7 stages"):
        check_inputs(net, M8, 7, 0.0, 8)
    with pytest.raises(PlanError, match="need at least one microbatch, got 0"):
        check_inputs(net, M8, 4, 0.34, 0)
    with pytest.raises(PlanError, match="leaves no stage besides stage 0"):
        check_inputs(net, M8, 3, 0.9, 8)
    tiny = build_network("gcp12", 6, memory_mb=1.0)
    with pytest.raises(PlanError, match="cannot hold stage 0 of m8 in 4 stages"):
        check_inputs(tiny, M8, 4, 0.34, 8)


def test_a_joining_node_takes_the_lowest_stage_no_node_holds():
    current = _plan(4, [(1, 2, 3)] * 4)
    alloc = {"a": 0, "b": 2}
    got = place_joining(current, alloc, [Node("j", "r")], M8)
    assert got == {"a": 0, "b": 2, "j": 1}
    assert alloc == {"a": 0, "b": 2}  # the caller's allocation is not changed


def test_a_joining_node_skips_a_missing_stage_its_memory_cannot_hold():
    stages = 3
    needs = [stage_memory(M8, stages)[s].needs_mb(1) for s in range(stages)]
    assert needs[0] > max(needs[1:])  # stage 0 holds the embedding and the head
    small = Node("j", "r", memory_mb=(needs[0] + max(needs[1:])) / 2)
    current = _plan(stages, [(1, 2)] * 2)
    assert place_joining(current, {"b": 2}, [small], M8)["j"] == 1  # 0 is missing but too big
    # when every missing stage is too big, it goes where the work per replica is highest
    got = place_joining(current, {"b": 1, "c": 2, "d": 2}, [small], M8)
    assert got["j"] == 1  # stage 1: 2 visits on 1 replica; stage 2: 2 visits on 2


def test_with_every_stage_held_a_joining_node_goes_where_the_visits_per_replica_are_highest():
    current = _plan(4, [(1, 2), (2, 3), (2, 3), (1, 2)])  # visits [4, 2, 4, 2]
    alloc = {"z0": 0, "z1": 0, "s1": 1, "s2": 2, "s3": 3}  # per replica: 2, 2, 4, 2
    assert place_joining(current, alloc, [Node("j", "r")], M8)["j"] == 2
    tie = {"z0": 0, "z1": 0, "s1": 1, "s2": 2, "t2": 2, "s3": 3}  # per replica: 2, 2, 2, 2
    assert place_joining(current, tie, [Node("j", "r")], M8)["j"] == 0  # the lowest on a tie


def test_joining_nodes_are_placed_in_order_each_counting_for_the_next():
    current = _plan(4, [(1, 2), (2, 3), (2, 3), (1, 2)])  # visits [4, 2, 4, 2]
    alloc = {"z0": 0, "s1": 1, "s2": 2}  # stage 3 missing
    got = place_joining(current, alloc, [Node("j1", "r"), Node("j2", "r"), Node("j3", "r")], M8)
    assert got["j1"] == 3  # the missing stage first
    assert got["j2"] == 0  # then per replica 4, 2, 4, 2: the lowest of the busiest
    assert got["j3"] == 2  # stage 0 now has two replicas (2 each), stage 2 still 4


def test_a_joining_node_that_can_hold_nothing_with_nothing_held_is_a_plan_error():
    tiny = Node("j", "r", memory_mb=0.5)
    with pytest.raises(PlanError, match="joining node j cannot hold any stage and no node holds one"):
        place_joining(_plan(3, [(1, 2)]), {}, [tiny], M8)


def _count_simulations(monkeypatch):
    """Count every call of the simulator that the planner's modules make."""
    from roving.pipeline.planning import planner, routes
    calls = [0]
    real = routes.simulate

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(routes, "simulate", counted)
    monkeypatch.setattr(planner, "simulate", counted)
    return calls


@pytest.mark.parametrize("network, nodes, stages, skip, microbatches, memory, sync, evals", [
    ("gcp12", 12, 4, 0.34, 16, 8, False, 150),
    ("gcp12", 12, 4, 0.34, 16, 8, True, 400),
    ("aws10", 18, 4, 0.25, 36, 3, False, 300),  # memory binds: two splits searched
])
def test_max_evals_is_the_number_of_simulations_the_plan_makes(monkeypatch, network, nodes, stages, skip,
                                                                microbatches, memory, sync, evals):
    """Every simulation counts, the allocation search's, the race's and the last one with replica
    synchronisation included (the count was of distinct allocations, which ran about 5% over)."""
    from roving.pipeline import model_preset
    calls = _count_simulations(monkeypatch)
    m = model_preset("llama-1.5b-skippipe")
    net = build_network(network, nodes, memory=memory)
    grads = [4.0 * 2 ** 20] * stages if sync else None
    p = plan(net, m, stages, skip, microbatches, budget_s=120.0, seed=2, max_evals=evals, sync_bytes=grads)
    assert calls[0] == evals == p.stats["path_evaluations"]
    assert not p.stats["capped"]
    calls[0] = 0
    new, _ = replan(p, net, m, failed=[p.paths[0].origin], budget_s=120.0, seed=2, max_evals=60)
    assert calls[0] == 60 == new.stats["path_evaluations"]


def _rule_settings():
    from roving.pipeline import model_preset
    paper = ["Belgium", "Canada", "Germany", "Iowa", "Japan", "LA", "NL", "Oregon", "Singapore", "Taiwan",
             "London", "Australia"]
    m = model_preset("llama-1.5b-skippipe")
    return [(build_network("gcp12", 20, regions=paper, memory=3), m, 6, 0.33, 30),
            (build_network("aws10", 18, memory=3), m, 4, 0.25, 36),
            (build_network("gcp12", 12), model_preset("llama-1.5b"), 7, 0.34, 16),
            (small_network(3, [50, 80, 120], [0.05, 0.1, 0.5], 10, 3), MODEL, 6, 0.0, 12)]


@pytest.mark.parametrize("case", range(4))
def test_every_route_keeps_skippipes_rule_by_default(case):
    """Each route: a stage at most one stage number behind the furthest reached, at most two swaps;
    after failures too (re-planned routes keep the plan's rule)."""
    from roving.pipeline.planning.plan import route_allowed, route_problem
    net, m, stages, skip, microbatches = _rule_settings()[case]
    p = plan(net, m, stages, skip, microbatches, budget_s=120.0, seed=case, max_evals=150)
    assert p.route_rule == "skippipe"
    assert [route_problem(r.stages) for r in p.paths if not route_allowed(r.stages)] == []
    assert validate(p, net) == []
    new, survivors = replan(p, net, m, failed=[p.paths[0].nodes[0]], budget_s=120.0, seed=case, max_evals=40)
    assert new.route_rule == "skippipe" and validate(new, survivors) == []


def test_the_looser_route_rule_is_an_option_by_name():
    from roving.pipeline.planning.plan import route_allowed
    net, m, stages, skip, microbatches = _rule_settings()[3]
    p = plan(net, m, stages, skip, microbatches, budget_s=120.0, seed=3, max_evals=150, route_rule="inversions")
    assert p.route_rule == "inversions" == p.to_dict()["route_rule"]
    assert validate(p, net) == [] and all(route_allowed(r.stages, "inversions") for r in p.paths)
    # looser indeed: here the search takes routes that SkipPipe's rule refuses, such as (3, 1, 2, 4, 5)
    assert any(not route_allowed(r.stages) for r in p.paths)
    with pytest.raises(PlanError, match="route rule must be one of skippipe, inversions, got 'any'"):
        plan(net, m, stages, skip, microbatches, budget_s=1.0, route_rule="any")


def test_routes_around_a_missing_stage_keep_the_rule_on_the_real_stage_numbers():
    """``plan_held`` plans the held stages as stages 0, 1, 2, ...: with stage 2 missing, its (2, 1) is the
    real (3, 1), which SkipPipe's rule refuses (stage 1 falls two behind stage 3)."""
    from roving.pipeline import model_preset
    from roving.pipeline.planning.plan import route_allowed
    from roving.pipeline.planning.planner import plan_held
    m = model_preset("llama-1.5b-skippipe")
    net = build_network("gcp12", 12, memory=3)
    alloc = dict(zip(net.names, [0, 0, 0, 1, 1, 3, 3, 4, 4, 5, 6, 6]))  # no node holds stage 2
    held = plan_held(net, m, alloc, 7, 0.0, 16, budget_s=60.0, seed=0, max_evals=150)
    assert held.route_rule == "skippipe" and held.stats["missing_stages"] == [2]
    assert all(2 not in p.stages and route_allowed(p.stages) for p in held.paths)
    loose = plan_held(net, m, alloc, 7, 0.0, 16, budget_s=60.0, seed=0, max_evals=150, route_rule="inversions")
    assert any(not route_allowed(p.stages) for p in loose.paths)  # what the looser rule takes here
