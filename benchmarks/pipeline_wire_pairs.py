"""The per-message costs of the pipeline's wire (``pipeline_wire.py``'s messages) on two checkouts of
roving, run in turn (A B A B ...) in child processes, each against its own ``src``: what a change of the
wire or of the messages costs a message. Timed in the CPU time of the timing thread (``time.thread_time``),
not wall time, so that other programs on a loaded machine do not count; each figure is the least of its
runs. The messages are those of ``pipeline_wire.py`` and every other message a node sends (``others``),
built as each checkout spells them (a receipt's
identity and a screening row as fields, or as a ``TensorId`` and a ``Screened`` row).

    python benchmarks/pipeline_wire_pairs.py --before /path/to/old/checkout --after . --pairs 5

Prints, per message, microseconds to write and to read it with the codec and pickled, before and after,
and the ratios after/before; and "judged": the read (codec, pickle), then a ``Norm``'s screening rows
judged sound and taken as the coordinator does before it screens them (``judged``), so that a reader
that makes its rows only when asked, or judges them all at once, is compared whole.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time

COLUMNS = ("codec write", "codec read", "pickle write", "pickle read", "codec judged", "pickle judged")


def samples() -> dict:
    """``pipeline_wire.samples("small", 4, 128)``'s messages, as the checkout imported spells them."""
    import torch

    from roving.pipeline import protocol as m
    from roving.pipeline.planning.plan import Route
    from roving.pipeline.presets import PRESETS
    from roving.pipeline.verify.receipts import Receipt
    from roving.pipeline.verify.screen import Summary
    dim = PRESETS["small"].dim
    act = torch.randn(4, 128, dim)
    route = Route("n00", ("n01", "n02", "n03"), (1, 2, 3))
    summary = Summary((), 1.2, 0.01, -0.3, torch.randn(dim))
    # a node's rows each summarise a tensor of their own (one summary in all 8 rows: what pickle's memo
    # writes once, as no node sends it)
    summaries = [Summary((), 1.2 + i / 8, 0.01, -0.3, torch.randn(dim)) for i in range(8)]
    try:
        from roving.pipeline.verify.tensor_id import Screened, TensorId
        receipt = Receipt(TensorId(7, "activation", 3, 1, "n01"), b"d" * 32, b"m" * 32)
        rows = tuple(Screened(TensorId(7, "activation", i, 1, "n00"), s) for i, s in enumerate(summaries))
        shared = tuple(Screened(TensorId(7, "activation", i, 1, "n00"), summary) for i in range(8))
    except ImportError:  # before the TensorId: a receipt's and a row's identity as their own fields
        receipt = Receipt("n01", 7, "activation", 3, 1, b"d" * 32, b"m" * 32)  # type: ignore[call-arg]
        rows = tuple(("activation", i, 1, "n00", s) for i, s in enumerate(summaries))  # type: ignore[misc]
        shared = tuple(("activation", i, 1, "n00", summary) for i in range(8))  # type: ignore[misc]
    share = torch.randn(sum(p.numel() for p in torch.nn.Linear(dim, dim).parameters()) * 4)
    return {
        "Forward (activation)": m.Forward(7, "n01", 3, 1, act, route, receipt),
        "Gradients (share)": m.Gradients(7, "n01", share, 4, receipt),
        "Done": m.Done(7, "n00", 3, 2.71),
        "Norm (8 summaries)": m.Norm(7, "n01", 1, 3.5, rows, (), {"n05": 0.9}, b"c" * 32),
        "Norm (1 summary x 8)": m.Norm(7, "n01", 1, 3.5, shared, (), {"n05": 0.9}, b"c" * 32),
        "Stepped": m.Stepped(7, "n01", {"processed": 12, "compute_s": 0.5, "peak_in_flight": 2,
                                        "trace": [("fwd", i, 1.0, 1.1) for i in range(12)]},
                             math.nan, b"w" * 32, "cpu"),
        "Beat": m.Beat("n01", 0),
        **others(m, act, route, receipt),
    }


