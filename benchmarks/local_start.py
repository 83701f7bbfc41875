"""How long the local backend takes to start children, with and without its starter (``local_preload``),
side by side with multiprocessing's own start methods (spawn, forkserver with the same preload).

    python3 benchmarks/local_start.py --children 8 --rounds 5

Each round starts ``--children`` processes at once in each way in turn (the ways interleaved, round after
round), each running a target from a module that imports torch (as a SkipPipe stage's does) and sending
the CPU seconds its process had spent before the target ran (``time.process_time()``: a forked child's
count starts at its fork). Timed from the first start to the last value received (wall; a starter's or
forkserver's own start, made afresh each round, is in it). Prints the median of the rounds per way (of
the wall time, and of the children's mean CPU before their target), and the JSON of every round with
``--out``.

Ways:
- ``roving fresh``: ``roving.Process`` on the local backend, each child a fresh interpreter;
- ``roving starter``: the same with ``local_preload="torch"`` (a new starter each round, its start
  included in the round's time);
- ``mp spawn``: ``multiprocessing`` with the spawn context and a ``multiprocessing.Queue``;
- ``mp forkserver``: the forkserver context with ``set_forkserver_preload(["torch"])`` (a new forkserver
  each round: its start is included).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# multiprocessing's forkserver (3.11) imports its preload with its own sys.path, not its parent's (and
# passes over an ImportError in silence): the target's folder goes on PYTHONPATH for it
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)

import local_start_target as target  # noqa: E402  (imports torch, as a stage module does)


def _round(n: int, make_queue, process) -> dict:
    """Start ``n`` children (``process(target, args)``) at once, each answering on a queue of
    ``make_queue()``; the wall time from the queue's making until all answered, and the children's mean
    CPU before their target."""
    t0 = time.perf_counter()
    queue = make_queue()
    procs = [process(target=target.answer, args=(queue, i)) for i in range(n)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=300) for _ in procs)
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(60)
    assert [i for i, _ in got] == list(range(n)), got
    return {"wall_s": wall, "cpu_s": statistics.mean(c for _, c in got)}


def roving_round(n: int, preload: str) -> dict:
    import roving
    from roving import backends

    roving.init(local_preload=preload, child_output="off")
    res = _round(n, roving.Queue, roving.Process)
    backends.get("local").close_starters()  # a fresh one next round
    return res


def mp_round(n: int, method: str) -> dict:
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["local_start_target"])
    res = _round(n, ctx.Queue, ctx.Process)
    if method == "forkserver":
        from multiprocessing import forkserver
        forkserver._forkserver._stop()  # (the stdlib's own tests' way) a fresh one next round
    return res


WAYS = {
    "roving fresh": lambda n: roving_round(n, ""),
    "roving starter": lambda n: roving_round(n, "torch"),
    "mp spawn": lambda n: mp_round(n, "spawn"),
    "mp forkserver": lambda n: mp_round(n, "forkserver"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--children", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    rounds: dict = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for way, run in WAYS.items():
            res = run(args.children)
            rounds[way].append(res)
            print(f"round {r}: {way}: {res['wall_s']:.2f} s wall, {res['cpu_s']:.3f} CPU s a child", flush=True)
    print(f"\n{args.children} children, each importing torch; median of {args.rounds} rounds")
    print("| way | wall, all started and answered (s) | CPU a child spent before its target (s) |")
    print("|---|---|---|")
    for way, res in rounds.items():
        wall = statistics.median(x["wall_s"] for x in res)
        cpu = statistics.median(x["cpu_s"] for x in res)
        print(f"| {way} | {wall:.2f} | {cpu:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"children": args.children, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
