"""Stage recovery side by side (issue 24): no failures, ``skip``, ``snapshot`` (every 10 iterations) and
``neighbours`` (CheckFree's rule), three seeds each, at failure rates of about 5%, 10% and 33% of the
stages per scaled hour; validation loss against iterations (measured) and against modelled time.

Each run trains the tiny model (6 layers of width 64, 3 stages on 3 nodes: no replica, CheckFree's
setting, so a failed node is a lost stage) on the corpus that ships with roving, on local processes. Failures
come from ``[faults] fail_rate`` with
``fail_hour_iterations`` iterations as the scaled hour: at an iteration's start every replica of the
stage is killed with -9 (``Trainer.kill_stage``), the killed node is started again and joins at once
(``Trainer.join``), and takes the stage over as the policy says (under ``skip`` the stage is gone for
good and the node does not come back). The seed gives the model's initial weights, the data order and
the failures: the same for every policy at one seed, and the failures at a lower rate are a subset of
those at a higher one (one uniform draw per stage and iteration).

Time is modelled, not measured (the tiny model's seconds say nothing about the paper's): each
iteration costs what the planner's simulator predicts for the plan in use (its paths and allocation)
with the paper's LLaMA-1.5B setting (``llama-1.5b-skippipe``: 24 layers of width 2048, sequence 4096,
0.055 s per sample per layer) on the run's network (gcp12), replica averaging included; on top:

- snapshot: every 10 iterations each stage's weights and AdamW moments (12 bytes a parameter, at the
  1.5B size) go from one replica to the coordinator's machine (in n00's region, not n00 itself) over the
  network description's link,
  all stages at once (the slowest link counts); a recovery brings the stage's snapshot back to each
  node that takes it over;
- neighbours: a recovery brings each neighbour's weights (4 bytes a parameter) from one of its
  replicas to each node that takes the stage over, in parallel;
- skip: nothing; every failure, whatever the policy: ``dead_after`` (2 s) until it is declared dead.

A run whose failure schedule is empty at a rate is the no-failure run of its seed (the same computation:
the planner is bounded by evaluation counts, so the runs are deterministic); it is not run again.

    PYTHONPATH=src python benchmarks/recovery.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from roving.pipeline.planning.costs import MODEL_PRESETS, PAPER_SECONDS_PER_SAMPLE_LAYER, stage_params
from roving.pipeline.faults import FailureSchedule
from roving.pipeline.planning.simulate import predict
from roving.pipeline.run.trainer import Trainer, TrainConfig, calibrate, prepare

BASE = dict(model="tiny", layers=6, dim=64, seq_len=32, samples=4, network="gcp12", nodes=3, stages=3,
            skip=0.33, microbatches=6, in_flight=3, lr=3e-3, min_lr=3e-4, warmup=3, clip=1.0,
            eval_every=5, eval_batches=8, planner_budget=5.0, planner_evals=500, replan_budget=1.0,
            replan_evals=100, timeout=120, recovery_lr_factor=1.1)
POLICIES = {"no failures": dict(snapshot_every=0), "skip": dict(stage_recovery="skip", snapshot_every=0),
            "snapshot": dict(stage_recovery="snapshot", snapshot_every=10),
            "neighbours": dict(stage_recovery="neighbours", snapshot_every=0)}
PAPER = MODEL_PRESETS["llama-1.5b-skippipe"]
STORE = "coordinator"  # where snapshots are kept: the coordinator's machine, in n00's region
STATE_BYTES, WEIGHT_BYTES = 12.0, 4.0  # per parameter: fp32 weights + two AdamW moments; fp32 weights


class Modelled:
    """The modelled seconds of a run (the module doc), kept as it goes."""

    def __init__(self, t: Trainer) -> None:
        self.t = t
        self.params = stage_params(PAPER, t.config.stages)
        self.sync = [p * 4.0 for p in self.params]
        self.seconds = 0.0
        self._cache: dict[str, float] = {}

    def _net(self):
        net = self.t.net
        return dataclasses.replace(net, nodes=[dataclasses.replace(n, speed=PAPER_SECONDS_PER_SAMPLE_LAYER)
                                               for n in net.nodes])

    def _transfer(self, src: str, dst: str, nbytes: float) -> float:
        """Seconds for ``nbytes`` from node ``src`` to ``dst`` (STORE: the coordinator's machine, in
        n00's region but not n00) over the run's network description (every node it started with)."""
        if src == dst:
            return 0.0
        net = self.t.prepared.network
        a, b = (n if n != STORE else "n00" for n in (src, dst))
        link = net.intra if a == b else net.link(a, b)
        return link.latency_s + nbytes / link.bandwidth_bps

    def iteration(self) -> float:
        key = json.dumps(self.t.plan.to_dict(), sort_keys=True, default=str)
        if key not in self._cache:
            self._cache[key] = predict(self.t.plan, self._net(), PAPER, sync_bytes=self.sync).with_sync_s
        self.seconds += self._cache[key]
        return self._cache[key]

    def snapshot(self) -> float:
        cost = max((self._transfer(nodes[0], STORE, self.params[s] * STATE_BYTES)
                    for s, nodes in self.t.replicas.items() if nodes), default=0.0)
        self.seconds += cost
        return cost

    def recovery(self, event: dict, weights_from: dict) -> float:
        stage, new = event["stage"], event.get("nodes") or []
        cost = self.t.config.dead_after
        if event["chosen"] == "snapshot":
            cost += max((self._transfer(STORE, n, self.params[stage] * STATE_BYTES) for n in new), default=0.0)
        elif event["chosen"] == "neighbours":
            sources = {s: sorted(self.t.replicas.get(s, [])) for s in event["neighbours"]}
            cost += max((self._transfer(src[0], n, self.params[s] * WEIGHT_BYTES)
                         for s, src in sources.items() if src for n in new), default=0.0)
        self.seconds += cost
        return cost


def one_run(policy: str, rate: float, seed: int, iterations: int, hour: int, planned) -> dict:
    cfg = TrainConfig(**{**BASE, **POLICIES[policy], "iterations": iterations, "seed": seed,
                         "fail_rate": rate if policy != "no failures" else 0.0, "fail_hour_iterations": hour})
    prep = dataclasses.replace(planned, config=cfg)  # the seed's plan, made once for every policy
    curve, failures, per_iteration = [], [], []
    t0 = time.perf_counter()
    with Trainer(prep) as t:
        model = Modelled(t)
        schedule, t.failures = t.failures, FailureSchedule(cfg.stages)  # failures injected here, with a rejoin
        ev = t.evaluate(0)
        curve.append({"iteration": 0, "modelled_s": 0.0, "val_loss": ev["val_loss"]})
        for it in range(iterations):
            t.iteration_no = it
            for stage in schedule.at(it):
                if stage in t.recovery.dropped:
                    continue
                n_events = len(t.metrics["events"])
                killed = t.kill_stage(stage)
                if policy != "skip":  # the stage is taken over as the killed node joins again
                    t.join(killed)
                new = t.metrics["events"][n_events:]
                rec = [e for e in new if e["event"] == "recovery"]
                replan = [e for e in new if e["event"] == "replan"]
                cost = sum(model.recovery(e, replan[-1]["weights_from"] if replan else {}) for e in rec)
                failures.append({"iteration": it, "stage": stage, "killed": killed, "modelled_cost_s": cost,
                                 "recovery": [{k: e.get(k) for k in ("chosen", "nodes", "neighbours", "shares",
                                                                     "snapshot_age")} for e in rec]})
            t.iteration(it)
            per_iteration.append(model.iteration())
            done = it + 1
            if policy == "snapshot" and done % cfg.snapshot_every == 0:
                model.snapshot()  # the trainer took it (blocking: every stage exports before going on)
            if done % cfg.eval_every == 0 or done == iterations:
                ev = t.evaluate(done)
                curve.append({"iteration": done, "modelled_s": model.seconds, "val_loss": ev["val_loss"]})
        events = [{k: v for k, v in e.items() if k in ("event", "iteration", "time_s", "why", "chosen", "stage",
                                                        "seconds_lost", "nodes")} for e in t.metrics["events"]]
    return {"policy": policy, "rate": rate, "seed": seed, "curve": curve, "failures": failures, "events": events,
            "modelled_iteration_s": per_iteration,
            "wall_s": time.perf_counter() - t0}


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def loss_at_time(curve: list[dict], seconds: float) -> float:
    """Validation loss at modelled time ``seconds``: the latest evaluation at or before it."""
    best = curve[0]["val_loss"]
    for p in curve:
        if p["modelled_s"] <= seconds + 1e-9:
            best = p["val_loss"]
    return best


def table(runs: list[dict], rates: list[float], seeds: list[int]) -> str:
    clean = {r["seed"]: r for r in runs if r["policy"] == "no failures"}
    lines = [("| rate per stage per hour | policy | failures per run | final val loss (mean ± sd) | "
              "vs no failures (mean of per-seed ratios) | modelled s at the end | val loss at no-failure's end time |"),
             "|---|---|---|---|---|---|---|"]
    end_time = {s: clean[s]["curve"][-1]["modelled_s"] for s in seeds}
    finals = [clean[s]["curve"][-1]["val_loss"] for s in seeds]
    m, sd = mean_sd(finals)
    lines.append(f"| 0 | no failures | 0 | {m:.4f} ± {sd:.4f} | - | {statistics.mean(end_time.values()):.0f} | "
                 f"{m:.4f} |")
    for rate in rates:
        for policy in ("skip", "snapshot", "neighbours"):
            rs = [r for r in runs if r["policy"] == policy and r["rate"] == rate]
            if not rs:
                continue
            f = [r["curve"][-1]["val_loss"] for r in rs]
            ratio = [r["curve"][-1]["val_loss"] / clean[r["seed"]]["curve"][-1]["val_loss"] - 1 for r in rs]
            at_t = [loss_at_time(r["curve"], end_time[r["seed"]]) for r in rs]
            fm, fsd = mean_sd(f)
            rm, rsd = mean_sd(ratio)
            am, asd = mean_sd(at_t)
            lines.append(f"| {rate:g} | {policy} | {statistics.mean(len(r['failures']) for r in rs):.2f} | "
                         f"{fm:.4f} ± {fsd:.4f} | {100 * rm:+.2f}% ± {100 * rsd:.2f} | "
                         f"{statistics.mean(r['curve'][-1]['modelled_s'] for r in rs):.0f} | {am:.4f} ± {asd:.4f} |")
    return "\n".join(lines)


def plot(runs: list[dict], rates: list[float], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(rates), figsize=(5 * len(rates), 8), squeeze=False)
    colours = {"no failures": "black", "skip": "tab:orange", "snapshot": "tab:blue", "neighbours": "tab:green"}
    for col, rate in enumerate(rates):
        for policy, colour in colours.items():
            rs = [r for r in runs if r["policy"] == policy and (policy == "no failures" or r["rate"] == rate)]
            if not rs:
                continue
            its = [p["iteration"] for p in rs[0]["curve"]]
            mean = [statistics.mean(r["curve"][i]["val_loss"] for r in rs) for i in range(len(its))]
            sd = [statistics.stdev(r["curve"][i]["val_loss"] for r in rs) if len(rs) > 1 else 0.0
                  for i in range(len(its))]
            ax = axes[0][col]
            ax.plot(its, mean, color=colour, label=policy)
            ax.fill_between(its, [a - b for a, b in zip(mean, sd)], [a + b for a, b in zip(mean, sd)],
                            color=colour, alpha=0.15)
            secs = [statistics.mean(r["curve"][i]["modelled_s"] for r in rs) for i in range(len(its))]
            axes[1][col].plot([s / 60 for s in secs], mean, color=colour, label=policy)
        axes[0][col].set(title=f"{rate:g} failures per stage per hour", xlabel="iteration", ylabel="val loss")
        axes[1][col].set(xlabel="modelled minutes (LLaMA-1.5B on gcp12)", ylabel="val loss")
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=32)
    ap.add_argument("--hour", type=int, default=4, help="iterations per scaled hour")
    ap.add_argument("--rates", default="0.05,0.1,0.33")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rates = [float(r) for r in args.rates.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = TrainConfig(**{**BASE, "iterations": args.iterations})
    calibration = calibrate(base.model_config(), base.samples, base.seq_len)
    t0 = time.perf_counter()
    runs: list[dict] = []
    for seed in seeds:
        planned = prepare(TrainConfig(**{**BASE, "iterations": args.iterations, "seed": seed}), calibration)
        clean = one_run("no failures", 0.0, seed, args.iterations, args.hour, planned)
        runs.append(clean)
        print(f"seed {seed} no failures: {clean['curve'][-1]['val_loss']:.4f} ({clean['wall_s']:.0f} s)", flush=True)
        for rate in rates:
            sched = FailureSchedule(base.stages, seed, rate, args.hour)
            scheduled = [(i, s) for i in range(args.iterations) for s in sched.at(i)]
            for policy in ("skip", "snapshot", "neighbours"):
                if not scheduled:  # no failure at this rate: the run is the no-failure run
                    runs.append({**clean, "policy": policy, "rate": rate, "reused_no_failure_run": True})
                    continue
                r = one_run(policy, rate, seed, args.iterations, args.hour, planned)
                runs.append(r)
                print(f"seed {seed} rate {rate:g} {policy}: {len(r['failures'])} failures, "
                      f"{r['curve'][-1]['val_loss']:.4f} ({r['wall_s']:.0f} s)", flush=True)
    wall = time.perf_counter() - t0
    text = table(runs, rates, seeds)
    print(text)
    print(f"{wall:.0f} s in all")
    (out / "recovery.json").write_text(json.dumps({"runs": runs, "wall_s": wall, "calibration": calibration,
                                                   "args": vars(args)}, indent=1, default=str))
    plot(runs, rates, out / "recovery.png")


if __name__ == "__main__":
    main()
