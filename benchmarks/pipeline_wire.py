"""What one pipeline message costs on its way, by how it is written: pickled (roving's serializer, as the
queues carry objects) against the data-only wire (``roving.pipeline.runtime.codec``), for the messages a
training sends most, and every other message a node sends (``pipeline_wire_pairs.others``), at the sizes
of a model preset.

    python benchmarks/pipeline_wire.py [--model small] [--repeat 2000] [--clock wall|cpu] [--runs 3]

For each message: microseconds to write it (the sender) and to read it back (the receiver), and its
bytes; pickled and coded side by side, in one run. The codec's read includes every check of the
message's schema (types, bounds, the tensor's dtype and length). ``--clock wall``: the median of
``--runs`` runs' wall-clock time; ``--clock cpu``: the least of their CPU time (of the timing thread),
so that other programs on a loaded machine count as little as they can.
"""
from __future__ import annotations

import argparse
import functools
import math
import time

import torch

from roving.pipeline.runtime import codec
from roving.pipeline import protocol as m
from roving.pipeline.planning.plan import Route
from roving.pipeline.presets import PRESETS as MODEL_PRESETS
from roving.pipeline.verify.receipts import Receipt
from roving.pipeline.verify.screen import Summary
from roving.pipeline.verify.tensor_id import Screened, TensorId
from roving.transport.serialize import dumps, loads

from pipeline_wire_pairs import others


def samples(model: str, samples_per_mb: int, seq_len: int) -> dict[str, m.Message]:
    cfg = MODEL_PRESETS[model]
    dim = cfg.dim
    act = torch.randn(samples_per_mb, seq_len, dim)
    route = Route("n00", ("n01", "n02", "n03"), (1, 2, 3))
    receipt = Receipt(TensorId(7, "activation", 3, 1, "n01"), b"d" * 32, b"m" * 32)
    share = torch.randn(sum(p.numel() for p in torch.nn.Linear(dim, dim).parameters()) * 4)
    summary = Summary((), 1.2, 0.01, -0.3, torch.randn(dim))
    # a node's rows each summarise a tensor of their own (one summary in all 8 rows: what pickle's memo
    # writes once, as no node sends it)
    summaries = [Summary((), 1.2 + i / 8, 0.01, -0.3, torch.randn(dim)) for i in range(8)]
    return {
        "Forward (activation)": m.Forward(7, "n01", 3, 1, act, route, receipt),
        "Gradients (share)": m.Gradients(7, "n01", share, 4, receipt),
        "Done": m.Done(7, "n00", 3, 2.71),
        "Norm (8 summaries)": m.Norm(7, "n01", 1, 3.5,
                                     tuple(Screened(TensorId(7, "activation", i, 1, "n00"), s)
                                           for i, s in enumerate(summaries)), (), {"n05": 0.9}, b"c" * 32),
        "Norm (1 summary x 8)": m.Norm(7, "n01", 1, 3.5,
                                       tuple(Screened(TensorId(7, "activation", i, 1, "n00"), summary)
                                             for i in range(8)), (), {"n05": 0.9}, b"c" * 32),
        "Stepped": m.Stepped(7, "n01", {"processed": 12, "compute_s": 0.5, "peak_in_flight": 2,
                                        "trace": [("fwd", i, 1.0, 1.1) for i in range(12)]},
                             math.nan, b"w" * 32, "cpu"),
        "Beat": m.Beat("n01", 0),
        **others(m, act, route, receipt),
    }


def timed(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()
    t0 = clock()
    for _ in range(repeat):
        fn()
    return (clock() - t0) / repeat * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    how = f"median of {args.runs} runs' wall-clock" if args.clock == "wall" else f"least of {args.runs} runs' CPU"
    print(f"model {args.model}, {args.samples} x {args.seq_len} tokens per microbatch; microseconds per message "
          f"({how} time, runs of {args.repeat})")
    print(f"{'message':24s} {'bytes':>10s} {'pickle write':>13s} {'pickle read':>12s} {'codec write':>12s} "
          f"{'codec read':>11s} {'codec/pickle':>13s}")
    for name, msg in samples(args.model, args.samples, args.seq_len).items():
        sender = getattr(msg, "sender", None)
        pickled, coded = dumps(msg), codec.encode(msg)
        figures = []
        for fn in (functools.partial(dumps, msg), functools.partial(loads, pickled),
                   functools.partial(codec.encode, msg), functools.partial(codec.decode, coded, sender)):
            runs = sorted(timed(fn, args.repeat, clock) for _ in range(args.runs))
            figures.append(runs[len(runs) // 2] if args.clock == "wall" else runs[0])
        size = sum(len(memoryview(f).cast("B")) for f in coded)
        ratio = (figures[2] + figures[3]) / (figures[0] + figures[1])
        print(f"{name:24s} {size:10d} {figures[0]:13.1f} {figures[1]:12.1f} {figures[2]:12.1f} {figures[3]:11.1f} "
              f"{ratio:12.2f}x")


if __name__ == "__main__":
    main()
