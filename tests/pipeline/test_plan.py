"""The plan's plain data: ``validate`` on hand-made plans, and the route type's names."""

from roving.pipeline import ModelSpec, validate
from helpers_pipeline import small_network

MODEL = ModelSpec(n_layers=12, dim=256, seq_len=256, samples_per_microbatch=2)


def _hand_plan(stages=5, skip=0.0):
    """One node per stage on one region; every microbatch visits the stages after 0 in order."""
    from roving.pipeline import Plan
    from roving.pipeline.planning.plan import Route
    net = small_network(1, [1], [1.0], stages)
    names = net.names
    alloc = {n: i for i, n in enumerate(names)}
    return net, names, alloc, Plan, Route


def test_validate_accepts_a_hand_made_valid_plan():
    net, n, alloc, Plan, Route = _hand_plan()
    p = Plan(5, 0.0, alloc, [Route(n[0], tuple(n[1:]), (1, 2, 3, 4))] * 2)
    assert validate(p, net) == [] and validate(p, net, model=MODEL) == []


def test_validate_reports_a_revisited_stage():
    net, n, alloc, Plan, Route = _hand_plan()
    p = Plan(5, 0.0, alloc, [Route(n[0], (n[1], n[2], n[2], n[4]), (1, 2, 2, 4))])
    assert any("visits a stage twice" in msg for msg in validate(p, net))


def test_validate_reports_three_inversions_under_the_inversions_rule():
    net, n, alloc, Plan, Route = _hand_plan()
    p = Plan(5, 0.0, alloc, [Route(n[0], (n[2], n[3], n[4], n[1]), (2, 3, 4, 1))], route_rule="inversions")
    assert any("3 swaps, at most 2 allowed" in msg for msg in validate(p, net))  # 3 inversions
    ok = Plan(5, 0.0, alloc, [Route(n[0], (n[2], n[3], n[1], n[4]), (2, 3, 1, 4))], route_rule="inversions")
    assert validate(ok, net) == []  # 2 inversions
    ok.route_rule = "skippipe"  # stage 1 falls two stages behind stage 3
    assert any("at most one stage behind" in msg for msg in validate(ok, net))


def test_skippipe_route_rule_refuses_a_stage_more_than_one_behind_and_a_third_swap():
    from roving.pipeline.planning.plan import route_allowed, route_problem
    # the routes the looser rule admits (at most 2 inversions) and SkipPipe's rule does not
    for seq in [(5, 1, 4), (4, 1, 5), (3, 1, 2), (2, 3, 1, 4), (1, 4, 2, 3)]:
        assert route_allowed(seq, "inversions"), seq
        assert not route_allowed(seq), seq  # the default is SkipPipe's rule
        assert "at most one stage behind" in route_problem(seq, "skippipe")
    # one stage behind the furthest reached, at most twice
    for seq in [(1, 2, 3), (2, 1), (2, 1, 4, 3), (1, 3, 2, 5, 4), (2, 4, 3)]:
        assert route_allowed(seq), seq
    assert route_problem((2, 1, 4, 3, 6, 5)) == "3 swaps, at most 2 allowed"
    assert not route_allowed((2, 1, 4, 3, 6, 5), "inversions")
    assert not route_allowed((3, 2, 1), "inversions") and not route_allowed((3, 2, 1))


def test_validate_judges_a_plan_by_its_own_route_rule_and_names_an_unknown_one():
    import pytest
    from roving.pipeline.errors import PlanError
    net, n, alloc, Plan, Route = _hand_plan()
    route = Route(n[0], (n[3], n[1], n[2], n[4]), (3, 1, 2, 4))
    assert validate(Plan(5, 0.0, alloc, [route], route_rule="inversions"), net) == []
    assert any("stage 1 after stage 3" in msg for msg in validate(Plan(5, 0.0, alloc, [route]), net))
    with pytest.raises(PlanError, match="route rule must be one of skippipe, inversions"):
        validate(Plan(5, 0.0, alloc, [route], route_rule="loose"), net)


def test_validate_reports_unbalanced_stage_loads():
    net, n, alloc, Plan, Route = _hand_plan(stages=4, skip=0.34)  # each microbatch visits 2 of 3 stages
    both_skip_3 = [Route(n[0], (n[1], n[2]), (1, 2))] * 2  # loads [2, 2, 0]
    problems = validate(Plan(4, 0.34, alloc, both_skip_3), net)
    assert any("stage loads [2, 2, 0] differ by more than one" in msg for msg in problems)
    spread = [Route(n[0], (n[1], n[2]), (1, 2)), Route(n[0], (n[1], n[3]), (1, 3))]  # loads [2, 1, 1]
    assert validate(Plan(4, 0.34, alloc, spread), net) == []


def test_validate_reports_an_origin_that_is_not_a_stage_0_node():
    net, n, alloc, Plan, Route = _hand_plan()
    p = Plan(5, 0.0, alloc, [Route(n[1], tuple(n[1:]), (1, 2, 3, 4))])
    assert any(f"origin {n[1]} is not a live stage-0 node" in msg for msg in validate(p, net))


def test_validate_reports_a_node_holding_a_stage_it_cannot_hold_in_memory():
    from roving.pipeline.planning.network import Node
    net, n, alloc, Plan, Route = _hand_plan()
    net = net.with_nodes([Node(x.name, x.region, x.speed, memory_mb=1.0 if x.name == n[2] else None)
                          for x in net.nodes])
    p = Plan(5, 0.0, alloc, [Route(n[0], tuple(n[1:]), (1, 2, 3, 4))])
    assert validate(p, net) == []  # without the model, memory is not checked
    assert any(f"node {n[2]} cannot hold stage 2" in msg for msg in validate(p, net, model=MODEL))
