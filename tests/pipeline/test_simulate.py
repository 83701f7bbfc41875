"""The simulator against timelines computed by hand."""

import math

import pytest

from roving.pipeline import ModelSpec, Plan, Route, build_network, simulate

# 1 MiB per transfer; 2 layers over 2 stages, 1 layer each; no head cost; backward = 2 x forward.
MODEL = ModelSpec(n_layers=2, dim=512, seq_len=1024, samples_per_microbatch=1, bytes_per_activation=2,
                  head_layers=0.0)
LINKS = {"regions": ["A", "B"], "bandwidth_unit": "MiB/s",
         "links": [{"a": "A", "b": "B", "latency_ms": 10, "bandwidth": 1}]}


def net(nodes):
    return build_network(LINKS, [dict(name=n, region=r, speed=s, memory=m) for n, r, s, m in nodes])


def test_one_microbatch_over_two_nodes_matches_hand_computed_makespan():
    network = net([("a", "A", 1.0, 4), ("b", "B", 1.0, 4)])
    plan = Plan(2, 0.0, {"a": 0, "b": 1}, [Route("a", ("b",), (1,))])
    res = simulate(network, MODEL, plan)
    # F(a) 0-1, send 1 s + 10 ms, F(b) 2.01-3.01, send -> 4.02, loss 0 s, send -> 5.03,
    # B(b) 2 s -> 7.03, send -> 8.04, B(a) 2 s -> 10.04
    assert res.makespan == pytest.approx(10.04)
    kinds = [(e.kind, round(e.start, 6), round(e.end, 6)) for e in res.timeline["b"] if e.kind != "idle"]
    assert kinds == [("compute-fwd", 2.01, 3.01), ("send", 3.01, 4.02), ("compute-bwd", 5.03, 7.03),
                     ("send", 7.03, 8.04)]
    idle_b = sum(e.end - e.start for e in res.timeline["b"] if e.kind == "idle")
    assert idle_b == pytest.approx(10.04 - 3.0)


def test_two_overlapping_transfers_on_one_link_share_its_bandwidth():
    # a's compute is negligible, so both microbatches start sending a->b at about t=0
    network = net([("a", "A", 1e-9, 4), ("b", "B", 1.0, 4)])
    one = simulate(network, MODEL, Plan(2, 0.0, {"a": 0, "b": 1}, [Route("a", ("b",), (1,))]))
    two = simulate(network, MODEL, Plan(2, 0.0, {"a": 0, "b": 1}, [Route("a", ("b",), (1,))] * 2))
    first_send = lambda r: sorted(e.end for e in r.timeline["a"] if e.kind == "send")[:2]
    assert first_send(one)[0] == pytest.approx(1.01, abs=1e-6)
    # each gets half the bandwidth: 2 s for the bytes, latency added once
    assert first_send(two) == pytest.approx([2.01, 2.01], abs=1e-6)


def test_without_link_sharing_overlapping_transfers_each_get_the_whole_link():
    network = net([("a", "A", 1e-9, 4), ("b", "B", 1.0, 4)])
    two = Plan(2, 0.0, {"a": 0, "b": 1}, [Route("a", ("b",), (1,))] * 2)
    res = simulate(network, MODEL, two, link_sharing=False)
    sends = sorted(e.end for e in res.timeline["a"] if e.kind == "send")[:2]
    assert sends == pytest.approx([1.01, 1.01], abs=1e-6)  # 1 s for the bytes each, as if alone
    assert res.makespan < simulate(network, MODEL, two).makespan


def test_memory_of_one_serialises_two_microbatches_on_a_node():
    paths = [Route("a", ("b",), (1,))] * 2
    roomy = net([("a", "A", 1.0, 4), ("b", "B", 1.0, 2)])
    tight = net([("a", "A", 1.0, 4), ("b", "B", 1.0, 1)])
    r2 = simulate(roomy, MODEL, Plan(2, 0.0, {"a": 0, "b": 1}, paths))
    r1 = simulate(tight, MODEL, Plan(2, 0.0, {"a": 0, "b": 1}, paths))
    ev = lambda r, kind, mb: next(e for e in r.timeline["b"] if e.kind == kind and e.microbatch == mb)
    assert r1.peak_in_flight["b"] == 1 and r2.peak_in_flight["b"] == 2
    # with memory 1, microbatch 1's forward at b waits for microbatch 0's backward there to end
    assert ev(r1, "compute-fwd", 1).start >= ev(r1, "compute-bwd", 0).end - 1e-9
    assert ev(r2, "compute-fwd", 1).start < ev(r2, "compute-bwd", 0).start
    assert r1.makespan > r2.makespan


