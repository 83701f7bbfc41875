"""Shared large data: a 1 GiB float32 array used by 8 workers on one machine (local backend).

Measures, side by side:

* baseline — writing the array once into ``multiprocessing.shared_memory`` (create + one copy);
* roving — ``roving.shared(array)`` (create + one copy, handle returned), then how long ``handle.get()``
  takes in each of 8 roving worker processes (mapping it read-only);
* memory — the PSS (proportional set size, /proc/<pid>/smaps_rollup: shared pages counted once in all)
  of the parent and the 8 workers together, sampled every 20 ms while every worker holds the array and
  has read all of it (each sums it). The source array is deleted once shared, as a program sharing a
  noise table would.

Targets (issue 4): peak PSS of all processes < 2 GiB; time to make it available (roving.shared plus the
slowest worker's get()) within 2x of the baseline write.

Run: ``python benchmarks/shared_data.py [--gib 1.0] [--workers 8] [--repeat 5]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from multiprocessing import shared_memory

import numpy as np

import roving


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def worker(handle, ready, done, out):
    t0 = time.perf_counter()
    arr = handle.get()
    got = time.perf_counter() - t0
    total = float(arr.sum(dtype=np.float64))  # touch every page
    out.put((os.getpid(), got, total, arr.flags.writeable))
    ready.wait(600)  # hold the mapping until the parent has measured
    done.put(1)


def baseline_write(src: np.ndarray) -> float:
    t0 = time.perf_counter()
    shm = shared_memory.SharedMemory(create=True, size=src.nbytes)
    np.ndarray(src.shape, src.dtype, buffer=shm.buf)[:] = src
    elapsed = time.perf_counter() - t0
    shm.close()
    shm.unlink()
    return elapsed


def roving_round(n: int, workers: int) -> dict:
    src = np.arange(n, dtype=np.float32)
    expected = float(src.sum(dtype=np.float64))
    t0 = time.perf_counter()
    handle = roving.shared(src)
    t_shared = time.perf_counter() - t0
    del src  # the segment is the only copy now
    ready, out, done = roving.Event(), roving.Queue(), roving.Queue()
    procs = [roving.Process(target=worker, args=(handle, ready, done, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    reports = [out.get(timeout=600) for _ in procs]
    pids = [os.getpid(), *(r[0] for r in reports)]
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], sum(pss_bytes(pid) for pid in pids))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    time.sleep(0.5)
    stop.set()
    sampler.join()
    ready.set()
    for _ in procs:
        done.get(timeout=600)
    for p in procs:
        p.join(60)
    assert all(abs(r[2] - expected) <= 1e-6 * abs(expected) + 1 for r in reports), "wrong data in a worker"
    assert not any(r[3] for r in reports), "a worker's array is writeable"
    handle.release()
    return {"shared": t_shared, "get_max": max(r[1] for r in reports), "peak_pss": peak[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // 4
    roving.init(child_output="off")
    base, runs = [], []
    for _ in range(args.repeat):
        src = np.arange(n, dtype=np.float32)
        base.append(baseline_write(src))
        del src
        runs.append(roving_round(n, args.workers))
    gib = 1 << 30
    b = statistics.median(base)
    s = statistics.median(r["shared"] for r in runs)
    g = statistics.median(r["get_max"] for r in runs)
    peak = max(r["peak_pss"] for r in runs)
    print(f"array: {n * 4 / gib:.2f} GiB float32, {args.workers} workers, {args.repeat} rounds (medians)")
    print(f"baseline write once to multiprocessing.shared_memory: {b:.3f} s  (runs: "
          + ", ".join(f"{x:.3f}" for x in base) + ")")
    print(f"roving.shared(array):                                 {s:.3f} s  (runs: "
          + ", ".join(f"{r['shared']:.3f}" for r in runs) + ")")
    print(f"slowest worker handle.get():                          {g * 1000:.2f} ms")
    print(f"time to make available / baseline, medians:          {(s + g) / b:.2f}x  (target < 2x)")
    bmin, smin = min(base), min(r["shared"] for r in runs)
    gmin = min(r["get_max"] for r in runs)
    print(f"time to make available / baseline, best of each:     {(smin + gmin) / bmin:.2f}x  "
          f"({smin + gmin:.3f} s vs {bmin:.3f} s)")
    print(f"peak PSS, parent + {args.workers} workers, all holding it: {peak / gib:.3f} GiB  (target < 2 GiB)")


if __name__ == "__main__":
    main()
