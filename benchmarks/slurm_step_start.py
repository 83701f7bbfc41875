"""Start-up of a Pool inside a Slurm allocation (issue 22): run it inside one, e.g.

    salloc -n 32 python3 benchmarks/slurm_step_start.py --workers 32 --repeat 3

Per repeat: "returns" is the time until ``Pool(N)`` returns (the first upkeep round started every worker),
"steps" the job steps of this allocation ``squeue --steps`` listed while the pool started that were not
there before it (not counting the batch, extern and interactive steps), "srun processes" the srun
processes this program had running after all N connected, "connected" the time until all N workers have
connected. Run it with the code to
compare on PYTHONPATH (one step of N tasks since this benchmark was added; one srun per worker before).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import roving


def connected(pool) -> int:
    return sum(1 for w in pool._workers.values() if w.ident is not None)


def steps() -> set:
    """The ids of this allocation's job steps squeue lists now (not the batch, extern, interactive ones)."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", os.environ["SLURM_JOB_ID"], "-o", "%i"],
                         capture_output=True, text=True, timeout=30).stdout.split()
    return {s for s in out if not s.endswith((".batch", ".extern", ".interactive"))}


def sruns() -> int:
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-x", "srun"], capture_output=True, text=True,
                         timeout=30).stdout
    return len(out.split())


def one(n: int) -> dict:
    before = steps()  # a previous pool's steps may still be ending
    t0 = time.monotonic()
    pool = roving.Pool(n)
    returned = time.monotonic() - t0
    deadline = t0 + 300
    seen = set()
    while connected(pool) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {connected(pool)} of {n} workers connected in 300 s")
        seen |= steps() - before
        time.sleep(0.05)
    ready = time.monotonic() - t0
    seen |= steps() - before
    most = len(seen)
    procs = sruns()
    pool.terminate()
    pool.join(120)
    return {"returned": returned, "ready": ready, "steps": most, "sruns": procs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not os.environ.get("SLURM_JOB_ID"):
        raise SystemExit("run this inside a Slurm allocation (salloc -n N python3 benchmarks/slurm_step_start.py)")
    roving.init(backend="slurm", cpu=1, memory="100M", child_output="off")
    rows = []
    for _ in range(args.repeat):
        rows.append(one(args.workers))
        r = rows[-1]
        print(f"  returns {r['returned']:.2f} s, {args.workers} connected {r['ready']:.2f} s, "
              f"{r['steps']} step(s), {r['sruns']} srun process(es)", flush=True)
    fmt = lambda xs: f"{statistics.median(xs):.2f} s ({min(xs):.2f}–{max(xs):.2f})"
    print(f"\nPool({args.workers}) inside allocation {os.environ['SLURM_JOB_ID']}, {args.repeat} repeats, "
          f"median (min–max); roving from {os.path.dirname(roving.__file__)}")
    print(f"| steps | srun processes | Pool({args.workers}) returns | {args.workers} connected |")
    print("|---|---|---|---|")
    print(f"| {max(r['steps'] for r in rows)} | {max(r['sruns'] for r in rows)} | "
          f"{fmt([r['returned'] for r in rows])} | {fmt([r['ready'] for r in rows])} |")


if __name__ == "__main__":
    main()
