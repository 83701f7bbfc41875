"""The SkipPipe training iteration on two checkouts of roving, run in turn (A B A B ...): what a change
of the runtime (here the data-only wire) costs a whole iteration. Each run is ``roving pipeline train``
with the same flags; its per-iteration seconds come from its metrics file (the first iterations, whose
processes are still warming up, left out).

    python benchmarks/wire_iteration.py --before /path/to/old/src --after src --pairs 3

Prints each run's median iteration and microbatch phase, and the CPU seconds the run took (the training
and every process it waited for, start-up and evaluations included: what a loaded machine does not
stretch, as it does wall time), then the medians over the runs and the ratios after/before.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

FLAGS = ["--model", "small", "--network", "gcp12", "--nodes", "8", "--stages", "4", "--skip", "0.25",
         "--microbatches", "8", "--samples", "4", "--seq-len", "128", "--eval-every", "1000", "--seed", "1"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one(src: str, iterations: int, verify: str) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cpu = _children_cpu()
        metrics = os.path.join(tmp, "m.json")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
        subprocess.run([sys.executable, "-m", "roving.cli", "pipeline", "train", *FLAGS, "--iterations",
                        str(iterations), "--verify", verify, "--metrics", metrics], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
        cpu = _children_cpu() - cpu
        its = json.load(open(metrics))["iterations"][5:]
        return (statistics.median(i["seconds"] for i in its), statistics.median(i["compute_seconds"] for i in its),
                cpu)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--verify", default="spot")
    args = ap.parse_args()
    runs: dict[str, list[tuple[float, float, float]]] = {"before": [], "after": []}
    for i in range(args.pairs):
        for label in ("before", "after"):
            got = one(getattr(args, label), args.iterations, args.verify)
            runs[label].append(got)
            print(f"pair {i + 1} {label:6s}: iteration {got[0]:.4f} s, compute_seconds {got[1]:.4f} s, "
                  f"run CPU {got[2]:.1f} s", flush=True)
    b = [statistics.median(x[k] for x in runs["before"]) for k in (0, 1, 2)]
    a = [statistics.median(x[k] for x in runs["after"]) for k in (0, 1, 2)]
    print(f"median before: iteration {b[0]:.4f} s, phase {b[1]:.4f} s, run CPU {b[2]:.1f} s")
    print(f"median after:  iteration {a[0]:.4f} s, phase {a[1]:.4f} s, run CPU {a[2]:.1f} s")
    print(f"after/before: iteration {a[0] / b[0]:.3f}x, phase {a[1] / b[1]:.3f}x, run CPU {a[2] / b[2]:.3f}x")


if __name__ == "__main__":
    main()
