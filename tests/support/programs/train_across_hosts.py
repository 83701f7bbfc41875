"""SkipPipe training whose nodes are Slurm jobs spread over the test hosts (tests/hosts/test_many_hosts.py).

Run on the login host with SLURM_CONF of the hosts' cluster. After a first iteration it prints PLACED
with each node's host and the host to cut (the one whose loss leaves every stage a node; a placement without
one is made again, with new jobs and another seed, up to ATTEMPTS times); at the first
microbatch done of the next iteration it prints CUT and waits for a line on stdin (the test cuts that
host meanwhile); then it trains on and prints RESULT.
"""
import json
import math
import subprocess
import sys

import torch

torch.set_num_threads(1)

from roving.pipeline.protocol import Done  # noqa: E402
from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare  # noqa: E402

CFG = dict(model="tiny", nodes=6, stages=3, skip=0.33, microbatches=6, samples=4, seq_len=32,
           iterations=10, lr=3e-3, warmup=1, eval_every=100, eval_batches=4, planner_budget=0.3,
           replan_budget=0.2, speed=1e-3, clip=1.0, timeout=120, in_flight=2, backend="slurm",
           dead_after=6.0)  # a loaded machine can delay a live node's heartbeats by seconds; a cut one stops


def host_of(proc) -> str:
    out = subprocess.run(["squeue", "-h", "-j", proc.job.id, "-o", "%N"], capture_output=True, text=True,
                         timeout=30).stdout.strip()
    return out


#: how many placements to try: Slurm places the jobs and the (time-bounded) planner allocates the stages,
#: neither knowing the other, so a placement may have no host whose loss leaves every stage a node
ATTEMPTS = 5


def main() -> dict:
    for attempt in range(ATTEMPTS):
        prep = prepare(TrainConfig(**{**CFG, "seed": attempt}))
        with Trainer(prep) as t:
            t.iteration(0)
            hosts = {name: host_of(p) for name, p in t.roster.procs.items()}
            stages: dict = {}
            for name, stage in t.alloc.items():
                stages.setdefault(stage, set()).add(hosts[name])
            victim = next((h for h in sorted(set(hosts.values()))
                           if all(held - {h} for held in stages.values())), None)
            if victim is None:
                print(f"attempt {attempt}: no host leaves every stage a node: {hosts}, {t.alloc}", flush=True)
                continue
            print("PLACED " + json.dumps({"hosts": hosts, "victim": victim, "attempt": attempt}), flush=True)
            return cut_and_train(t, hosts, victim)
    raise SystemExit(f"no placement in {ATTEMPTS} attempts had a host whose loss leaves every stage a node")


def cut_and_train(t: Trainer, hosts: dict, victim: str) -> dict:
    """Trains on while the test cuts ``victim`` off at the first microbatch done of iteration 1."""
    real = t.roster.recv  # every node message comes in through the roster
    seen = {"done": 0}

    def hooked(kind, *args, **kwargs):
        msg = real(kind, *args, **kwargs)
        if isinstance(msg, Done):
            seen["done"] += 1
            if seen["done"] == 1:
                print("CUT " + json.dumps(victim), flush=True)
                sys.stdin.readline()
        return msg

    t.roster.recv = hooked  # type: ignore[method-assign]
    try:
        rec = t.iteration(1)
    finally:
        t.roster.recv = real  # type: ignore[method-assign]
    losses = [rec["train_loss"]] + [t.iteration(it)["train_loss"] for it in (2, 3)]
    dead = [e for e in t.metrics["events"] if e["event"] == "dead"]
    return {"hosts": hosts, "victim": victim, "dead": sorted(n for e in dead for n in e["nodes"]),
            "losses_finite": all(math.isfinite(x) for x in losses), "alloc": sorted(t.alloc),
            "cut_mid_iteration": seen["done"] >= 1}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
