"""What a stage process pays to start: building its stage and taking its first optimizer step.

    python3 benchmarks/stage_start.py --runs 5      # each run a fresh interpreter; prints the median

Every start of a node (the run's start, a restart, a join, a recovery) builds its stage and its optimizer;
the first step is where ``torch.optim.AdamW`` imported ``torch._dynamo`` (its methods are wrapped for a
compiler), which ``roving.pipeline.optim.AdamW`` does not. Run from another tree's checkout
(``PYTHONPATH=<tree>/src``), it times that tree: the optimizer is the one that tree's stage process uses
(roving's where ``roving.pipeline.optim`` exists, torch's before). Each run is a fresh interpreter, timed
from just after ``import torch`` (which both pay) to the end of the first step: the roving imports, the
stage's build (``Stage``), one forward and backward on a microbatch, and ``step()``. CPU seconds
(``time.process_time``) and wall seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

ONE = r"""
import json, time
import torch
torch.set_num_threads(1)
cpu, wall = time.process_time(), time.perf_counter()
from roving.pipeline.presets import preset
from roving.pipeline.stages import Stage
try:
    from roving.pipeline.optim import AdamW
    which = "roving"
except ImportError:
    AdamW = torch.optim.AdamW
    which = "torch"
cfg = preset(MODEL)
stage = Stage(cfg, 1, 3, seed=0)
opt = AdamW(list(stage.parameters()), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
h = torch.randn(2, 32, cfg.dim)
stage(h).square().mean().backward()
opt.step()
print(json.dumps({"optimizer": which, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    runs = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", ONE.replace("MODEL", repr(args.model))], check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps({"optimizer": runs[0]["optimizer"], "runs": len(runs),
                      "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 3),
                      "wall_s_median": round(statistics.median(r["wall_s"] for r in runs), 3)}))


if __name__ == "__main__":
    main()
