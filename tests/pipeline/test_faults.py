"""SkipPipe training through failures (issue 9), on local roving processes: a node killed with -9 in
the middle of an iteration, a node that stops answering (SIGSTOP: its heartbeats stop), a node slowed
down, a whole stage lost and taken over, killed nodes rejoining with their replicas' exact state, and a
run resumed after its coordinator was killed."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

torch.set_num_threads(1)

from roving.pipeline.protocol import Done, Export, Exported, Load, Microbatch, Stepped
from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare
from helpers_core import roving_children, wait_until

CFG = dict(model="tiny", nodes=6, stages=4, skip=0.33, microbatches=6, samples=4, seq_len=32,
           iterations=10, lr=3e-3, warmup=1, eval_every=100, eval_batches=4, planner_budget=0.3,
           replan_budget=0.2, speed=1e-3, clip=1.0, timeout=120, in_flight=2)


def kill_mid_iteration(t: Trainer, victims: list[str], kill=None) -> dict:
    """Run one iteration, killing ``victims`` (with -9, or ``kill(victims)``) as soon as its first
    microbatch is done (so the others are still on their way): a failure in the middle of the
    iteration, every time."""
    real = t.roster.recv
    seen = {"done": 0, "killed_during": None}

    def hooked(kind, *args, **kwargs):
        msg = real(kind, *args, **kwargs)
        if isinstance(msg, Done):
            seen["done"] += 1
            if seen["done"] == 1:
                seen["killed_during"] = len(t.plan.paths) - 1  # microbatches not done yet
                (kill or t.roster.kill)(victims)
        return msg

    t.roster.recv = hooked
    try:
        rec = t.iteration(t.iteration_no + 1)
    finally:
        t.roster.recv = real
    assert seen["killed_during"] and seen["killed_during"] > 0
    return rec


def stage_groups(t: Trainer) -> dict[int, list[str]]:
    """Each stage's nodes, as the current plan has them."""
    groups: dict[int, list[str]] = {}
    for n, s in sorted(t.alloc.items()):
        groups.setdefault(s, []).append(n)
    return groups


def train_until_admitted(t: Trainer, name: str, it: int, what: str, timeout: float = 60.0) -> int:
    """Run iterations from ``it`` until node ``name`` is in the plan (it is admitted between two);
    returns the next iteration number."""
    deadline = time.monotonic() + timeout
    while name not in t.alloc:
        assert time.monotonic() < deadline, what
        t.iteration(it)
        it += 1
        time.sleep(0.1)
    return it


def replicas_equal(t: Trainer, stage: int) -> list[str]:
    names = sorted(n for n, s in t.alloc.items() if s == stage)
    states = t.stage_states(all_replicas=True)
    first = states[names[0]][1]
    for n in names[1:]:
        for k, v in first.items():
            assert torch.equal(states[n][1][k], v), f"{n} differs from {names[0]} in {k}"
    return names


@pytest.fixture(scope="module")
def killed_and_rejoined():
    """8 iterations with a node of a replicated stage killed in iteration 2 and rejoining after
    iteration 4; and the same run without failures."""
    out = {}
    # the re-plan's search by evaluation count (the budget only caps it): the same on any machine
    prep = prepare(TrainConfig(**{**CFG, "replan_budget": 5.0, "replan_evals": 30}))
    with Trainer(prep) as t:
        out["val0"] = t.evaluate(0)["val_loss"]
        for it in range(2):
            t.iteration(it)
        groups = stage_groups(t)
        stage, names = max(groups.items(), key=lambda kv: (len(kv[1]), -kv[0]))
        assert len(names) >= 2
        victim = sorted(names)[0]
        out.update(victim=victim, stage=stage, alloc_before=dict(t.alloc))
        t.iteration_no = 1
        out["failed_rec"] = kill_mid_iteration(t, [victim])
        out["alloc_after"] = dict(t.alloc)
        out["plan_after"] = t.plan
        for it in range(3, 5):
            t.iteration(it)
        t.join([victim])
        out["alloc_joined"] = dict(t.alloc)
        out["joined_stage"] = t.alloc[victim]
        out["equal_at_join"] = replicas_equal(t, t.alloc[victim])
        ex = t.weights.ask(Export(), Exported, out["equal_at_join"])
        out["opt_states"] = {n: msg.optimizer for n, msg in ex.items()}
        for it in range(5, 8):
            t.iteration(it)
        out["equal_later"] = replicas_equal(t, t.alloc[victim])
        out["val"] = t.evaluate(8)["val_loss"]
        out["records"] = list(t.metrics["iterations"])
        out["events"] = list(t.metrics["events"])
    with Trainer(prepare(TrainConfig(**CFG))) as ref:
        for it in range(8):
            ref.iteration(it)
        out["val_ref"] = ref.evaluate(8)["val_loss"]
    return out


