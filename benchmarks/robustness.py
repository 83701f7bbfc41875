"""SkipPipe's robustness claims, measured on this machine.

    PYTHONPATH=src python benchmarks/robustness.py drop --iterations 100 --out benchmarks/results

``drop``: stages missing at inference. Trains the same model twice on the same nodes, data, seed and
iterations -- once by skip-pipelining (k = 0.33) and once by the full pipeline (the DT-FM baseline,
k = 0) -- saves both checkpoints, then evaluates each with 0, 25, 33 and 50% of the stages after stage 0
dropped (``roving.pipeline.run.inference``: random subsets of that size, averaged). Writes
``robustness_drop.json`` (every subset's figures), ``robustness_drop.png`` (perplexity increase against
the fraction dropped) and prints a Markdown table.

    PYTHONPATH=src python benchmarks/robustness.py failures --iterations 60 --out benchmarks/results

``failures``: training through node failures. The same SkipPipe run (k = 0.33, 12 nodes, 6 stages,
emulated gcp12 links) twice with one calibration, so both have the same plan: once undisturbed, and
once with 25% of the nodes (3 of 12, chosen at random by the seed) killed with -9 partway through an
iteration, and started again at a later iteration (they rejoin with their replicas' state, or take
a lost stage over from its snapshot). Writes ``robustness_failures.json`` (both runs' metrics and
events) and ``robustness_failures.png`` (loss against iterations and against training seconds) and
prints a Markdown table: iterations completed, time lost, the work thrown away against one
iteration's time, and validation loss at equal iterations.

    PYTHONPATH=src python benchmarks/robustness.py refine --iterations 40 --out benchmarks/results

``refine``: the same run twice with 2 of its 12 nodes killed for good in iteration 5: once with the
quick re-plan alone, once with that re-plan refined in the background (``refine_budget``). Writes
``robustness_refine.json`` and prints the predictions after each and the measured iteration times over
the iterations after the refined plan was taken.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from roving.pipeline.run.inference import drop_subsets, evaluate_drops, load_checkpoint, validation_set
from roving.pipeline.run.trainer import Trainer, TrainConfig, calibrate, prepare, run

from train import BASE as TRAIN_BASE

# benchmarks/train.py's data, batch and optimiser settings; a wider model split into 9 stages so that
# 25, 33 and 50% of the 8 droppable stages are 2, 3 and 4 of them (with 6 stages, 33% and 50% both
# round to 2 of 5); 18 nodes (2 replicas of each stage; DT-FM: 2 pipelines of 9); no link emulation
# (only the trained weights matter here); a fixed compute speed so that both plans use the same costs.
DROP_BASE = {**TRAIN_BASE, "layers": 18, "dim": 128, "stages": 9, "nodes": 18, "emulate_network": False,
             "speed": 2e-4, "eval_every": 1000, "timeout": 600.0}
DROP_RUNS = {"skippipe k=0.33": dict(schedule="skippipe", skip=0.33),
             "full pipeline k=0 (DT-FM)": dict(schedule="dtfm", skip=0.0)}
FRACTIONS = (0.0, 0.25, 0.33, 0.5)


def train_drop_models(iterations: int, out: Path, reuse: bool) -> dict[str, Path]:
    """One checkpoint per run in DROP_RUNS (kept when ``reuse`` and already there)."""
    paths = {}
    for name, over in DROP_RUNS.items():
        path = out / f"robustness_{over['schedule']}_{over['skip']}.pt"
        paths[name] = path
        if reuse and path.is_file():
            print(f"{name}: reusing {path}", flush=True)
            continue
        cfg = TrainConfig(**{**DROP_BASE, **over, "iterations": iterations, "checkpoint": str(path)})
        t0 = time.time()
        print(f"{name}: training {iterations} iterations", flush=True)
        metrics = run(cfg)
        its = metrics["iterations"]
        print(f"{name}: {time.time() - t0:.0f} s, {sum(r['seconds'] for r in its) / len(its):.2f} s per "
              f"iteration, final validation loss {metrics['evaluations'][-1]['val_loss']:.4f}", flush=True)
    return paths


def evaluate_drop_models(paths: dict[str, Path], subsets: int, seed: int) -> dict:
    """For each checkpoint and fraction in FRACTIONS: the whole model's and the subsets' figures."""
    results = {}
    for name, path in paths.items():
        ckpt = load_checkpoint(path)
        batches = validation_set(ckpt)
        per = {}
        for f in FRACTIONS:
            drops = drop_subsets(ckpt.stages, f, subsets, seed)
            per[str(f)] = evaluate_drops(ckpt, drops, batches)
            avg = per[str(f)]["average"]
            print(f"  {name}: {f:.0%} dropped ({len(drops[0])} of {ckpt.stages - 1} stages, {len(drops)} "
                  f"subsets): perplexity {avg['perplexity']:.3f} ({avg['increase_percent']:+.2f}%)", flush=True)
        results[name] = {"checkpoint": str(path), "iteration": ckpt.iteration, "by_fraction": per}
    return results


def drop_table(results: dict) -> str:
    rows = ["| model | full-model perplexity | " + " | ".join(f"{f:.0%} dropped" for f in FRACTIONS[1:]) + " |",
            "|---|---|" + "---|" * (len(FRACTIONS) - 1)]
    for name, r in results.items():
        per = r["by_fraction"]
        cells = []
        for f in FRACTIONS[1:]:
            avg = per[str(f)]["average"]
            k = len(per[str(f)]["subsets"][0]["dropped"])
            cells.append(f"{avg['perplexity']:.3f} ({avg['increase_percent']:+.1f}%, {k} stages)")
        rows.append(f"| {name} | {per[str(FRACTIONS[0])]['full']['perplexity']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_drop(results: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, r in results.items():
        per = r["by_fraction"]
        ax.plot([100 * f for f in FRACTIONS], [per[str(f)]["average"]["increase_percent"] for f in FRACTIONS],
                "o-", label=name)
    ax.axhline(5.0, color="0.6", ls="--", lw=1, label="target: +5% at 50%")
    ax.set_xlabel("stages after stage 0 dropped (%)")
    ax.set_ylabel("validation perplexity increase (%)")
    ax.set_title("stages dropped at inference (mean over random subsets)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def run_drop(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    paths = train_drop_models(args.iterations, out, args.reuse)
    results = evaluate_drop_models(paths, args.subsets, args.seed)
    doc = {"settings": {**DROP_BASE, "iterations": args.iterations, "subsets": args.subsets, "seed": args.seed,
                        "fractions": list(FRACTIONS)},
           "runs": {name: {**over} for name, over in DROP_RUNS.items()},
           "results": results, "seconds": time.time() - t0}
    (out / "robustness_drop.json").write_text(json.dumps(doc, indent=1))
    plot_drop(results, out / "robustness_drop.png")
    print(drop_table(results))
    print(f"\n{time.time() - t0:.0f} s; figures: {out / 'robustness_drop.json'}, plot: {out / 'robustness_drop.png'}")


FAIL_BASE = {**TRAIN_BASE, "skip": 0.33, "eval_every": 10, "timeout": 600.0}


def failure_run(iterations: int, calibration: dict, kill_at: int | None, rejoin_at: int | None,
                fraction: float, seed: int, kill_after_s: float, overrides: dict | None = None,
                label: str | None = None) -> dict:
    """One run; with ``kill_at``, ``fraction`` of the nodes are killed ``kill_after_s`` seconds into
    iteration ``kill_at`` (from a timer thread, wherever the iteration is then) and started again
    before iteration ``rejoin_at`` (None: never). ``overrides``: TrainConfig fields beside FAIL_BASE."""
    import random
    import threading

    cfg = TrainConfig(**{**FAIL_BASE, **(overrides or {}), "iterations": iterations})
    prep = prepare(cfg, calibration)
    label = label or ("failures" if kill_at is not None else "no failures")
    shown = ('nodes', 'failed', 'joined', 'moved', 'missing_stages', 'seconds_lost', 'adopted',
             'iteration_s_before', 'iteration_s_refined')
    show = {"evaluation": lambda r: print(f"  {label}: after {r['iteration']} iterations val {r['val_loss']:.4f}",
                                          flush=True),
            "fault": lambda r: print(f"  {label}: [{r['kind']}] iteration {r['iteration']} "
                                     f"{ {k: r[k] for k in shown if k in r} }", flush=True)}
    victims: list[str] = []
    with Trainer(prep, progress=lambda r: show.get(r["event"], lambda r: None)(r)) as t:
        t.evaluate(0)
        for it in range(iterations):
            if it == kill_at:
                victims = sorted(random.Random(seed).sample(sorted(t.alloc), round(fraction * len(t.alloc))))
                hit = {v: t.alloc[v] for v in victims}
                print(f"  {label}: killing {hit} (node: stage) {kill_after_s:.2f} s into iteration {it}", flush=True)
                threading.Timer(kill_after_s, t.roster.kill, [victims]).start()
            if it == rejoin_at:
                print(f"  {label}: starting {victims} again before iteration {it}", flush=True)
                t.join(victims)
            t.iteration(it)
            if (it + 1) % cfg.eval_every == 0 or it + 1 == iterations:
                t.evaluate(it + 1)
        metrics = t.metrics
    metrics["victims"] = victims
    metrics["kill_at"], metrics["rejoin_at"] = kill_at, rejoin_at
    return metrics


def failure_table(clean: dict, failed: dict) -> str:
    its_c, its_f = clean["iterations"], failed["iterations"]
    mean_c = sum(r["seconds"] for r in its_c) / len(its_c)
    lost_work = sum(r["seconds_lost"] for r in its_f)
    hit = failed["iterations"][failed["kill_at"]]
    extra = hit["seconds"] - mean_c
    total_c, total_f = its_c[-1]["train_seconds_total"], its_f[-1]["train_seconds_total"]
    ev_c = {e["iteration"]: e["val_loss"] for e in clean["evaluations"]}
    ev_f = {e["iteration"]: e["val_loss"] for e in failed["evaluations"]}
    rows = ["| run | iterations completed | training seconds | mean iteration s | final val loss |",
            "|---|---|---|---|---|"]
    for name, m in (("no failures", clean), ("25% of nodes killed, then rejoined", failed)):
        its = m["iterations"]
        rows.append(f"| {name} | {len(its)} | {its[-1]['train_seconds_total']:.1f} | "
                    f"{sum(r['seconds'] for r in its) / len(its):.3f} | {m['evaluations'][-1]['val_loss']:.4f} |")
    rows.append("")
    rows.append(f"- work thrown away (the aborted attempt of iteration {failed['kill_at']}): {lost_work:.3f} s = "
                f"{lost_work / mean_c:.2f} of an undisturbed iteration ({mean_c:.3f} s); that iteration took "
                f"{hit['seconds']:.3f} s ({extra:+.3f} s, re-planning and re-running included), "
                f"attempts: {hit['attempts']}")
    rows.append(f"- training seconds in all: {total_f - total_c:+.1f} s against the undisturbed run "
                f"({(total_f - total_c) / mean_c:+.1f} iterations' worth)")
    common = sorted(set(ev_c) & set(ev_f))
    diffs = ", ".join(f"{i}: {ev_f[i] - ev_c[i]:+.4f}" for i in common if i)
    rows.append(f"- validation loss, failure run minus undisturbed, at equal iterations: {diffs}")
    return "\n".join(rows)


def plot_failures(clean: dict, failed: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, m in (("no failures", clean), ("25% of nodes killed, then rejoined", failed)):
        its = m["iterations"]
        line, = a.plot([r["iteration"] + 1 for r in its], [r["train_loss"] for r in its], alpha=0.35, lw=1)
        ev = m["evaluations"]
        a.plot([e["iteration"] for e in ev], [e["val_loss"] for e in ev], "o-", color=line.get_color(),
               label=f"{name} (validation)")
        b.plot([r["train_seconds_total"] for r in its], [r["train_loss"] for r in its], color=line.get_color(),
               label=name)
    for x, what in ((failed["kill_at"], "killed"), (failed["rejoin_at"], "rejoined")):
        a.axvline(x + 0.5, color="0.5", ls="--", lw=1)
        a.text(x + 0.7, a.get_ylim()[1], what, va="top", fontsize=8)
    a.set_xlabel("iteration")
    a.set_ylabel("loss (nats per byte)")
    a.legend(fontsize=8)
    b.set_xlabel("training seconds (wall clock)")
    b.set_ylabel("train loss")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def run_failures(args: argparse.Namespace) -> None:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfg = TrainConfig(**{**FAIL_BASE, "iterations": args.iterations})
    model = cfg.model_config()
    torch.set_num_threads(1)
    calibration = calibrate(model, cfg.samples, cfg.seq_len)
    clean = failure_run(args.iterations, calibration, None, None, args.fraction, args.seed, 0.0)
    phase = sorted(r["compute_seconds"] for r in clean["iterations"])[len(clean["iterations"]) // 2]
    failed = failure_run(args.iterations, calibration, args.kill_at, args.rejoin_at, args.fraction, args.seed,
                         0.5 * phase)
    doc = {"settings": {**FAIL_BASE, "iterations": args.iterations, "kill_at": args.kill_at,
                        "rejoin_at": args.rejoin_at, "fraction": args.fraction, "seed": args.seed},
           "calibration": calibration, "no_failures": clean, "failures": failed, "seconds": time.time() - t0}
    (out / "robustness_failures.json").write_text(json.dumps(doc, indent=1, default=str))
    plot_failures(clean, failed, out / "robustness_failures.png")
    print(failure_table(clean, failed))
    print(f"\n{time.time() - t0:.0f} s; figures: {out / 'robustness_failures.json'}, plot: "
          f"{out / 'robustness_failures.png'}")


def refine_table(runs: dict[str, dict]) -> str:
    """Per run: predictions before the failure, after the quick re-plan and after the refinement, and
    the measured iteration and microbatch-phase seconds over the same window of iterations (from the
    one after the refinement was taken to the end)."""
    def first(m: dict, kind: str) -> dict | None:
        return next((e for e in m["events"] if e["event"] == kind), None)

    def last(m: dict, kind: str) -> dict | None:  # deaths seen one after the other re-plan twice
        return next((e for e in reversed(m["events"]) if e["event"] == kind), None)

    taken = [first(m, "refine") for m in runs.values()]
    start = 1 + max((e["iteration"] for e in taken if e), default=max(m["kill_at"] for m in runs.values()))
    rows = [("| run | predicted phase s before | after the re-plan | after refining | refined plan taken in iteration "
             f"| mean iteration s, iterations {start + 1}-end | mean microbatch phase s, same |"),
            "|---|---|---|---|---|---|---|"]
    for name, m in runs.items():
        rp, rf = last(m, "replan"), first(m, "refine")
        window = [r for r in m["iterations"] if r["iteration"] >= start]
        if not window:
            rows.append(f"| {name} | (no iteration after {start}: run longer) |||||| ")
            continue
        after = f"{rf['predicted_s']:.3f}" if rf and rf.get("adopted") else "-"
        when = (f"{rf['iteration'] + 1}" + ("" if rf.get("adopted") else " (not taken)")) if rf else "-"
        rows.append(f"| {name} | {m['predicted_s']:.3f} | {rp['predicted_s']:.3f} | {after} | {when} "
                    f"| {sum(r['seconds'] for r in window) / len(window):.3f} "
                    f"| {sum(r['compute_seconds'] for r in window) / len(window):.3f} |")
    return "\n".join(rows)


def run_refine(args: argparse.Namespace) -> None:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfg = TrainConfig(**{**FAIL_BASE, "iterations": args.iterations})
    torch.set_num_threads(1)
    calibration = calibrate(cfg.model_config(), cfg.samples, cfg.seq_len)
    kill_after = 0.5 * prepare(cfg, calibration).predicted_s
    runs = {}
    for name, budget in (("re-plan only", 0.0), (f"re-plan, refined ({args.refine_budget:g} s)", args.refine_budget)):
        runs[name] = failure_run(args.iterations, calibration, args.kill_at, None, args.fraction, args.seed,
                                 kill_after, overrides={"refine_budget": budget}, label=name)
    doc = {"settings": {**FAIL_BASE, "iterations": args.iterations, "kill_at": args.kill_at,
                        "fraction": args.fraction, "seed": args.seed, "refine_budget": args.refine_budget},
           "calibration": calibration, "runs": runs, "seconds": time.time() - t0}
    (out / "robustness_refine.json").write_text(json.dumps(doc, indent=1, default=str))
    print(refine_table(runs))
    print(f"\n{time.time() - t0:.0f} s; figures: {out / 'robustness_refine.json'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("drop", help="perplexity with stages dropped at inference, skip-trained vs full pipeline")
    d.add_argument("--iterations", type=int, default=100)
    d.add_argument("--out", default="benchmarks/results")
    d.add_argument("--subsets", type=int, default=8, help="random subsets averaged per fraction")
    d.add_argument("--seed", type=int, default=0, help="picks the subsets")
    d.add_argument("--reuse", action="store_true", help="evaluate checkpoints already in --out instead of training")
    d.set_defaults(handler=run_drop)
    f = sub.add_parser("failures", help="a run with 25%% of its nodes killed and rejoining, against one without")
    f.add_argument("--iterations", type=int, default=60)
    f.add_argument("--kill-at", type=int, default=20, help="the iteration in which the nodes are killed")
    f.add_argument("--rejoin-at", type=int, default=40, help="the iteration before which they start again")
    f.add_argument("--fraction", type=float, default=0.25, help="of the nodes killed")
    f.add_argument("--seed", type=int, default=0, help="picks the nodes killed")
    f.add_argument("--out", default="benchmarks/results")
    f.set_defaults(handler=run_failures)
    r = sub.add_parser("refine", help="nodes killed for good: the quick re-plan alone against it refined in "
                                      "the background (--refine-budget)")
    r.add_argument("--iterations", type=int, default=40)
    r.add_argument("--kill-at", type=int, default=5, help="the iteration in which the nodes are killed")
    r.add_argument("--fraction", type=float, default=0.17, help="of the nodes killed (0.17: 2 of 12)")
    r.add_argument("--seed", type=int, default=0, help="picks the nodes killed")
    r.add_argument("--refine-budget", type=float, default=30.0)
    r.add_argument("--out", default="benchmarks/results")
    r.set_defaults(handler=run_refine)
    args = ap.parse_args()
    args.handler(args)


if __name__ == "__main__":
    main()
