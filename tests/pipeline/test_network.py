import json

import pytest

from roving.pipeline import PlanError, build_network
from roving.pipeline.planning.allocate import replica_counts, visits_per_microbatch
from roving.pipeline.planning.costs import model_preset, stage_costs, stage_layers
from roving.pipeline.planning.network import GIB


def test_presets_load_with_units_converted_to_bytes_per_second():
    gcp = build_network("gcp12", 12)
    aws = build_network("aws10", 10)
    assert len({n.region for n in gcp.nodes}) == 12
    # gcp12 is in GiB/s, aws10 in Gbit/s: Oregon-Virginia is 0.79 Gbit/s
    oregon = next(n.name for n in aws.nodes if n.region == "Oregon")
    virginia = next(n.name for n in aws.nodes if n.region == "Virginia")
    link = aws.link(oregon, virginia)
    assert link.bandwidth_bps == pytest.approx(0.79e9 / 8)
    assert link.latency_s == pytest.approx(0.067)
    assert aws.link(virginia, oregon) == link


def test_nodes_are_placed_on_regions_round_robin_and_intra_region_links_are_1ms_2gib():
    net = build_network("gcp12", 20)
    regions = [n.region for n in net.nodes]
    assert regions[:8] == regions[12:20]
    assert len(set(regions[:12])) == 12
    intra = net.link(net.nodes[0].name, net.nodes[12].name)
    assert intra.latency_s == 0.001 and intra.bandwidth_bps == 2 * GIB


def test_nodes_file_sets_regions_speed_and_memory(tmp_path):
    f = tmp_path / "nodes.json"
    f.write_text(json.dumps([{"name": "a", "region": "Oregon", "speed": 0.1, "memory": 3},
                             {"name": "b", "region": "Tokyo"}]))
    net = build_network("aws10", str(f), memory=5)
    assert [(n.name, n.region, n.speed, n.memory) for n in net.nodes] == [
        ("a", "Oregon", 0.1, 3), ("b", "Tokyo", 0.055, 5)]


def _doc(links):
    return {"regions": ["x", "y", "z"], "links": links}


def test_missing_link_is_a_clear_error():
    links = [{"a": "x", "b": "y", "latency_ms": 5, "bandwidth": 1},
             {"a": "x", "b": "z", "latency_ms": 5, "bandwidth": 1}]
    with pytest.raises(PlanError, match="no link between regions y-z"):
        build_network(_doc(links), 3)


@pytest.mark.parametrize("bw", [0, -1.0])
def test_zero_or_negative_bandwidth_is_a_clear_error(bw):
    links = [{"a": "x", "b": "y", "latency_ms": 5, "bandwidth": bw}]
    with pytest.raises(PlanError, match="bandwidth must be positive"):
        build_network({"regions": ["x", "y"], "links": links}, 2)


def test_memory_below_one_microbatch_is_a_clear_error():
    with pytest.raises(PlanError, match="too small for any plan"):
        build_network("gcp12", 4, memory=0)


def test_unknown_preset_or_missing_file_is_a_clear_error():
    with pytest.raises(PlanError, match="neither a preset"):
        build_network("nowhere.json", 4)


def test_skip_that_leaves_no_stage_is_rejected_and_visits_round_half_up():
    with pytest.raises(PlanError, match="leaves no stage besides stage 0"):
        visits_per_microbatch(3, 0.8)
    assert visits_per_microbatch(6, 0.33) == 3
    assert visits_per_microbatch(4, 0.25) == 2
    assert visits_per_microbatch(6, 0.0) == 5


def test_fewer_nodes_than_stages_is_rejected():
    with pytest.raises(PlanError, match="3 nodes cannot hold 4 stages"):
        replica_counts(3, 4, 0.0, model_preset("llama-1.5b"))


def test_replica_counts_give_stage0_its_larger_share():
    m = model_preset("llama-1.5b")
    # stage 0: 4 layers + 1 head equivalent for every microbatch = 5; others: 4 layers x 3/5 = 2.4
    # so 20 nodes split about 20*5/17 = 5.9 for stage 0 and 2.8 for each other stage
    assert replica_counts(20, 6, 0.33, m) == [6, 3, 3, 3, 3, 2]
    counts = replica_counts(18, 4, 0.25, m)
    assert sum(counts) == 18 and counts[0] == max(counts) and min(counts) >= 1
    assert replica_counts(4, 4, 0.5, m) == [1, 1, 1, 1]


def test_as_many_nodes_as_stages_give_one_node_each_whatever_the_shares():
    """The shares' floors can overshoot the node count when stage 0's share is large (a tiny model whose
    head weighs as much as its layers): taking nodes back must never leave a stage with none."""
    from roving.pipeline.planning.costs import ModelSpec

    assert replica_counts(4, 4, 0.33, ModelSpec(n_layers=4, dim=64, seq_len=32, samples_per_microbatch=4,
                                                 bytes_per_activation=4, head_layers=1.0)) == [1, 1, 1, 1]
    small = ModelSpec(n_layers=12, dim=64, seq_len=32, samples_per_microbatch=4, bytes_per_activation=4,
                      head_layers=3.0)
    for stages in (2, 3, 4, 6):
        for skip in ((0.0,) if stages == 2 else (0.0, 0.33, 0.5)):
            for spare in (0, 1, 2, 5):
                counts = replica_counts(stages + spare, stages, skip, small)
                assert sum(counts) == stages + spare and min(counts) >= 1, (stages, skip, spare, counts)


def test_cost_model_matches_the_paper_formula():
    m = model_preset("llama-1.5b")  # 24 layers, 4 samples, 1 head-layer equivalent
    assert stage_layers(m, 6) == [4] * 6
    c = stage_costs(m, 6, 0.055)
    assert c.forward[1] == pytest.approx(4 * 4 * 0.055)
    assert c.backward[1] == pytest.approx(2 * c.forward[1])
    assert c.forward[0] == pytest.approx((4 + 0.5) * 4 * 0.055)
    assert m.transfer_bytes == 4 * 1024 * 2048 * 2