def test_a_node_killed_mid_iteration_is_routed_around_and_the_iteration_completes(killed_and_rejoined):
    r = killed_and_rejoined
    rec = r["failed_rec"]
    assert rec["attempts"] == 2, "the microbatch phase ran again after the failure"
    assert math.isfinite(rec["train_loss"])
    victim = r["victim"]
    assert victim not in r["alloc_after"]
    assert r["alloc_after"] == {n: s for n, s in r["alloc_before"].items() if n != victim}, \
        "the dead node's replica group shrank; no other node moved"
    for p in r["plan_after"].paths:
        assert victim != p.origin and victim not in p.nodes
    dead = [e for e in r["events"] if e["event"] == "dead"]
    assert dead[0]["nodes"] == [victim] and "exited" in dead[0]["why"][victim]
    assert [rec["iteration"] for rec in r["records"]] == list(range(8)), "training never stopped"
    replans = [e for e in r["events"] if e["event"] == "replan" and e["why"] in ("failure", "joined")]
    assert [e["path_evaluations"] for e in replans] == [30, 30], "replan_evals bounds each re-plan's search"


def test_training_stays_on_course_through_the_failure(killed_and_rejoined):
    r = killed_and_rejoined
    assert r["val"] < r["val0"] - 0.3
    assert abs(r["val"] - r["val_ref"]) / r["val_ref"] < 0.03, (r["val"], r["val_ref"])


def test_a_rejoined_node_gets_identical_weights_and_optimizer_state(killed_and_rejoined):
    r = killed_and_rejoined
    assert r["victim"] in r["alloc_joined"]
    assert r["victim"] in r["equal_at_join"] and len(r["equal_at_join"]) >= 2
    opts = list(r["opt_states"].values())
    for other in opts[1:]:
        assert other["state"].keys() == opts[0]["state"].keys()
        for idx, st in opts[0]["state"].items():
            for k, v in st.items():
                assert torch.equal(other["state"][idx][k], v), f"optimizer state {idx}.{k} differs"
    assert r["victim"] in r["equal_later"], "replicas stay identical after training on"
    joins = [e for e in r["events"] if e["event"] == "replan" and e["why"] == "joined"]
    assert joins and joins[0]["weights_from"][r["joined_stage"]] in r["alloc_joined"]


def test_a_lost_stage_is_skipped_until_a_node_takes_it_over_from_the_snapshot():
    cfg = dict(CFG, nodes=4, stages=4, skip=0.33, snapshot_every=2)
    prep = prepare(TrainConfig(**cfg))
    assert sorted(prep.plan.allocation.values()) == [0, 1, 2, 3], "one node per stage: no donor"
    with Trainer(prep) as t:
        for it in range(2):
            t.iteration(it)  # snapshot after iteration 2
        snap = {k: v.clone() for k, v in t.weights.snapshot["stages"][2]["params"].items()}
        assert t.weights.snapshot["iteration"] == 2
        t.iteration(2)
        lost = next(n for n, s in t.alloc.items() if s == 2)
        t.iteration_no = 2
        rec = kill_mid_iteration(t, [lost])
        assert rec["missing_stages"] == [2] and t.missing_stages == [2]
        for p in t.plan.paths:
            assert 2 not in p.stages and lost not in p.nodes
        assert all(len(p.stages) >= 1 for p in t.plan.paths), "the other stages are still visited"
        t.iteration(4)
        new = t.join([None])[0]
        assert t.alloc[new] == 2 and t.missing_stages == []
        state = t.stage_states(all_replicas=True)[new][1]
        for k, v in snap.items():
            assert torch.equal(state[k], v), f"{k} was not taken from the snapshot of iteration 2"
        takeover = [e for e in t.metrics["events"] if e["event"] == "takeover"]
        assert takeover and takeover[0]["stage"] == 2 and takeover[0]["snapshot_iteration"] == 2
        r5 = t.iteration(5)
        assert r5["missing_stages"] == [] and any(2 in p.stages for p in t.plan.paths)
        assert math.isfinite(r5["train_loss"])


