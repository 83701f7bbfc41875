"""A SkipPipe ``schedule.json`` read as a roving plan: its allocation and routes as its trainer reads
them, simulated and planned beside roving's plans; what does not fit is an error naming the field."""

import copy
import json

import pytest

from roving.cli import main
from roving.pipeline import model_preset, simulate
from roving.pipeline.errors import PlanError
from roving.pipeline.planning.plan import Plan, Route
from roving.pipeline.planning.skippipe_schedule import read_schedule, schedule_network, schedule_plan

#: a schedule of SkipPipe's shape, small: 7 nodes on 3 stages, origins 0 and 3, 2 microbatches each,
#: memory 2; "ca-paths" one route an origin, "non-ca-paths" memory (2) routes an origin.
SCHEDULE = {
    "locations": ["Belgium", "Canada", "Germany", "Iowa", "Japan", "LA", "NL"],
    "partitions": [[0, 3], [1, 5], [2, 4, 6]],
    "memory": 2,
    "ours-sends": 2,
    "delays": [[0.5] * 7 for _ in range(7)],  # not read: roving's network judges
    "ca-paths": {"0": {"0": 1, "1": 2}, "1": {"3": 4, "4": 5}},
    "non-ca-paths": {"0": {"0": 5, "5": 6}, "1": {"0": 1, "1": 4}, "2": {"3": 2, "2": 1}, "3": {"3": 5, "5": 6}},
}
MODEL = model_preset("llama-1.5b-skippipe")


def test_a_schedule_becomes_the_plan_its_trainer_runs_each_origins_microbatches_on_its_routes():
    sched = read_schedule(SCHEDULE)
    net = schedule_network(sched)
    assert [(n.name, n.region, n.memory) for n in net.nodes][:2] == [("n00", "Belgium", 2), ("n01", "Canada", 2)]
    ca = schedule_plan(sched, net, "ca")
    assert ca.allocation == {"n00": 0, "n03": 0, "n01": 1, "n05": 1, "n02": 2, "n04": 2, "n06": 2}
    # one route an origin: both of its microbatches take it; stage 1 then 2, and stage 2 then 1
    assert ca.paths == [Route("n00", ("n01", "n02"), (1, 2))] * 2 + [Route("n03", ("n04", "n05"), (2, 1))] * 2
    assert (ca.stages, ca.skip, ca.route_rule) == (3, 0.0, "skippipe")
    non_ca = schedule_plan(sched, net, "non-ca")
    # memory routes an origin: microbatch j of origin o takes route o * memory + j % memory
    assert [(p.origin, p.nodes) for p in non_ca.paths] == [
        ("n00", ("n05", "n06")), ("n00", ("n01", "n04")), ("n03", ("n02", "n01")), ("n03", ("n05", "n06"))]
    by_hand = Plan(3, 0.0, dict(ca.allocation), list(ca.paths))
    assert simulate(net, MODEL, ca, record=False).makespan == simulate(net, MODEL, by_hand, record=False).makespan


def test_a_schedules_skip_is_the_one_whose_visits_its_routes_make():
    doc = {**SCHEDULE, "partitions": [[0, 3], [1], [5], [2, 4, 6]],
           "ca-paths": {"0": {"0": 1, "1": 2}, "1": {"3": 5, "5": 4}}}
    doc.pop("non-ca-paths")
    sched = read_schedule(doc)
    p = schedule_plan(sched, schedule_network(sched))
    assert p.stages == 4 and [len(r.nodes) for r in p.paths] == [2] * 4
    from roving.pipeline.planning.plan import visits_per_microbatch
    assert visits_per_microbatch(4, p.skip) == 2


def _broken(**changes):
    doc = copy.deepcopy(SCHEDULE)
    for k, v in changes.items():
        if v is None:
            doc.pop(k.replace("_", "-"))
        else:
            doc[k.replace("_", "-")] = v
    return doc


@pytest.mark.parametrize("doc, words", [
    (_broken(partitions=None), "partitions must be a list of at least 2 stages"),
    (_broken(partitions=[[0, 3], [1, 9]]), "partitions[1][1] must be a node number below 7"),
    (_broken(partitions=[[0, 3], [1, 3]]), "partitions[1][1] puts node 3 in stage 1, but it is in stage 0"),
    (_broken(memory=0), "memory must be a whole number >= 1, got 0"),
    (_broken(ours_sends="6"), "ours-sends must be a whole number >= 1"),
    (_broken(ca_paths={"0": {"0": 1, "1": 2}}), "ca-paths must be an object of 2 routes (one an origin) or 4"),
    (_broken(ca_paths={"0": {"1": 2}, "1": {"3": 4}}), "ca-paths[0] must start at node 0 (partitions[0][0])"),
    (_broken(ca_paths={"0": {"0": 3}, "1": {"3": 4}}), "ca-paths[0] sends to node 3, which holds stage 0"),
    (_broken(ca_paths={"0": {"0": 1, "1": 0}, "1": {"3": 4}}), "ca-paths[0] visits node 0 twice"),
    (_broken(ca_paths={"0": {"0": 1, "2": 4}, "1": {"3": 4}}), "ca-paths[0] has hops that do not follow on"),
    (_broken(ca_paths={"0": {"0": "one"}, "1": {"3": 4}}), "ca-paths[0] must map node numbers to node numbers"),
    (_broken(ca_paths=None, non_ca_paths=None), "the routes are missing"),
    (["not", "an", "object"], "the file must be a JSON object"),
])
def test_a_schedule_that_does_not_fit_is_an_error_naming_the_field(doc, words):
    with pytest.raises(PlanError) as err:
        read_schedule(doc)
    assert words in str(err.value) and str(err.value).startswith("schedule.json: "), str(err.value)


