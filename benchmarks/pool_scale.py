"""How many workers one roving parent keeps busy: tasks of 100 ms on 16, 64, 256 ... local workers.

For each pool size N, ``--seconds`` of ideal work (N x seconds / 0.1 tasks, each its own unit of work:
``map(chunksize=1)``) runs once every worker is connected. Figures: worker utilisation (task time done /
(N x wall time)), tasks dispatched per second, and the CPU the parent used meanwhile (all its threads: a
parent near 100% of a core is the bottleneck). On one small machine the workers are oversubscribed
(they sleep, so that is fair to the parent, which does all the dispatching); memory bounds N: each worker
is a Python process of 30-60 MB.

    python benchmarks/pool_scale.py --sizes 16 64 256
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import roving

TASK_S = 0.1


def task(_: Any) -> None:
    time.sleep(TASK_S)


def measure(n: int, seconds: float) -> tuple:
    started = time.perf_counter()
    with roving.Pool(n) as pool:
        deadline = time.monotonic() + 600
        while sum(1 for w in list(pool._workers.values()) if w.ident) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        up = time.perf_counter() - started
        pool.map(task, range(n), chunksize=1)  # every worker has run once
        tasks = int(n * seconds / TASK_S)
        start, cpu = time.perf_counter(), time.process_time()
        pool.map(task, range(tasks), chunksize=1)
        took = time.perf_counter() - start
        cpu = time.process_time() - cpu
    return up, tasks, took, tasks * TASK_S / (n * took), tasks / took, cpu / took


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    print("| workers | start-up s | tasks of 100 ms | wall s (ideal %.1f) | utilisation | tasks dispatched/s "
          "(ideal) | parent CPU (all its threads) |" % args.seconds)
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        up, tasks, took, util, rate, cpu = measure(n, args.seconds)
        print(f"| {n} | {up:.1f} | {tasks} | {took:.2f} | {util:.0%} | {rate:,.0f} ({n / TASK_S:,.0f}) | "
              f"{cpu:.0%} of a core |", flush=True)


if __name__ == "__main__":
    main()
