"""SkipPipe's robustness claims, measured on this machine.

    PYTHONPATH=src python benchmarks/robustness.py drop --iterations 100 --out benchmarks/results

``drop``: stages missing at inference. Trains the same model twice on the same nodes, data, seed and
iterations -- once by skip-pipelining (k = 0.33) and once by the full pipeline (the DT-FM baseline,
k = 0) -- saves both checkpoints, then evaluates each with 0, 25, 33 and 50% of the stages after stage 0
dropped (``roving.pipeline.inference``: random subsets of that size, averaged). Writes
``robustness_drop.json`` (every subset's figures), ``robustness_drop.png`` (perplexity increase against
the fraction dropped) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from roving.pipeline.inference import drop_subsets, evaluate_drops, load_checkpoint, validation_set
from roving.pipeline.trainer import TrainConfig, run

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
    args = ap.parse_args()
    args.handler(args)


if __name__ == "__main__":
    main()