def others(m, act, route, receipt) -> dict:
    """The other messages a node sends (and ``ProgressRequest``), those the checkout has."""
    import torch

    from roving.transport.postbox import PostboxAddress
    trace = [("fwd", i, 1.0, 1.1) for i in range(12)]
    out = {
        "Backward (gradient)": m.Backward(7, "n01", 3, 2, act, route, receipt),
        "Ready": m.Ready("n01", 0, PostboxAddress("tcp://127.0.0.1:5000", 3)),
        "Rechecked": m.Rechecked(7, "n01", 4, 0.001),
        "Loaded": m.Loaded("n01", 1),
        "Stopped": m.Stopped("n01"),
        "Released": m.Released("n01"),
        "Failed": m.Failed("n01", "Traceback (most recent call last):\n" + "  File \"x.py\", line 1\n" * 20),
        "EvidenceItems (1)": m.EvidenceItems(7, "n01", {getattr(receipt, "id", ("activation", 3, 1, "n01")):
                                                        (act[0], receipt, False)}, 2),
        "WeightsShown (2)": m.WeightsShown(7, "n01", 1, {"w": torch.randn(64, 64), "b": torch.randn(64)}),
        "Stepped (real stats)": m.Stepped(7, "n01", {"processed": 12, "compute_s": 0.5, "peak_in_flight": 2,
                                                     "trace": trace, "verify_cpu_s": 0.01},
                                          1.5, b"w" * 32, "cpu"),
    }
    if hasattr(m, "Progress"):  # since 2026-12-07 (not at f6e1f49)
        out["Progress"] = m.Progress(7, "n01", tuple(range(36)), tuple(range(36)))
        out["ProgressRequest"] = m.ProgressRequest(7)
    return out


def judged(decode, coded, sender: str | None) -> None:
    """``decode``, then a ``Norm``'s screening rows judged and taken as the coordinator does before it
    screens them: every summary ``screen.sound`` (a table of rows that can judge itself, ``sound()``, asked
    once), then every row made and its profile taken (a reader that makes its rows only when asked pays
    for them here)."""
    from roving.pipeline.verify.screen import sound
    rows = getattr(decode(coded, sender), "screened", ())
    whole = getattr(rows, "sound", None)
    summaries = (row.summary if hasattr(row, "summary") else row[-1] for row in rows)
    if whole is not None:
        whole()
        for summary in summaries:
            summary.profile  # noqa: B018
    else:
        for summary in summaries:
            sound(summary)


def child(repeat: int) -> None:
    """Time every message of ``samples`` (its figures as JSON on stdout)."""
    import torch

    from roving.pipeline.runtime import codec
    from roving.transport.serialize import dumps, loads
    torch.set_num_threads(1)
    out = {}
    for name, msg in samples().items():
        sender = getattr(msg, "sender", None)
        coded, pickled = codec.encode(msg), dumps(msg)
        figures = []
        for fn in (functools.partial(codec.encode, msg), functools.partial(codec.decode, coded, sender),
                   functools.partial(dumps, msg), functools.partial(loads, pickled),
                   functools.partial(judged, codec.decode, coded, sender),
                   functools.partial(judged, lambda frames, _: loads(frames), pickled, sender)):
            fn()
            t0 = time.thread_time()
            for _ in range(repeat):
                fn()
            figures.append((time.thread_time() - t0) / repeat * 1e6)
        out[name] = figures
    print(json.dumps(out))


def one(root: str, repeat: int) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(root), "src"))
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--repeat", str(repeat)], env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(run.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before")
    ap.add_argument("--after")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.repeat)
        return
    best: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for _ in range(args.pairs):
        for label in ("before", "after"):
            for name, figures in one(getattr(args, label), args.repeat).items():
                old = best[label].setdefault(name, figures)
                best[label][name] = [min(a, b) for a, b in zip(old, figures)]
    print(f"least of {args.pairs} runs each of {args.repeat} (microseconds of CPU per message)")
    print(f"{'message':22s} {'':7s}" + "".join(f"{c:>14s}" for c in COLUMNS))
    for name, after in best["after"].items():
        before = best["before"].get(name)
        if before is None:
            print(f"{name:22s} {'before':7s} (no such message)")
        else:
            print(f"{name:22s} {'before':7s}" + "".join(f"{x:14.1f}" for x in before))
        print(f"{'':22s} {'after':7s}" + "".join(f"{x:14.1f}" for x in after))
        if before is not None:
            print(f"{'':22s} {'ratio':7s}" + "".join(f"{a / b:13.2f}x" for a, b in zip(after, before)))


if __name__ == "__main__":
    main()