def test_a_node_that_stops_answering_is_declared_dead_by_its_heartbeats_and_a_slow_node_is_planned_around():
    cfg = dict(CFG, dead_after=2.0, heartbeat=0.25, slow_factor=3.0, slow_iterations=2)
    prep = prepare(TrainConfig(**cfg))
    with Trainer(prep) as t:
        first = t.iteration(0)
        groups = stage_groups(t)
        busy = sorted(n for g in groups.values() if len(g) >= 2 for n in g)
        slow = max(busy, key=lambda n: (first["processed"][n], n))  # one the plan gives work to
        assert first["processed"][slow] > 0
        t.throttle(slow, 10.0)
        for it in range(1, 5):
            t.iteration(it)
            if any(e["event"] == "slow" for e in t.metrics["events"]):
                break
        marks = [e for e in t.metrics["events"] if e["event"] == "slow"]
        assert marks and marks[0]["nodes"] == [slow], t.metrics["events"]
        assert t.net.node(slow).speed > prep.network.node(slow).speed * 2, "re-planned with its measured speed"
        from roving.pipeline.planning.simulate import simulate

        old = simulate(t.net, prep.spec, prep.plan, record=False).makespan
        assert t.prediction.iteration_s < old, "on the network with the slow node, the new plan is faster than the old"
        replans = [e for e in t.metrics["events"] if e["event"] == "replan" and e["why"] == "slow"]
        assert replans and all(src and not src.startswith("snapshot") for src in replans[0]["weights_from"].values()), \
            "nodes that changed stage took the live weights of the stage, not a snapshot"
        # SIGSTOP: the process lives on but answers nothing, heartbeats included
        stopped = next(n for n in busy if n != slow)
        os.kill(t.roster.procs[stopped].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        rec = t.iteration(t.iteration_no + 1)
        dead = [e for e in t.metrics["events"] if e["event"] == "dead"]
        assert dead and dead[0]["nodes"] == [stopped]
        assert "no heartbeat" in dead[0]["why"][stopped]
        assert stopped not in t.alloc and rec["attempts"] >= 1
        waited = time.monotonic() - t0
        assert waited >= 2.0, "declared dead only after dead_after seconds without a heartbeat"
        t.roster.procs[stopped].join(timeout=10)
        assert not t.roster.procs[stopped].is_alive(), "a node declared dead is killed (fenced off)"


def test_resume_after_the_coordinator_is_killed_continues_exactly(tmp_path):
    """A full-pipeline run (every microbatch visits every stage, so losses do not depend on the
    plan) killed with -9 after a checkpoint, then resumed, computes the same losses as a run that was
    never interrupted."""
    common = ["--model", "tiny", "--network", "gcp12", "--nodes", "4", "--stages", "2", "--schedule", "dtfm",
              "--skip", "0", "--microbatches", "4", "--samples", "4", "--seq-len", "32", "--iterations", "24",
              "--eval-every", "100", "--seed", "3"]
    # 24 iterations, the checkpoint read every 20 ms: on a fast machine 8 iterations had all been done
    # between two reads of a 0.2 s poll, and the run ended before it could be killed mid-way
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROVING_")}
    cmd = [sys.executable, "-m", "roving.cli", "pipeline", "train", *common]
    ck = tmp_path / "run.pt"
    ref = subprocess.run([*cmd, "--metrics", str(tmp_path / "ref.json")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = subprocess.Popen([*cmd, "--checkpoint", str(ck), "--checkpoint-every", "1"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert time.monotonic() < deadline and run.poll() is None, "the run ended before it was killed"
            if ck.exists():
                done = torch.load(ck, weights_only=True)["iteration"]
                if done >= 3:
                    break
            time.sleep(0.02)
        nodes = roving_children(run.pid)
        assert len(nodes) == 4, nodes  # its nodes (forked by its starter)
        run.kill()
        run.wait()
    finally:
        if run.poll() is None:
            run.kill()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
              for p in nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p for p in nodes if os.path.exists(f"/proc/{p}")
             and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, "the dead coordinator's nodes exit within 10 s"
    at = torch.load(ck, weights_only=True)["iteration"]
    resumed = subprocess.run([*cmd, "--checkpoint", str(ck), "--checkpoint-every", "1", "--resume",
                              "--metrics", str(tmp_path / "resumed.json")], env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    got = json.loads((tmp_path / "resumed.json").read_text())
    want = json.loads((tmp_path / "ref.json").read_text())
    assert at < 24, "the run was killed before its end"
    assert [r["iteration"] for r in got["iterations"]] == list(range(24)), "each iteration once"
    assert any(e["event"] == "resumed" and e["iteration"] == at for e in got["events"])
    for a, b in zip(got["iterations"], want["iterations"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4), a["iteration"]


def test_resume_refuses_a_checkpoint_that_does_not_match(tmp_path):
    from roving.pipeline.errors import PlanError

    with pytest.raises(PlanError, match="does not exist"):
        Trainer(prepare(TrainConfig(**CFG, checkpoint=str(tmp_path / "none.pt"), resume=True)))
    torch.save({"model": {}}, tmp_path / "old.pt")
    with pytest.raises(PlanError, match="optimizer state"):
        Trainer(prepare(TrainConfig(**CFG, checkpoint=str(tmp_path / "old.pt"), resume=True)))
    with pytest.raises(PlanError, match="resume needs checkpoint"):
        TrainConfig(**CFG, resume=True).check()
    with pytest.raises(PlanError, match="heartbeat"):
        TrainConfig(**CFG, heartbeat=3.0, dead_after=2.0).check()


def test_a_node_that_starts_late_is_planned_around_and_joins_when_it_starts(monkeypatch):
    """As a job that a busy cluster keeps pending: the node's process is stopped (SIGSTOP) right
    after it is started, so it is not ready in ``start_wait``; training starts without it, and it
    joins once it runs (SIGCONT), with its replicas' weights."""
    from roving.pipeline.runtime.roster import Roster

    late = {}
    real_launch = Roster.launch

    def launch(self, name, stage, index, fresh=True):
        real_launch(self, name, stage, index, fresh)
        if not late and stage != 0 and list(self.prepared.plan.allocation.values()).count(stage) >= 2:
            late[name] = stage
            os.kill(self.procs[name].pid, signal.SIGSTOP)

    monkeypatch.setattr(Roster, "launch", launch)
    cfg = dict(CFG, nodes=7, start_wait=1.0)
    prep = prepare(TrainConfig(**cfg))
    with Trainer(prep) as t:
        assert len(late) == 1, prep.plan.allocation
        name = next(iter(late))
        assert name not in t.alloc and set(t.alloc.values()) == set(range(4))
        t.iteration(0)
        os.kill(t.roster.procs[name].pid, signal.SIGCONT)
        it = train_until_admitted(t, name, 1, "the late node never joined")
        t.iteration(it)
        replicas_equal(t, t.alloc[name])
        assert any(e["event"] == "replan" and e["joined"] == [name] for e in t.metrics["events"])


def test_the_join_command_adds_a_node_to_a_running_training(tmp_path):
    # 300 iterations: on a loaded 2-core machine the joining node's start took until iteration 93 (it
    # competes for the cores with the run, whose iterations slow down with it) and its refinement was
    # judged at iteration 110
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROVING_")}
    control = tmp_path / "control"
    train = subprocess.Popen(
        [sys.executable, "-m", "roving.cli", "pipeline", "train", "--model", "tiny", "--network", "gcp12",
         "--nodes", "4", "--stages", "2", "--skip", "0", "--microbatches", "4", "--samples", "2", "--seq-len", "16",
         "--iterations", "300", "--eval-every", "1000", "--control", str(control), "--metrics",
         str(tmp_path / "m.json"), "--refine-budget", "2",
         "--start-wait", "120"],  # all four from the start: a re-plan around a late one refines too
        env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (control / "status.json").exists():
            assert train.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        bad = subprocess.run([sys.executable, "-m", "roving.cli", "pipeline", "join", "--control", str(control),
                              "--region", "nowhere"], env=env, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "unknown region 'nowhere'" in bad.stderr
        ok = subprocess.run([sys.executable, "-m", "roving.cli", "pipeline", "join", "--control", str(control)],
                            env=env, capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        new = ok.stdout.split()[1].rstrip(":,")
        out, _ = train.communicate(timeout=300)
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 0, out[-3000:]
    m = json.loads((tmp_path / "m.json").read_text())
    joins = [e for e in m["events"] if e["event"] == "replan" and e["joined"] == [new]]
    assert joins, m["events"]
    assert new in joins[0]["allocation"]
    assert m["iterations"][-1]["nodes"] == 5
    status = subprocess.run([sys.executable, "-m", "roving.cli", "pipeline", "status", "--control", str(control)],
                            env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "iteration 300/300" in status.stdout and new in status.stdout and "stage 0:" in status.stdout
    # --refine-budget: the join's re-plan was followed by a refinement, judged once it came back
    refines = [e for e in m["events"] if e["event"] == "refine"]
    assert len(refines) == 1 and refines[0]["iteration"] > joins[0]["iteration"] and "error" not in refines[0]
    assert ("taken" if refines[0]["adopted"] else "not faster: not taken") in status.stdout
    doc = json.loads((control / "status.json").read_text())
    assert doc["nodes"][new] in (0, 1) and doc["starting"] == []
    nowhere = subprocess.run([sys.executable, "-m", "roving.cli", "pipeline", "join", "--control",
                              str(tmp_path / "none")], env=env, capture_output=True, text=True, timeout=60)
    assert nowhere.returncode == 2 and "not the control folder" in nowhere.stderr


def test_on_slurm_a_node_cancelled_by_scancel_is_routed_around_and_rejoins():
    """The same training with every node a job of the real Slurm that scripts/cluster/slurm.sh
    starts: an operator cancels one node's job mid-iteration; training goes on, and the node, started
    again as a new job, rejoins with its replicas' state. Five nodes over the four stages: one stage has
    two replicas, the one the victim is taken from."""
    import helpers_backends as hb

    hb.require("slurm")
    prep = prepare(TrainConfig(**{**CFG, "nodes": 5}, backend="slurm"))
    with Trainer(prep) as t:
        assert all(p.job.id.isdigit() for p in t.roster.procs.values()), "each node is a Slurm job"
        t.iteration(0)
        groups = stage_groups(t)
        victim = sorted(max(groups.values(), key=len))[0]
        def cancel(names):
            # scancel only asks: wait until the job has ended, so that it ends mid-iteration however
            # loaded the machine is (under load the iteration could otherwise finish first)
            hb.kill_from_outside("slurm", t.roster.procs[names[0]])
            assert wait_until(lambda: not t.roster.procs[names[0]].is_alive(), 60), "scancel did not end the job"

        rec = kill_mid_iteration(t, [victim], cancel)
        it = 2
        if victim in t.alloc:
            # Slurm ends the job some time after scancel, and the coordinator waits for that inside the
            # iteration: on a loaded machine the victim's part of it can be done by then, the iteration
            # ends, and the death, found after it, is planned around from the next one.
            t.iteration(it)
            it += 1
        assert victim not in t.alloc
        dead = [e for e in t.metrics["events"] if e["event"] == "dead"]
        assert dead and dead[0]["nodes"] == [victim]
        assert math.isfinite(rec["train_loss"])
        t.iteration(it)
        t.join([victim], timeout=120)
        assert t.roster.procs[victim].job.id.isdigit()
        t.iteration(it + 1)
        assert victim in replicas_equal(t, t.alloc[victim])


def test_with_restart_a_killed_node_is_started_again_and_rejoins_by_itself():
    # five nodes over the four stages: one stage has two replicas, the one the victim is taken from
    prep = prepare(TrainConfig(**{**CFG, "nodes": 5}, restart=True))
    with Trainer(prep) as t:
        t.iteration(0)
        groups = stage_groups(t)
        victim = sorted(max(groups.values(), key=len))[0]
        old_pid = t.roster.procs[victim].pid
        t.iteration_no = 0
        kill_mid_iteration(t, [victim])
        assert victim not in t.alloc
        it = train_until_admitted(t, victim, 2, "the restarted node never rejoined")
        assert t.roster.procs[victim].pid != old_pid and t.roster.incarnation[victim] == 1
        t.iteration(it)
        assert victim in replicas_equal(t, t.alloc[victim])
        kinds = [e["event"] for e in t.metrics["events"]]
        assert kinds.index("dead") < kinds.index("join-requested")


def test_in_docker_a_node_killed_by_docker_kill_is_routed_around_and_rejoins():
    """The same with every node a container of the real Docker engine that scripts/cluster/docker.sh
    starts: `docker kill` of one node's container mid-iteration; it rejoins as a new container. Five
    nodes over the four stages: one stage has two replicas, the one the victim is taken from."""
    import helpers_backends as hb
    import roving

    hb.require("docker")
    roving.init(**hb.docker_options())
    prep = prepare(TrainConfig(**{**CFG, "nodes": 5}, backend="docker"))
    with Trainer(prep) as t:
        t.iteration(0)
        victim = sorted(max(stage_groups(t).values(), key=len))[0]
        first_container = t.roster.procs[victim].job.id
        rec = kill_mid_iteration(t, [victim], lambda names: hb.kill_from_outside("docker", t.roster.procs[names[0]]))
        assert victim not in t.alloc and math.isfinite(rec["train_loss"])
        assert [e for e in t.metrics["events"] if e["event"] == "dead"][0]["nodes"] == [victim]
        t.iteration(2)
        t.join([victim], timeout=120)
        assert t.roster.procs[victim].job.id != first_container
        t.iteration(3)
        assert victim in replicas_equal(t, t.alloc[victim])


def test_a_node_dying_while_the_others_step_or_while_states_are_gathered_stops_nothing():
    prep = prepare(TrainConfig(**CFG))
    with Trainer(prep) as t:
        t.iteration(0)
        groups = stage_groups(t)
        first = sorted(max(groups.values(), key=len))[0]
        real = t.roster.recv
        seen = {"stepped": 0}

        def hooked(kind, *args, **kwargs):
            msg = real(kind, *args, **kwargs)
            if kind is Stepped:
                seen["stepped"] += 1
                if seen["stepped"] == 1:
                    t.roster.kill([first])  # the step messages are out: the others step all the same
            return msg

        t.roster.recv = hooked
        try:
            rec = t.iteration(1)
        finally:
            t.roster.recv = real
        assert rec["attempts"] == 1, "it died after the microbatch phase: nothing is run again"
        assert seen["stepped"] >= 1
        r2 = t.iteration(2)  # the dead node is planned around at this boundary
        assert first not in t.alloc and math.isfinite(r2["train_loss"])
        assert [e for e in t.metrics["events"] if e["event"] == "dead"][0]["nodes"] == [first]
        # one replica of each stage is asked for its weights; the one asked for a replicated stage dies
        # first (5 nodes hold 4 stages: some stage has two)
        stage = next(s for s, g in sorted(stage_groups(t).items()) if len(g) >= 2)
        holders = sorted(n for n in t.alloc if t.alloc[n] == stage)
        t.roster.kill([holders[0]])
        states = t.stage_states()
        assert {st for st, _ in states.values()} == set(range(4)), "another replica answered"
        assert holders[0] not in states
        assert math.isfinite(t.iteration(3)["train_loss"])


def test_a_round_that_lost_a_message_stalls_and_runs_again_on_the_same_plan():
    """A message lost to a network drop (here: the coordinator's order to start one microbatch,
    dropped on its way in the first attempt) leaves the round waiting with every node alive: after
    ``stall_after`` seconds without a message it is aborted and run again on the same plan; no node is
    declared dead and nothing is re-planned. Four nodes, one a stage: no replica is needed for it."""
    prep = prepare(TrainConfig(**{**CFG, "nodes": 4, "timeout": 300}, stall_after=3.0))
    with Trainer(prep) as t:
        t.iteration(0)
        alloc, paths = dict(t.alloc), [p.nodes for p in t.plan.paths]
        real = t.roster.put
        dropped = []

        def lossy(name, msg):
            if isinstance(msg, Microbatch) and not dropped:
                dropped.append(msg.mb)  # the first microbatch's order never arrives
                return
            real(name, msg)

        t.roster.put = lossy
        try:
            rec = t.iteration(1)
        finally:
            t.roster.put = real
        assert len(dropped) == 1
        stalled = [e for e in t.metrics["events"] if e["event"] == "stalled"]
        assert len(stalled) == 1 and "within 3 s" in stalled[0]["why"]
        assert rec["attempts"] == 2 and rec["seconds_lost"] >= 3.0
        assert math.isfinite(rec["train_loss"])
        assert t.alloc == alloc and [p.nodes for p in t.plan.paths] == paths  # the same plan
        assert not [e for e in t.metrics["events"] if e["event"] in ("dead", "replan")]
        t.iteration(2)


def test_stall_after_must_be_seconds_at_least_zero():
    from roving.pipeline.errors import PlanError

    for bad in (-1, "ten", True):
        with pytest.raises(PlanError, match="stall_after"):
            TrainConfig(**CFG, stall_after=bad).check()


def test_a_round_is_taken_as_stalled_after_stall_after_but_never_before_twice_the_predicted_iteration():
    from types import SimpleNamespace

    from roving.pipeline.dispatch import Dispatch
    from roving.pipeline.errors import NoMessage, RoundStalled

    t = Trainer.__new__(Trainer)  # the rule alone: no nodes
    asked = []

    def recv(kind, timeout=None, rnd=None):
        asked.append(timeout)
        raise NoMessage(f"no {kind!r} message from the nodes within {timeout} s")

    t.dispatch = Dispatch(SimpleNamespace(recv=recv))
    t.dispatch.on(Done, lambda msg: None)
    for stall_after, predicted, expect in ((3.0, 1.0, 3.0), (3.0, 10.0, 20.0), (3.0, math.nan, 3.0)):
        t.config, t.prediction = TrainConfig(**CFG, stall_after=stall_after), SimpleNamespace(here_s=predicted)
        with pytest.raises(RoundStalled, match="within"):
            t._read_round(lambda: False, 1)
        assert asked[-1] == expect
    t.config = TrainConfig(**CFG, stall_after=0)  # off: the plain timeout, and its error
    with pytest.raises(NoMessage):
        t._read_round(lambda: False, 1)
    assert asked[-1] is None


def test_loading_weights_leaves_out_a_node_that_dies_meanwhile():
    """Two nodes of one lost machine are declared dead one after the other: the second can die while
    the first one's re-plan moves weights to it. The load goes on without it (it is re-planned around
    at the next boundary) instead of waiting for its answer until the timeout (seen across hosts)."""
    prep = prepare(TrainConfig(**dict(CFG, timeout=30)))
    with Trainer(prep) as t:
        t.iteration(0)
        a, b = sorted(t.alloc)[:2]
        stage = t.alloc[a]
        ex = t.weights.ask(Export(), Exported, [a])[a]
        params, opt = ex.params, ex.optimizer
        real_put = t.roster.put

        def put(name, msg):
            real_put(name, msg)
            if name == b and isinstance(msg, Load):  # b dies before it can answer
                t.roster.procs[b].kill()
                assert wait_until(lambda: not t.roster.procs[b].is_alive(), 30)

        t.roster.put = put
        started = time.monotonic()
        try:
            t.weights.load({stage: {"params": params, "optimizer": opt}}, {a: stage, b: stage}, t._limit)
        finally:
            t.roster.put = real_put
        assert time.monotonic() - started < 25, "the load waited for the dead node's answer"
        assert t.roster.holding[a] == stage and b in t.roster.lost and b not in t.roster.inboxes
        rec = t.iteration(1)  # the next attempt plans around it
        assert b not in t.alloc and math.isfinite(rec["train_loss"])
