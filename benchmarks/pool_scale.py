"""A thousand real workers from one parent: how long they take to start, what they cost in memory, and
how busy one parent keeps them, beside multiprocessing's Pool at the sizes it reaches here.

For each size N, in a fresh process of its own (so that one size's memory does not count in the next):

* **start**: seconds until ``Pool(N)`` returned and until every worker had connected (the pool's own
  figures, ``roving.observe.snapshot()``), and how many lines the run printed on the terminal meanwhile
  (none is the goal: anything printed is a warning);
* **memory**, once all are connected and idle: the machine's (``MemAvailable`` before the pool, less
  after), the workers' (and the local backend's starter's) proportional and private memory summed from
  ``/proc/PID/smaps_rollup`` (PSS counts a page shared by k processes as 1/k to each; private is what is
  each one's alone), and the parent's RSS growth per worker;
* **busy**: tasks that sleep 100 ms (``--seconds`` of ideal work for N workers), through
  ``map(chunksize=1)``, ``imap_unordered`` and ``Executor.submit`` in a loop: utilisation (task time
  done / (N x wall time)), tasks per second, and the parent's CPU per task (all its threads).

multiprocessing's Pool (fork, the default start method here) runs the same start, memory and ``map``
figures at the sizes given by ``--mp-sizes``.

    python3 benchmarks/pool_scale.py --sizes 100 300 1000 --mp-sizes 100 300 1000 --seconds 10
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

TASK_S = 0.1
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def task(_: Any) -> None:
    time.sleep(TASK_S)


# -- memory ----------------------------------------------------------------------------------------------

def _children_of() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(root: int) -> List[int]:
    kids, out, todo = _children_of(), [], [root]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rollup(pids: List[int]) -> Dict[str, float]:
    """MB of PSS, private (clean + dirty) and RSS summed over ``pids``."""
    total = {"pss": 0, "private": 0, "rss": 0}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    kb = int(rest.split()[0]) if key in ("Pss", "Private_Clean", "Private_Dirty", "Rss") else 0
                    if key == "Pss":
                        total["pss"] += kb
                    elif key in ("Private_Clean", "Private_Dirty"):
                        total["private"] += kb
                    elif key == "Rss":
                        total["rss"] += kb
        except OSError:
            pass
    return {k: v / 1024 for k, v in total.items()}


def available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def own_rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


# -- one size, in a process of its own -------------------------------------------------------------------

def _busy(n: int, seconds: float, run: Any) -> Dict[str, float]:
    tasks = int(n * seconds / TASK_S)
    start, cpu = time.perf_counter(), time.process_time()
    run(tasks)
    took = time.perf_counter() - start
    cpu = time.process_time() - cpu
    return {"tasks": tasks, "wall_s": took, "utilisation": tasks * TASK_S / (n * took),
            "tasks_per_s": tasks / took, "parent_us_per_task": cpu / tasks * 1e6,
            "parent_cores": cpu / took}


def _connected() -> int:
    import roving.observe
    pools = roving.observe.snapshot().get("pools") or []
    return sum(1 for p in pools for w in p.get("workers", []) if w.get("state") != "starting")


def measure_roving(n: int, seconds: float, limit: float) -> Dict[str, Any]:
    import roving
    import roving.futures
    before_mb, rss0 = available_mb(), own_rss_kb()
    out: Dict[str, Any] = {"peer": "roving", "workers": n}
    t0 = time.perf_counter()
    with roving.Pool(n) as pool:
        out["returned_s"] = time.perf_counter() - t0
        deadline = time.monotonic() + limit
        while _connected() < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {_connected()} of {n} workers connected within {limit:g} s")
            time.sleep(0.2)
        out["connected_s"] = time.perf_counter() - t0
        time.sleep(3)  # idle: heartbeats only
        out["memory"] = _memory(n, before_mb, rss0)
        pool.map(task, range(n), chunksize=1)  # every worker has run once
        out["map"] = _busy(n, seconds, lambda k: pool.map(task, range(k), chunksize=1))
        out["imap_unordered"] = _busy(n, seconds, lambda k: sum(1 for _ in pool.imap_unordered(task, range(k))))
    t0 = time.perf_counter()
    with roving.futures.Executor(max_workers=n) as ex:
        list(ex.map(task, range(n)))  # started and warm
        out["executor_ready_s"] = time.perf_counter() - t0

        def submit(k: int) -> None:
            for f in [ex.submit(task, i) for i in range(k)]:
                f.result()
        out["submit"] = _busy(n, seconds, submit)
    return out


def measure_mp(n: int, seconds: float, limit: float) -> Dict[str, Any]:
    import multiprocessing
    before_mb, rss0 = available_mb(), own_rss_kb()
    out: Dict[str, Any] = {"peer": "multiprocessing", "workers": n}
    t0 = time.perf_counter()
    with multiprocessing.Pool(n) as pool:
        out["returned_s"] = time.perf_counter() - t0
        pool.map(task, range(n), chunksize=1)  # every worker has run once
        out["connected_s"] = time.perf_counter() - t0
        time.sleep(3)
        out["memory"] = _memory(n, before_mb, rss0)
        out["map"] = _busy(n, seconds, lambda k: pool.map(task, range(k), chunksize=1))
        out["imap_unordered"] = _busy(n, seconds, lambda k: sum(1 for _ in pool.imap_unordered(task, range(k))))
    return out


def _memory(n: int, before_mb: float, rss0: int) -> Dict[str, float]:
    kids = rollup(descendants(os.getpid()))
    return {"machine_mb": before_mb - available_mb(), "pss_mb": kids["pss"], "private_mb": kids["private"],
            "rss_mb": kids["rss"], "private_mb_per_worker": kids["private"] / n,
            "pss_mb_per_worker": kids["pss"] / n, "parent_kb_per_worker": (own_rss_kb() - rss0) / n}


def run_one(peer: str, n: int, seconds: float, limit: float) -> Dict[str, Any]:
    """One size of one peer in a fresh process; its figures, and the lines it printed (stderr)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, __file__, "--one", peer, str(n), str(seconds), str(limit)],
                          capture_output=True, text=True, env=env, timeout=limit + 20 * seconds + 600)
    if proc.returncode != 0:
        raise SystemExit(f"{peer} with {n} workers failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    figures["printed"] = [line for line in proc.stderr.splitlines() if line.strip()]
    return figures


def table(rows: List[Dict[str, Any]]) -> None:
    print("| peer | workers | Pool() returned s | all connected s | lines printed | machine MB | private MB/worker "
          "| PSS MB/worker | parent KB/worker |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["memory"]
        print(f"| {r['peer']} | {r['workers']} | {r['returned_s']:.1f} | {r['connected_s']:.1f} | {len(r['printed'])} "
              f"| {m['machine_mb']:,.0f} | {m['private_mb_per_worker']:.1f} | {m['pss_mb_per_worker']:.1f} "
              f"| {m['parent_kb_per_worker']:.0f} |")
    print()
    print("| peer | workers | way | tasks of 100 ms | wall s | utilisation | tasks/s | parent µs/task | parent cores |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for way in ("map", "imap_unordered", "submit"):
            b = r.get(way)
            if b:
                print(f"| {r['peer']} | {r['workers']} | {way} | {b['tasks']:,} | {b['wall_s']:.2f} | "
                      f"{b['utilisation']:.2f} | {b['tasks_per_s']:,.0f} | {b['parent_us_per_task']:.0f} | "
                      f"{b['parent_cores']:.2f} |")
    for r in rows:
        for line in r["printed"][:5]:
            print(f"printed by {r['peer']} {r['workers']}: {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--mp-sizes", type=int, nargs="*", default=[100, 300, 1000])
    ap.add_argument("--seconds", type=float, default=10.0, help="ideal seconds of work per busy figure")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds the workers have to connect")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        peer, n, seconds, limit = args.one[0], int(args.one[1]), float(args.one[2]), float(args.one[3])
        figures = (measure_roving if peer == "roving" else measure_mp)(n, seconds, limit)
        print(json.dumps(figures))
        return
    rows = []
    for n in sorted(set(args.sizes) | set(args.mp_sizes)):
        if n in args.sizes:
            rows.append(run_one("roving", n, args.seconds, args.limit))
            print(f"roving {n}: connected in {rows[-1]['connected_s']:.1f} s", file=sys.stderr, flush=True)
        if n in args.mp_sizes:
            rows.append(run_one("multiprocessing", n, args.seconds, args.limit))
            print(f"multiprocessing {n}: started in {rows[-1]['connected_s']:.1f} s", file=sys.stderr, flush=True)
    table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
