"""The full-pipeline baseline (DT-FM's allocation) against the length of its search: its simulated
iteration time after N evaluations of DT-FM's cost model, for several N and seeds, on the planner
benchmark's settings (benchmarks/plan.py). A baseline that a longer search makes slower is not one to
divide by.

    PYTHONPATH=src python benchmarks/dtfm_search.py --evals 2000 5000 20000 --seeds 0 1

Every figure is the one simulator's makespan (roving.pipeline.planning.simulate); "judged" counts the
simulations the baseline makes on top of its cost-model evaluations (absent before they were made).
"""

from __future__ import annotations

import argparse
import sys
import time

from roving.pipeline import build_network, full_pipeline, model_preset

from plan import MEMORY, MODEL, SETTINGS, paper_microbatches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evals", type=int, nargs="+", default=[2000, 5000, 20000])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--settings", type=int, default=4, help="the first this many of plan.py's settings")
    args = ap.parse_args(argv)
    model = model_preset(MODEL)
    print("| setting | seed | " + " | ".join(f"{n:,} evaluations s" for n in args.evals)
          + " | non-increasing | judged | seconds |")
    print("|---|---|" + "---|" * len(args.evals) + "---|---|---|")
    for name, network, nodes, stages, _skip, regions in SETTINGS[:args.settings]:
        net = build_network(network, nodes, regions=regions, memory=MEMORY)
        m = paper_microbatches(nodes, stages)
        for seed in args.seeds:
            t = time.perf_counter()
            runs = [full_pipeline(net, model, stages, m, budget_s=3600.0, seed=seed, max_evals=n)
                    for n in args.evals]
            times = [r.predicted_s for r in runs]
            ok = all(b <= a for a, b in zip(times, times[1:]))
            judged = "/".join(str(r.stats.get("judged", "-")) for r in runs)
            print(f"| {name} | {seed} | " + " | ".join(f"{x:.1f}" for x in times)
                  + f" | {'yes' if ok else 'no'} | {judged} | {time.perf_counter() - t:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
