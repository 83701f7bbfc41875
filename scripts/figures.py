"""Make the documentation's pictures again: ``python3 scripts/figures.py [--only NAME ...]``.

- ``docs/plan-gantt.png``: a SkipPipe plan's Gantt chart, from ``roving pipeline plan --gantt`` (a fixed
  evaluation budget, so the same plan on any machine).
- ``docs/es-pendulum.png``: the demo's learning curve, from ``examples/es.py --plot`` (seed 0).
- ``docs/verify-overhead.png`` and ``docs/verify-adversaries.png``: verification's cost against its targets,
  and each adversary's validation loss with verification off and on, read from the tables of
  benchmarks/RESULTS.md ("Untrusted nodes"), so that a new run's figures are drawn as they are written.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def results_table(heading: str) -> list[list[str]]:
    """The rows (cells, header and rule left out) of the first table under ``heading`` in RESULTS.md."""
    text = RESULTS.read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif rows:
            break
    return rows[2:]


def _percent(cell: str) -> float:
    return float(re.search(r"[-+]?\d+(\.\d+)?(?=%)", cell).group(0))


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


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def verify_overhead() -> None:
    plt = _pyplot()
    rows = [r for r in results_table("### Cost (--overhead; paired runs)") if "target" not in r[0]]
    rows = [r for r in rows if r[4].startswith("<")]  # the modes that have a target
    names = [r[0].strip("`").replace("`", "") for r in rows]
    fig, ax = plt.subplots(figsize=(6, 2.6))
    ax.barh(names, [_percent(r[1]) for r in rows], color="#4a7ab5", label="measured (median, paired runs)")
    ax.scatter([_percent(r[4]) for r in rows], names, marker="|", s=400, color="#c0392b", label="target")
    ax.set_xlabel("extra wall-clock time against verification off (%)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "verify-overhead.png", dpi=120)


def verify_adversaries() -> None:
    plt = _pyplot()
    rows = [r for r in results_table("### Each adversary: verification off, on, and a clean run")
            if r[0] != "none (clean)"]
    names = [r[0] for r in rows]
    on = [_percent(r[3]) for r in rows]
    off = [_percent(r[4]) if "%" in r[4] else float("nan") for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], off, height=0.4, color="#c0392b", label="verification off")
    ax.barh([i - 0.2 for i in y], on, height=0.4, color="#4a7ab5", label="verification on (spot, 5%)")
    for i, r in enumerate(rows):
        if "%" not in r[4]:
            ax.text(0.2, i + 0.2, "off: diverged (NaN)", va="center", fontsize=7, color="#c0392b")
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.6)
    ax.set_xlabel("validation loss against a clean run after 40 iterations (%)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "verify-adversaries.png", dpi=120)


FIGURES = {"plan-gantt": plan_gantt, "es-pendulum": es_pendulum, "verify-overhead": verify_overhead,
           "verify-adversaries": verify_adversaries}


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
