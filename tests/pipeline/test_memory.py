"""The memory model (device MB -> microbatches in flight per stage) and how plans respect it."""

import json

import pytest

from roving.cli import main
from roving.pipeline import ModelSpec, PlanError, build_network, full_pipeline, plan, replan, simulate, validate
from roving.pipeline.planning.costs import MIB, microbatches_in_flight, model_preset, stage_memory
from roving.pipeline.planning.network import Node
from helpers_pipeline import assert_memory_respected, assert_paths_valid, small_network

# 12 layers of hidden 256 in 3 stages (4 layers each); a small vocabulary keeps stage 0 close to the
# others, so one memory size can leave exactly one microbatch in flight on every stage.
SMALL = ModelSpec(n_layers=12, dim=256, seq_len=256, samples_per_microbatch=2, vocab_size=256)


def test_memory_model_on_a_hand_computed_case():
    m = ModelSpec(n_layers=4, dim=64, seq_len=32, samples_per_microbatch=2, vocab_size=100)
    st0, st1 = stage_memory(m, 2)  # 2 layers each
    layer_params = 12 * 64 * 64  # 49,152
    assert st1.static_bytes == 2 * layer_params * 16  # 1,572,864: 16 bytes of training state per parameter
    # stage 0 also: embedding + head (2 x 100 x 64 parameters) and fp32 logits of one microbatch (4 x 2 x 32 x 100)
    assert st0.static_bytes == (2 * layer_params + 2 * 100 * 64) * 16 + 4 * 2 * 32 * 100  # 1,803,264
    # activations: 34 bytes x samples x seq x hidden per layer, 2 layers
    assert st0.per_microbatch_bytes == st1.per_microbatch_bytes == 2 * 34 * 2 * 32 * 64  # 278,528
    # 3 microbatches fit at stage 0 with 100,000 bytes to spare; stage 1 has 230,400 more bytes free: 4 fit
    mem_mb = (1_803_264 + 3 * 278_528 + 100_000) / MIB
    assert microbatches_in_flight(mem_mb, 0, m, 2) == 3
    assert microbatches_in_flight(mem_mb, 1, m, 2) == 4
    # exactly the weights plus one microbatch: 1; a byte less: 0
    assert microbatches_in_flight(st0.needs_mb(1), 0, m, 2) == 1
    assert microbatches_in_flight(st0.needs_mb(1) - 1 / MIB, 0, m, 2) == 0


def test_llama_1_5b_in_six_stages():
    # per stage of 4 layers: 4 x 12 x 2048^2 x 16 B = 3072 MiB; stage 0 adds 2 x 32000 x 2048 x 16 B = 2000 MiB
    # and 4 x 4 x 1024 x 32000 B = 500 MiB of logits; activations 4 x 34 x 4 x 1024 x 2048 B = 1088 MiB
    mem = stage_memory(model_preset("llama-1.5b"), 6)
    assert [round(s.needs_mb(1)) for s in mem] == [6660] + [4160] * 5
    assert microbatches_in_flight(24576, 0, model_preset("llama-1.5b"), 6) == 17  # (24576-5572)//1088


