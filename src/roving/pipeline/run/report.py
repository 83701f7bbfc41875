"""The records of a training run written out: its metrics as JSON, its loss curves as a PNG."""

from __future__ import annotations

import json
from pathlib import Path


def write_metrics(metrics: dict, path: str) -> None:
    """``metrics`` as indented JSON at ``path`` (its folder made when missing)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(metrics, indent=1))


def plot_losses(runs: dict[str, dict], out_png: str) -> None:
    """Train and validation loss of each run against iterations and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, m in runs.items():
        its = m["iterations"]
        line, = a.plot([r["iteration"] + 1 for r in its], [r["train_loss"] for r in its], alpha=0.35, lw=1)
        ev = m["evaluations"]
        a.plot([e["iteration"] for e in ev], [e["val_loss"] for e in ev], "o-", color=line.get_color(),
               label=f"{label} (validation)")
        b.plot([e["train_seconds_total"] for e in ev], [e["val_loss"] for e in ev], "o-",
               color=line.get_color(), label=label)
    a.set_xlabel("iteration")
    a.set_ylabel("loss (nats per byte)")
    a.set_title("train (faint) and validation loss")
    a.legend(fontsize=8)
    b.set_xlabel("training seconds (wall clock)")
    b.set_ylabel("validation loss")
    b.set_title("validation loss against time")
    b.legend(fontsize=8)
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
