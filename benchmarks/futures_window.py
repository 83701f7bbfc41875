"""How many calls roving's Executor hands its pool at once, and what that costs in throughput.

A call handed to the pool counts as RUNNING and can no longer be cancelled; the standard library's
``ProcessPoolExecutor`` hands over ``max_workers + 1`` (its call queue). This runs the same loads on
roving Executors that hand over ``max_workers + EXTRA_QUEUED_CALLS`` calls for several values of
``EXTRA_QUEUED_CALLS`` (``15 * workers`` is the former 16 per worker) and on the standard library's
executor, every executor up and warm first, their runs interleaved, medians of ``--repeat``:

* ``submit`` of many no-op calls, all gathered (the hand-over on the critical path of every call);
* ``submit`` of 1,000 calls sleeping 1 ms, all at once (ideal 0.2 s on 5 workers: does a worker wait for
  its next call?);
* ``map`` of 5,000 no-op calls (chunksize 1);
* joblib ``Parallel`` of 20,000 no-op calls on the "roving" backend (its batches are the executor's calls;
  the backend keeps one executor, so each hand-over's runs come together, after a warm-up run).

    PYTHONPATH=src python benchmarks/futures_window.py --repeat 5
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import time
from typing import Any, Callable, Dict, List

import roving.futures
from roving.futures import Executor

WORKERS = 5


def noop(x: Any) -> Any:
    return x


def sleep_task(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _submit_noops(ex: Any, n: int) -> float:
    start = time.perf_counter()
    futures = [ex.submit(noop, i) for i in range(n)]
    assert [f.result() for f in futures] == list(range(n))
    return time.perf_counter() - start


def _submit_sleeps(ex: Any) -> float:
    start = time.perf_counter()
    futures = [ex.submit(sleep_task, 0.001) for _ in range(1000)]
    for f in futures:
        f.result()
    return time.perf_counter() - start


def _map_noops(ex: Any) -> float:
    start = time.perf_counter()
    assert list(ex.map(noop, range(5000)))[-1] == 4999
    return time.perf_counter() - start


TESTS: Dict[str, Callable[[Any], float]] = {
    "2,000 submit (no-op)": lambda ex: _submit_noops(ex, 2000),
    "20,000 submit (no-op)": lambda ex: _submit_noops(ex, 20_000),
    "1,000 submit x 1 ms at once (ideal 0.20 s)": _submit_sleeps,
    "map of 5,000 (no-op)": _map_noops,
}


def _joblib_noops(extra: int) -> float:
    from joblib import Parallel, delayed, parallel_config

    roving.futures.EXTRA_QUEUED_CALLS = extra  # read when the backend makes its executor
    start = time.perf_counter()
    with parallel_config(backend="roving", n_jobs=WORKERS):
        out = Parallel()(delayed(noop)(i) for i in range(20_000))
    assert out[-1] == 19_999
    return time.perf_counter() - start


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", type=int, nargs="+", default=[1, WORKERS, 15 * WORKERS],
                        help="values of EXTRA_QUEUED_CALLS to compare (default: 1, 5, 75)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-joblib", action="store_true")
    args = parser.parse_args(argv)
    default = roving.futures.EXTRA_QUEUED_CALLS
    peers: Dict[str, Any] = {}
    try:
        for extra in args.extra:
            roving.futures.EXTRA_QUEUED_CALLS = extra  # read by the constructor
            peers[f"roving +{extra}"] = Executor(WORKERS)
        roving.futures.EXTRA_QUEUED_CALLS = default
        peers["stdlib"] = cf.ProcessPoolExecutor(WORKERS)
        for ex in peers.values():
            assert list(ex.map(noop, range(WORKERS * 4))) == list(range(WORKERS * 4))
        time.sleep(1.0)
        runs: Dict[str, Dict[str, List[float]]] = {p: {t: [] for t in TESTS} for p in peers}
        for name, test in TESTS.items():
            for _ in range(args.repeat):
                for peer, ex in peers.items():
                    runs[peer][name].append(test(ex))
    finally:
        for ex in peers.values():
            ex.shutdown()
    names = list(peers)
    print(f"workers {WORKERS}; hand-over max_workers + EXTRA_QUEUED_CALLS; seconds, median of {args.repeat}")
    print(f"| test | {' | '.join(names)} |")
    print("|---" * (len(names) + 1) + "|")
    for name in TESTS:
        print(f"| {name} | " + " | ".join(f"{statistics.median(runs[p][name]):.3f}" for p in names) + " |")
    if args.no_joblib:
        return
    from roving import joblib as roving_joblib

    jl: Dict[int, List[float]] = {extra: [] for extra in args.extra}
    for extra in args.extra:  # the backend keeps one executor: a hand-over at a time, its repeats together
        _joblib_noops(extra)  # workers up
        for _ in range(args.repeat):
            jl[extra].append(_joblib_noops(extra))
        roving_joblib.shutdown()
    roving.futures.EXTRA_QUEUED_CALLS = default
    print()
    print("| joblib Parallel: 20,000 no-op, with workers started (seconds, median) | "
          + " | ".join(f"roving +{e}" for e in args.extra) + " |")
    print("|---" * (len(args.extra) + 1) + "|")
    print("| | " + " | ".join(f"{statistics.median(jl[e]):.3f}" for e in jl) + " |")


if __name__ == "__main__":
    main()
