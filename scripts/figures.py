"""Make the documentation's pictures again: ``python3 scripts/figures.py [--only NAME ...]``.

- ``docs/plan-gantt.png``: a SkipPipe plan's Gantt chart, from ``roving pipeline plan --gantt`` (a fixed
  evaluation budget, so the same plan on any machine).
- ``docs/es-pendulum.png``: the demo's learning curve, from ``examples/es.py --plot`` (seed 0).
- ``docs/verify-overhead.png``: verification's cost, from the figures of benchmarks/RESULTS.md
  ("Untrusted nodes"), which :data:`OVERHEAD` copies with the commit they were measured at.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: verification's overhead in wall-clock time against runs with verification off, median over paired
#: runs (benchmarks/RESULTS.md, "Untrusted nodes", benchmarks/verify.py --overhead), and its target.
OVERHEAD = {"screen": (1.75, 2.0), "spot at 5%": (4.7, 10.0)}


def plan_gantt() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "roving", "pipeline", "plan", "--network", "gcp12", "--nodes", "12",
                        "--stages", "4", "--skip", "0.25", "--microbatches", "8", "--evals", "300",
                        "--json", str(Path(tmp) / "plan.json"), "--gantt", str(DOCS / "plan-gantt.png")],
                       check=True, cwd=ROOT)


def es_pendulum() -> None:
    subprocess.run([sys.executable, str(ROOT / "examples" / "es.py"), "--iterations", "120", "--seed", "0",
                    "--plot", str(DOCS / "es-pendulum.png")], check=True, cwd=ROOT)


def verify_overhead() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.6))
    names = list(OVERHEAD)
    ax.barh(names, [OVERHEAD[n][0] for n in names], color="#4a7ab5", label="measured (median, paired runs)")
    ax.scatter([OVERHEAD[n][1] for n in names], names, marker="|", s=400, color="#c0392b", label="target")
    ax.set_xlabel("extra wall-clock time against verification off (%)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "verify-overhead.png", dpi=120)


FIGURES = {"plan-gantt": plan_gantt, "es-pendulum": es_pendulum, "verify-overhead": verify_overhead}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(FIGURES), help="make only these")
    args = parser.parse_args(argv)
    for name in args.only or FIGURES:
        FIGURES[name]()
        print(f"made docs/{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
