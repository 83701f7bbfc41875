"""Per backend: time from Process.start() to the child running, and from Pool(8) to all workers ready.

usage: python benchmarks/backends.py [--backends local,slurm,docker] [--repeat 5]
Slurm and Docker must be running (bash scripts/cluster/slurm.sh; bash scripts/cluster/docker.sh).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import roving


def ping(q):
    q.put(time.time())


def pool_ready(pool, n, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(1 for w in pool._workers.values() if w.ident is not None) == n:
            return True
        time.sleep(0.01)
    raise TimeoutError("pool workers not ready")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="local,slurm,docker")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from helpers_backends import OPTIONS

    print("| backend | Process.start() → child running (median, min–max) "
          "| Pool(8) → all 8 workers ready (median, min–max) |")
    print("|---|---|---|")
    for name in args.backends.split(","):
        roving.init(backend=name, child_output="off", **OPTIONS[name])
        starts, pools = [], []
        for _ in range(args.repeat):
            q = roving.Queue()
            p = roving.Process(target=ping, args=(q,))
            t0 = time.time()
            p.start()
            starts.append(q.get(timeout=120) - t0)
            p.join(60)
        for _ in range(args.repeat):
            t0 = time.monotonic()
            pool = roving.Pool(8)
            pool_ready(pool, 8)
            pools.append(time.monotonic() - t0)
            pool.terminate()
            pool.join(60)
        fmt = lambda xs: f"{statistics.median(xs):.2f} s ({min(xs):.2f}–{max(xs):.2f})"
        print(f"| {name} | {fmt(starts)} | {fmt(pools)} |", flush=True)


if __name__ == "__main__":
    main()