def test_backward_work_is_served_before_waiting_forward_work():
    network = net([("a", "A", 1.0, 8), ("b", "B", 1.0, 8)])
    model = ModelSpec(n_layers=2, dim=512, seq_len=1024, samples_per_microbatch=1, head_layers=1.0)
    res = simulate(network, model, Plan(2, 0.0, {"a": 0, "b": 1}, [Route("a", ("b",), (1,))] * 6))
    # forwards at a take 1.5 s each, so microbatch 0 returns for its loss (at 1.5+1.01+1+1.01 = 4.52 s)
    # while forwards of later microbatches still wait; the loss must run next, at 6.0 s, before them
    a = [e for e in res.timeline["a"] if e.kind.startswith("compute")]
    loss0 = next(e for e in a if e.kind == "compute-loss" and e.microbatch == 0)
    assert loss0.start == pytest.approx(6.0)
    later_fwd = [e for e in a if e.kind == "compute-fwd" and e.start > loss0.start]
    assert later_fwd, "some forwards were still waiting when the loss was served"
    assert all(e.start >= loss0.end for e in later_fwd)


def test_opposite_swapped_paths_with_memory_one_deadlock_and_are_reported():
    doc = {"regions": ["A"], "links": []}
    network = build_network(doc, [dict(name=n, region="A", speed=1.0, memory=m)
                                  for n, m in [("o1", 4), ("o2", 4), ("x", 1), ("y", 1)]])
    model = ModelSpec(n_layers=3, dim=8, seq_len=8, samples_per_microbatch=1, head_layers=0.0)
    alloc = {"o1": 0, "o2": 0, "x": 1, "y": 2}
    plan = Plan(3, 0.0, alloc, [Route("o1", ("x", "y"), (1, 2)), Route("o2", ("y", "x"), (2, 1))])
    res = simulate(network, model, plan)
    assert res.deadlock and math.isinf(res.makespan)
    # without the swap the same plan finishes
    ok = Plan(3, 0.0, alloc, [Route("o1", ("x", "y"), (1, 2)), Route("o2", ("x", "y"), (1, 2))])
    assert not simulate(network, model, ok).deadlock


def test_simulation_is_deterministic():
    network = build_network("gcp12", 8)
    from roving.pipeline import model_preset, random_skip
    m = model_preset("llama-500m")
    alloc = {n.name: i % 4 for i, n in enumerate(network.nodes)}
    p = random_skip(network, m, alloc, 4, 0.34, 12, seed=3)
    a, b = simulate(network, m, p), simulate(network, m, p)
    assert a.makespan == b.makespan and a.timeline == b.timeline


def test_nodes_sharing_one_machine_share_its_cores():
    # two origins a1, a2 (region A) each run one microbatch through b1 / b2 (region B); both start at 0
    network = net([("a1", "A", 1.0, 4), ("a2", "A", 1.0, 4), ("b1", "B", 1.0, 4), ("b2", "B", 1.0, 4)])
    plan = Plan(2, 0.0, {"a1": 0, "a2": 0, "b1": 1, "b2": 1},
                [Route("a1", ("b1",), (1,)), Route("a2", ("b2",), (1,))])
    own = simulate(network, MODEL, plan)
    two = simulate(network, MODEL, plan, shared_cores=2)
    one = simulate(network, MODEL, plan, shared_cores=1)
    assert own.makespan == pytest.approx(10.04) and two.makespan == pytest.approx(10.04)
    # one core: every compute step of the two microbatches overlaps its twin, so each takes twice as
    # long: F 0-2, send -> 3.01, F 3.01-5.01, send back -> 6.02, loss (0 s), send -> 7.03,
    # B 7.03-11.03, send -> 12.04, B 12.04-16.04
    assert one.makespan == pytest.approx(16.04)
    fwd = [e for e in one.timeline["a1"] if e.kind == "compute-fwd"]
    assert [(round(e.start, 6), round(e.end, 6)) for e in fwd] == [(0.0, 2.0)]


