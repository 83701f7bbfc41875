"""The roster of a training run on its own (no trainer, no plan changes): stage processes started and
admitted with every inbox, a node joining and being admitted, a process whose heartbeats stop or whose
process exits reported lost (and fenced off), and a roster that never plans."""

import ast
import os
import signal
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from roving.pipeline import protocol as m
from roving.pipeline.errors import NodesLost
from roving.pipeline.runtime.roster import Roster
from roving.pipeline.run.trainer import TrainConfig, prepare
from helpers_core import wait_until

CFG = dict(model="tiny", nodes=3, stages=2, skip=0.0, microbatches=2, samples=2, seq_len=16, iterations=2,
           eval_batches=2, planner_budget=0.2, speed=1e-3, timeout=60, in_flight=2, heartbeat=0.2, dead_after=1.5)


def started(prep) -> tuple[Roster, list]:
    events: list = []
    roster = Roster(prep, lambda kind, **fields: events.append((kind, fields)))
    for index, (name, stage) in enumerate(sorted(prep.plan.allocation.items())):
        roster.launch(name, stage, index)
    while roster.starting:
        roster.recv(m.Ready, check=False)
    assert roster.open() == [], "every process was ready"
    return roster, events


def states(roster: Roster, names) -> dict[str, int]:
    for n in names:
        roster.put(n, m.StateRequest())
    got = {}
    for _ in names:
        msg = roster.recv(m.State, names=set(names))
        got[msg.sender] = msg.stage
    return got


def test_processes_are_admitted_a_node_joins_and_all_stop():
    prep = prepare(TrainConfig(**CFG))
    roster, events = started(prep)
    try:
        alloc = prep.plan.allocation
        assert set(roster.inboxes) == set(alloc) and roster.holding == alloc
        assert states(roster, sorted(alloc)) == alloc, "each answers with the stage it was started with"
        name = roster.request_join()
        assert name not in alloc and name in roster.universe and roster.holding[name] is None
        assert ("join-requested", {"nodes": [name]}) in events
        assert roster.admit() == [], "not reported ready yet (ready is read by recv): nothing to admit"
        roster.wait_ready([name], timeout=60)
        assert roster.admit() == [name] and name in roster.inboxes
        assert states(roster, [name]) == {name: 0}, "a joining process starts on stage 0"
        with pytest.raises(Exception, match="already running"):
            roster.request_join(name)
        roster.check(force=True)  # nobody lost
        assert roster.take_lost() == {}
    finally:
        roster.stop()
    assert wait_until(lambda: not any(p.is_alive() for p in roster.procs.values()), 30)


def test_a_process_whose_heartbeats_stop_and_one_that_exits_are_reported_lost():
    prep = prepare(TrainConfig(**CFG))
    roster, events = started(prep)
    try:
        quiet, gone, kept = sorted(roster.inboxes)
        os.kill(roster.procs[quiet].pid, signal.SIGSTOP)
        with pytest.raises(NodesLost) as lost:
            assert wait_until(lambda: roster.check(force=True), 30)
        assert list(lost.value.names) == [quiet] and "no heartbeat" in lost.value.names[quiet]
        assert quiet not in roster.inboxes
        assert wait_until(lambda: not roster.procs[quiet].is_alive(), 30), "fenced off: killed"
        roster.kill([gone])
        assert wait_until(lambda: not roster.procs[gone].is_alive(), 30)
        with pytest.raises(NodesLost) as lost:
            roster.check(force=True)
        assert list(lost.value.names) == [gone] and "exited" in lost.value.names[gone]
        assert roster.take_lost().keys() == {quiet, gone} and roster.take_lost() == {}
        assert [f["nodes"] for k, f in events if k == "dead"] == [[quiet], [gone]]
        assert states(roster, [kept]) == {kept: prep.plan.allocation[kept]}, "the others go on"
    finally:
        roster.stop()


def test_the_roster_never_plans():
    """It reports lost processes; what to do about them is the trainer's: it imports no planning."""
    src = Path(__file__).parents[2] / "src" / "roving" / "pipeline" / "runtime" / "roster.py"
    imported = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    planning = {"paths", "planner", "routes", "baselines", "allocate", "simulate", "background", "trainer", "dtfm"}
    assert not imported & planning, imported & planning
    assert not [n for n in dir(Roster) if "plan" in n.lower()]
