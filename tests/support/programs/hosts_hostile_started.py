"""A SkipPipe training whose nodes are jobs of the multi-node Slurm on the compute hosts, one of them
hostile from its start (``hostile_node.started_main``: while the others start it asks the coordinator's
node for every mailbox there is, asks for credentials, and sends a pickle that would write a marker file
and a negative norm). The coordinator runs here, on the login host. Prints, as JSON, what the test checks.

usage: hosts_hostile_started.py RESULT_PATH
"""
import json
import os
import socket
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import hostile_node  # noqa: E402
from helpers_core import wait_or_exit  # noqa: E402

from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare  # noqa: E402
from roving.pipeline.runtime import roster as roster_module  # noqa: E402




if __name__ == "__main__":
    result = sys.argv[1]
    os.environ["HOSTILE_NODE_RESULT"] = result  # the jobs inherit it (the hosts share the filesystem)
    roster_module.stage_main = hostile_node.started_main
    launch = roster_module.Roster.launch

    def hostile_first(self, name, *args, **kwargs):  # the others start while it already attacks
        if name != hostile_node.HOSTILE and hostile_node.HOSTILE not in self.procs:
            launch(self, hostile_node.HOSTILE, prep.plan.allocation[hostile_node.HOSTILE],
                   sorted(prep.plan.allocation).index(hostile_node.HOSTILE))
            wait_or_exit(lambda: Path(result + ".attacking").exists(), 180)
        if name == hostile_node.HOSTILE and name in self.procs:
            return
        launch(self, name, *args, **kwargs)

    roster_module.Roster.launch = hostile_first
    cfg = TrainConfig(model="tiny", network="gcp12", nodes=5, stages=2, skip=0.0, microbatches=4, samples=2,
                      seq_len=16, iterations=6, eval_every=100, eval_batches=2, planner_budget=0.3, timeout=180,
                      start_wait=60, seed=2, backend="slurm")
    prep = prepare(cfg)
    assert hostile_node.HOSTILE in prep.plan.allocation
    with Trainer(prep) as t:
        metrics = t.train()
        jobs = {name: str(p.job.id) for name, p in t.roster.procs.items()}
        excluded = sorted(t.roster.excluded)
        trains = sorted(t.alloc)
    said = json.loads(Path(result).read_text())
    print(json.dumps({"coordinator_host": socket.gethostname(), "hostile": hostile_node.HOSTILE, "jobs": jobs,
                      "caught": [e["nodes"] for e in metrics["events"] if e["event"] == "caught"],
                      "blamed": [e for e in metrics["events"] if e["event"] == "caught"],
                      "excluded": excluded, "trains": trains, "nodes": sorted(prep.plan.allocation),
                      "iterations": len(metrics["iterations"]),
                      "losses": [r["train_loss"] for r in metrics["iterations"]],
                      "hostile_said": said, "marker": Path(result + ".marker").exists()}))