def test_a_task_alone_on_a_shared_core_runs_at_full_speed_after_the_other_ends():
    # a1's microbatch visits b1 (1 s forward); a2's stays at stage 0 with a fast origin: on one
    # core the two first forwards overlap only while both run
    network = net([("a1", "A", 1.0, 4), ("a2", "A", 0.25, 4), ("b1", "B", 1.0, 4)])
    plan = Plan(2, 0.0, {"a1": 0, "a2": 0, "b1": 1}, [Route("a1", ("b1",), (1,)), Route("a2", ("b1",), (1,))])
    res = simulate(network, MODEL, plan, shared_cores=1)
    f1 = next(e for e in res.timeline["a1"] if e.kind == "compute-fwd")
    f2 = next(e for e in res.timeline["a2"] if e.kind == "compute-fwd")
    # both at half speed until a2's 0.25 s of work is done at 0.5 s; a1 then has 0.75 s left alone
    assert f2.end == pytest.approx(0.5) and f1.end == pytest.approx(1.25)


SYNC_LINKS = {"regions": ["A", "B", "C"], "bandwidth_unit": "MiB/s",
              "links": [{"a": "A", "b": "B", "latency_ms": 10, "bandwidth": 1},
                        {"a": "A", "b": "C", "latency_ms": 10, "bandwidth": 1},
                        {"a": "B", "b": "C", "latency_ms": 20, "bandwidth": 1}]}


def sync_case():
    network = build_network(SYNC_LINKS, [dict(name="a", region="A", speed=1.0, memory=4),
                                         dict(name="b", region="B", speed=1.0, memory=4),
                                         dict(name="c", region="C", speed=1.0, memory=4)])
    plan = Plan(2, 0.0, {"a": 0, "b": 1, "c": 1}, [Route("a", ("b",), (1,)), Route("a", ("c",), (1,))])
    return network, plan


def test_replica_synchronisation_matches_hand_computed_timeline():
    network, plan = sync_case()
    # Without it: mb0 F(a) 0-1, -> b 2.01, F(b) -> 3.01, -> a 4.02, loss, -> b 5.03, B(b) 5.03-7.03,
    # -> a 8.04, B(a) 8.04-10.04; mb1 F(a) 1-2, -> c 3.01, F(c) -> 4.01, -> a 5.02, -> c 6.03,
    # B(c) 6.03-8.03, -> a 9.04, B(a) waits for a: 10.04-12.04.
    plain = simulate(network, MODEL, plan)
    assert plain.makespan == pytest.approx(12.04) and plain.sync_end == {}
    # With 8 MiB of stage-1 gradients: b sends them to c once its only backward ends (7.03 + 8 s +
    # 20 ms = 15.05), c to b from 8.03 (16.05): the stage is averaged at 16.05, after the microbatches.
    mib = 2.0 ** 20
    res = simulate(network, MODEL, plan, sync_bytes=[0.0, 8 * mib])
    assert res.sync_end == {1: pytest.approx(16.05)}
    assert res.makespan == pytest.approx(16.05)
    assert max(res.finish) == pytest.approx(12.04)  # the microbatches themselves are not delayed
    sends = sorted((n, e.peer, round(e.start, 6), round(e.end, 6)) for n, evs in res.timeline.items()
                   for e in evs if e.kind == "sync")
    assert sends == [("b", "c", 7.03, 15.05), ("c", "b", 8.03, 16.05)]
    # small gradients: the averaging ends before the last backward and does not lengthen the iteration
    small = simulate(network, MODEL, plan, sync_bytes=[0.0, 0.5 * mib])
    assert small.sync_end[1] == pytest.approx(8.03 + 0.5 + 0.02)
    assert small.makespan == pytest.approx(12.04)


def test_a_replica_without_microbatches_sends_its_gradients_at_once():
    network, plan = sync_case()
    plan = Plan(2, 0.0, plan.allocation, plan.paths[:1])  # only a -> b: c runs no backward
    mib = 2.0 ** 20
    res = simulate(network, MODEL, plan, sync_bytes=[0.0, 8 * mib])
    sends = sorted((n, e.peer, round(e.start, 6), round(e.end, 6)) for n, evs in res.timeline.items()
                   for e in evs if e.kind == "sync")
    # c: at 0, 8 s + 20 ms; b: after its backward (5.03-7.03), arriving 15.05; mb0 itself ends at 10.04
    assert sends == [("b", "c", 7.03, 15.05), ("c", "b", 0.0, 8.02)]
    assert res.makespan == pytest.approx(15.05) and max(res.finish) == pytest.approx(10.04)


