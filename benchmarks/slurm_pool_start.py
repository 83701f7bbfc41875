"""Slurm start-up of a Pool: one job array (slurm_array=True, the default) against one sbatch per worker
(slurm_array=False), side by side in one run, interleaved, a few repeats (issue 22).

usage: python benchmarks/slurm_pool_start.py [--workers 64] [--repeat 3]

Per repeat and mode: "submitted" is the time from ``Pool(N)`` until it returns, which is once Slurm has
accepted every worker (the pool's first upkeep round submits them all); "sbatch calls" counts the
submissions (distinct array/job ids of the pool's workers); "K running" the time until squeue lists K of
them RUNNING (the cluster's side of start-up); "K connected" the time until K workers have connected to
the pool (their Python interpreters started, which on a 2-core machine is most of it), K = min(N, the CPUs
Slurm offers): each worker asks for 1 CPU, so at most that many
run at once. Slurm must be running (bash scripts/cluster/slurm.sh); the queue should be otherwise idle.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import roving


def connected(pool) -> int:
    return sum(1 for w in pool._workers.values() if w.ident is not None)


def running_jobs(ids) -> int:
    """How many tasks/jobs of these arrays/jobs squeue lists as RUNNING."""
    out = subprocess.run(["squeue", "-h", "-r", "-t", "RUNNING", "-j", ",".join(sorted(ids)), "-o", "%i"],
                         capture_output=True, text=True, timeout=30).stdout
    return len(out.split())


def queue_clear(tag: str, timeout: float = 120) -> None:
    """Wait until no job of this session is pending or running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-r", "-n", f"roving-{tag}", "-t", "PENDING,RUNNING,COMPLETING",
                              "-o", "%i"], capture_output=True, text=True, timeout=30).stdout
        if not out.strip():
            return
        time.sleep(0.2)
    raise TimeoutError("the previous pool's jobs are still in the Slurm queue")


def one(n: int, array: bool, k: int) -> dict:
    roving.init(backend="slurm", cpu=1, memory="100M", child_output="off", slurm_array=array,
                pending_warning=3600)  # half the pool pends (1 CPU each): expected, not worth a warning
    t0 = time.monotonic()
    pool = roving.Pool(n)
    submitted = time.monotonic() - t0
    ids = {proc.job.id.split("_")[0] for proc in pool._pool}
    deadline = time.monotonic() + 300
    running = ready = None
    while running is None or ready is None:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"only {connected(pool)} of {k} workers connected in 300 s")
        if ready is None and connected(pool) >= k:
            ready = now - t0
        if running is None and running_jobs(ids) >= k:
            running = now - t0
        time.sleep(0.05)
    pool.terminate()
    pool.join(120)
    return {"submitted": submitted, "running": running, "ready": ready, "calls": len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from roving.transport import session as _session
    roving.init(backend="slurm")
    k = min(args.workers, roving.cpu_count())
    tag = _session.current().tag
    rows = {True: [], False: []}
    for _ in range(args.repeat):
        for array in (True, False):
            queue_clear(tag)
            rows[array].append(one(args.workers, array, k))
            r = rows[array][-1]
            print(f"  slurm_array={array}: submitted {r['submitted']:.2f} s, {k} running {r['running']:.2f} s, "
                  f"{k} connected {r['ready']:.2f} s, "
                  f"{r['calls']} submission(s)", flush=True)
    fmt = lambda xs: f"{statistics.median(xs):.2f} s ({min(xs):.2f}–{max(xs):.2f})"
    print(f"\nPool({args.workers}) on Slurm, {args.repeat} repeats, median (min–max)")
    print(f"| mode | sbatch calls | Pool({args.workers}) returns: all submitted | {k} running (squeue) | "
          f"{k} workers connected |")
    print("|---|---|---|---|---|")
    for array, label in ((True, "one job array (slurm_array=True)"), (False, "one job each (slurm_array=False)")):
        xs = rows[array]
        print(f"| {label} | {xs[0]['calls']} | {fmt([x['submitted'] for x in xs])} | "
              f"{fmt([x['running'] for x in xs])} | {fmt([x['ready'] for x in xs])} |")
    sub = statistics.median(x["submitted"] for x in rows[False]) / statistics.median(x["submitted"] for x in rows[True])
    med = lambda key, array: statistics.median(x[key] for x in rows[array])
    print(f"\narrays faster (ratio of medians): submission {sub:.1f}x, until {k} running "
          f"{med('running', False) / med('running', True):.1f}x, until {k} connected "
          f"{med('ready', False) / med('ready', True):.1f}x")


if __name__ == "__main__":
    main()
