"""The route search on a given allocation: deterministic by evaluation count, and the rule each move
passes."""

import math

from roving.pipeline import ModelSpec
from helpers_pipeline import small_network

MODEL = ModelSpec(n_layers=12, dim=256, seq_len=256, samples_per_microbatch=2)


def test_planner_is_deterministic_for_a_seed_and_evaluation_count():
    """The seeded path search, stopped by an evaluation count (not the clock), gives the same result
    twice; another seed searches differently."""
    import random
    from roving.pipeline.planning.routes import SearchContext, build_routes, improve_routes
    net = small_network(3, [50, 80, 120], [0.05, 0.1, 0.5], 9)
    ctx = SearchContext(net, MODEL, {n.name: i % 3 for i, n in enumerate(net.nodes)}, 3)
    start = build_routes(ctx, 10, 1)
    assert start == build_routes(ctx, 10, 1)

    def search(seed):
        return improve_routes(ctx, start, 0.5, math.inf, random.Random(seed), max_evals=150)

    a, b = search(7), search(7)
    assert a[3] == 150  # stopped by the count, so a slower or faster machine gives the same result
    assert a == b
    trails = {tuple(search(seed)[0]) for seed in range(4)}
    assert len(trails) > 1, "the seed must steer the search"


def test_the_path_search_takes_a_lower_makespan_or_an_equal_one_with_an_earlier_mean_finish():
    """``_accepts``, the rule each move of ``improve_routes`` passes: on a plateau of the makespan the
    microbatches' mean finish decides (a move that lets the other late ones end sooner is taken, one
    that makes them later is not); a deadlocked candidate never replaces a plan that runs."""
    from roving.pipeline.planning.routes import _accepts
    inf = math.inf
    assert _accepts(9.0, 8.0, 10.0, 5.0), "a lower makespan is taken even with later finishes"
    assert _accepts(10.0, 4.0, 10.0, 5.0) and _accepts(10.0, 5.0, 10.0, 5.0)
    assert not _accepts(10.0, 6.0, 10.0, 5.0), "same makespan, later mean finish: not taken"
    assert not _accepts(10.5, 1.0, 10.0, 5.0)
    assert not _accepts(inf, inf, 10.0, 5.0), "a deadlock never replaces a plan that runs"
    assert _accepts(10.0, 5.0, inf, inf) and _accepts(inf, inf, inf, inf)


def test_routes_over_stages_of_more_replicas_than_one_microbatch_weighs_keep_every_rule():
    """100 nodes on 6 stages (about 17 replicas a stage, more than ``routes.CANDIDATES``): the greedy
    routes and the planner's plan are valid (quotas, the route rule, every stage visited as often as the
    others within one), each stage's microbatches spread over many of its replicas."""
    from roving.pipeline import build_network, model_preset, plan
    from roving.pipeline.planning import routes
    from roving.pipeline.planning.plan import Plan, validate
    net = build_network("gcp12", 100, memory=3)
    model = model_preset("llama-1.5b-skippipe")
    alloc = {n: i % 6 for i, n in enumerate(net.names)}
    ctx = routes.SearchContext(net, model, alloc, 6, None, None, "skippipe", routes.Tally())
    assert min(len(r) for r in ctx.replicas) > routes.CANDIDATES
    paths = routes.build_routes(ctx, 60, 3)
    assert validate(Plan(6, 0.33, alloc, paths), net) == []
    used = {n for p in paths for n in p.nodes}
    assert len(used) > 3 * routes.CANDIDATES, "the load spreads beyond the first few replicas"
    p = plan(net, model, 6, 0.33, 60, budget_s=60.0, seed=0, max_evals=20)
    assert validate(p, net) == []