def test_cli_rejects_memory_too_small_with_a_clear_message(tmp_path, capsys):
    base = ["pipeline", "plan", "--network", "gcp12", "--nodes", "8", "--stages", "6", "--skip", "0.33",
            "--json", str(tmp_path / "o.json")]
    assert main(base + ["--memory", "6000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: memory 6000 MB per node cannot hold stage 0 of llama-1.5b in 6 stages")
    assert "needs 6660 MB" in err and "use more memory, more stages, or a smaller model" in err
    assert not (tmp_path / "o.json").exists()
    assert main(base + ["--memory-microbatches", "0"]) == 2
    assert "too small for any plan" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(base + ["--memory", "8000", "--memory-microbatches", "3"])
    assert exc.value.code == 2


def test_cli_memory_sets_microbatches_in_flight_per_stage(tmp_path):
    out = tmp_path / "o.json"
    rc = main(["pipeline", "plan", "--network", "gcp12", "--nodes", "8", "--stages", "6", "--skip", "0.33",
               "--memory", "7000", "--budget", "0.3", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    # 7000 MB: stage 0 holds (7000-5572)//1088 = 1 microbatch, the other stages (7000-3072)//1088 = 3
    got = {n["name"]: n["in_flight"] for n in doc["nodes"]}
    assert all(got[n] == (1 if s == 0 else 3) for n, s in doc["allocation"].items())


def _tight(nodes: int):
    """Nodes on two regions, each with memory for the largest stage's weights and one microbatch."""
    need = max(s.needs_mb(1) for s in stage_memory(SMALL, 3))
    net = small_network(2, [30], [0.05], nodes)
    return net.with_nodes([Node(n.name, n.region, n.speed, memory_mb=need) for n in net.nodes])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plans_respect_one_microbatch_in_flight_when_memory_fits_only_one(seed):
    net = _tight(7)
    assert all(net.nodes[0].in_flight(s, SMALL, 3) == 1 for s in range(3))
    p = plan(net, SMALL, 3, 0.5, 10, budget_s=0.3, seed=seed)
    assert_paths_valid(p, net, 3, 0.5, 10)
    assert validate(p, net, model=SMALL) == []
    assert_memory_respected(p, net, SMALL)  # rebuilt from the timeline: never above 1
    res = simulate(net, SMALL, p)
    assert max(res.peak_in_flight.values()) == 1
    # the limit binds: the same plan with room for more holds several at once somewhere
    roomy = net.with_nodes([Node(n.name, n.region, n.speed, memory=8) for n in net.nodes])
    assert max(simulate(roomy, SMALL, p).peak_in_flight.values()) > 1
    # baselines and re-planning keep it too
    f = full_pipeline(net, SMALL, 3, 10, budget_s=0.05, seed=seed)
    assert f.stats["memory_ok"] and max(simulate(net, SMALL, f).peak_in_flight.values()) == 1
    new, new_net = replan(p, net, SMALL, failed=[p.paths[0].origin], budget_s=0.1, seed=seed)
    assert_memory_respected(new, new_net, SMALL)


def _mixed(big: int, small: int, small_mb: float):
    big_mb = stage_memory(SMALL, 3)[0].needs_mb(4)
    doc = {"regions": ["A", "B"], "links": [{"a": "A", "b": "B", "latency_ms": 20, "bandwidth": 0.2}]}
    nodes = [dict(name=f"big{i}", region="AB"[i % 2], memory_mb=big_mb) for i in range(big)]
    nodes += [dict(name=f"small{i}", region="AB"[i % 2], memory_mb=small_mb) for i in range(small)]
    return build_network(doc, nodes)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_node_too_small_for_stage_0_is_never_given_it(seed):
    st = stage_memory(SMALL, 3)
    small_mb = (st[0].needs_mb(1) + st[1].needs_mb(1)) / 2  # holds stage 1 or 2, not stage 0
    net = _mixed(2, 5, small_mb)
    p = plan(net, SMALL, 3, 0.5, 12, budget_s=0.3, seed=seed)
    assert sorted(n for n, s in p.allocation.items() if s == 0) in (["big0"], ["big1"], ["big0", "big1"])
    assert validate(p, net, model=SMALL) == []
    assert_memory_respected(p, net, SMALL)
    # a joined small node goes to a stage it can hold
    new, new_net = replan(p, net, SMALL, joined=[Node("late", "A", memory_mb=small_mb)], budget_s=0.1)
    assert new.allocation["late"] != 0
    assert_memory_respected(new, new_net, SMALL)


def test_memory_that_cannot_place_every_stage_is_a_clear_error():
    st = stage_memory(SMALL, 3)
    small_mb = (st[0].needs_mb(1) + st[1].needs_mb(1)) / 2
    with pytest.raises(PlanError, match=r"memory 66.25 MB per node cannot hold stage 0 of the model in 3 stages "
                                        r"\(needs 68 MB: 50 MB of weights"):
        plan(_mixed(0, 4, small_mb), SMALL, 3, 0.0, 4, budget_s=0.05)
    mixed = _mixed(0, 4, small_mb)
    mixed = mixed.with_nodes(mixed.nodes + [Node("mid", "A", memory_mb=small_mb + 1)])
    with pytest.raises(PlanError, match=r"no node can hold stage 0 of the model in 3 stages \(needs 68 MB.*"
                                        r"the largest node has 67.25 MB\)"):
        plan(mixed, SMALL, 3, 0.0, 4, budget_s=0.05)
    # 7 layers in 3 stages: [2, 2, 3]; with a tiny head stage 2 needs the most, then stage 0
    m7 = ModelSpec(n_layers=7, dim=256, seq_len=256, samples_per_microbatch=2, vocab_size=8, name="m7")
    s7 = stage_memory(m7, 3)
    assert s7[2].needs_mb(1) > s7[0].needs_mb(1) > s7[1].needs_mb(1)
    doc = {"regions": ["A"], "links": []}
    nodes = [dict(name="big", region="A", memory_mb=s7[2].needs_mb(1))] + \
        [dict(name=f"s{i}", region="A", memory_mb=s7[1].needs_mb(1)) for i in range(3)]
    with pytest.raises(PlanError, match=r"stages 0, 2 of m7 can only be held by nodes big \(1 nodes for 2 stages\)"):
        plan(build_network(doc, nodes), m7, 3, 0.0, 4, budget_s=0.05)
    nodes.append(dict(name="tiny", region="A", memory_mb=1.0))
    with pytest.raises(PlanError, match="node tiny with 1 MB cannot hold any stage"):
        plan(build_network(doc, nodes + [dict(name="big2", region="A", memory_mb=s7[2].needs_mb(1))]),
             m7, 3, 0.0, 4, budget_s=0.05)


def test_nodes_file_memory_mb_and_memory_count(tmp_path):
    f = tmp_path / "nodes.json"
    f.write_text(json.dumps([{"name": "a", "region": "Oregon", "memory_mb": 9000},
                             {"name": "b", "region": "Tokyo", "memory": 2},
                             {"name": "c", "region": "Tokyo"}]))
    net = build_network("aws10", str(f), memory_mb=12000)
    assert [(n.memory_mb, n.memory if n.memory_mb is None else None) for n in net.nodes] == [
        (9000, None), (None, 2), (12000, None)]
    assert net.node("b").in_flight(0, SMALL, 3) == 2  # a count holds whatever the stage
    f.write_text(json.dumps([{"name": "a", "region": "Oregon", "memory_mb": 9000, "memory": 2}]))
    with pytest.raises(PlanError, match="not both"):
        build_network("aws10", str(f))
