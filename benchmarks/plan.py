"""SkipPipe planner against its baselines in the paper's settings; writes its RESULTS.md section.

    PYTHONPATH=src python benchmarks/plan.py --budget 20 --write

Every iteration time is the same simulator's makespan (roving.pipeline.simulate).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from roving.pipeline import build_network, full_pipeline, model_preset, plan, random_skip, replan

SECTION = "## SkipPipe planner — benchmarks/plan.py"
FIVE_REGIONS = ["Belgium", "Iowa", "Japan", "Oregon", "Singapore"]
NOTES = """\
Model llama-1.5b (24 layers, hidden 2048, sequence 1024, 4 samples per microbatch, bf16 activations:
16 MiB per transfer), 0.055 s per sample per layer (the paper's cost model), backward = 2x forward,
memory 8 microbatches in flight per node, microbatches per iteration = 2 x nodes. Nodes placed on the
regions round-robin. Each search (skippipe, full_pipeline, full_pipeline_planned) gets the same `--budget`;
random_skip uses skippipe's allocation. Re-plan: the first microbatch's origin and last visited node
fail; the re-plan time is wall time of `replan()` (0.3 s search budget), "after re-plan" its makespan.

full_pipeline is meant as a strong, honest baseline: DT-FM-style fixed pipelines (nodes // stages of
them, so 2 of 20 and 2 of 18 nodes stay idle), chains seeded from a nearest-neighbour tour of the nodes and
then improved by swapping nodes (spares included) with the same simulator as the judge, microbatches split
evenly, scheduled by the simulator's backward-first policy. It is stronger than a fixed chain order, so
the ratio to it is more conservative than the paper's.
"""
SETTINGS = [
    # name, network, nodes, stages, skip, regions to place on (None = all, round-robin)
    ("gcp12 (paper)", "gcp12", 20, 6, 0.33, None),
    ("aws10 (paper)", "aws10", 18, 4, 0.25, None),
    ("single cluster (Iowa)", "gcp12", 20, 6, 0.33, ["Iowa"]),
    ("5 clusters (gcp12 subset)", "gcp12", 20, 6, 0.33, FIVE_REGIONS),
]


def run(setting, budget: float, model_name: str, seed: int) -> dict:
    name, network, nodes, stages, skip, regions = setting
    net = build_network(network, nodes, regions=regions)
    model = model_preset(model_name)
    m = 2 * nodes
    t = time.perf_counter()
    sp = plan(net, model, stages, skip, m, budget_s=budget, seed=seed)
    planner_s = time.perf_counter() - t
    full = full_pipeline(net, model, stages, m, budget_s=budget, seed=seed)
    fpp = plan(net, model, stages, 0.0, m, budget_s=budget, seed=seed)
    rnd = random_skip(net, model, sp.allocation, stages, skip, m, seed=seed)
    failed = [sp.paths[0].origin, sp.paths[0].nodes[-1]]
    t = time.perf_counter()
    new, _ = replan(sp, net, model, failed=failed, seed=seed)
    replan_s = time.perf_counter() - t
    return dict(name=name, nodes=nodes, stages=stages, skip=skip, microbatches=m, skippipe=sp.predicted_s,
                full=full.predicted_s, fpp=fpp.predicted_s, random=rnd.predicted_s, planner_s=planner_s,
                replan_s=replan_s, replan_time=new.predicted_s, failed=",".join(failed))


def table(rows: list[dict]) -> str:
    head = ("| setting | N | S | k | M | skippipe s | full_pipeline s | full_pipeline_planned s | random_skip s "
            "| sp/full (<=0.45) | sp/planned (<=0.75) | sp/random (<=0.85) | planner s | re-plan s (2 failed) "
            "| after re-plan s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['nodes']} | {r['stages']} | {r['skip']} | {r['microbatches']} "
            f"| {r['skippipe']:.1f} | {r['full']:.1f} | {r['fpp']:.1f} | {r['random']:.1f} "
            f"| {r['skippipe'] / r['full']:.2f} | {r['skippipe'] / r['fpp']:.2f} | {r['skippipe'] / r['random']:.2f} "
            f"| {r['planner_s']:.1f} | {r['replan_s']:.2f} | {r['replan_time']:.1f} |")
    return "\n".join(lines)


def write_section(path: Path, body: str) -> None:
    text = path.read_text() if path.exists() else "# roving benchmark results\n"
    start = text.find(SECTION)
    if start >= 0:
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + (text[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text.rstrip("\n") + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=20.0, help="seconds for each planner/baseline search")
    ap.add_argument("--model", default="llama-1.5b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="only the two paper settings")
    ap.add_argument("--write", action="store_true", help="update the section in benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    rows = []
    for s in SETTINGS[:2] if args.quick else SETTINGS:
        rows.append(run(s, args.budget, args.model, args.seed))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    out = table(rows)
    print(out)
    if args.write:
        cmd = "PYTHONPATH=src python benchmarks/plan.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(Path(__file__).parent / "RESULTS.md", f"{SECTION}\n\nCommand: `{cmd}`\n\n{out}\n\n{NOTES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