def test_a_schedule_that_does_not_fit_the_network_or_its_plan_is_an_error_naming_the_field():
    with pytest.raises(PlanError, match=r"locations\[2\] is region 'Mars', which network gcp12 does not have"):
        schedule_network(read_schedule(_broken(locations=["Belgium", "Canada", "Mars", "Iowa", "Japan", "LA", "NL"])))
    sched = read_schedule(SCHEDULE)
    with pytest.raises(PlanError, match="random-paths is missing from the schedule"):
        schedule_plan(sched, schedule_network(sched), "random")
    small = schedule_network(read_schedule({**SCHEDULE, "locations": SCHEDULE["locations"][:5] + ["LA", "NL"]}))
    with pytest.raises(PlanError, match=r"partitions\[1\] names node 5, but the network has no node n05"):
        schedule_plan(sched, small.without(["n05", "n06"]))
    uneven = read_schedule(_broken(ca_paths={"0": {"0": 1, "1": 2}, "1": {"3": 4}}))
    with pytest.raises(PlanError, match=r"ca-paths routes visit different numbers of stages \(\[1, 2\]\)"):
        schedule_plan(uneven, schedule_network(uneven))


def test_pipeline_simulate_and_plan_judge_a_schedule_beside_roving_plans(tmp_path, capsys):
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(SCHEDULE))
    sched = read_schedule(SCHEDULE)
    net = schedule_network(sched)
    want = simulate(net, MODEL, schedule_plan(sched, net), record=False).makespan
    assert main(["pipeline", "simulate", str(path)]) == 0
    assert f"SkipPipe ca schedule: {want:.2f} s per iteration (4 microbatches on 7 nodes, 3 stages; shared links)" \
        in capsys.readouterr().out
    out = tmp_path / "plan.json"
    assert main(["pipeline", "plan", "--skippipe-schedule", str(path), "--evals", "40", "--budget", "120",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["iteration_time_s"]["skippipe_schedule"] == pytest.approx(want)
    assert (doc["stages"], doc["microbatches"], len(doc["nodes"])) == (3, 4, 7)
    assert [n["region"] for n in doc["nodes"]] == SCHEDULE["locations"]
    capsys.readouterr()
    # the plan written is read back by `simulate`, under either model of the links
    assert main(["pipeline", "simulate", str(out)]) == 0
    assert f"plan: {doc['iteration_time_s']['skippipe']:.2f} s per iteration" in capsys.readouterr().out
    assert main(["pipeline", "simulate", str(out), "--no-link-sharing"]) == 0
    assert "no link sharing" in capsys.readouterr().out
    path.write_text(json.dumps(_broken(memory=-1)))
    assert main(["pipeline", "simulate", str(path)]) == 2
    assert "error: schedule.json: memory must be a whole number >= 1, got -1" in capsys.readouterr().err


def test_a_schedule_is_trained_on_its_own_plan_and_a_run_that_does_not_fit_it_is_refused(tmp_path):
    import math

    import torch

    from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare
    torch.set_num_threads(1)
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(SCHEDULE))
    run = dict(model="tiny", nodes=7, stages=3, skip=0.0, microbatches=4, samples=2, seq_len=16, iterations=2,
               lr=3e-3, warmup=1, eval_every=100, eval_batches=1, planner_budget=0.3, speed=1e-3, timeout=120,
               in_flight=2, start_wait=120, skippipe_schedule=str(path))
    prep = prepare(TrainConfig(**run))
    sched = read_schedule(SCHEDULE)
    assert prep.plan.paths == schedule_plan(sched, schedule_network(sched)).paths
    assert [n.region for n in prep.network.nodes] == SCHEDULE["locations"]
    with Trainer(prep) as t:
        metrics = t.train()
    assert len(metrics["iterations"]) == 2 and all(math.isfinite(r["train_loss"]) for r in metrics["iterations"])
    assert t.plan.paths == prep.plan.paths, "no node lost: the schedule's routes throughout"
    for name, value, words in (("stages", 4, "[plan] stages is 4 but the SkipPipe schedule"),
                               ("microbatches", 6, "[plan] microbatches is 6 but"),
                               ("nodes", 8, "[plan] nodes is 8 but")):
        with pytest.raises(PlanError) as err:
            prepare(TrainConfig(**{**run, name: value}))
        assert words in str(err.value) and f"makes {({'stages': 3, 'microbatches': 4, 'nodes': 7})[name]}" \
            in str(err.value), str(err.value)
    with pytest.raises(PlanError, match="skippipe_schedule must be the path of a SkipPipe schedule.json"):
        TrainConfig(**{**run, "schedule": "dtfm"}).check()
