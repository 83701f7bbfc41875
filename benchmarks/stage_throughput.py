"""One node's stage throughput against the same layers run as plain PyTorch (issue 8's GPU check).

    PYTHONPATH=src python benchmarks/stage_throughput.py --model 500m --stages 6 --samples 4 \\
        --seq-len 1024 --microbatches 8 --bf16          # on a machine with an NVIDIA GPU
    PYTHONPATH=src python benchmarks/stage_throughput.py  # tiny, on the CPU: checks the script runs

``--dim``, ``--heads`` and ``--layers`` override the preset, e.g. ``--dim 1024 --heads 16 --layers 48
--stages 2 --samples 8`` gives a 24-layer stage of width 1024 on 8 x 1024 tokens, the shape of the
issue's reference figure for plain eager PyTorch on an H200 (about 98k tokens/s forward and backward).

The node is a real roving process running ``stage_process.StageProcess`` for stage 1; this process plays the nodes
before and after it: it sends every microbatch's activations (forward), takes the outputs back, then
sends the gradients (backward) and takes the input gradients back, over roving's transport. Each
round is timed from the first send to the last answer, so the node's figure includes receiving,
moving activations to and from the device and sending. Plain PyTorch runs the same stage, with the same
autocast, on the same device, in this process: the forwards of all microbatches, then the backwards.
Target: the node's tokens per second within 10% of plain PyTorch's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import roving
from roving.pipeline.presets import preset
from roving.pipeline import protocol as m
from roving.pipeline.runtime import mail
from roving.pipeline.runtime.stage_process import StageSettings, pick_device, stage_main
from roving.transport import session
from roving.pipeline.planning.plan import Route
from roving.pipeline.stages import Stage


def plain(stage: Stage, device: str, bf16: bool, xs: list, gs: list, rounds: int) -> list[float]:
    dev = torch.device(device)
    times = []
    for r in range(rounds + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ins, outs = [], []
        for x in xs:
            xi = x.to(dev).requires_grad_(True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                outs.append(stage(xi))
            ins.append(xi)
        for y, g in zip(outs, gs):
            y.backward(g.to(dev))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if r:  # round 0 warms up
            times.append(time.perf_counter() - t0)
    return times


def _peer(ready, inbox_of_node, rounds: int, xs: list, gs: list, back) -> None:
    """The node's peer "me" (a process of its own: a node takes work only from a stage process, and its
    orders only from the coordinator): sends the microbatches, times each round, hands the times back."""
    mine = mail.Inbox(mail.Directory())
    ready.put((mine.address, session.current().uid))
    mine.directory.add(back.get(timeout=300), "n1")  # the node's id, from the coordinator
    to_node = mail.Outbox(inbox_of_node)
    path = Route("me", ("n1",), (1,))
    times = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        for mb, x in enumerate(xs):
            to_node.put(m.Forward(r, "me", mb, 0, x, path))
        for _ in xs:
            mine.get(timeout=300)
        for mb, g in enumerate(gs):
            to_node.put(m.Backward(r, "me", mb, 0, g, path))
        for _ in gs:
            mine.get(timeout=300)
        if r:
            times.append(time.perf_counter() - t0)
    ready.put(times)


def via_node(args, cfg, xs: list, gs: list) -> list[float]:
    control = mail.Inbox(mail.Directory())
    s = StageSettings("n1", 1, args.stages, cfg, 0, in_flight=len(xs), device=args.device, bf16=args.bf16,
                      threads=args.threads, coordinator_id=session.current().uid)
    proc = roving.Process(target=stage_main, args=(s, control.address), name="stage1-n1", daemon=True,
                          trusted=False)
    proc.start()
    control.directory.add(proc.node_id, "n1")
    ready, back = roving.Queue(), roving.Queue()
    peer = None
    try:
        msg = control.get(timeout=300)
        if isinstance(msg, m.Failed):
            raise RuntimeError(msg.traceback)
        inbox = msg.inbox  # Ready
        peer = roving.Process(target=_peer, args=(ready, inbox, args.rounds, xs, gs, back), daemon=True)
        peer.start()
        mine, me_id = ready.get(timeout=300)
        to_node = mail.Outbox(inbox)
        to_node.put(m.Peers({"n1": inbox, "me": mine}, {"me": me_id}))
        to_node.qsize()  # the node knows its peer before the peer's first microbatch arrives
        back.put(proc.node_id)
        times = ready.get(timeout=3600)
        to_node.put(m.Stop())
        control.get(timeout=60)  # Stopped
        to_node.put(m.Release())
        return times
    finally:
        for p in (proc, peer):
            if p is not None:
                p.join(30)
                if p.is_alive():
                    p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dim", type=int, help="override the preset's hidden size")
    ap.add_argument("--heads", type=int, help="override the preset's attention heads")
    ap.add_argument("--layers", type=int, help="override the preset's layer count (stage 1 gets layers/stages)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    over = {k: v for k, v in (("dim", args.dim), ("n_heads", args.heads), ("n_layers", args.layers)) if v}
    cfg = preset(args.model, max_seq_len=args.seq_len, **over)
    stage = Stage(cfg, 1, args.stages).to(device)
    dtype = torch.bfloat16 if args.bf16 and device.startswith("cuda") else torch.float32
    xs = [torch.randn(args.samples, args.seq_len, cfg.dim, dtype=dtype) for _ in range(args.microbatches)]
    gs = [torch.randn_like(x) * 1e-3 for x in xs]
    tokens = args.microbatches * args.samples * args.seq_len
    base = plain(stage, device, args.bf16, xs, gs, args.rounds)
    node = via_node(args, cfg, xs, gs)
    b, n = tokens / statistics.median(base), tokens / statistics.median(node)
    print(f"device {device}, model {args.model}, stage 1 of {args.stages} ({len(stage.layer_ids)} layers), "
          f"{args.microbatches} microbatches of {args.samples}x{args.seq_len} tokens, bf16 {args.bf16}")
    print(f"plain PyTorch: {b:,.0f} tokens/s   node over roving: {n:,.0f} tokens/s   ratio {n / b:.3f} "
          f"(target >= 0.90)")


if __name__ == "__main__":
    main()