def test_gradient_bytes_of_the_cost_model_and_of_a_real_stage_split_agree():
    """``costs.gradient_bytes`` (12 h^2 a layer, embedding and head at stage 0, 4 bytes a value) against
    the parameters a real stage holds (``stages.stage_gradient_bytes``, counted on the meta device): the
    cost model leaves out the norms and the rounding of the MLP width, which weighs most in tiny models."""
    from roving.pipeline.planning.costs import gradient_bytes
    from roving.pipeline.presets import LlamaConfig, preset
    from roving.pipeline.stages import model_spec, stage_gradient_bytes
    for cfg, rel in ((LlamaConfig(dim=64, n_layers=12, vocab_size=260), 0.10), (preset("500m"), 0.05)):
        real = stage_gradient_bytes(cfg, 6)
        model = gradient_bytes(model_spec(cfg, 4, 64), 6)
        assert len(real) == len(model) == 6
        assert real[0] > real[1] == real[5]  # stage 0 also holds the embedding and the head
        for r, m in zip(real, model):
            assert m == pytest.approx(r, rel=rel), (cfg.dim, r, m)
        assert gradient_bytes(model_spec(cfg, 4, 64), 6, bytes_per_value=2.0)[1] == model[1] / 2


def _replicated_plan():
    from roving.pipeline import model_preset, plan

    network = build_network("gcp12", 9)
    model = model_preset("llama-500m")
    p = plan(network, model, 3, 0.0, 6, budget_s=60.0, max_evals=60, seed=2)
    assert any(list(p.allocation.values()).count(s) > 1 for s in range(3))  # replicas to synchronise
    return network, model, p


def test_predict_gives_what_the_separate_simulations_give():
    from roving.pipeline import predict

    network, model, p = _replicated_plan()
    sync = [2.0e8, 1.0e8, 1.0e8]
    got = predict(p, network, model, shared_cores=2, sync_bytes=sync)
    plain = simulate(network, model, p)
    assert got.iteration_s == plain.makespan == simulate(network, model, p, record=False).makespan
    assert got.here_s == simulate(network, model, p, record=False, shared_cores=2).makespan
    assert got.with_sync_s == simulate(network, model, p, record=False, sync_bytes=sync).makespan
    assert got.here_s > got.iteration_s  # 9 nodes on 2 cores are slower than 9 machines
    assert got.with_sync_s > got.iteration_s  # the replicas' exchange comes on top
    assert got.whole_s == got.with_sync_s and not got.deadlock
    assert set(got.busy_s) == set(p.allocation)
    for name, events in plain.timeline.items():
        assert got.busy_s[name] == sum(e.end - e.start for e in events if e.kind.startswith("compute"))
    assert all(v > 0 for v in got.busy_s.values())


def test_predict_without_shared_cores_or_sync_bytes_reports_the_microbatch_phase():
    from roving.pipeline import predict

    network, model, p = _replicated_plan()
    got = predict(p, network, model)
    assert got.here_s == got.iteration_s == got.whole_s
    assert math.isnan(got.with_sync_s)
    assert math.isnan(predict(p, network, model, sync_bytes=[]).with_sync_s)


def test_predict_reports_a_deadlocked_plan_as_infinite():
    from roving.pipeline import predict

    doc = {"regions": ["A"], "links": []}
    network = build_network(doc, [dict(name=n, region="A", speed=1.0, memory=m)
                                  for n, m in [("o1", 4), ("o2", 4), ("x", 1), ("y", 1)]])
    model = ModelSpec(n_layers=3, dim=8, seq_len=8, samples_per_microbatch=1, head_layers=0.0)
    alloc = {"o1": 0, "o2": 0, "x": 1, "y": 2}
    plan = Plan(3, 0.0, alloc, [Route("o1", ("x", "y"), (1, 2)), Route("o2", ("y", "x"), (2, 1))])
    got = predict(plan, network, model)
    assert got.deadlock and math.isinf(got.iteration_s) and math.isinf(got.whole_s)
